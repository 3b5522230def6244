#!/usr/bin/env bash
# Where the time goes on the CUDA path: the same bench with deeper rings, MPS off and on,
# printing how long the producer waited for free slots and the consumers for batches.
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
G=gpipe
b() { echo "## $*"; timeout -k 5 120 setsid $G bench --backend cuda "$@" 2>&1 | grep -E "timed batches|where the time|ceiling|PROBLEM"; }
sweep() {
  for s in 8 32; do b --batch-bytes 2MiB --consumers 1 --batches 20000 --slots $s; done
  for s in 8 32; do b --batch-bytes 64MiB --consumers 1 --batches 2000 --slots $s; done
  b --batch-bytes 64MiB --consumers 1 --batches 2000 --slots 8 --mode shared
}
echo "# MPS off"; sweep
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d; sleep 1
echo "# MPS on"; sweep
echo quit | nvidia-cuda-mps-control
