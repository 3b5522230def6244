#!/usr/bin/env bash
# The NCCL relay (docs/relay.md) on a machine with 2 GPUs, from the repository root after
# scripts/gpu/build: two
# "hosts" on one machine (ring A on GPU 0, the receiver's ring B on GPU 1), NCCL's default
# transport and its socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, as between
# machines). Results under $OUT: tests.log, relay.jsonl (one line per run), summary.txt.
#   bash scripts/gpu/relay.sh          # tests, then the benchmark
#   bash scripts/gpu/relay.sh tests    # the tests alone
#   MPS=both bash scripts/gpu/relay.sh bench   # the benchmark without MPS, then with it
#   MPS=on SIZES="64MiB:3000" REPS=3 FAR_VERIFY=0 bash scripts/gpu/relay.sh bench
#     (sizes as SIZE:BATCHES for the default transport; FAR_VERIFY=0: the far consumer
#     receives and releases without reading, to measure what its verify kernel costs;
#     PRIORITY=high: the relay's NCCL streams at high priority instead of normal)
set -u
. "$(dirname "$0")/lib.sh"
O=${OUT:-/tmp/o}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0
what=${1:-all}
if [ -z "${GPIPE_NCCL_LIB:-}" ]; then
  GPIPE_NCCL_LIB=$(python3 -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  export GPIPE_NCCL_LIB
fi
echo "NCCL: $GPIPE_NCCL_LIB"; ls -la "$GPIPE_NCCL_LIB" || exit 1
if [ "$what" = all ] || [ "$what" = tests ]; then
  echo "== relay tests (host ones and the 2-GPU NCCL ones)"
  limit 240 .gpu/tests/relay --include-ignored --test-threads=1 > "$O/tests.log" 2>&1
  echo "relay tests rc=$?"; grep -E "^test |test result" "$O/tests.log"
  [ "$what" = tests ] && exit 0
fi
W=$(mktemp -d /tmp/relay.XXXX)
printf 'relay benchmark secret, local only\n' > "$W/secret"; chmod 600 "$W/secret"
port=41000
run() { # transport size batches (MPS_NOW: on or off, for the record)
  local tr=$1 size=$2 n=$3 env=()
  [ "$tr" = sockets ] && env=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
  port=$((port + 1))
  local d="$W/$tr-$size-$MPS_NOW"; mkdir -p "$d"
  env "${env[@]}" timeout -k 5 100 setsid gpipe produce --backend cuda --socket "$d/a.sock" --batch-bytes "$size" --slots 8 --batches "$n" --wait-for-consumers 1 2> "$d/p.err" &
  local pp=$!
  for _ in $(seq 100); do [ -S "$d/a.sock" ] && break; sleep 0.1; done
  env "${env[@]}" timeout -k 5 100 setsid gpipe relay recv --connect 127.0.0.1:$port --socket "$d/b.sock" --secret-file "$W/secret" --device 1 --stream-priority "${PRIORITY:-normal}" --json > "$d/recv.json" 2> "$d/recv.err" &
  local rp=$!
  env "${env[@]}" timeout -k 5 100 setsid gpipe relay send --socket "$d/a.sock" --listen 127.0.0.1:$port --secret-file "$W/secret" --stream-priority "${PRIORITY:-normal}" --json > "$d/send.json" 2> "$d/send.err" &
  local sp=$!
  for _ in $(seq 200); do [ -S "$d/b.sock" ] && break; sleep 0.1; done
  local far=(--verify); [ "${FAR_VERIFY:-1}" = 0 ] && far=()
  timeout -k 5 100 setsid gpipe consume --socket "$d/b.sock" --device 1 "${far[@]}" --json > "$d/far.json" 2> "$d/far.err" &
  local fp=$!
  wait $pp $sp $rp $fp
  port=$((port + 1))
  env "${env[@]}" timeout -k 5 60 setsid gpipe relay nccl-bench --listen 127.0.0.1:$port --secret-file "$W/secret" --device 0 --bytes "$size" --iters "$n" --json > "$d/nccl-send.json" 2> "$d/nccl.err" &
  local np=$!
  env "${env[@]}" timeout -k 5 60 setsid gpipe relay nccl-bench --connect 127.0.0.1:$port --secret-file "$W/secret" --device 1 --bytes "$size" --iters "$n" --json > "$d/nccl-recv.json" 2>> "$d/nccl.err"
  wait $np
  python3 - "$tr" "$size" "$d" "$MPS_NOW" >> "$O/relay.jsonl" <<'PY'
import json, os, sys
tr, size, d, mps = sys.argv[1:]
def last(p):
    try:
        return json.loads([l for l in open(p) if l.strip()][-1])
    except Exception as e:
        return {"error": f"{p}: {e}"}
print(json.dumps({"transport": tr, "size": size, "mps": mps, "far_verify": os.environ.get("FAR_VERIFY", "1") != "0", "priority": os.environ.get("PRIORITY", "normal"), "recv": last(f"{d}/recv.json"), "send": last(f"{d}/send.json"),
                  "far": last(f"{d}/far.json"), "nccl": last(f"{d}/nccl-recv.json")}))
PY
  tail -n 2 "$d"/*.err | grep -iE "error|fail" | head -5
}
case "${MPS:-off}" in both) modes="off on";; on) modes=on;; *) modes=off;; esac
for MPS_NOW in $modes; do
  echo "== benchmark, MPS $MPS_NOW"
  [ "$MPS_NOW" = on ] && mps_on
  for rep in $(seq "${REPS:-2}"); do
    for sz in ${SIZES:-2MiB:20000 64MiB:3000 256MiB:800}; do run default "${sz%%:*}" "${sz##*:}"; done
    [ "$MPS_NOW" = off ] && { run sockets 2MiB 800; run sockets 64MiB 80; run sockets 256MiB 20; }
  done
  [ "$MPS_NOW" = on ] && mps_off
done
python3 - "$O/relay.jsonl" <<'PY' | tee "$O/summary.txt"
import json, sys, statistics
from collections import defaultdict
rows = defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); rows[(r["transport"], r.get("mps", "off"), r["size"], r.get("far_verify", True), r.get("priority", "normal"))].append(r)
print(f"{'transport':9} {'MPS':3} {'size':7} {'far reads':9} {'priority':8} {'relay GB/s':>11} {'NCCL GB/s':>10} {'ratio':>6}  far consumer (received, mismatches)")
for (tr, mps, size, fv, prio), rs in sorted(rows.items()):
    rel = [r["recv"].get("gb_per_s", 0) for r in rs]; nc = [r["nccl"].get("gb_per_s", 0) for r in rs]
    ratios = [a / b if b else 0 for a, b in zip(rel, nc)]
    far = [(r["far"].get("received"), r["far"].get("mismatches")) for r in rs]
    print(f"{tr:9} {mps:3} {size:7} {'verify' if fv else 'no':9} {prio:8} {statistics.median(rel):11.1f} {statistics.median(nc):10.1f} {statistics.median(ratios):6.2f}  {far}")
PY
rm -rf "$W"
