#!/usr/bin/env bash
# The trainer on a high-priority stream (as run.sh's "priority" runs), with DDP's NCCL
# collectives on high-priority streams too (loader_lib.py --nccl-high-priority) or not:
# ResNet-18 under DDP with MPS, GPU_WORKERS decode workers a rank, REPEATS rounds, then the
# DDP ceiling, in one run. From the repository root after scripts/gpu/build. Results under
# $OUT: loader.jsonl, summary.txt, cpu.txt.
#   bash docs/experiments/2026-11-28-stream-priority/run-nccl.sh
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
loader_runs stream-priority-nccl
L=(--configs loader --loader-workers "${GPU_WORKERS:-2}" --loader-stream-priority -1 --budget 90 --run-limit 85)
mps_on
for i in $(seq "${REPEATS:-2}"); do
  limit 100 "${R[@]}" "${L[@]}" --label "priority-$i" >/dev/null
  limit 100 "${R[@]}" "${L[@]}" --label "priority-nccl-$i" --loader-nccl-high-priority >/dev/null
done
loader_ceiling
mps_off
loader_summary
