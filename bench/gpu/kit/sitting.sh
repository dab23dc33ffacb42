#!/bin/bash
# The GPU sitting's last call, after receive.sh has run for every part (bench/gpu/kit/README.md).
# Waits for the parts' installs, then runs each check under its own time limit, cheapest and most
# important first, and skips a check that no longer fits the call's budget (BUDGET seconds, default
# 560). Everything goes to $OUT/sitting.log; figures to $OUT/results.jsonl. A failing check is
# logged and the next one runs: a failure on the GPU is a finding. FROM=NAME skips the stages before
# NAME (a follow-up call on the same warm machine, whose /tmp still holds the installs and models).
set -u
BUDGET=${BUDGET:-560}
FROM=${FROM:-}
START=$(date +%s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/sitting.log
RESULTS=$OUT/results.jsonl
exec > >(tee -a "$LOG") 2>&1
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
stage() {  # stage NAME SECONDS command...: run if it fits, note rc and time
  local name=$1 limit=$2; shift 2
  [ "$name" = "$FROM" ] && FROM=
  if [ -n "$FROM" ]; then echo "### $name: before FROM, not run"; return 0; fi
  local remaining; remaining=$(left)
  if [ "$remaining" -lt 20 ]; then echo "### $name: skipped ($remaining s left)"; echo "{\"stage\":\"$name\",\"skipped\":true}" >> "$RESULTS"; return 1; fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo "### $name (limit ${limit}s) $(date +%T)"
  local t0; t0=$(date +%s.%N)
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  local took; took=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
  echo "### $name: rc=$rc in ${took}s"
  echo "{\"stage\":\"$name\",\"rc\":$rc,\"seconds\":$took}" >> "$RESULTS"
  return $rc
}

PARTS=$(python3 -c 'import json; print(json.load(open("/tmp/kit/in/manifest.json"))["parts"])')
echo "### waiting for $PARTS part installs $(date +%T)"
for _ in $(seq 1 240); do
  done_count=$(ls /tmp/kit/part*.ok 2>/dev/null | wc -l)
  [ "$done_count" -ge "$PARTS" ] && break
  ls /tmp/kit/part*.failed >/dev/null 2>&1 && break
  sleep 0.5
done
cat /tmp/kit/install*.log; cat /tmp/kit/part*.failed 2>/dev/null
[ "$(ls /tmp/kit/part*.ok 2>/dev/null | wc -l)" -ge "$PARTS" ] || { echo "### install incomplete: stopping"; exit 1; }
echo "### installed in $(( $(date +%s) - START ))s after the last part arrived"

export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GENRUN_CACHE=/tmp/genrun_cache TOKENIZERS_PARALLELISM=false
SMOL=/tmp/genrun_cache/models/SmolLM2-135M-Instruct
SGL="actor_rollout_ref.rollout.engine_kwargs.sglang"
GPU_RUN=(actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.n=4 data.max_response_length=128
  actor_rollout_ref.rollout.calculate_log_probs=true actor_rollout_ref.rollout.max_num_seqs=512 generation.max_inflight=512
  actor_rollout_ref.rollout.gpu_memory_utilization=0.8 ray_kwargs.ray_init.num_gpus=1
  $SGL.attention_backend=triton +$SGL.sampling_backend=pytorch +$SGL.enable_memory_saver=false)

stage imports 60 python3 -c '
import importlib, torch
for name in ("sgl_kernel", "sglang", "verl", "ray", "prefect", "transformers", "flashinfer"):
    module = importlib.import_module(name)
    print(name, getattr(module, "__version__", "?"), module.__file__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
' || exit 1
# Order (the second sitting's lesson: the verl replica took over 190 s to boot on SmolLM2 with CUDA
# graphs, the engine alone over 120 s, so a 600 s call holds one graph-captured genrun run at most):
# 1. the bundled model (real weights: the proof that genrun loads model.path) through genrun in eager
#    mode (no CUDA graph capture at boot), its output shown; 2. the engine alone on the same prompts;
# 3. the same genrun run with CUDA graphs (the ratio to 2); then the 1B pair, then the hf engine.
# Piecewise CUDA graphs (prefill) are off on both sides of the ratio: a shorter boot, the same work.
# SGLang's own log is at info (verl sets error) so the sitting log says where a boot's time goes.
# A follow-up call on the warm machine starts at the first stage skipped: FROM=NAME BUDGET=... .
# Each run folder, less its merged pickle and zip, comes back in $OUT/runs.tgz (time split,
# provenance, report), re-packed after each run: a call stopped later keeps what ran (8 files come back).
keep_run() {
  mkdir -p /tmp/keep && rm -rf "/tmp/keep/$1" && cp -r "/tmp/genrun_$1" "/tmp/keep/$1" 2>/dev/null
  find /tmp/keep \( -name '*.pkl' -o -name '*.zip' \) -delete; tar czf "$OUT/runs.tgz" -C /tmp/keep . || true
}
GPU_RUN+=(+$SGL.disable_piecewise_cuda_graph=true +$SGL.log_level=info)
stage smol_model 90 python3 -m generation_core.config.bundled
stage prompts 30 python3 bench/gpu/sglang_offline.py --make-prompts /tmp/prompts528.parquet --repeat 11
stage genrun_smol_eager 240 python3 -m flows.cli "${GPU_RUN[@]}" actor_rollout_ref.rollout.enforce_eager=true \
  actor_rollout_ref.model.path="$SMOL" data.train_files=/tmp/prompts528.parquet trainer.default_local_dir=/tmp/genrun_smol_eager
stage dataproto_smol_eager 60 python3 bench/gpu/kit/show_output.py /tmp/genrun_smol_eager "$SMOL" "$OUT/genrun_smol_eager.json"
keep_run smol_eager
stage engine_smol 180 python3 bench/gpu/sglang_offline.py "$SMOL" /tmp/prompts528.parquet --n 4 --max-new-tokens 128 \
  --no-piecewise-cuda-graph --json "$OUT/engine_smol.json"
stage genrun_smol 300 python3 -m flows.cli "${GPU_RUN[@]}" actor_rollout_ref.model.path="$SMOL" \
  data.train_files=/tmp/prompts528.parquet trainer.default_local_dir=/tmp/genrun_smol
stage dataproto_smol 60 python3 bench/gpu/kit/show_output.py /tmp/genrun_smol "$SMOL" "$OUT/genrun_smol.json"
keep_run smol
stage model_1b 60 python3 bench/gpu/build_model.py "$SMOL" /tmp/model1b
stage engine_1b 180 python3 bench/gpu/sglang_offline.py /tmp/model1b /tmp/prompts528.parquet --n 4 --max-new-tokens 128 \
  --no-piecewise-cuda-graph --json "$OUT/engine_1b.json"
stage genrun_1b 300 python3 -m flows.cli "${GPU_RUN[@]}" actor_rollout_ref.model.path=/tmp/model1b \
  data.train_files=/tmp/prompts528.parquet trainer.default_local_dir=/tmp/genrun_1b
stage dataproto_1b 60 python3 bench/gpu/kit/show_output.py /tmp/genrun_1b /tmp/model1b "$OUT/genrun_1b.json"
keep_run 1b
stage genrun_hf 150 python3 -m flows.cli actor_rollout_ref.model.path="$SMOL" actor_rollout_ref.rollout.n=4 \
  data.max_response_length=128 actor_rollout_ref.rollout.engine_kwargs.hf.device=cuda actor_rollout_ref.rollout.max_num_seqs=256 \
  generation.max_inflight=256 ray_kwargs.ray_init.num_gpus=1 trainer.default_local_dir=/tmp/genrun_hf
nvidia-smi --query-gpu=memory.used,memory.total --format=csv
echo "### sitting done in $(( $(date +%s) - START ))s"
