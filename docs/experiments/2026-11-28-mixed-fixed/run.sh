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
O=${OUT:-/tmp/mixed-fixed}; mkdir -p "$O"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
machine_facts >"$O/cpu.txt"
loader_data
WORLD=${WORLD:-$(gpu_count)}
R=(python3 apps/loader/run_all.py --data /tmp/loader-data --out "$O" --world-size "$WORLD" --ddp-only
   --models "${MODEL:-resnet18}" --warmup 40 --steps 150 --no-summary)
mps_on
limit 100 "${R[@]}" --label "gpu-w${GPU_ONLY:-2}" --loader-workers "${GPU_ONLY:-2}" --configs loader \
  --budget 90 --run-limit 85 >/dev/null
for w in ${MIXES:-9 13}; do
  limit 100 "${R[@]}" --label "mixed1-w$w" --loader-workers "$w" --loader-mixed 1 --configs loader \
    --budget 90 --run-limit 85 >/dev/null
done
limit 60 "${R[@]}" --label ceiling --configs ceiling --budget 45 --run-limit 42 >/dev/null
mps_off
python3 docs/experiments/2026-11-28-worker-cpus/summary.py "$O/loader.jsonl" | tee "$O/summary.txt"
