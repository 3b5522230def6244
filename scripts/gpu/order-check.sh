#!/usr/bin/env bash
# scripts/gpu/order-check.py without and with MPS.
set -u
. .gpu/env.sh
echo "== no MPS"; timeout -k 5 120 setsid python3 scripts/gpu/order-check.py 2>&1 | tail -6
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && sleep 1
echo "== MPS"; timeout -k 5 120 setsid python3 scripts/gpu/order-check.py 2>&1 | tail -6
echo quit | nvidia-cuda-mps-control
