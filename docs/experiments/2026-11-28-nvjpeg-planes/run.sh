#!/usr/bin/env bash
# Does decoding into the JPEGs' planes (nvjpeg_planes.py) give ResNet-18 under DDP with MPS the
# step time the RGB decode took from it? MPS on; each rank fed by GPU_WORKERS decode workers
# on its GPU: torchvision's RGB decode (GPIPE_DECODE=torchvision), then the planes, then the
# DDP ceiling, all in one run. Then probe.py on GPU 0 without MPS. From the repository root
# after scripts/gpu/build. Results under $OUT: loader.jsonl, summary.txt, probe.json, cpu.txt.
#   bash docs/experiments/2026-11-28-nvjpeg-planes/run.sh            # every GPU of the machine
#   WORLD=1 bash docs/experiments/2026-11-28-nvjpeg-planes/run.sh
# Needs planes.patch applied first (README.md): git apply docs/experiments/2026-11-28-nvjpeg-planes/planes.patch
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/nvjpeg-planes}; mkdir -p "$O"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
machine_facts >"$O/cpu.txt"
loader_data
WORLD=${WORLD:-$(gpu_count)}
R=(python3 apps/loader/run_all.py --data /tmp/loader-data --out "$O" --world-size "$WORLD" --ddp-only
   --models "${MODEL:-resnet18}" --warmup 40 --steps 150 --no-summary)
W=${GPU_WORKERS:-2}
mps_on
limit 100 env GPIPE_DECODE=torchvision "${R[@]}" --label "rgb-w$W" --loader-workers "$W" --configs loader \
  --budget 90 --run-limit 85 >/dev/null
limit 100 "${R[@]}" --label "planes-w$W" --loader-workers "$W" --configs loader --budget 90 --run-limit 85 >/dev/null
limit 60 "${R[@]}" --label ceiling --configs ceiling --budget 45 --run-limit 42 >/dev/null
mps_off
python3 docs/experiments/2026-11-28-worker-cpus/summary.py "$O/loader.jsonl" | tee "$O/summary.txt"
limit 120 python3 docs/experiments/2026-11-28-nvjpeg-planes/probe.py /tmp/loader-data --batch 256 >"$O/probe.json"
