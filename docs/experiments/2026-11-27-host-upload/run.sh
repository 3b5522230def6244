#!/usr/bin/env bash
# Where host decode's trainer spends its time (apps/loader/host_decode.py's Upload, its
# upload_s), from the repository root after scripts/gpu/build, MPS off, one GPU, W fixed
# workers (default 12; PIN= skips pin_cost.py). Results under $OUT:
#   pin.jsonl      pin_cost.py: page-locking a shared mapping, and copies from it (156, 236 MB)
#   w$W.jsonl      loader_lib.py --host-decode with W fixed workers: upload_s, the timeline
#   profile.txt    torch.profiler over 8 steps after the timed ones
#   bash docs/experiments/2026-11-27-host-upload/run.sh
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
export OUT=${OUT:-/tmp/host-upload}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=docs/experiments/2026-11-27-host-upload
W=${W:-12}
DATA=/tmp/loader-data
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | head -1
[ -n "${PIN-1}" ] && { limit 60 python3 $here/pin_cost.py 156 10; limit 60 python3 $here/pin_cost.py 236 5; } >"$OUT/pin.jsonl"
limit 100 python3 apps/loader/make_dataset.py "$DATA" --count 20000 2>&1 | tail -1
lib=(apps/loader/loader_lib.py --data "$DATA" --host-decode --workers "$W" --settle 0 --warmup 20)
echo "== $W workers, 60 steps, then 8 under torch.profiler"
limit 200 python3 "${lib[@]}" --steps 60 --profile 8 --profile-out "$OUT/profile.txt" --label "w$W" \
  >"$OUT/w$W.jsonl" 2>"$OUT/w$W.err" || tail -5 "$OUT/w$W.err"
python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l); print({k: r.get(k) for k in ("images_per_s", "wait_fraction", "host_wait_fraction", "upload_s", "batches_uploaded")})' "$OUT/w$W.jsonl"
