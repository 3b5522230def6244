#!/usr/bin/env bash
# Where the host time of a batch goes. The driver calls' own cost (`gpipe probe
# --call-costs`), MPS off and on, then `gpipe bench` with one consumer at 2, 8 (leads auto,
# 2, 4, 8) and 64 MiB and the 1-slot round trip, MPS on, printing each side's host µs per
# batch (`host µs per batch`: the producer's fill and publish, the consumer's check and
# release; a side whose GPU queue is full waits inside its launches, so these include that). From the repo root after
# staging; results under $OUT: costs.txt, bench.txt, bench.jsonl.
#   bash docs/experiments/2026-11-23-host-costs/host-costs.sh        # about 3 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-5}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
echo "== call costs, MPS off" | tee "$O/costs.txt"
limit 60 gpipe probe --call-costs 2>&1 | sed -n '/host cost/,$p' | tee -a "$O/costs.txt"
mps_on
echo "== call costs, MPS on" | tee -a "$O/costs.txt"
limit 60 gpipe probe --call-costs 2>&1 | sed -n '/host cost/,$p' | tee -a "$O/costs.txt"
run() { # tag, then gpipe bench arguments: the human report, then the JSON one
  local tag=$1; shift
  echo "== $tag: $*" | tee -a "$O/bench.txt"
  limit 120 gpipe bench --backend cuda --repeat "$REPS" "$@" 2>&1 |
    grep -E "timed batches|ratio|where the time|host µs|round trip|FAILED|error" | tee -a "$O/bench.txt"
  bench_into "$O/bench.jsonl" 120 "$tag" --repeat "$REPS" "$@"
}
run mps-1c-2MiB --consumers 1 --batch-bytes 2MiB --batches 20000 --slots 8
run mps-1c-8MiB-lead-auto --consumers 1 --batch-bytes 8MiB --batches 10000 --slots 8 --max-lead auto
for lead in 2 4 8; do
  run mps-1c-8MiB-lead-$lead --consumers 1 --batch-bytes 8MiB --batches 10000 --slots 8 --max-lead $lead
done
run mps-1c-64MiB --consumers 1 --batch-bytes 64MiB --batches 3000 --slots 8
run mps-rtt-2MiB --consumers 1 --batch-bytes 2MiB --batches 5000 --slots 1 --round-trip
mps_off
python3 docs/experiments/2026-11-23-fair-ceiling/perf_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
