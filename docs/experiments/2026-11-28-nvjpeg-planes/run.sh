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
loader_runs nvjpeg-planes
W=${GPU_WORKERS:-2}
mps_on
limit 100 env GPIPE_DECODE=torchvision "${R[@]}" --label "rgb-w$W" --loader-workers "$W" --configs loader \
  --budget 90 --run-limit 85 >/dev/null
limit 100 "${R[@]}" --label "planes-w$W" --loader-workers "$W" --configs loader --budget 90 --run-limit 85 >/dev/null
loader_ceiling
mps_off
loader_summary
limit 120 python3 docs/experiments/2026-11-28-nvjpeg-planes/probe.py /tmp/loader-data --batch 256 >"$O/probe.json"
