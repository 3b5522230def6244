#!/usr/bin/env bash
# What this experiment's changes owe a GPU, in one command from the repository root after
# scripts/gpu/build, MPS off. Results under $OUT: tests.txt, rust.txt, loader.jsonl,
# summary.txt, run.txt, logs.txt (the loader's progress and auto's decisions).
#   bash docs/experiments/2026-11-27-host-upload/verify.sh
# It ran at 18:45 UTC on 2026-11-27 and found the Loader's hold bug (README.md); run it again
# for pipeline-core's on_map after the handshake.
# 1. pipeline-cuda's read-only lock and the kept current context (host_registration test);
# 2. the pinned Loader and Consumer tests (the DataLoader idiom, a rank on another GPU),
#    host decode's;
# 3. host decode with auto on one GPU: does it settle before the timed steps? Target >= 0.95
#    of the ceiling (1.00 at 18:58).
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
export OUT=${OUT:-/tmp/host-upload-verify}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
limit 120 .gpu/tests/host_registration --include-ignored >"$OUT/rust.txt" 2>&1
tail -3 "$OUT/rust.txt"
limit 300 python3 -m pytest -v -p no:cacheprovider gpipe-py/tests/test_torch_loader.py \
  gpipe-py/tests/test_torch.py apps/tests/test_loader.py -k "pin or host_decode or on_a_gpu" \
  >"$OUT/tests.txt" 2>&1
grep -E "passed|failed" "$OUT/tests.txt" | tail -2
HOST_DECODE=1 M=off WORLDS=1 MODELS=resnet50 ONE_S=330 L=345 \
  bash docs/experiments/2026-11-27-loader-lib/run.sh >"$OUT/run.txt" 2>&1
grep -A4 "== lib" "$OUT/run.txt" | cut -c1-400
