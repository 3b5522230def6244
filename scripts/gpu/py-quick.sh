#!/usr/bin/env bash
# The Python package's GPU tests alone (quicker than python-suite.sh), figures under $OUT.
set -u
O=${OUT:-/tmp/o}; mkdir -p "$O"
. .gpu/env.sh
GPIPE_REPORT=$O/figures.txt timeout -k 5 250 setsid python3 -m pytest -q gpipe-py/tests/test_gpu.py gpipe-py/tests/test_torch.py -p no:cacheprovider "$@" > "$O/pytest.log" 2>&1; echo "pytest rc=$?"
grep -E "^E  |^FAILED|passed|failed" "$O/pytest.log" | head -20; cat "$O/figures.txt"
