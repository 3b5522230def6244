#!/usr/bin/env bash
# The single-GPU benchmark of docs/benchmarks.md: every row of its "One GPU" tables, each one
# `gpipe bench --backend cuda --json --repeat $REPS` (broadcast, every batch verified on the
# GPU, the ratio taken against the run's own fair ceiling), with MPS and then without it;
# with TORCH=1 also torch.multiprocessing doing the same fill and verify
# (benches/torch_mp_bench.py, the peer column). From the repository root after
# scripts/gpu/build. Results under $OUT (default /tmp/gpipe-matrix): bench.jsonl (tagged
# reports), torch.jsonl, summary.txt (the table, also on stdout).
#   scripts/gpu/bench-matrix.sh               # MPS on, then off
#   REPS=3 MPS=on scripts/gpu/bench-matrix.sh  # MPS on only (MPS=off: off only)
set -u
. "$(dirname "$0")/lib.sh"
O=${OUT:-/tmp/gpipe-matrix}; mkdir -p "$O"
REPS=${REPS:-5}
: >"$O/bench.jsonl"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
bench() { local tag=$1; shift; bench_into "$O/bench.jsonl" 150 "$tag" --repeat "$REPS" "$@"; }
torch_mp() { # tag, then benches/torch_mp_bench.py arguments
  local tag=$1 line; shift
  line=$(limit 150 python3 benches/torch_mp_bench.py --json "$@" 2>>"$O/torch.err" | tail -1)
  [ -n "$line" ] && echo "{\"tag\": \"$tag\", \"report\": $line}" >>"$O/torch.jsonl" || echo "FAILED: torch $tag"
}
with_mps() {
  bench mps-1c-2MiB --consumers 1 --batch-bytes 2MiB --batches 20000 --slots 8
  bench mps-4c-2MiB --consumers 4 --batch-bytes 2MiB --batches 20000 --slots 8
  bench mps-1c-8MiB-lead-auto --consumers 1 --batch-bytes 8MiB --batches 10000 --slots 8 --max-lead auto
  for size in 16:6000 32:3000 64:3000 128:1500; do
    bench "mps-1c-${size%%:*}MiB" --consumers 1 --batch-bytes "${size%%:*}MiB" --batches "${size##*:}" --slots 8
  done
  bench mps-rtt-2MiB --consumers 1 --batch-bytes 2MiB --batches 5000 --slots 1 --round-trip
}
without_mps() {
  for slots in 8 64 auto; do
    bench "nomps-1c-2MiB-slots-$slots" --consumers 1 --batch-bytes 2MiB --batches 8000 --slots $slots
  done
  bench nomps-4c-2MiB-slots-8 --consumers 4 --batch-bytes 2MiB --batches 5000 --slots 8
  for slots in 8 32 auto; do
    bench "nomps-1c-64MiB-slots-$slots" --consumers 1 --batch-bytes 64MiB --batches 2000 --slots $slots
  done
  bench nomps-rtt-2MiB --consumers 1 --batch-bytes 2MiB --batches 2000 --slots 1 --round-trip
}
torch_sizes() { # mps label
  for size in 2MiB 8MiB 64MiB; do
    torch_mp "torch-$1-1c-$size" --batch-bytes "$size" --consumers 1 --batches 300 --warmup 20
  done
}
unset CUDA_DEVICE_MAX_CONNECTIONS
if [ "${MPS:-both}" != off ]; then
  echo "== MPS on"
  mps_on
  with_mps
  [ "${TORCH:-0}" = 1 ] && torch_sizes mps
  mps_off
fi
if [ "${MPS:-both}" != on ]; then
  echo "== MPS off"
  without_mps
  [ "${TORCH:-0}" = 1 ] && torch_sizes nomps
fi
python3 scripts/gpu/bench_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
[ -s "$O/torch.jsonl" ] && python3 - "$O/torch.jsonl" <<'PY' | tee -a "$O/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['tag']:30} {r['report'].get('batches_per_s', 0):9.0f} batches/s (torch.multiprocessing)")
PY
