#!/usr/bin/env bash
# The trainer on a high-priority stream (as run.sh's "priority" runs), with DDP's NCCL
# collectives on high-priority streams too (loader_lib.py --nccl-high-priority) or not:
# ResNet-18 under DDP with MPS, GPU_WORKERS decode workers a rank, REPEATS rounds, then the
# DDP ceiling, in one run. From the repository root after scripts/gpu/build. Results under
# $OUT: loader.jsonl, summary.txt, cpu.txt.
#   bash docs/experiments/2026-11-28-stream-priority/run-nccl.sh
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/stream-priority-nccl}; mkdir -p "$O"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
machine_facts >"$O/cpu.txt"
loader_data
WORLD=${WORLD:-$(gpu_count)}
R=(python3 apps/loader/run_all.py --data /tmp/loader-data --out "$O" --world-size "$WORLD" --ddp-only
   --models "${MODEL:-resnet18}" --warmup 40 --steps 150 --no-summary)
L=(--configs loader --loader-workers "${GPU_WORKERS:-2}" --loader-stream-priority -1 --budget 90 --run-limit 85)
mps_on
for i in $(seq "${REPEATS:-2}"); do
  limit 100 "${R[@]}" "${L[@]}" --label "priority-$i" >/dev/null
  limit 100 "${R[@]}" "${L[@]}" --label "priority-nccl-$i" --loader-nccl-high-priority >/dev/null
done
limit 60 "${R[@]}" --label ceiling --configs ceiling --budget 45 --run-limit 42 >/dev/null
mps_off
python3 docs/experiments/2026-11-28-worker-cpus/summary.py "$O/loader.jsonl" | tee "$O/summary.txt"
