#!/usr/bin/env bash
# Consumers on another GPU (issue #12), on the 2-GPU machine, from the repo root after staging.
# Results under $OUT: tests.log (the 2-GPU Rust tests), pytest.log (the Python ones),
# bench.jsonl (one `gpipe bench --json` report per line, tagged), summary.txt.
#
#   bash scripts/gpu/multi-gpu.sh          # tests, then the benchmark (about 8 minutes)
#   bash scripts/gpu/multi-gpu.sh bench    # the benchmark alone
#   REPS=5 bash scripts/gpu/multi-gpu.sh bench
#
# Every child runs under a hard limit that kills its process group.
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. .gpu/env.sh
export NCCL_NVLS_ENABLE=0
limit() { local s=$1; shift; timeout -k 5 "$s" setsid "$@"; }
what=${1:-all}; REPS=${REPS:-3}
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$O/gpus.txt"
nvidia-smi topo -m > "$O/topo.txt" 2>&1
gpipe probe > "$O/probe.txt" 2>&1; cat "$O/probe.txt" | tail -12
if [ "$what" = all ]; then
  echo "== 2-GPU Rust tests"
  limit 330 .gpu/tests/multi_gpu --include-ignored --test-threads=1 > "$O/tests.log" 2>&1
  echo "multi_gpu tests rc=$?"; grep -E "^test |test result" "$O/tests.log"
  echo "== 2-GPU Python tests"
  limit 150 python3 -m pytest -q -p no:cacheprovider gpipe-py/tests/test_gpu.py -k another_gpu > "$O/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -3 "$O/pytest.log"
fi
echo "== benchmark: one consumer on GPU 1, in place and mirrored, x$REPS interleaved"
bench() { # tag, then gpipe bench arguments
  local tag=$1; shift
  local line
  line=$(limit 90 gpipe bench --backend cuda --json "$@" 2>>"$O/bench.err" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))')
  [ -n "$line" ] && echo "{\"tag\": \"$tag\", \"report\": $line}" >> "$O/bench.jsonl" || echo "FAILED: $tag $*"
}
for rep in $(seq "$REPS"); do
  for size in 2MiB:4000 64MiB:1000 256MiB:300; do
    b=${size%%:*}; n=${size##*:}
    for d in in-place mirror; do
      bench "gpu1-$d-$b" --consumers 1 --consumer-devices 1 --delivery $d --batch-bytes $b --batches $n --slots 8
    done
    bench "gpu0-$b" --consumers 1 --batch-bytes $b --batches $n --slots 8
  done
  # Does a consumer on GPU 0 lose anything to one on GPU 1? Shared mode, each at its own pace.
  bench "shared-gpu0-alone-64MiB" --mode shared --consumers 1 --consumer-devices 0 --batch-bytes 64MiB --batches 1500 --slots 8
  bench "shared-gpu0-with-gpu1-64MiB" --mode shared --consumers 2 --consumer-devices 0,1 --batch-bytes 64MiB --batches 1500 --slots 8
done
python3 scripts/gpu/multi_gpu_summary.py "$O/bench.jsonl" | tee "$O/summary.txt"
