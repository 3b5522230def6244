#!/usr/bin/env bash
# The second command: the three models on GPUs 1-3, eager, MPS on, against the same three
# models each alone in a process of its own on its GPU, all at once, no transport
# (run_all.py's "together" part), two interleaved repetitions; then gpipe in place once. From
# the repository root after scripts/gpu/build, on a machine of 4 GPUs; about 2.5 minutes.
# Results under $OUT: fanout2.jsonl, spread2.txt.
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/spread-eager}; mkdir -p "$O/2"
mps_on
limit 150 python3 apps/fanout/run_all.py --out "$O/2" --run-timeout 60 --modes eager --mps on-spread \
  --only together,gpipe --model-devices 1,2,3 --repeat 2 | tail -8
limit 75 python3 apps/fanout/run_all.py --out "$O/2" --run-timeout 60 --modes eager \
  --mps on-spread-inplace --only gpipe --model-devices 1,2,3 --delivery in-place | tail -4
mps_off
mv "$O/2/fanout.jsonl" "$O/fanout2.jsonl"
