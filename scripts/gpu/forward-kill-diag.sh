#!/usr/bin/env bash
# A forwarder in the middle of a CUDA chain SIGKILLed (issue #20's fault case), by hand, for
# each sync mode of the forwarders' rings: which process is left, and where it waits.
# Every process runs in its own session (pgid = pid) and is killed by pid at the end; all
# output goes to files. DEV: the forwarders' and far consumer's GPU.
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. .gpu/env.sh
DEV=${DEV:-1}
BYTES=${BYTES:-8MiB}; SLOTS=${SLOTS:-8}
for sync in semaphore events; do
for action in clean kill; do
  W=$(mktemp -d /tmp/fk.XXXX)
  echo "== forwarders with --sync $sync, on GPU $DEV, $BYTES x $SLOTS: $action"
  setsid gpipe produce --backend cuda --socket $W/a.sock --batch-bytes $BYTES --slots $SLOTS --rate 1000 > /dev/null 2> $W/p.err < /dev/null & P=$!
  for _ in $(seq 100); do [ -S $W/a.sock ] && break; sleep 0.1; done
  setsid gpipe consume --socket $W/a.sock --verify --json > $W/other.json 2> /dev/null < /dev/null & OTHER=$!
  setsid gpipe relay forward --upstream $W/a.sock --socket $W/b.sock --device $DEV --sync $sync --wait-for-consumers 1 > /dev/null 2> $W/f1.err < /dev/null & F1=$!
  for _ in $(seq 100); do [ -S $W/b.sock ] && break; sleep 0.1; done
  setsid gpipe relay forward --upstream $W/b.sock --socket $W/c.sock --device $DEV --sync $sync --wait-for-consumers 1 > /dev/null 2> $W/f2.err < /dev/null & F2=$!
  for _ in $(seq 100); do [ -S $W/c.sock ] && break; sleep 0.1; done
  setsid gpipe consume --socket $W/c.sock --device $DEV --verify --json > $W/far.json 2> $W/far.err < /dev/null & FAR=$!
  sleep 4
  if [ $action = kill ]; then echo "killing f1 ($F1)"; kill -9 $F1; else echo "stopping the producer"; kill -INT $P; fi
  sleep 6
  for n in F2 FAR P; do
    pid=${!n}
    if kill -0 $pid 2>/dev/null && [ "$(cat /proc/$pid/stat 2>/dev/null | awk '{print $3}')" != Z ]; then
      echo "$n still running (pid $pid):"
      for t in /proc/$pid/task/*; do echo "  $(cat $t/comm) $(cat $t/wchan 2>/dev/null)"; done
    else
      wait $pid; echo "$n exited rc=$?"
    fi
  done
  echo "-- f2.err"; tail -3 $W/f2.err; echo "-- far.err"; tail -3 $W/far.err; echo "-- far.json"; python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print({k: r.get(k) for k in ['received','mismatches','bad_seqs','first_seq','last_seq','gaps','error']})" $W/far.json
  for pid in $P $F1 $F2 $FAR $OTHER; do kill -9 -- -$pid 2>/dev/null; kill -9 $pid 2>/dev/null; done
  wait 2>/dev/null
  rm -rf $W
done
done
