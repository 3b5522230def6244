#!/usr/bin/env bash
# The measurements on one GPU, from the repo root after staging: ratios to the fair
# ceiling (the run's own work in one process), median of 5, with MPS then without; the
# producer-lead bound (auto vs the ring's); 4 broadcast consumers; the 1-slot round trip.
# Results under $OUT: perf.jsonl (one `gpipe bench --json --repeat N` report per line,
# tagged), summary.txt (docs/experiments/2026-11-23-fair-ceiling/perf_summary.py).
#   bash docs/experiments/2026-11-23-fair-ceiling/perf.sh            # MPS and no MPS (about 3 minutes on an H100)
#   REPS=3 bash docs/experiments/2026-11-23-fair-ceiling/perf.sh
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-5}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
bench() { local tag=$1; shift; bench_into "$O/perf.jsonl" 150 "$tag" --repeat "$REPS" "$@"; } # tag, then gpipe bench arguments
matrix() { # label
  local m=$1
  for size in 2MiB:20000 8MiB:10000 64MiB:2000; do
    b=${size%%:*}; n=${size##*:}
    bench "$m-1c-$b-lead-ring" --consumers 1 --batch-bytes $b --batches $n --slots 8
    bench "$m-1c-$b-lead-auto" --consumers 1 --batch-bytes $b --batches $n --slots 8 --max-lead auto
  done
  bench "$m-4c-broadcast-2MiB" --consumers 4 --batch-bytes 2MiB --batches 20000 --slots 8
  bench "$m-rtt-2MiB" --consumers 1 --batch-bytes 2MiB --batches 5000 --slots 1 --round-trip
}
mps_on
matrix mps
mps_off
echo "== MPS off"
for slots in 8 32; do
  bench "nomps-1c-2MiB-slots$slots" --consumers 1 --batch-bytes 2MiB --batches 8000 --slots $slots
done
python3 docs/experiments/2026-11-23-fair-ceiling/perf_summary.py "$O/perf.jsonl" | tee "$O/summary.txt"
