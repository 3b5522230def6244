#!/usr/bin/env bash
# MPS's client priority for the decode workers (CUDA_MPS_CLIENT_PRIORITY=1, below normal, in
# their environment only: loader_lib.py --worker-env) against the trainer's high-priority
# stream (--stream-priority -1), each alone, both, and neither: ResNet-18 under DDP with MPS,
# GPU_WORKERS decode workers a rank, REPEATS rounds, then the DDP ceiling, in one run. From
# the repository root after scripts/gpu/build. Results under $OUT: loader.jsonl, summary.txt,
# cpu.txt.
#   bash docs/experiments/2026-11-28-stream-priority/run-client.sh
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/stream-priority-client}; mkdir -p "$O"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
machine_facts >"$O/cpu.txt"
loader_data
WORLD=${WORLD:-$(gpu_count)}
R=(python3 apps/loader/run_all.py --data /tmp/loader-data --out "$O" --world-size "$WORLD" --ddp-only
   --models "${MODEL:-resnet18}" --warmup 40 --steps 150 --no-summary --configs loader
   --loader-workers "${GPU_WORKERS:-2}" --budget 90 --run-limit 85)
BELOW=(--loader-worker-env CUDA_MPS_CLIENT_PRIORITY=1)
HIGH=(--loader-stream-priority -1)
mps_on
for i in $(seq "${REPEATS:-1}"); do
  limit 100 "${R[@]}" --label "neither-$i" >/dev/null
  limit 100 "${R[@]}" "${BELOW[@]}" --label "workers-below-$i" >/dev/null
  limit 100 "${R[@]}" "${HIGH[@]}" --label "trainer-high-$i" >/dev/null
  limit 100 "${R[@]}" "${BELOW[@]}" "${HIGH[@]}" --label "both-$i" >/dev/null
done
limit 60 python3 apps/loader/run_all.py --data /tmp/loader-data --out "$O" --world-size "$WORLD" --ddp-only \
  --models "${MODEL:-resnet18}" --warmup 40 --steps 150 --no-summary --label ceiling --configs ceiling \
  --budget 45 --run-limit 42 >/dev/null
mps_off
python3 docs/experiments/2026-11-28-worker-cpus/summary.py "$O/loader.jsonl" | tee "$O/summary.txt"
