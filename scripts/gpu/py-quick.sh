#!/usr/bin/env bash
# Quick GPU checks of the Python package while developing: the GPU tests, then the torch ring
# benchmark at 2 MiB in its gpipe variants, without and with MPS. Logs under $OUT.
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. .gpu/env.sh
GPIPE_REPORT=$O/figures.txt timeout -k 5 200 setsid python3 -m pytest -q gpipe-py/tests/test_gpu.py gpipe-py/tests/test_torch.py -p no:cacheprovider > "$O/pytest.log" 2>&1; echo "pytest rc=$?"; tail -4 "$O/pytest.log"; cat "$O/figures.txt"
b() { timeout -k 5 90 setsid python3 benches/torch_ring_bench.py --sizes 2MiB --consumers 1,4 --reps 1 --seconds 0.3 "$@" 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r["gpipe_variant"], r["sync"], r["consumers"], r["median_batches_per_s"])'; }
echo "== no MPS"
for v in full nowork cached; do b --gpipe-variant $v --programs gpipe,hand,single; done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && sleep 1
echo "== MPS"
for v in full nowork cached; do b --gpipe-variant $v --programs gpipe,hand,single; done
b --gpipe-variant cached --sync events --programs gpipe,single
echo quit | nvidia-cuda-mps-control
