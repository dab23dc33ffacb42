#!/usr/bin/env bash
# The process work pool the deployments in prefect.yaml use (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/prefect work-pool create "${GENRUN_POOL:-genrun-local}" --type process --overwrite
