#!/bin/bash
# Rehearse the sitting's install here, on the CPU: the same steps receive.sh runs on the GPU machine
# (each part copied, verified, unpacked and pip-installed into a clean /tmp/site), timed, then every
# module an SGLang-through-verl genrun run imports is imported from that target with the GPU
# image's Python and torch.
#
#   bench/gpu/kit/rehearse.sh PYTHON3.12
#
# PYTHON3.12: an interpreter that stands for the GPU image: Python 3.12 with torch 2.11.0+cu130 and
# transformers 5.17 (README.md: how to make one). Two stand-ins, here only: a libcuda.so.1 stub
# (functions that return an error) so that sgl_kernel's extension loads without a driver, and, since
# sgl_kernel picks its sm100 build when it sees no GPU and the kit carries only sm90 (Hopper), an
# sm100 link to sm90.
set -eu
PY=$1
KIT_DIR=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$KIT_DIR/../../.." && pwd)
cd "$REPO"
rm -rf /tmp/kit /tmp/site
PARTS=$(python3 -c 'import json; print(json.load(open(".gpukit/manifest.json"))["parts"])')
START=$(date +%s.%N)
for N in $(seq 1 "$PARTS"); do
  mkdir -p /tmp/kit/in
  cp .gpukit/part$N/* /tmp/kit/in/
  # Installs run one after another here (2 cores); on the GPU machine they overlap the transfers.
  "$PY" "$KIT_DIR/install_part.py" "$N"
done
python3 -c "import time; print(f'installed {$PARTS} parts in {time.time() - $START:.1f} s')"
du -sm /tmp/site
STUB=/tmp/kit/stub
mkdir -p $STUB
find /tmp/site -name '*.so*' -type f -exec nm -D --undefined-only {} + 2>/dev/null | awk '{print $2}' | grep -E '^cu[A-Z]' | sed 's/@.*//' | sort -u \
  | awk '{print "int " $1 "(void){return 999;}"}' > $STUB/stub.c
gcc -shared -fPIC -o $STUB/libcuda.so.1 -Wl,-soname,libcuda.so.1 $STUB/stub.c
ln -sfn sm90 /tmp/site/sgl_kernel/sm100
MODULES=sgl_kernel,sglang,sglang.srt.entrypoints.engine,sglang.srt.entrypoints.http_server,sglang.srt.managers.scheduler
MODULES=$MODULES,sglang.srt.managers.tokenizer_manager,sglang.srt.managers.detokenizer_manager,sglang.srt.model_executor.model_runner
MODULES=$MODULES,sglang.srt.models.llama,sglang.srt.layers.attention.triton_backend,sglang.srt.layers.sampler,sglang.srt.server_args
MODULES=$MODULES,sglang.srt.layers.logits_processor,sglang.srt.model_loader.loader,sglang.srt.mem_cache.radix_cache,sglang.bench_offline_throughput
MODULES=$MODULES,verl.workers.rollout.sglang_rollout.async_sglang_server,verl.protocol,flows.cli,flows.generate,tasks.run_shard
MODULES=$MODULES,generation_core.serving.pool,generation_core.shard.streaming,generation_core.engines.replicas,generation_core.engines.hf.engine,generation_core.config.bundled
MODULES=$MODULES,generation_core.outputs.merge,prefect,prefect.server.api.server,prefect.server.database.orm_models,prefect.cli,prefect_ray
MODULES=$MODULES,ray.dashboard.dashboard,ray.dashboard.agent,ray.util.state,aiosqlite,alembic,sqlalchemy.dialects.sqlite.aiosqlite,gguf,flashinfer
LD_LIBRARY_PATH=$STUB PYTHONPATH=/tmp/site:$REPO "$PY" "$KIT_DIR/import_trace.py" /tmp/site "$MODULES" > /tmp/kit/trace.json
"$PY" -c '
import json, sys
trace = json.load(open("/tmp/kit/trace.json"))
print("imported", len(trace["tops"]), "top-level packages from /tmp/site")
if trace["failed"]:
    sys.exit("FAILED: " + json.dumps(trace["failed"], indent=1))
print("rehearsal passed: every module of the run imports from the kit")
'
