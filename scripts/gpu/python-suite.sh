#!/usr/bin/env bash
# On the GPU host, from the repo root, after staging (../shared/scripts/stage-gpu.sh with
# maturin installed): the Rust suite with the GPU tests, the Python package's tests (host and
# GPU, torch/CuPy/JAX), and the Python per-batch cost benchmark with torch. Every step runs in
# its own process group under a hard time limit; logs go to $OUT.
# Usage: bash scripts/gpu/python-suite.sh [rust|py|bench ...]   (default: all three)
set -u
O=${OUT:-/tmp/gpipe-py-suite}; mkdir -p "$O"
. .gpu/env.sh
steps=${*:-rust py bench}
. scripts/gpu/lib.sh
for step in $steps; do
  case $step in
    rust)
      echo "== Rust suite (GPU tests included)"
      limit 280 bash .gpu/run.sh >"$O/rust.log" 2>&1; echo "rust rc=$?"
      grep -E "test result|FAILED|panicked|test executables" "$O/rust.log" | sort | uniq -c | tail -15 ;;
    py)
      echo "== Python package tests"
      GPIPE_REPORT="$O/figures.txt" limit 300 python3 -m pytest -q -rs gpipe-py/tests -p no:cacheprovider >"$O/pytest.log" 2>&1; echo "pytest rc=$?"; cat "$O/figures.txt" 2>/dev/null
      tail -25 "$O/pytest.log" ;;
    bench)
      echo "== Python per-batch cost (host backend)"
      limit 120 python3 benches/python_overhead.py --rounds 200 2>&1 | tee "$O/python_overhead.txt" ;;
    smoke)
      echo "== torch ring benchmark, smoke run (no MPS)"
      limit 200 python3 benches/torch_ring_bench.py --sizes 2MiB --consumers 1,4 --reps 1 --seconds 0.3 2>&1 | tail -8 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)'
