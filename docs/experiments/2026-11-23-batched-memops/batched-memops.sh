#!/usr/bin/env bash
# The batched stream operations (a consumer's `finished` write with the next
# batch's `ready` wait, a producer's `ready` write with the next slot's `finished` waits, and
# a producer's waits on several consumers, each as one `cuStreamBatchMemOp`) against the
# build before them. Needs that build's `gpipe` in .gpu/base/ (copied there by hand after
# staging). MPS on, median of $REPS, the two builds alternating, $ROUNDS rounds. From the
# repo root; results under $OUT and on stdout.
#   bash docs/experiments/2026-11-23-batched-memops/batched-memops.sh     # about 2 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-5}
ROUNDS=${ROUNDS:-2}
[ -x .gpu/base/gpipe ] || { echo "no .gpu/base/gpipe: copy the earlier build's there"; exit 2; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
ab() { # tag, then gpipe bench arguments: the earlier build, then this one
  local tag=$1; shift
  PATH="$PWD/.gpu/base:$PATH" bench_into "$O/bench.jsonl" 150 "base-$tag" --repeat "$REPS" "$@"
  bench_into "$O/bench.jsonl" 150 "new-$tag" --repeat "$REPS" "$@"
}
unset CUDA_DEVICE_MAX_CONNECTIONS
mps_on
limit 60 gpipe probe --gpu-gaps 2>&1 | sed -n '/GPU idle/,$p' | tee "$O/gaps.txt"
for round in $(seq "$ROUNDS"); do
  echo "== round $round"
  ab 1c-2MiB --consumers 1 --batch-bytes 2MiB --batches 20000 --slots 8
  ab 1c-8MiB-lead-auto --consumers 1 --batch-bytes 8MiB --batches 10000 --slots 8 --max-lead auto
  ab 1c-64MiB --consumers 1 --batch-bytes 64MiB --batches 3000 --slots 8
  ab 4c-2MiB --consumers 4 --batch-bytes 2MiB --batches 20000 --slots 8
  ab rtt-2MiB --consumers 1 --batch-bytes 2MiB --batches 5000 --slots 1 --round-trip
done
mps_off
python3 docs/experiments/2026-11-23-fair-ceiling/perf_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
