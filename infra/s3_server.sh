#!/usr/bin/env bash
# A local S3 API for trying s3:// outputs without a cloud account (moto's server mode), on
# 127.0.0.1 only. Then:
#   export AWS_ENDPOINT_URL=http://127.0.0.1:${S3_PORT:-9000} AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local AWS_DEFAULT_REGION=us-east-1
#   .venv/bin/python -c "import s3fs; s3fs.S3FileSystem().mkdir('genrun-demo')"
#   make demo ARGS="trainer.default_local_dir=s3://genrun-demo/run1"
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/moto_server -H 127.0.0.1 -p "${S3_PORT:-9000}"
