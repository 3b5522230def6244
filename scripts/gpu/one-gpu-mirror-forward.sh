#!/usr/bin/env bash
# Mirror delivery and a forwarding chain on one GPU (what a one-GPU machine can check of
# #12's mirror and #20's forwarder), from the repo root after staging. Results under $OUT.
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. .gpu/env.sh
. scripts/gpu/lib.sh
for mode in broadcast shared; do
  limit 60 gpipe bench --backend cuda --mode $mode --consumers 2 --delivery mirror,in-place --batches 2000 --batch-bytes 8MiB --json > "$O/bench-$mode.json" 2>> "$O/err.txt"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], 'lost', r['lost'], 'dup', r['duplicated'], 'mismatches', r['mismatches'], [(c['delivery'], c['received']) for c in r['per_consumer']], round(r['batches_per_s']))" "$O/bench-$mode.json" $mode
done
limit 60 gpipe bench --backend cuda --consumers 1 --delivery mirror --mirror-buffers 2 --batches 2000 --batch-bytes 2MiB --json > "$O/bench-2buf.json" 2>> "$O/err.txt"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('2 buffers: lost', r['lost'], 'mismatches', r['mismatches'], r['per_consumer'][0]['delivery'])" "$O/bench-2buf.json"
W=$(mktemp -d /tmp/fw.XXXX)
limit 60 gpipe produce --backend cuda --socket $W/a.sock --batch-bytes 8MiB --batches 3000 --wait-for-consumers 1 2> "$O/produce.err" &
for _ in $(seq 100); do [ -S $W/a.sock ] && break; sleep 0.1; done
limit 60 gpipe relay forward --upstream $W/a.sock --socket $W/b.sock --device 0 --json > "$O/forward.json" 2> "$O/forward.err" &
for _ in $(seq 100); do [ -S $W/b.sock ] && break; sleep 0.1; done
limit 60 gpipe consume --socket $W/b.sock --verify --json > "$O/far.json" 2> "$O/far.err"
wait
python3 -c "import json; f=json.load(open('$O/forward.json')); c=json.loads(open('$O/far.json').read().strip().splitlines()[-1]); print('forward', f.get('batches'), 'GB/s', round(f.get('gb_per_s',0),1), '| far consumer received', c['received'], 'mismatches', c['mismatches'], 'gaps', c['gaps'], 'error', c['error'])"
rm -rf $W
