# What the GPU scripts share. Each sources it first: `. "$(dirname "$0")/lib.sh"` in
# scripts/gpu, `. scripts/gpu/lib.sh` from the repository root. It moves to the repository
# root and sources .gpu/env.sh, which scripts/gpu/build makes (the README's "On a GPU machine").

gpu_lib_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$gpu_lib_root" || exit 2
if [ ! -f .gpu/env.sh ]; then
  echo "$gpu_lib_root/.gpu/env.sh is missing: run scripts/gpu/build first (here with a Rust toolchain," \
    "or on a build machine, then copy the repository with its .gpu/ folder here)" >&2
  exit 2
fi
# shellcheck source=/dev/null
. .gpu/env.sh || exit 2

# limit SECONDS COMMAND...: runs COMMAND in its own process group under a hard limit that
# kills the whole group.
limit() { local s=$1; shift; timeout -k 5 "$s" setsid "$@"; }

# machine_facts: the GPUs and their driver, the date, and the CPUs (lscpu's summary), for a
# results folder.
machine_facts() {
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  date -u
  lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name"
}

# loader_data: the loader apps' data set in /tmp/loader-data (20 000 JPEGs), made once.
loader_data() {
  [ -d /tmp/loader-data ] ||
    limit 100 python3 apps/loader/make_dataset.py /tmp/loader-data --count 20000 | tail -1
}

# loader_runs NAME: how the loader's experiments (docs/experiments) start. Sets O (OUT, else
# /tmp/NAME), writes the machine's facts to $O/cpu.txt, makes the data set (loader_data), sets
# WORLD (default: every GPU here) and R: run_all.py for DDP runs of MODEL (default resnet18)
# on WORLD GPUs, 40 warm-up and 150 timed steps, each run a line of $O/loader.jsonl.
loader_runs() {
  O=${OUT:-/tmp/$1}; mkdir -p "$O"
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
  machine_facts >"$O/cpu.txt"
  loader_data
  WORLD=${WORLD:-$(gpu_count)}
  R=(python3 apps/loader/run_all.py --data /tmp/loader-data --out "$O" --world-size "$WORLD" --ddp-only
     --models "${MODEL:-resnet18}" --warmup 40 --steps 150 --no-summary)
}

# loader_ceiling: R's ceiling (the same step on synthetic tensors), the last run of an experiment.
loader_ceiling() { limit 60 "${R[@]}" --label ceiling --configs ceiling --budget 45 --run-limit 42 >/dev/null; }

# loader_summary: the table of $O/loader.jsonl, each run against the ceiling, to stdout and
# $O/summary.txt.
loader_summary() {
  python3 docs/experiments/2026-11-28-worker-cpus/summary.py "$O/loader.jsonl" | tee "$O/summary.txt"
}

# gpu_count: the number of GPUs this machine shows (0 without nvidia-smi).
gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; }

# bench_into FILE SECONDS TAG ARGS...: one `gpipe bench --backend cuda --json ARGS` report,
# appended to FILE (JSONL) as {"tag": TAG, "report": ...}; its stderr goes to FILE with .err
# for .jsonl. Prints "FAILED: ..." when no report came back.
bench_into() {
  local file=$1 secs=$2 tag=$3
  shift 3
  local line
  line=$(limit "$secs" gpipe bench --backend cuda --json "$@" 2>>"${file%.jsonl}.err" </dev/null |
    python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))' 2>>"${file%.jsonl}.err")
  if [ -n "$line" ]; then
    echo "{\"tag\": \"$tag\", \"report\": $line}" >>"$file"
  else
    echo "FAILED: $tag $*"
  fi
}

# mps_on / mps_off: start and stop the MPS control daemon for this script's processes.
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && sleep 1 && echo "MPS on"
}
mps_off() {
  echo quit | nvidia-cuda-mps-control
  sleep 2
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
