#!/usr/bin/env bash
# A persistent local Prefect server (UI at http://127.0.0.1:4200), bound to loopback only.
# Then, in every shell that runs genrun or a worker: export PREFECT_API_URL=http://127.0.0.1:4200/api
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/prefect server start --host 127.0.0.1 --port "${PREFECT_PORT:-4200}"
