#!/usr/bin/env bash
# Diagnose a consumer SIGKILL on the CUDA backend: producer + 3 consumers, kill one, then
# check the producer still answers, and dump every thread's stack if it does not.
set -u
G=.gpu/bin/gpipe
D=$(mktemp -d); S=$D/ring.sock
mode=${1:-broadcast}
RUST_LOG=pipeline_core=debug,pipeline_cuda=debug setsid $G produce --socket $S --backend cuda --mode $mode --batch-bytes 64KiB --slots 4 >$D/p.out 2>$D/p.err &
P=$!
for i in $(seq 50); do [ -S $S ] && break; sleep 0.1; done
$G consume --socket $S --verify --json >$D/a.out 2>$D/a.err & A=$!
$G consume --socket $S --verify --json >$D/v.out 2>$D/v.err & V=$!
$G consume --socket $S --verify --json >$D/c.out 2>$D/c.err & C=$!
sleep 2
timeout 5 $G inspect --socket $S | head -5
kill -9 $V; echo "killed victim $V"
sleep 1
if timeout 6 $G inspect --socket $S; then echo "INSPECT OK"; else echo "INSPECT HUNG"; 
  for t in /proc/$P/task/*; do echo "== $t $(cat $t/comm) wchan=$(cat $t/wchan)"; done
  timeout 60 cuda-gdb -p $P -batch -ex "thread apply all bt" 2>&1 | grep -E "^#|^Thread" | head -80
fi
sleep 1; timeout 5 $G inspect --socket $S | grep -E "head|dead"
kill -INT $P; sleep 3
echo "--- producer stderr"; tail -20 $D/p.err
echo "--- a"; tail -3 $D/a.out $D/a.err; echo "--- c"; tail -3 $D/c.out $D/c.err
kill -9 $P $A $C 2>/dev/null
