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
O=${OUT:-/tmp/stream-priority}; mkdir -p "$O"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
machine_facts >"$O/cpu.txt"
loader_data
WORLD=${WORLD:-$(gpu_count)}
R=(python3 apps/loader/run_all.py --data /tmp/loader-data --out "$O" --world-size "$WORLD" --ddp-only
   --models "${MODEL:-resnet18}" --warmup 40 --steps 150 --no-summary)
W=${GPU_WORKERS:-2}
mps_on
for i in $(seq "${REPEATS:-2}"); do
  limit 100 "${R[@]}" --label "default-w$W-$i" --loader-workers "$W" --configs loader --budget 90 \
    --run-limit 85 >/dev/null
  limit 100 "${R[@]}" --label "priority-w$W-$i" --loader-workers "$W" --loader-stream-priority -1 \
    --configs loader --budget 90 --run-limit 85 >/dev/null
done
limit 60 "${R[@]}" --label ceiling --configs ceiling --budget 45 --run-limit 42 >/dev/null
mps_off
python3 docs/experiments/2026-11-28-worker-cpus/summary.py "$O/loader.jsonl" | tee "$O/summary.txt"
