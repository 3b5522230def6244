#!/usr/bin/env bash
# The Python benchmark matrix of docs/benchmarks.md, on the GPU host from the repo root after
# staging: gpipe's Python package, the hand-built torch ring, torch.multiprocessing queues and
# the one-process ceiling (benches/torch_ring_bench.py), and the Rust `gpipe bench`:
# without MPS at 2 MiB with 1 consumer, then with MPS at 2, 8 and 64 MiB with 1 and 4
# consumers; 5 repetitions, programs interleaved. JSON lines and logs go to $OUT.
set -u
O=${OUT:-/tmp/gpipe-py-bench}; mkdir -p "$O"
. .gpu/env.sh
. scripts/gpu/lib.sh
rust() { # label, gpipe bench args
  local label=$1; shift
  local line
  line=$(limit 60 .gpu/bin/gpipe bench --backend cuda --json "$@" 2>>"$O/rust-stderr.log" | tr -d '\n')
  echo "{\"label\":\"$label\",\"report\":${line:-null}}" >>"$O/rust.jsonl"
  echo "$label: $(echo "$line" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(round(r["batches_per_s"]), "b/s")' 2>&1)"
}
echo "== no MPS"
limit 230 python3 benches/torch_ring_bench.py --label nomps --sizes 2MiB --consumers 1 --reps 5 --seconds 0.4 --json "$O/torch.jsonl" 2>"$O/nomps-stderr.log" | cut -c1-400
for r in 1 2 3; do rust "nomps 2MiB c1 rep$r" --batch-bytes 2MiB --consumers 1 --batches 5000 --slots 8; done
echo "== MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && sleep 1
limit 400 python3 benches/torch_ring_bench.py --label mps --sizes 2MiB,8MiB,64MiB --consumers 1,4 --reps 5 --seconds 0.5 --json "$O/torch.jsonl" 2>"$O/mps-stderr.log" | cut -c1-400
for size in 2MiB 8MiB 64MiB; do for c in 1 4; do
  rust "mps $size c$c" --batch-bytes $size --consumers $c --batches 5000 --slots 8
done; done
echo quit | nvidia-cuda-mps-control
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
