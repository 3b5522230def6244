#!/usr/bin/env bash
# Do decode workers slow the trainer's own step by taking the CPUs its threads need? Host
# decode, MPS off, a fixed number of workers, each run twice interleaved: the workers on any
# CPU, then on all but the first RES per trainer (Loader(worker_cpus=...)); the ceiling last.
# From the repository root after scripts/gpu/build. Results under $OUT: loader.jsonl,
# summary.txt (summary.py), cpu.txt.
#   bash docs/experiments/2026-11-28-worker-cpus/run.sh                  # 1 GPU, ResNet-18, nproc-2 workers
#   WORLD=2 W=20 RES=2 bash docs/experiments/2026-11-28-worker-cpus/run.sh  # 2 GPUs (DDP), 20 workers a rank
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
WORLD=${WORLD:-1}
loader_runs worker-cpus
R+=(--loader-host-decode)
N=$(nproc); RES=${RES:-2}; W=${W:-$((N - RES * WORLD))}
CPUS="$((RES * WORLD))-$((N - 1))"
for rep in 1 2; do
  limit 100 "${R[@]}" --label "any-w$W" --loader-workers "$W" --configs loader --budget 90 --run-limit 85 >/dev/null
  limit 100 "${R[@]}" --label "cpus$CPUS-w$W" --loader-workers "$W" --loader-worker-cpus "$CPUS" \
    --configs loader --budget 90 --run-limit 85 >/dev/null
done
loader_ceiling
loader_summary
