#!/usr/bin/env bash
# `--fanout auto` on 4 GPUs (consumers on 1-3), MPS off, against NCCL broadcast in the same
# run; from the repository root after scripts/gpu/build. Writes to $OUT.
set -u
. scripts/gpu/lib.sh
O=$OUT; export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$O/gpus.txt"
limit 90 python3 scripts/gpu/nccl_broadcast.py --sizes 2MiB,64MiB,256MiB > "$O/nccl.jsonl" 2> "$O/nccl.err"
for size in 2MiB:5000 64MiB:1000 256MiB:300; do
  b=${size%%:*}; k=${size##*:}
  bench_into "$O/auto.jsonl" 45 "auto-$b" --consumers 3 --consumer-devices 1,2,3 --fanout auto --batch-bytes "$b" --batches "$k"
done
python3 - "$O/auto.jsonl" "$O/nccl.jsonl" <<'PY' | tee "$O/auto-summary.txt"
import json, sys
nc = {}
for l in open(sys.argv[2]):
    try:
        r = json.loads(l); nc[r["bytes"]] = r["per_gpu_gb_per_s"]
    except Exception:
        pass
for l in open(sys.argv[1]):
    r = json.loads(l); rep = r["report"]; n = nc.get(rep["batch_bytes"], 0)
    fan = rep.get("fanout") or rep.get("extra", {}).get("fanout")
    print(f'{r["tag"]:12} {rep["gb_per_s"]:8.1f} GB/s per GPU  NCCL {n:6.1f}  ratio {rep["gb_per_s"]/n if n else 0:5.3f}  problems {len(rep["problems"])}  plan {json.dumps(fan)[:300]}')
PY
