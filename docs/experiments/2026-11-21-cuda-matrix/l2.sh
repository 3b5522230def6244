#!/usr/bin/env bash
# Is the gap to the single-process ceiling L2 locality? Shallow rings (less producer run-ahead)
# and the lagged ceiling (verify reads data filled slots/2 batches earlier), MPS on.
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
G=gpipe
b() { echo "## $*"; timeout -k 5 120 setsid $G bench --backend cuda "$@" 2>&1 | grep -E "timed batches|ceiling|PROBLEM" | cut -c1-260; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d; sleep 1
for s in 2 3 4 8; do b --batch-bytes 64MiB --consumers 1 --batches 2000 --slots $s; done
for s in 2 4 8; do b --batch-bytes 2MiB --consumers 1 --batches 20000 --slots $s; done
for s in 2 4; do b --batch-bytes 8MiB --consumers 1 --batches 10000 --slots $s; done
echo quit | nvidia-cuda-mps-control
