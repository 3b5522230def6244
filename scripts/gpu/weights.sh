#!/usr/bin/env bash
# Weight updates (apps/weights, docs/examples.md) on every GPU of the machine, from the
# repository root after scripts/gpu/build: the library's tests on the GPU
# (gpipe-py/tests/test_weight_updates.py), then apps/weights/run_all.py: for the 3.2 GB (192 tensors)
# and 8.6 GB (128 tensors) bf16 state dicts, the in-process copy, torch.mp CUDA IPC and gpipe
# on GPU 0, and with 2 or more GPUs NCCL broadcast and gpipe (direct, and the fan-out plan) to
# the other GPUs, 100 updates each; a receiver SIGKILLed and the trainer SIGKILLed. MPS off.
# About 7 minutes; every step in its own process group under a hard limit.
# Results under $OUT: gpus.txt, pytest.log, weights.jsonl (one record per run), summary.txt
# (the table and the issue's targets), logs.tar.gz (each run's output).
#   scripts/gpu/weights.sh                 # everything
#   scripts/gpu/weights.sh quick           # the tiny size and the faults (~1 minute)
#   UPDATES=40 scripts/gpu/weights.sh      # fewer updates per run
#   SIZES=8.6GB BUDGET=200 scripts/gpu/weights.sh   # one size (the budget is run_all's, s)
set -u
. "$(dirname "$0")/lib.sh"
O=${OUT:-/tmp/gpipe-weights}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0
G=$(gpu_count)
[ "$G" -ge 1 ] || { echo "scripts/gpu/weights.sh: no GPU (nvidia-smi -L)"; exit 2; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$O/gpus.txt"
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' | tee -a "$O/gpus.txt"
sizes=${SIZES:-3.2GB,8.6GB}; budget=${BUDGET:-380}
if [ "${1:-}" = quick ]; then sizes=tiny; budget=${BUDGET:-150}; fi
echo "== gpipe-py/tests/test_weight_updates.py (the library, GPU tests included)"
limit 60 python3 -m pytest -q -rs -p no:cacheprovider gpipe-py/tests/test_weight_updates.py > "$O/pytest.log" 2>&1
echo "pytest rc=$?"; tail -3 "$O/pytest.log"
echo "== apps/weights/run_all.py on $G GPUs, sizes $sizes"
limit $((budget + 40)) python3 apps/weights/run_all.py --out "$O/run" --sizes "$sizes" \
  --updates "${UPDATES:-100}" --budget "$budget" --run-timeout 120
echo "run_all rc=$?"
cp "$O/run/weights.jsonl" "$O/run/summary.txt" "$O/" 2>/dev/null
tar -czf "$O/logs.tar.gz" -C "$O/run" logs 2>/dev/null && rm -rf "$O/run"
