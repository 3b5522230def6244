#!/usr/bin/env bash
# The CLI's output for a fixed list of invocations (host backend, no GPU), one file per
# invocation, with temporary paths, pids and durations masked so that two builds compare.
# Usage: run.sh GPIPE OUTDIR
G=$1; O=$2; mkdir -p "$O"; D=$(mktemp -d); trap 'rm -rf "$D"' EXIT
n=0
run() { n=$((n+1)); f=$(printf "%s/%02d.txt" "$O" $n); { echo "\$ gpipe $*"; timeout 60 "$G" "$@" 2>&1; echo "[exit $?]"; } | sed -E "s#$D#DIR#g; s/pid [0-9]+/pid N/g; s/[0-9]+\.[0-9]+ (ms|s|µs|us)\b/T \1/g" > "$f"; }
run --help
run bench --help
run produce --help
run consume --help
run inspect --help
run probe --help
run soak --help
run relay --help
run probe
run produce --batch-bytes 0 --socket "$D/a.sock"
run produce --slots 5000 --socket "$D/a.sock"
run produce --rate 1e-300 --socket "$D/a.sock"
run consume --socket "$D/missing/x.sock"
run consume --socket "$D/none.sock" --attach-timeout-ms 200
run inspect --socket "$D/none.sock"
run bench --backend host --batch-bytes 0
run bench --backend host --consumers 0
run bench --backend host --consumers 99
run bench --backend host --slots 0
run bench --backend host --batches 300 --batch-bytes 64KiB --consumers 2 --quiet
run produce --backend host --socket "$D/p.sock" --batches 50 --wait-for-consumers 9 --max-consumers 2
