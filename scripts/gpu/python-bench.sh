#!/usr/bin/env bash
# The Python benchmarks of docs/benchmarks.md, from the repository root after
# scripts/gpu/build: the package's own per-batch cost (benches/python_overhead.py, host
# backend), then gpipe's Python package against the hand-built torch ring,
# torch.multiprocessing queues and the one-process ceiling (benches/torch_ring_bench.py; every
# program fills each batch with one torch op and each consumer reduces it with one), with the
# Rust `gpipe bench` beside it for scale: without MPS at 2 MiB with 1 consumer, then with MPS
# at 2, 8 and 64 MiB with 1 and 4 consumers; 5 repetitions, programs interleaved. JSON lines
# and logs go to $OUT (default /tmp/gpipe-py-bench).
#   scripts/gpu/python-bench.sh            # all of it
#   scripts/gpu/python-bench.sh overhead   # the per-batch cost alone
#   scripts/gpu/python-bench.sh torch      # the torch comparison alone
set -u
. "$(dirname "$0")/lib.sh"
O=${OUT:-/tmp/gpipe-py-bench}; mkdir -p "$O"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
python3 -c 'import torch, numpy, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)'
if [ "$what" = all ] || [ "$what" = overhead ]; then
  echo "== per-batch cost of the package (host backend, median of 200 rounds)"
  limit 120 python3 benches/python_overhead.py --rounds 200 2>&1 | tee "$O/python_overhead.txt"
fi
[ "$what" = overhead ] && exit 0
rust() { # label, gpipe bench args
  local label=$1; shift
  bench_into "$O/rust.jsonl" 60 "$label" "$@"
}
echo "== torch comparison, no MPS"
limit 230 python3 benches/torch_ring_bench.py --label nomps --sizes 2MiB --consumers 1 --reps 5 --seconds 0.4 --json "$O/torch.jsonl" 2>"$O/nomps-stderr.log" | cut -c1-400
for r in 1 2 3; do rust "nomps 2MiB c1 rep$r" --batch-bytes 2MiB --consumers 1 --batches 5000 --slots 8; done
echo "== torch comparison, MPS"
mps_on
limit 400 python3 benches/torch_ring_bench.py --label mps --sizes 2MiB,8MiB,64MiB --consumers 1,4 --reps 5 --seconds 0.5 --json "$O/torch.jsonl" 2>"$O/mps-stderr.log" | cut -c1-400
for size in 2MiB 8MiB 64MiB; do for c in 1 4; do
  rust "mps $size c$c" --batch-bytes $size --consumers $c --batches 5000 --slots 8
done; done
mps_off
python3 scripts/gpu/bench_summary.py "$O/rust.jsonl"
