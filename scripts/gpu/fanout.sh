#!/usr/bin/env bash
# Fan-out shapes (docs/multi-gpu.md) on every GPU of the machine (2 or more), from the
# repository root after scripts/gpu/build:
# one producer on GPU 0, a consumer on every other GPU, direct in place, direct mirrored,
# chain and tree, at 2, 64 and 256 MiB, against NCCL broadcast on the same GPUs in the same
# run. Results under $OUT: fanout.jsonl (tagged `gpipe bench --json` reports), nccl.jsonl,
# fanout-summary.txt.
#   scripts/gpu/fanout.sh            REPS=3 scripts/gpu/fanout.sh
set -u
. "$(dirname "$0")/lib.sh"
O=${OUT:-/tmp/o}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0
REPS=${REPS:-3}
G=$(gpu_count)
[ "$G" -ge 2 ] || { echo "scripts/gpu/fanout.sh: needs 2 or more GPUs; this machine has $G"; exit 2; }
others=$(seq -s, 1 $((G - 1)))
echo "== $G GPUs; consumers on GPUs $others"
echo "== NCCL broadcast from GPU 0 to the others"
limit 180 python3 scripts/gpu/nccl_broadcast.py --sizes 2MiB,64MiB,256MiB > "$O/nccl.jsonl" 2> "$O/nccl.err"
echo "nccl rc=$?"; cat "$O/nccl.jsonl"
bench() { bench_into "$O/fanout.jsonl" 120 "$@"; } # tag, then gpipe bench arguments
n=$((G - 1))
for rep in $(seq "$REPS"); do
  echo "-- repetition $rep of $REPS"
  for size in 2MiB:10000 64MiB:2000 256MiB:500; do
    b=${size%%:*}; k=${size##*:}
    bench "direct-in-place-$b" --consumers $n --consumer-devices $others --delivery in-place --fanout direct --batch-bytes $b --batches $k
    bench "direct-mirror-$b" --consumers $n --consumer-devices $others --delivery mirror --fanout direct --batch-bytes $b --batches $k
    bench "chain-$b" --consumers $n --consumer-devices $others --fanout chain --batch-bytes $b --batches $k
    [ "$G" -gt 2 ] && bench "tree-$b" --consumers $n --consumer-devices $others --fanout tree --batch-bytes $b --batches $k
  done
done
python3 - "$O/fanout.jsonl" "$O/nccl.jsonl" <<'PY' | tee "$O/fanout-summary.txt"
import json, sys, statistics
from collections import defaultdict
rows = defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); rows[r["tag"]].append(r["report"])
nccl = {}
for l in open(sys.argv[2]):
    try:
        r = json.loads(l); nccl[r["bytes"]] = r["per_gpu_gb_per_s"]
    except Exception:
        pass
print(f"{'shape':18} {'batch':7} {'per-GPU GB/s':>13} {'total GB/s':>11} {'NCCL bcast':>11} {'ratio':>6}  problems")
for tag, rs in rows.items():
    shape, size = tag.rsplit("-", 1)
    per = statistics.median(r["gb_per_s"] for r in rs)
    tot = statistics.median(r["delivered_gb_per_s"] for r in rs)
    b = rs[0]["batch_bytes"]; nc = nccl.get(b, 0)
    probs = sum(len(r["problems"]) for r in rs)
    print(f"{shape:18} {size:7} {per:13.1f} {tot:11.1f} {nc:11.1f} {per / nc if nc else 0:6.2f}  {probs}")
PY
