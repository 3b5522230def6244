#!/usr/bin/env bash
# The CLI's defaults after the side-signal measurements: `gpipe bench` with no
# side-signal or sync options (auto: side signals from 16 MiB slots, and then
# CUDA_DEVICE_MAX_CONNECTIONS=8 for the producer and the consumers), MPS on, 1 consumer, 8 slots, median of
# $REPS, at 2, 8 (lead auto), 16, 32, 64 and 128 MiB. From the repo root after staging;
# results under $OUT and on stdout.
#   bash docs/experiments/2026-11-23-side-signals/side-signals-defaults.sh   # about 2 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-5}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps_on
for size in 2 8 16 32 64 128; do
  case $size in 2) batches=20000 ;; 8) batches=10000 ;; 16) batches=6000 ;; 128) batches=1500 ;; *) batches=3000 ;; esac
  lead=(); [ "$size" = 8 ] && lead=(--max-lead auto)
  bench_into "$O/bench.jsonl" 150 "mps-1c-${size}MiB-defaults" --repeat "$REPS" \
    --consumers 1 --batch-bytes ${size}MiB --batches $batches --slots 8 "${lead[@]}"
done
mps_off
python3 docs/experiments/2026-11-23-fair-ceiling/perf_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
python3 - "$O/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); rep = r["report"]
    side = [c.get("attach", {}).get("side_signals") for c in rep["per_consumer"]]
    print(r["tag"], "side signals", side, "CUDA environment", rep["extra"].get("cuda_env"))
PY
