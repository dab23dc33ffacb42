#!/bin/bash
# Transfer step N on the GPU machine: copy part N out of the travelled tree and start its
# verify+install in the background (setsid: it outlives this call while the machine stays warm),
# so the next part can travel while this one installs. Prints what the machine is, once.
set -eu
N=$1
mkdir -p /tmp/kit/in
cp .gpukit/part$N/* /tmp/kit/in/
setsid nohup python3 bench/gpu/kit/install_part.py "$N" > /tmp/kit/install$N.log 2>&1 < /dev/null &
echo "part $N received: $(du -sm .gpukit/part$N | cut -f1) MiB at $(date +%T)"
if [ "$N" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)'
  nproc; free -g | head -2; df -h /tmp | tail -1
fi
