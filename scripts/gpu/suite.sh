#!/usr/bin/env bash
# The whole Rust suite with the GPU tests (.gpu/run.sh), skipping the tests that need more
# GPUs than this machine has (two_gpu_* below 2, four_gpu_* below 4): they fail there rather
# than pass without running.
set -u
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
skip=()
[ "$n" -lt 2 ] && skip+=(--skip two_gpu)
[ "$n" -lt 4 ] && skip+=(--skip four_gpu)
[ ${#skip[@]} -gt 0 ] && echo "suite: $n GPU(s) here: skipping ${skip[*]}"
exec bash .gpu/run.sh "${skip[@]}" "$@"
