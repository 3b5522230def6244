#!/usr/bin/env bash
# GPU tests of the Python package, then the 2 MiB torch-ring comparison without and with MPS
# (3 repetitions, programs interleaved): a quick check after a change to the CUDA path.
# Logs under $OUT.
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. .gpu/env.sh
GPIPE_REPORT=$O/figures.txt timeout -k 5 250 setsid python3 -m pytest -q gpipe-py/tests/test_gpu.py gpipe-py/tests/test_torch.py -p no:cacheprovider > "$O/pytest.log" 2>&1; echo "pytest rc=$?"
grep -E "^E  |^FAILED|passed|failed" "$O/pytest.log" | head -12; cat "$O/figures.txt"
b() { timeout -k 5 150 setsid python3 benches/torch_ring_bench.py --sizes 2MiB --consumers 1,4 --reps ${REPS:-3} --seconds 0.3 --programs gpipe,gpipe_fast,hand,single "$@" 2>/dev/null | tee -a "$O/check.jsonl" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r["consumers"], r["median_batches_per_s"], r.get("ratio_to_single"))'; }
echo "== no MPS"; b --label nomps
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && sleep 1
echo "== MPS"; b --label mps
echo quit | nvidia-cuda-mps-control
