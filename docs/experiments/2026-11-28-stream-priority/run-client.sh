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
loader_runs stream-priority-client
L=(--configs loader --loader-workers "${GPU_WORKERS:-2}" --budget 90 --run-limit 85)
BELOW=(--loader-worker-env CUDA_MPS_CLIENT_PRIORITY=1)
HIGH=(--loader-stream-priority -1)
mps_on
for i in $(seq "${REPEATS:-1}"); do
  limit 100 "${R[@]}" "${L[@]}" --label "neither-$i" >/dev/null
  limit 100 "${R[@]}" "${L[@]}" "${BELOW[@]}" --label "workers-below-$i" >/dev/null
  limit 100 "${R[@]}" "${L[@]}" "${HIGH[@]}" --label "trainer-high-$i" >/dev/null
  limit 100 "${R[@]}" "${L[@]}" "${BELOW[@]}" "${HIGH[@]}" --label "both-$i" >/dev/null
done
loader_ceiling
mps_off
loader_summary
