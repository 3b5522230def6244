#!/usr/bin/env bash
# How steady is "ResNet-50 alone, eager", the fan-out's reference? With MPS, one
# model per process, alternating: nothing else running, then three CPU-bound Python
# processes beside it; twice each; then once with torch's default CPU threads. Then the
# empty-model latency runs with where each frame's latency went (consumers spinning 20 ms).
# From the repo root after staging; JSON lines in $OUT/solo.jsonl and $OUT/fanout.jsonl.
#   bash docs/experiments/2026-11-23-fanout-app/fanout-solo.sh       # about 3 minutes on an H100
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
solo() { # label, then baselines.py options
  local label=$1; shift
  echo "== ResNet-50 alone, $label"
  limit 90 python3 apps/fanout/baselines.py inproc --models resnet50 --modes eager --runs solo \
    --duration 3 "$@" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); r["label"] = sys.argv[1]; print(json.dumps(r))
    print(sys.argv[1], "fps", r["fps"], file=sys.stderr)' "$label" >>"$O/solo.jsonl"
}
busy_pids=()
busy() { for k in 1 2 3; do setsid python3 -c 'while True: pass' & busy_pids+=($!); done; }
quiet() { kill -9 "${busy_pids[@]}" 2>/dev/null; wait "${busy_pids[@]}" 2>/dev/null; busy_pids=(); }
trap quiet EXIT
mps_on
for rep in 1 2; do
  solo "alone-$rep"
  busy; solo "3-busy-neighbours-$rep"; quiet
done
solo "alone-torch-default-threads" --threads 0
echo "== empty models at 110 frames/s, consumers spinning 20 ms"
limit 120 python3 apps/fanout/run_all.py --mps on --out "$O" --run-timeout 60 \
  --modes eager --only empty --rate 110 --spin 0.02 "$@"
mps_off
