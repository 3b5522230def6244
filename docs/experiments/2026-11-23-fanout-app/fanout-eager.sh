#!/usr/bin/env bash
# The fan-out's eager and latency targets, with MPS: the models alone, in turn and
# through gpipe, REPS times interleaved (the targets take the medians: "ResNet-50 alone"
# varied from 114 to 198 frames/s between runs on the H100), then the empty-model latency
# runs with where each frame's latency went, consumers spinning 20 ms before sleeping.
# From the repo root after staging; JSON lines in $OUT/fanout.jsonl, the summary on stdout.
#   bash docs/experiments/2026-11-23-fanout-app/fanout-eager.sh       # about 3 minutes on an H100 (REPS=3)
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-3}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
mps_on
limit 400 python3 apps/fanout/run_all.py --mps on --out "$O" --run-timeout 60 \
  --modes eager --only inproc,gpipe --repeat "$REPS" "$@"
limit 120 python3 apps/fanout/run_all.py --mps on --out "$O" --run-timeout 60 \
  --modes eager --only empty --rate 110 --spin 0.02 "$@"
mps_off
