#!/usr/bin/env bash
# Where the fan-out's added latency goes at p99: three empty models at 110 frames/s, consumers
# spinning 20 ms, MPS on then off, each setting with the processes where the scheduler puts
# them and pinned to two CPUs each (run_all.py --pin-cpus), two interleaved repetitions; then
# the machine's floor (latency_floor.py, spinning and sleeping readers). From the repository
# root after scripts/gpu/build, one GPU, about 3 minutes. Results under $OUT: fanout.jsonl,
# floor.jsonl, cpu.txt, summary.txt.
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/fanout-latency}; mkdir -p "$O"; : >"$O/fanout.jsonl"
export PYTHONUNBUFFERED=1
machine_facts >"$O/cpu.txt"
E=(python3 apps/fanout/run_all.py --out "$O" --run-timeout 40 --modes eager --only empty --rate 110 --spin 0.02)
for m in on off; do
  [ $m = on ] && mps_on
  for rep in 1 2; do
    limit 60 "${E[@]}" --mps $m >/dev/null
    limit 60 "${E[@]}" --mps $m --pin-cpus >/dev/null
  done
  [ $m = on ] && mps_off
done
: >"$O/floor.jsonl"
for w in spin sleep; do
  limit 30 python3 apps/fanout/latency_floor.py --readers 3 --rate 110 --seconds 3 --wait $w >>"$O/floor.jsonl"
done
python3 "$(dirname "$0")/summary.py" "$O" | tee "$O/summary.txt"
