#!/usr/bin/env bash
# The whole Rust suite with the GPU tests (.gpu/run.sh), skipping the 2-GPU tests (named
# two_gpu_*) on a machine with one GPU: they fail there rather than pass without running.
set -u
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$n" -lt 2 ]; then
  echo "suite: $n GPU(s) here: skipping the 2-GPU tests (two_gpu_*)"
  exec bash .gpu/run.sh --skip two_gpu "$@"
fi
exec bash .gpu/run.sh "$@"
