#!/usr/bin/env bash
# The fan-out's eager and latency targets: what the CPU side costs. With MPS:
# the machine's CPU topology; the latency floor between Python processes with no GPU
# (apps/fanout/latency_floor.py, readers spinning and sleeping); the eager fan-out against the
# models alone (run_all.py --only inproc,gpipe, one torch thread per process, the default);
# ResNet-50 alone while three CPU-bound Python processes run beside it (does a busy
# neighbour slow a launch-bound model?); the empty-model latency runs, consumers spinning.
# From the repo root after staging; JSON lines in $OUT/fanout.jsonl and $OUT/floor.jsonl.
#   bash docs/experiments/2026-11-23-fanout-app/fanout-cpu.sh        # about 4 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|MHz" | tee "$O/cpu.txt"
for c in 0 1 2 3; do
  echo "cpu$c siblings: $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null)"
done | tee -a "$O/cpu.txt"
grep '^cpu ' /proc/stat | tee -a "$O/cpu.txt"
echo "== latency floor (no GPU, no gpipe)"
for w in spin sleep; do
  limit 30 python3 apps/fanout/latency_floor.py --readers 3 --rate 110 --seconds 3 --wait $w |
    tee -a "$O/floor.jsonl"
done
mps_on
echo "== eager: models alone, the gpipe fan-out"
limit 200 python3 apps/fanout/run_all.py --mps on --out "$O" --run-timeout 60 \
  --modes eager --only inproc,gpipe "$@"
echo "== ResNet-50 alone, three busy CPU neighbours"
busy_pids=()
for k in 1 2 3; do setsid python3 -c 'while True: pass' & busy_pids+=($!); done
trap 'kill -9 "${busy_pids[@]}" 2>/dev/null' EXIT
limit 90 python3 apps/fanout/baselines.py inproc --models resnet50 --modes eager --runs solo \
  --duration 3 | tee -a "$O/fanout.jsonl"
kill -9 "${busy_pids[@]}" 2>/dev/null; wait "${busy_pids[@]}" 2>/dev/null
echo "== empty models at 110 frames/s, consumers spinning 20 ms"
limit 120 python3 apps/fanout/run_all.py --mps on --out "$O" --run-timeout 60 \
  --modes eager --only empty --rate 110 --spin 0.02 "$@"
mps_off
grep '^cpu ' /proc/stat | tee -a "$O/cpu.txt"
