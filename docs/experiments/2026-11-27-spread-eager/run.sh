#!/usr/bin/env bash
# Why the fan-out's eager models ran at 0.64x the slowest model alone when they sat on GPUs 1-3
# (docs/experiments/2026-11-27-fanout-64core): ResNet-50 alone as one gpipe consumer on GPU 0,
# then on GPU 1 mirrored (delivery auto) and in place; the three models on GPUs 1-3 mirrored
# and in place; with MPS and without. From the repository root after scripts/gpu/build, on a
# machine of 4 GPUs; about 4 minutes. Each record carries every consumer's frames/s and the
# share of its time spent waiting in recv (wait_share). Results under $OUT: fanout.jsonl, logs/.
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/spread-eager}; mkdir -p "$O"; : >"$O/fanout.jsonl"
run() { limit 75 python3 apps/fanout/run_all.py --out "$O" --run-timeout 60 --modes eager "$@" | tail -4; }
for m in on off; do
  [ "$m" = on ] && mps_on
  echo "== MPS $m: ResNet-50 alone, in one process and as one gpipe consumer on GPU 0"
  run --mps "$m" --models resnet50 --only inproc,gpipe
  echo "== MPS $m: ResNet-50 as one gpipe consumer on GPU 1, mirrored, then in place"
  run --mps "$m-gpu1" --models resnet50 --only gpipe --model-devices 1
  run --mps "$m-gpu1-inplace" --models resnet50 --only gpipe --model-devices 1 --delivery in-place
  echo "== MPS $m: the three models on GPUs 1-3, mirrored, then in place"
  run --mps "$m-spread" --only inproc,gpipe --model-devices 1,2,3
  run --mps "$m-spread-inplace" --only gpipe --model-devices 1,2,3 --delivery in-place
  [ "$m" = on ] && mps_off
done
python3 - "$O/fanout.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    cons = r.get("consumers") or []
    per = ", ".join(f"{c.get('model')}@{c.get('device')} {c.get('fps')} fps wait {c.get('wait_share')}"
                    for c in cons if c)
    print(f"{r.get('mps'):>20} {r.get('run'):>8} {r.get('mode')}: {r.get('fps') or ''} {per}")
PY
