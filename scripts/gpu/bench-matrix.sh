#!/usr/bin/env bash
# The CUDA benchmark matrix for docs/benchmarks.md: 2/8/64 MiB, 1 and 4 consumers, MPS off
# and on, gpipe throughput (with its single-process ceiling), single-slot round trips, and
# torch.multiprocessing doing the same fill and reduce. Writes JSON lines under $OUT.
# Usage (on the GPU host, from the repo root): bash scripts/gpu/bench-matrix.sh
set -u
G=.gpu/bin/gpipe
O=${OUT:-/tmp/gpipe-matrix}; mkdir -p "$O"
run() { # label, then gpipe args
  local label=$1; shift
  local line
  line=$(timeout -k 5 120 setsid $G bench --backend cuda --json "$@" 2>>"$O/stderr.log" | tr -d '\n')
  echo "{\"label\":\"$label\",\"report\":${line:-null}}" >>"$O/matrix.jsonl"
  echo "$label: $(echo "$line" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(round(r["batches_per_s"]), "b/s", round(r["gb_per_s"],1), "GB/s ratio", round(r["extra"]["ratio_to_ceiling"],3), "rtt", r.get("round_trip_p50_us"), r.get("round_trip_p99_us"), "problems", r["problems"])' 2>&1)"
}
torch() { # label, then script args
  local label=$1; shift
  local line
  line=$(timeout -k 5 150 setsid python3 benches/torch_mp_bench.py --json "$@" 2>>"$O/torch-stderr.log" | tail -1)
  echo "{\"label\":\"$label\",\"report\":${line:-null}}" >>"$O/torch.jsonl"
  echo "$label: $line" | cut -c1-300
}
matrix() { # mps label
  local mps=$1
  for size in 2MiB 8MiB 64MiB; do
    case $size in 2MiB) n=20000;; 8MiB) n=10000;; 64MiB) n=2000;; esac
    for c in 1 4; do
      run "gpipe mps=$mps size=$size consumers=$c" --batch-bytes $size --consumers $c --batches $n --slots 8
    done
    run "gpipe-rtt mps=$mps size=$size" --batch-bytes $size --consumers 1 --batches 2000 --slots 1 --round-trip
  done
  run "gpipe mps=$mps size=2MiB consumers=1 slots=32" --batch-bytes 2MiB --consumers 1 --batches 20000 --slots 32
  run "gpipe mps=$mps size=2MiB consumers=4 mode=shared" --batch-bytes 2MiB --consumers 4 --batches 20000 --slots 8 --mode shared
}
torch_matrix() {
  local mps=$1
  for size in 2MiB 8MiB 64MiB; do
    for c in 1 4; do
      torch "torch mps=$mps size=$size consumers=$c" --batch-bytes $size --consumers $c --batches 300 --warmup 20
    done
  done
}
: >"$O/matrix.jsonl"; : >"$O/torch.jsonl"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$O/device.txt"
matrix off
torch_matrix off
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && sleep 1
$G probe | grep -i mps
matrix on
torch_matrix on
echo quit | nvidia-cuda-mps-control
