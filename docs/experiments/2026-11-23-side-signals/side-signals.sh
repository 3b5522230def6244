#!/usr/bin/env bash
# The consumer's signals on side streams (`--side-signals`). `gpipe probe
# --gpu-gaps` with MPS (what each stream operation between two kernels costs the GPU), then
# `gpipe bench` with MPS, 1 consumer, the CLI's default sync (semaphores, device words), with
# the consumer's `ready` wait and `finished` write on side streams (on) and on the verify's
# stream (off), alternating, at 2 to 128 MiB, and the 1-slot round trip. From the repo root
# after staging; results under $OUT and on stdout.
#   bash docs/experiments/2026-11-23-side-signals/side-signals.sh       # about 4 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-5}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
mps_on
limit 60 gpipe probe --gpu-gaps 2>&1 | sed -n '/GPU idle/,$p' | tee "$O/gaps.txt"
for size in 64 32 16 128 8 2; do
  case $size in 2) batches=20000 ;; 8) batches=10000 ;; 16) batches=6000 ;; 128) batches=1500 ;; *) batches=3000 ;; esac
  lead=(); [ "$size" = 8 ] && lead=(--max-lead auto)
  for s in on off; do
    bench_into "$O/bench.jsonl" 150 "mps-1c-${size}MiB-side-$s" --repeat "$REPS" \
      --gpu-timeline 1000 --consumers 1 --batch-bytes ${size}MiB --batches $batches --slots 8 \
      "${lead[@]}" --side-signals $s
  done
done
for s in on off; do
  bench_into "$O/bench.jsonl" 120 "mps-rtt-2MiB-side-$s" --repeat "$REPS" \
    --consumers 1 --batch-bytes 2MiB --batches 5000 --slots 1 --round-trip --side-signals $s
done
mps_off
python3 docs/experiments/2026-11-23-fair-ceiling/perf_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
python3 docs/experiments/2026-11-23-gpu-timeline/timeline_summary.py "$O/bench.jsonl" | cut -c1-150 | tee "$O/timeline.txt"
