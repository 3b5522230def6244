#!/usr/bin/env bash
# What the GPU does between the batches. `gpipe bench --gpu-timeline N` stamps the
# GPU start and end of N batches' fill and verify kernels (the GPU's global timer, shared by
# every process) and reports how busy the GPU was, how much the producer's and consumers'
# kernels overlapped, the idle gaps and the handover (verify start minus fill end). With MPS:
# 2, 8 (leads auto and 8) and 64 MiB, one consumer, and 2 MiB with four; without MPS: 2 MiB
# at 8 and 64 slots, 64 MiB at 8 and 32. From the repo root after staging; results under
# $OUT: timeline.jsonl (tagged reports), raw-*.json (every stamp of a few runs), and the
# table on stdout.
#   bash docs/experiments/2026-11-23-gpu-timeline/gpu-timeline.sh       # about 3 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-3}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
run() { # tag, then gpipe bench arguments
  local tag=$1; shift
  bench_into "$O/timeline.jsonl" 150 "$tag" --repeat "$REPS" --gpu-timeline 2000 "$@"
}
raw() { # tag, then gpipe bench arguments: one run, every stamp of 500 batches kept
  local tag=$1; shift
  limit 120 gpipe bench --backend cuda --json --gpu-timeline 500 \
    --gpu-timeline-out "$O/raw-$tag.json" "$@" >/dev/null 2>>"$O/raw.err" || echo "FAILED: raw $tag"
}
mps_on
run mps-1c-2MiB --consumers 1 --batch-bytes 2MiB --batches 20000 --slots 8 --max-lead auto
run mps-1c-8MiB-lead-auto --consumers 1 --batch-bytes 8MiB --batches 10000 --slots 8 --max-lead auto
run mps-1c-8MiB-lead-8 --consumers 1 --batch-bytes 8MiB --batches 10000 --slots 8
run mps-1c-64MiB --consumers 1 --batch-bytes 64MiB --batches 3000 --slots 8
run mps-4c-2MiB --consumers 4 --batch-bytes 2MiB --batches 20000 --slots 8
raw mps-1c-64MiB --consumers 1 --batch-bytes 64MiB --batches 1000 --slots 8
mps_off
run nomps-1c-2MiB-slots8 --consumers 1 --batch-bytes 2MiB --batches 8000 --slots 8
run nomps-1c-2MiB-slots64 --consumers 1 --batch-bytes 2MiB --batches 8000 --slots 64
run nomps-1c-64MiB-slots8 --consumers 1 --batch-bytes 64MiB --batches 2000 --slots 8
run nomps-1c-64MiB-slots32 --consumers 1 --batch-bytes 64MiB --batches 2000 --slots 32
raw nomps-1c-2MiB-slots8 --consumers 1 --batch-bytes 2MiB --batches 2000 --slots 8
raw nomps-1c-2MiB-slots64 --consumers 1 --batch-bytes 2MiB --batches 2000 --slots 64
python3 docs/experiments/2026-11-23-gpu-timeline/timeline_summary.py "$O/timeline.jsonl" "$O"/raw-*.json | tee "$O/summary.txt"
