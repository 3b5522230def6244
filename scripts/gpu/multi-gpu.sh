#!/usr/bin/env bash
# Consumers on another GPU (docs/multi-gpu.md), on a machine with 2 GPUs, from the repository
# root after scripts/gpu/build.
# Results under $OUT: tests.log (the 2-GPU Rust tests), pytest.log (the Python ones),
# bench.jsonl (one `gpipe bench --json` report per line, tagged), summary.txt.
#
#   scripts/gpu/multi-gpu.sh          # the 2-GPU tests, then the benchmark
#   scripts/gpu/multi-gpu.sh tests    # the 2-GPU tests alone (Rust and Python)
#   scripts/gpu/multi-gpu.sh suite    # the whole Rust suite + the 2-GPU Python tests
#   scripts/gpu/multi-gpu.sh bench    # the benchmark alone (about 4 minutes)
#   REPS=5 scripts/gpu/multi-gpu.sh bench
#   scripts/gpu/multi-gpu.sh mirror-streams  # a mirror's copies on 1 stream against 2
#   scripts/gpu/multi-gpu.sh cost     # what a consumer on GPU 1 costs one on GPU 0 that
#                                     # reads each batch PASSES times (default 16)
#
# Every child runs under a hard limit that kills its process group.
set -u
. "$(dirname "$0")/lib.sh"
O=${OUT:-/tmp/o}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0
what=${1:-all}; REPS=${REPS:-3}
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$O/gpus.txt"
nvidia-smi topo -m > "$O/topo.txt" 2>&1
gpipe probe > "$O/probe.txt" 2>&1; cat "$O/probe.txt" | tail -12
if [ "$what" = all ] || [ "$what" = tests ] || [ "$what" = suite ]; then
  if [ "$what" = suite ]; then
    echo "== the whole Rust suite, GPU and 2-GPU tests included"
    OUT="$O/suite" limit 590 scripts/gpu/test rust > "$O/tests.log" 2>&1
    echo "suite rc=$?"; tail -40 "$O/tests.log"; grep -hE "^test two_gpu" "$O"/suite/rust-*.log
  else
    echo "== 2-GPU Rust tests"
    skip4=(); [ "$(gpu_count)" -lt 4 ] && skip4=(--skip four_gpu)
    limit 330 .gpu/tests/multi_gpu --include-ignored --test-threads=1 "${skip4[@]}" > "$O/tests.log" 2>&1
    echo "multi_gpu tests rc=$?"; grep -E "^test |test result" "$O/tests.log"
  fi
  echo "== 2-GPU Python tests"
  limit 150 python3 -m pytest -q -p no:cacheprovider gpipe-py/tests/test_gpu.py -k another_gpu > "$O/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -3 "$O/pytest.log"
  [ "$what" = all ] || exit 0
fi
bench() { bench_into "$O/bench.jsonl" 90 "$@"; } # tag, then gpipe bench arguments
if [ "$what" = mirror-streams ]; then
  echo "== mirror on GPU 1: copies on 1 and on 2 copy streams (GPIPE_MIRROR_STREAMS), x$REPS interleaved"
  for rep in $(seq "$REPS"); do
    for size in 2MiB:20000 64MiB:3000 256MiB:800; do
      b=${size%%:*}; n=${size##*:}
      for ns in 1 2; do
        GPIPE_MIRROR_STREAMS=$ns bench "gpu1-mirror-s$ns-$b" --consumers 1 --consumer-devices 1 --delivery mirror --batch-bytes $b --batches $n --slots 8
      done
    done
  done
  python3 scripts/gpu/multi_gpu_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
  exit 0
fi
if [ "$what" = cost ]; then
  # A consumer on GPU 0 that does real work on each batch (PASSES reads), alone and with a
  # consumer on GPU 1 beside it: a light one reading in place, or one doing the same work on a
  # mirrored copy. The ring moves at the slower consumer's pace; with GPU 0's the slower, the
  # rate is GPU 0's consumer's own, and the question is whether GPU 1's costs it anything.
  P=${PASSES:-16}
  echo "== cost: GPU 0 consumer with $P passes, alone and beside a GPU 1 consumer, x$REPS interleaved"
  for rep in $(seq "$REPS"); do
    for size in 2MiB:20000 64MiB:2000; do
      b=${size%%:*}; n=${size##*:}
      bench "cost-alone-$b" --consumers 1 --consumer-devices 0 --passes "$P" --batch-bytes $b --batches $n --slots 8
      bench "cost-with-gpu1-in-place-1pass-$b" --consumers 2 --consumer-devices 0,1 --delivery in-place --passes "$P",1 --batch-bytes $b --batches $n --slots 8
      bench "cost-with-gpu1-mirror-${P}pass-$b" --consumers 2 --consumer-devices 0,1 --delivery in-place,mirror --passes "$P","$P" --batch-bytes $b --batches $n --slots 8
    done
  done
  python3 - "$O/bench.jsonl" <<'PY' | tee "$O/cost.txt"
import json, statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r["tag"].startswith("cost-"):
        rows[r["tag"]].append(r["report"])
for tag, rs in sorted(rows.items()):
    rate = [x["batches_per_s"] for x in rs]
    bad = sum(x["mismatches"] + x["lost"] for x in rs)
    print(f"{tag:44} {statistics.median(rate):10.0f} batches/s (runs {[round(v) for v in rate]}), mismatched+lost {bad}")
PY
  exit 0
fi
echo "== benchmark: one consumer on GPU 1, in place and mirrored, x$REPS interleaved"
for rep in $(seq "$REPS"); do
  echo "-- repetition $rep of $REPS"
  for size in 2MiB:20000 8MiB:8000 64MiB:3000 256MiB:800; do
    b=${size%%:*}; n=${size##*:}
    for d in in-place mirror; do
      bench "gpu1-$d-$b" --consumers 1 --consumer-devices 1 --delivery $d --batch-bytes $b --batches $n --slots 8
    done
    bench "gpu0-$b" --consumers 1 --batch-bytes $b --batches $n --slots 8
  done
  # The memory path's effect on the link (the ceilings use cuMemAlloc memory).
  for m in vmm legacy; do
    for d in in-place mirror; do
      bench "path-$m-gpu1-$d-64MiB" --memory $m --consumers 1 --consumer-devices 1 --delivery $d --batch-bytes 64MiB --batches 3000 --slots 8
    done
  done
  # Egress: two consumers on GPU 1 share GPU 0's link; one on each GPU in broadcast.
  bench "egress-2x-gpu1-in-place-64MiB" --consumers 2 --consumer-devices 1,1 --delivery in-place --batch-bytes 64MiB --batches 3000 --slots 8
  bench "egress-2x-gpu1-mirror-64MiB" --consumers 2 --consumer-devices 1,1 --delivery mirror --batch-bytes 64MiB --batches 3000 --slots 8
  bench "bcast-gpu0-gpu1-64MiB" --consumers 2 --consumer-devices 0,1 --batch-bytes 64MiB --batches 3000 --slots 8
  # Does a consumer on GPU 0 lose anything to one on GPU 1? Shared mode, each at its own pace.
  bench "shared-gpu0-alone-64MiB" --mode shared --consumers 1 --consumer-devices 0 --batch-bytes 64MiB --batches 3000 --slots 8
  bench "shared-gpu0-with-gpu1-64MiB" --mode shared --consumers 2 --consumer-devices 0,1 --batch-bytes 64MiB --batches 3000 --slots 8
done
python3 scripts/gpu/multi_gpu_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
