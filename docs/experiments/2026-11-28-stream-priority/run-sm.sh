#!/usr/bin/env bash
# The trainer on a high-priority stream (as run.sh's "priority" runs), with each decode worker
# held to SM_PERCENTS of the SMs (MPS's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, set in the workers'
# environment by loader_lib.py --worker-env) or not: ResNet-18 under DDP with MPS, GPU_WORKERS decode
# workers a rank, REPEATS rounds, then the DDP ceiling, in one run. From the repository root
# after scripts/gpu/build. Results under $OUT: loader.jsonl, summary.txt, cpu.txt.
#   bash docs/experiments/2026-11-28-stream-priority/run-sm.sh
#   SM_PERCENTS="20 40" REPEATS=1 bash docs/experiments/2026-11-28-stream-priority/run-sm.sh
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
loader_runs stream-priority-sm
L=(--configs loader --loader-workers "${GPU_WORKERS:-2}" --loader-stream-priority -1 --budget 90 --run-limit 85)
mps_on
for i in $(seq "${REPEATS:-2}"); do
  limit 100 "${R[@]}" "${L[@]}" --label "priority-$i" >/dev/null
  for p in ${SM_PERCENTS:-25 50}; do
    limit 100 "${R[@]}" "${L[@]}" --label "priority-sm$p-$i" \
      --loader-worker-env "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$p" >/dev/null
  done
done
loader_ceiling
mps_off
loader_summary
