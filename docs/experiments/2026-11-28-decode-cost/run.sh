#!/usr/bin/env bash
# Host decode's CPU cost, old against new, then what it buys without MPS, decode on the
# host, auto workers, against the ceiling. From the repository root after scripts/gpu/build,
# on a 4-GPU machine, one device command each (~6-9 min). Results under $OUT: tests.txt,
# bench.txt, run.txt (loader.jsonl, summary.txt, logs.txt from the loader runs).
#   bash docs/experiments/2026-11-28-decode-cost/run.sh       # tests, bench, ResNet-50 on 4 GPUs
#   bash docs/experiments/2026-11-28-decode-cost/run.sh r18   # ResNet-18 on 1 and 2 GPUs (WORLDS=2: on 2)
#   bash docs/experiments/2026-11-28-decode-cost/run.sh mixed # ResNet-18 on 4 GPUs (WORLDS=2: 2), MPS on:
#     the first worker a GPU decodes on it, auto adds host decoders (loader_lib.py --mixed)
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
export OUT=${OUT:-/tmp/decode-cost}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ "${1:-}" = r18 ]; then
  [ -d /tmp/loader-data ] || limit 100 python3 apps/loader/make_dataset.py /tmp/loader-data --count 20000 | tail -1
  HOST_DECODE=1 M=off WORLDS="${WORLDS:-1 2}" MODELS=resnet18 ONE_S=${ONE_S:-240} DDP_S=${DDP_S:-270} L=${L:-530} \
    LOADER_SETTLE=${LOADER_SETTLE:-1200} bash docs/experiments/2026-11-27-loader-lib/run.sh >"$OUT/run.txt" 2>&1
  grep -A6 "== lib" "$OUT/run.txt" | cut -c1-400
  grep -h "^settle:" "$OUT/logs.txt" 2>/dev/null | cut -c1-260 | tail -6
  exit 0
fi
if [ "${1:-}" = mixed ]; then
  [ -d /tmp/loader-data ] || limit 100 python3 apps/loader/make_dataset.py /tmp/loader-data --count 20000 | tail -1
  limit 150 python3 -m pytest -v -p no:cacheprovider apps/tests/test_loader.py -k mixed >"$OUT/tests.txt" 2>&1
  grep -E "passed|failed" "$OUT/tests.txt" | tail -1
  MIXED=${MIXED:-1} M=on WORLDS=${WORLDS:-4} MODELS=resnet18 DDP_S=${DDP_S:-360} L=${L:-370} \
    LOADER_SETTLE=${LOADER_SETTLE:-1000} bash docs/experiments/2026-11-27-loader-lib/run.sh >"$OUT/run.txt" 2>&1
  grep -A6 "== lib" "$OUT/run.txt" | cut -c1-400
  grep -h "^settle:" "$OUT/logs.txt" 2>/dev/null | cut -c1-260 | tail -6
  exit 0
fi
limit 150 python3 -m pytest -v -p no:cacheprovider apps/tests/test_loader.py \
  -k "fused or host_decode or mixed" >"$OUT/tests.txt" 2>&1
limit 200 python3 -m pytest -v -p no:cacheprovider gpipe-py/tests/test_torch_loader.py \
  -k "on_a_gpu or pin" >>"$OUT/tests.txt" 2>&1
grep -E "(passed|failed).* in [0-9.]+s" "$OUT/tests.txt"
[ -d /tmp/loader-data ] || limit 100 python3 apps/loader/make_dataset.py /tmp/loader-data --count 20000 | tail -1
limit 90 python3 "$(dirname "$0")/bench.py" /tmp/loader-data --seconds 5 >"$OUT/bench.txt" 2>&1
cat "$OUT/bench.txt"
HOST_DECODE=1 M=off WORLDS=4 MODELS=resnet50 DDP_S=${DDP_S:-370} L=${L:-380} LOADER_SETTLE=${LOADER_SETTLE:-1000} \
  bash docs/experiments/2026-11-27-loader-lib/run.sh >"$OUT/run.txt" 2>&1
grep -A5 "== lib" "$OUT/run.txt" | cut -c1-400
grep -h "^settle:" "$OUT/logs.txt" 2>/dev/null | cut -c1-260 | tail -6
