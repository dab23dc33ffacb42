#!/usr/bin/env bash
# Start the Ray head of a genrun cluster by hand (what cluster.yaml's head_start_ray_commands do).
#   infra/ray/start_head.sh [NODE_IP] [more ray start arguments, e.g. --block --num-cpus=16]
# NODE_IP: the address the workers reach this machine at (default 127.0.0.1: a one-machine
# "cluster", what tests/chaos/test_restarts.py runs against). The head advertises no GPU: shard
# tasks and the flow driver run on its CPUs; GPU workers join with start_worker.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
NODE_IP=${1:-127.0.0.1}
shift $(( $# > 0 ? 1 : 0 ))
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec .venv/bin/ray start --head --node-ip-address="$NODE_IP" --port="${RAY_PORT:-6379}" \
  --num-gpus="${HEAD_GPUS:-0}" --include-dashboard=false "$@"
