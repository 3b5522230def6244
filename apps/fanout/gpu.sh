#!/usr/bin/env bash
# The inference fan-out application (apps/fanout) on a GPU machine, from the repository
# root after scripts/gpu/build: run_all.py without MPS, then with the MPS daemon; one JSON line per run in
# $OUT/fanout.jsonl, each process's stderr in $OUT/logs/, the tables on stdout, a chart in
# $OUT/fanout.png (if matplotlib is there). Every step runs in its own process group under a
# hard time limit. About 6 minutes on an H100.
# Usage: bash apps/fanout/gpu.sh            # the full comparison, MPS off and on
#        bash apps/fanout/gpu.sh quick      # smoke run: a few frames per run, MPS off
#        bash apps/fanout/gpu.sh quick mps  # the same, then MPS on too
# Extra run_all.py options can follow (e.g. --rate 120).
# SPREAD=1: the gpipe runs put the three models on GPUs 1, 2 and 3, fed from one source on
# GPU 0 (needs 4 GPUs; the baselines stay on GPU 0); labels end in -spread.
set -u
. "$(dirname "$0")/../../scripts/gpu/lib.sh"
O=${OUT:-/tmp/gpipe-fanout}; mkdir -p "$O"
quick=; mps_too=1
if [ "${1:-}" = quick ]; then
  quick=--quick; mps_too=; shift
  if [ "${1:-}" = mps ]; then mps_too=1; shift; fi
fi
: >"$O/fanout.jsonl"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$O/device.txt"
python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)'
spread=(); sp=
if [ -n "${SPREAD:-}" ]; then
  g=$(gpu_count)
  [ "$g" -ge 4 ] || { echo "SPREAD=1 needs 4 GPUs (a source on GPU 0, a model on each of 1-3); this machine has $g"; exit 2; }
  spread=(--model-devices 1,2,3); sp=-spread
fi
run() { # mps label
  echo "== run_all.py, MPS $1${sp}"
  limit 250 python3 apps/fanout/run_all.py --mps "$1$sp" --out "$O" --budget 200 --run-timeout 60 $quick \
    "${spread[@]}" "${@:2}"
  echo "run_all rc=$?"
}
run off "$@"
if [ -n "$mps_too" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
  nvidia-cuda-mps-control -d && sleep 1
  gpipe probe 2>&1 | grep -i mps
  run on "$@"
  echo quit | nvidia-cuda-mps-control; trap - EXIT
fi
limit 30 python3 apps/fanout/plot.py "$O/fanout.jsonl" --out "$O/fanout"
