#!/usr/bin/env bash
# A worker that runs deployment flow runs as local processes, from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/prefect worker start --pool "${GENRUN_POOL:-genrun-local}"
