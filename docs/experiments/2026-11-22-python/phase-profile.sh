#!/usr/bin/env bash
# Diagnosis of the Python package's per-batch cost on the GPU:
# benches/py_phase_profile.py (host time per phase, producer and consumer) without and with
# MPS, for both sync modes, with and without torch work. Rows under $OUT/phases.jsonl.
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
prof() { timeout -k 5 60 setsid python3 benches/py_phase_profile.py "$@" 2>>"$O/prof.err" | tee -a "$O/phases.jsonl"; }
run_all() {
  for sync in semaphore events; do
    prof --sync $sync --label "$1" --batches ${BATCHES:-4000}
    prof --sync $sync --label "$1" --variant nowork --batches ${BATCHES:-4000}
  done
}
echo "== no MPS"; run_all nomps
mps_on
echo "== MPS"; run_all mps
mps_off
tail -5 "$O/prof.err"
