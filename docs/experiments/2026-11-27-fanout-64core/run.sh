#!/usr/bin/env bash
# The fan-out app's eager and latency targets on a 4-GPU host's 64 cores, MPS on, from the
# repository root after scripts/gpu/build: two interleaved repetitions of the eager
# throughput runs, the latency of three empty models at 110 frames/s with consumers spinning
# 20 ms, then eager and graph runs with the three models on GPUs 1-3 fed from GPU 0. About
# 6 minutes. Results under $OUT: fanout.jsonl, fanout.txt, logs/.
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/fanout-64core}; mkdir -p "$O"; : >"$O/fanout.jsonl"
mps_on
limit 230 python3 apps/fanout/run_all.py --mps on --out "$O" --run-timeout 60 --budget 200 --modes eager \
  --only inproc,gpipe --repeat 2
limit 70 python3 apps/fanout/run_all.py --mps on --out "$O" --run-timeout 50 --modes eager --only empty \
  --rate 110 --spin 0.02
limit 130 python3 apps/fanout/run_all.py --mps on-spread --out "$O" --run-timeout 60 --budget 100 \
  --modes eager,graph --only inproc,gpipe --model-devices 1,2,3
mps_off
