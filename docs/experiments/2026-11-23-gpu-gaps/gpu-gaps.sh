#!/usr/bin/env bash
# What each stream operation of the hot path costs the GPU. `gpipe probe
# --gpu-gaps` stamps two small kernels with one operation between them (a write or wait on a
# timeline word, an event record or wait; on one stream, or handed to a second, waiting,
# stream) and reports the GPU's idle time between them; MPS off, then on, twice each. Then
# the 64 MiB pipeline, where one such gap per batch is what stands between it and its
# ceiling, with each sync and word placement and its GPU timeline. From the repo root after
# staging; results under $OUT and on stdout.
#   bash docs/experiments/2026-11-23-gpu-gaps/gpu-gaps.sh           # about 2 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-3}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
gaps() { # label
  echo "== GPU gaps, $1" | tee -a "$O/gaps.txt"
  limit 60 gpipe probe --gpu-gaps 2>&1 | sed -n '/GPU idle/,$p' | tee -a "$O/gaps.txt"
  limit 60 gpipe probe --json --gpu-gaps 2>>"$O/gaps.err" |
    python3 -c 'import json,sys; print(json.dumps({"label": sys.argv[1], "gaps": json.load(sys.stdin)["gpu_gaps"]}))' "$1" \
    >>"$O/gaps.jsonl" || echo "FAILED: gaps json $1"
}
gaps "MPS off"
mps_on
gaps "MPS on"
for sw in "semaphore device" "events device" "events host" "semaphore host"; do
  set -- $sw
  tag="mps-1c-64MiB-$1-$2"
  bench_into "$O/bench.jsonl" 150 "$tag" --repeat "$REPS" --gpu-timeline 1000 \
    --consumers 1 --batch-bytes 64MiB --batches 3000 --slots 8 --sync "$1" --timeline-memory "$2"
done
mps_off
python3 docs/experiments/2026-11-23-fair-ceiling/perf_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
python3 docs/experiments/2026-11-23-gpu-timeline/timeline_summary.py "$O/bench.jsonl" | tee "$O/timeline.txt"
