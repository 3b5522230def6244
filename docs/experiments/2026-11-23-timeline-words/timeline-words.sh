#!/usr/bin/env bash
# Timeline words in host memory (mapped for the GPU) against device memory
# (`--timeline-memory device`), with both sync modes, same run, median of REPS repetitions:
# the 1-slot round trip, 1 and 4 consumers at 2 MiB, 1 consumer at 8 MiB (lead auto), with
# MPS; then 2 MiB at 32 slots without MPS. Host and device alternate per configuration, so
# drift in the machine falls on both. From the repo root after staging; results under $OUT:
# words.jsonl (tagged `gpipe bench --json --repeat N` reports), summary.txt.
#   bash docs/experiments/2026-11-23-timeline-words/timeline-words.sh        # about 5 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-5}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
bench() { local tag=$1; shift; bench_into "$O/words.jsonl" 150 "$tag" --repeat "$REPS" "$@"; }
both() { # label, then gpipe bench arguments: once per sync mode and word memory
  local label=$1; shift
  for sync in events semaphore; do
    for words in host device; do
      bench "$label-$sync-$words" --sync $sync --timeline-memory $words "$@"
    done
  done
}
mps_on
both mps-rtt-2MiB --consumers 1 --batch-bytes 2MiB --batches 5000 --slots 1 --round-trip
both mps-1c-2MiB --consumers 1 --batch-bytes 2MiB --batches 20000 --slots 8
both mps-4c-2MiB --consumers 4 --batch-bytes 2MiB --batches 20000 --slots 8
both mps-1c-8MiB-lead-auto --consumers 1 --batch-bytes 8MiB --batches 10000 --slots 8 --max-lead auto
mps_off
echo "== MPS off"
for words in host device; do
  bench "nomps-1c-2MiB-slots32-events-$words" --timeline-memory $words --consumers 1 --batch-bytes 2MiB --batches 8000 --slots 32
done
python3 docs/experiments/2026-11-23-fair-ceiling/perf_summary.py "$O/words.jsonl" | tee "$O/summary.txt"
