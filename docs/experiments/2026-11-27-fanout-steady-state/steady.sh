#!/usr/bin/env bash
# Does the length of a run decide the 256 MiB ratio? `gpipe bench --fanout auto` (3 consumer
# GPUs, every batch verified) at 64 and 256 MiB, short runs (what scripts/gpu/fanout.sh ran:
# 1000 and 300 batches, 64-80 GB) and long ones (4000 and 1500 batches, about 270-400 GB),
# against NCCL broadcast timed over 2 GiB (fanout.sh's yardstick) and over 64 GiB per GPU;
# MPS off, then on. From the repository root after scripts/gpu/build; results in $OUT.
set -u
. scripts/gpu/lib.sh
O=$OUT; export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$O/gpus.txt"
one() { # MPS
  for gib in 2 64; do
    limit 120 python3 scripts/gpu/nccl_broadcast.py --sizes 64MiB,256MiB --gib $gib 2>>"$O/nccl.err" |
      sed "s/^{/{\"mps\": \"$1\", \"gib\": $gib, /" >> "$O/nccl.jsonl"
  done
  for run in 64MiB:1000 64MiB:4000 256MiB:300 256MiB:1500; do
    b=${run%%:*}; k=${run##*:}
    bench_into "$O/steady.jsonl" 60 "$1|auto-$b-$k" --consumers 3 --consumer-devices 1,2,3 \
      --fanout auto --batch-bytes "$b" --batches "$k"
  done
}
one off
export CUDA_MPS_PIPE_DIRECTORY=/tmp/steady-mps CUDA_MPS_LOG_DIRECTORY=/tmp/steady-mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if nvidia-cuda-mps-control -d; then
  sleep 1; one on; echo quit | nvidia-cuda-mps-control; sleep 1
fi
python3 - "$O/steady.jsonl" "$O/nccl.jsonl" <<'PY' | tee "$O/steady-summary.txt"
import json, sys
nc = {}
for l in open(sys.argv[2]):
    try:
        r = json.loads(l); nc[(r["mps"], r["gib"], r["bytes"])] = r["per_gpu_gb_per_s"]
    except (ValueError, KeyError):
        pass
print(f"{'MPS':4} {'run':22} {'GB/s':>7} {'s':>6} {'NCCL 2GiB':>9} {'NCCL 64GiB':>10} {'ratio(64GiB)':>12}  problems")
for l in open(sys.argv[1]):
    r = json.loads(l); rep = r["report"]; mps, tag = r["tag"].split("|")
    a, b = nc.get((mps, 2, rep["batch_bytes"]), 0), nc.get((mps, 64, rep["batch_bytes"]), 0)
    print(f"{mps:4} {tag:22} {rep['gb_per_s']:7.1f} {rep['elapsed_s']:6.2f} {a:9.1f} {b:10.1f} "
          f"{rep['gb_per_s'] / b if b else 0:12.3f}  {len(rep['problems'])}")
PY
