#!/usr/bin/env bash
# Mixed decode at fixed worker counts: does one GPU decoder a rank plus enough CPU decoders
# feed ResNet-18 under DDP with MPS, where GPU decoders alone lose the decode's GPU time?
# auto could not tell (a CPU worker adds a tenth of a GPU one and was retired on noise).
# MPS on; each rank: GPU decode with GPU_ONLY workers, then 1 GPU worker and each count of
# MIXES - 1 CPU workers; the DDP ceiling last. From the repository root after
# scripts/gpu/build. Results under $OUT: loader.jsonl, summary.txt, cpu.txt.
#   bash docs/experiments/2026-11-28-mixed-fixed/run.sh                      # every GPU of the machine
#   WORLD=4 MIXES="11 15" bash docs/experiments/2026-11-28-mixed-fixed/run.sh
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
loader_runs mixed-fixed
mps_on
limit 100 "${R[@]}" --label "gpu-w${GPU_ONLY:-2}" --loader-workers "${GPU_ONLY:-2}" --configs loader \
  --budget 90 --run-limit 85 >/dev/null
for w in ${MIXES:-9 13}; do
  limit 100 "${R[@]}" --label "mixed1-w$w" --loader-workers "$w" --loader-mixed 1 --configs loader \
    --budget 90 --run-limit 85 >/dev/null
done
loader_ceiling
mps_off
loader_summary
