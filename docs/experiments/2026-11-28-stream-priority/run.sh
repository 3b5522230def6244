#!/usr/bin/env bash
# Does a high-priority CUDA stream for the trainer give ResNet-18 under DDP with MPS back the
# step time its GPU decode workers take? MPS on; each rank fed by GPU_WORKERS decode workers on
# its GPU; runs alternate between the default stream and one of priority -1 (loader_lib.py
# --stream-priority; the workers keep the default, the lowest), REPEATS times each, then the
# DDP ceiling, all in one run. From the repository root after scripts/gpu/build. Results under
# $OUT: loader.jsonl, summary.txt, cpu.txt.
#   bash docs/experiments/2026-11-28-stream-priority/run.sh            # every GPU of the machine
#   WORLD=1 REPEATS=1 bash docs/experiments/2026-11-28-stream-priority/run.sh
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
loader_runs stream-priority
W=${GPU_WORKERS:-2}
mps_on
for i in $(seq "${REPEATS:-2}"); do
  limit 100 "${R[@]}" --label "default-w$W-$i" --loader-workers "$W" --configs loader --budget 90 \
    --run-limit 85 >/dev/null
  limit 100 "${R[@]}" --label "priority-w$W-$i" --loader-workers "$W" --loader-stream-priority -1 \
    --configs loader --budget 90 --run-limit 85 >/dev/null
done
loader_ceiling
mps_off
loader_summary
