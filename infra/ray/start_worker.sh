#!/usr/bin/env bash
# Join a machine to the genrun Ray cluster (what cluster.yaml's worker_start_ray_commands do).
#   infra/ray/start_worker.sh HEAD_IP [NODE_IP]
# Ray detects the machine's GPUs; NUM_GPUS=N advertises fewer. A GPU node needs 2 Ray CPUs per
# GPU for verl's replica bundles (genrun refuses a layout the cluster cannot place).
set -euo pipefail
cd "$(dirname "$0")/../.."
HEAD_IP=${1:?usage: start_worker.sh HEAD_IP [NODE_IP]}
NODE_IP=${2:-}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec .venv/bin/ray start --address="$HEAD_IP:${RAY_PORT:-6379}" ${NODE_IP:+--node-ip-address="$NODE_IP"} \
  ${NUM_GPUS:+--num-gpus="$NUM_GPUS"} --block
