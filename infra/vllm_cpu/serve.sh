#!/usr/bin/env bash
# Serve a model with vLLM on the CPU, on 127.0.0.1 only (after infra/vllm_cpu/setup.sh):
#   infra/vllm_cpu/serve.sh [MODEL_DIR] [PORT] [more vllm serve arguments]
# then run genrun against it:
#   make demo ARGS="actor_rollout_ref.rollout.name=remote actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[http://127.0.0.1:8000]"
# float32 and no compilation (--enforce-eager): on a small CPU the graph compilation takes
# minutes; 1 GiB of KV cache is plenty for the bundled 135M model.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL=${1:-$HOME/.cache/genrun/models/SmolLM2-135M-Instruct}
PORT=${2:-8000}
shift $(( $# > 2 ? 2 : $# ))
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "$HERE/.venv/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 2048 --enforce-eager "$@"
