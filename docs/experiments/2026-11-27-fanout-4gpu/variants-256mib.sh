#!/usr/bin/env bash
# 256 MiB chain variants (copies in flight, slots) against NCCL broadcast, MPS off; from the
# repository root after scripts/gpu/build, on 3 or more GPUs. Writes to $OUT.
set -u
. scripts/gpu/lib.sh
O=$OUT; export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$O/gpus.txt"
limit 90 python3 scripts/gpu/nccl_broadcast.py --sizes 64MiB,256MiB > "$O/nccl.jsonl" 2> "$O/nccl.err"; cat "$O/nccl.jsonl"
c=(--consumers 3 --consumer-devices 1,2,3 --fanout chain --chunk off --batch-bytes 256MiB --batches 300)
for v in "inproc-d3:--forwarders in-consumer" "inproc-d1:--forwarders in-consumer --forward-depth 1" \
         "inproc-d2:--forwarders in-consumer --forward-depth 2" "inproc-d6:--forwarders in-consumer --forward-depth 6" \
         "inproc-s16:--forwarders in-consumer --slots 16" "inproc-s16-d6:--forwarders in-consumer --slots 16 --forward-depth 6" \
         "proc-d3:--forwarders process" "inproc-d3-again:--forwarders in-consumer"; do
  tag=${v%%:*}; args=${v#*:}
  # shellcheck disable=SC2086
  bench_into "$O/probe.jsonl" 45 "$tag" "${c[@]}" $args
done
python3 - "$O/probe.jsonl" "$O/nccl.jsonl" <<'PY' | tee "$O/probe-summary.txt"
import json, sys
nc = {}
for l in open(sys.argv[2]):
    try:
        r = json.loads(l); nc[r["bytes"]] = r["per_gpu_gb_per_s"]
    except Exception:
        pass
for l in open(sys.argv[1]):
    r = json.loads(l); rep = r["report"]; n = nc.get(rep["batch_bytes"], 0)
    print(f'{r["tag"]:18} {rep["gb_per_s"]:8.1f} GB/s per GPU  NCCL {n:6.1f}  ratio {rep["gb_per_s"]/n if n else 0:5.3f}  problems {len(rep["problems"])}')
PY
