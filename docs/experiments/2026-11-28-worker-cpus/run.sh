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
O=${OUT:-/tmp/worker-cpus}; mkdir -p "$O"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
machine_facts >"$O/cpu.txt"
loader_data
N=$(nproc); WORLD=${WORLD:-1}; RES=${RES:-2}; W=${W:-$((N - RES * WORLD))}
CPUS="$((RES * WORLD))-$((N - 1))"
R=(python3 apps/loader/run_all.py --data /tmp/loader-data --out "$O" --world-size "$WORLD" --ddp-only
   --models "${MODEL:-resnet18}" --loader-host-decode --warmup 40 --steps 150 --no-summary)
for rep in 1 2; do
  limit 100 "${R[@]}" --label "any-w$W" --loader-workers "$W" --configs loader --budget 90 --run-limit 85 >/dev/null
  limit 100 "${R[@]}" --label "cpus$CPUS-w$W" --loader-workers "$W" --loader-worker-cpus "$CPUS" \
    --configs loader --budget 90 --run-limit 85 >/dev/null
done
limit 60 "${R[@]}" --label ceiling --configs ceiling --budget 45 --run-limit 42 >/dev/null
python3 "$(dirname "$0")/summary.py" "$O/loader.jsonl" | tee "$O/summary.txt"
