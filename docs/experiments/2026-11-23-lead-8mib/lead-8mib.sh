#!/usr/bin/env bash
# The producer-lead bound at 8 MiB again, with the batched stream operations: leads
# 2 (the `auto` choice), 3 and 4 and the ring's own (8), MPS on, 1 consumer, median of $REPS,
# $ROUNDS rounds, interleaved. From the repo root after staging; results under $OUT.
#   bash docs/experiments/2026-11-23-lead-8mib/lead-8mib.sh     # about 3 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-5}
ROUNDS=${ROUNDS:-2}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps_on
for round in $(seq "$ROUNDS"); do
  for lead in 2 3 4 8; do
    bench_into "$O/bench.jsonl" 150 "8MiB-lead-$lead" --repeat "$REPS" \
      --consumers 1 --batch-bytes 8MiB --batches 10000 --slots 8 --max-lead $lead
  done
done
mps_off
python3 docs/experiments/2026-11-23-fair-ceiling/perf_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
