#!/usr/bin/env bash
# What this experiment's changes owe a GPU, from the repository root after scripts/gpu/build,
# MPS off, on a 4-GPU machine. One mode a device command (each under 10 minutes); results
# under $OUT (tests.txt, run.txt, loader.jsonl, logs.txt, summary.txt).
#   bash docs/experiments/2026-11-27-host-upload/verify.sh nice   # ~5 min
#   bash docs/experiments/2026-11-27-host-upload/verify.sh ddp2   # ~6 min
#   bash docs/experiments/2026-11-27-host-upload/verify.sh ddp4   # ~9 min
# nice: the worker_nice tests, then ResNet-50 on 4 GPUs, host decode, 14 workers per GPU at
#   nice 0 and at the default 10, and 15 at 10, with one ceiling (0.85 / 0.946 / 0.83 at
#   22:18-22:20 UTC on 2026-11-27, before every thread of a worker was niced).
# ddp2: auto on 2 GPUs under the DDP rule as mended after the 22:02 run (0.99 then), a waiting
#   rank doubling its workers (2026-11-28).
# ddp4: auto on 4 GPUs with a settle cap of 1500 steps (at 600 it was still climbing: 0.31).
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
export OUT=${OUT:-/tmp/host-upload-verify}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
data() { [ -d /tmp/loader-data ] || limit 100 python3 apps/loader/make_dataset.py /tmp/loader-data --count 20000 | tail -1; }
case "${1:-}" in
  nice)
    limit 120 python3 -m pytest -v -p no:cacheprovider gpipe-py/tests/test_torch_loader.py \
      -k "nicer or slower_peer or still_waits or doubles or limit_shares" >"$OUT/tests.txt" 2>&1
    grep -E "passed|failed" "$OUT/tests.txt" | tail -1
    data
    R=(python3 apps/loader/run_all.py --data /tmp/loader-data --out "$OUT" --world-size 4 --ddp-only
       --models resnet50 --loader-host-decode --warmup 40 --steps 100 --no-summary)
    limit 110 "${R[@]}" --label w14-nice0 --loader-workers 14 --loader-worker-nice 0 --configs loader --budget 100 --run-limit 95 >"$OUT/run.txt" 2>&1
    limit 110 "${R[@]}" --label w14-nice10 --loader-workers 14 --configs loader --budget 100 --run-limit 95 >>"$OUT/run.txt" 2>&1
    limit 110 "${R[@]}" --label w15-nice10 --loader-workers 15 --configs loader --budget 100 --run-limit 95 >>"$OUT/run.txt" 2>&1
    limit 50 "${R[@]}" --label ceiling --configs ceiling --budget 45 --run-limit 42 >>"$OUT/run.txt" 2>&1
    grep "img/s" "$OUT/run.txt" | cut -c1-200 ;;
  ddp2)
    HOST_DECODE=1 M=off WORLDS=2 MODELS=resnet50 DDP_S=330 L=345 \
      bash docs/experiments/2026-11-27-loader-lib/run.sh >"$OUT/run.txt" 2>&1
    grep -A5 "== lib" "$OUT/run.txt" | cut -c1-400 ;;
  ddp4)
    HOST_DECODE=1 M=off WORLDS=4 MODELS=resnet50 DDP_S=540 L=555 LOADER_SETTLE=1500 \
      bash docs/experiments/2026-11-27-loader-lib/run.sh >"$OUT/run.txt" 2>&1
    grep -A5 "== lib" "$OUT/run.txt" | cut -c1-400 ;;
  *) echo "usage: verify.sh nice|ddp2|ddp4" >&2; exit 2 ;;
esac
