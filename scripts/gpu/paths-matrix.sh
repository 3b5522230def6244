#!/usr/bin/env bash
# Every CUDA memory path x sync mode (docs/benchmarks.md, "Memory paths"): 2/8/64 MiB, 1 and
# 4 consumers, MPS off and on, in one run; the attach cost per path comes from the consumers'
# import timings. From the repository root after scripts/gpu/build; writes $OUT/paths.jsonl
# (default /tmp/gpipe-paths).
#   scripts/gpu/paths-matrix.sh
set -u
. "$(dirname "$0")/lib.sh"
G=gpipe
O=${OUT:-/tmp/gpipe-paths}; mkdir -p "$O"; : >"$O/paths.jsonl"
one() { # mps memory sync size consumers batches
  local line
  line=$(timeout -k 5 90 setsid $G bench --backend cuda --json --memory "$2" --sync "$3" \
    --batch-bytes "$4" --consumers "$5" --batches "$6" --slots 8 2>>"$O/stderr.log" | tr -d '\n')
  echo "{\"mps\":\"$1\",\"memory\":\"$2\",\"sync\":\"$3\",\"size\":\"$4\",\"consumers\":$5,\"report\":${line:-null}}" >>"$O/paths.jsonl"
  echo "$1 $2 $3 $4 x$5: $(echo "${line:-null}" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(round(r["batches_per_s"]), round(r["extra"]["ratio_to_ceiling"],3), r["problems"])' 2>&1 | head -c 200)"
}
sweep() {
  for m in pool vmm legacy; do for y in events semaphore; do
    one "$1" $m $y 2MiB 1 10000; one "$1" $m $y 2MiB 4 10000
    one "$1" $m $y 8MiB 1 5000;  one "$1" $m $y 8MiB 4 5000
    one "$1" $m $y 64MiB 1 1000; one "$1" $m $y 64MiB 4 1000
  done; done
}
sweep off
mps_on
sweep on
mps_off
