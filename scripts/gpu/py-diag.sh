#!/usr/bin/env bash
# Diagnosis of the Python package's per-batch cost on the GPU: the package's GPU tests, then
# benches/py_phase_profile.py (host time per phase, producer and consumer) without and with
# MPS, for both sync modes, with and without torch work. Rows under $OUT/phases.jsonl.
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. .gpu/env.sh
if [ "${SKIP_TESTS:-0}" != 1 ]; then bash scripts/gpu/py-quick.sh; fi
prof() { timeout -k 5 60 setsid python3 benches/py_phase_profile.py "$@" 2>>"$O/prof.err" | tee -a "$O/phases.jsonl"; }
run_all() {
  for sync in semaphore events; do
    prof --sync $sync --label "$1" --batches ${BATCHES:-4000}
    prof --sync $sync --label "$1" --variant nowork --batches ${BATCHES:-4000}
  done
}
echo "== no MPS"; run_all nomps
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && sleep 1
echo "== MPS"; run_all mps
echo quit | nvidia-cuda-mps-control
tail -5 "$O/prof.err"
