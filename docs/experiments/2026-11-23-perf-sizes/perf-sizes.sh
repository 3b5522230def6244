#!/usr/bin/env bash
# The plot data, on one GPU, from the repo root after staging: batches/s against batch
# size (2-256 MiB) with the fair ceiling, 1 and 4 broadcast consumers, MPS on and off, each a
# `gpipe bench --repeat $REPS`; then `--slots auto` without MPS. Results under $OUT:
# sizes.jsonl (tagged reports); plot with docs/experiments/2026-11-23-perf-sizes/perf_sizes_plot.py.
#   REPS=3 bash docs/experiments/2026-11-23-perf-sizes/perf-sizes.sh
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
REPS=${REPS:-3}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
bench() { bench_into "$O/sizes.jsonl" 120 "$@"; } # tag, then gpipe bench arguments
sweep() { # mps label
  for size in 2MiB:10000 8MiB:5000 32MiB:2000 64MiB:1000 128MiB:600 256MiB:300; do
    b=${size%%:*}; n=${size##*:}
    for c in 1 4; do
      [ "$1" = off ] && n=$((n / 2))
      bench "$1-${c}c-$b" --consumers $c --batch-bytes $b --batches $n --slots 8 --repeat "$REPS"
    done
  done
}
mps_on
sweep on
mps_off
echo "== MPS off"
sweep off
echo "== --slots auto without MPS"
for b in 2MiB:10000 64MiB:1000; do
  bench "off-1c-${b%%:*}-slots-auto" --consumers 1 --batch-bytes ${b%%:*} --batches ${b##*:} --slots auto
done
python3 - "$O/sizes.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); rep = r["report"]; x = rep.get("extra", {})
    print(f'{r["tag"]:24} {rep["slots"]:3} slots {rep["batches_per_s"]:9.0f}/s  fair {x.get("fair_ceiling_batches_per_s", 0):9.0f}/s  ratio {x.get("ratio_to_fair_ceiling", 0):.2f}  problems {len(rep["problems"])}')
    if "slots_auto" in x:
        print("   ", x["slots_auto"].get("why"))
PY
