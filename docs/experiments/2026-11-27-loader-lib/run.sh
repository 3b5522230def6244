#!/usr/bin/env bash
# gpipe.torch.Loader against the training ceiling (apps/loader/loader_lib.py through
# run_all.py's `loader` configuration), from the repository root after scripts/gpu/build.
# Results under $OUT (loader.jsonl, summary.txt, logs.txt, loader.svg).
#   bash docs/experiments/2026-11-27-loader-lib/run.sh            # MPS on, 1 and 2 GPUs
#   M=off bash docs/experiments/2026-11-27-loader-lib/run.sh      # MPS off
#   WORLDS="1 2 4" bash docs/experiments/2026-11-27-loader-lib/run.sh   # a 4-GPU machine
# GPIPE_AUGMENT=torch keeps the augmentation's torch kernels instead of the fused one.
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
export OUT=${OUT:-/tmp/loader-lib}; mkdir -p "$OUT"
MPS_SETTINGS=${M:-on} WORLDS="${WORLDS:-1 2}" ONE_S=${ONE_S:-165} DDP_S=${DDP_S:-165} \
  limit "${L:-560}" bash apps/loader/gpu.sh loader
