#!/usr/bin/env bash
# Under MPS, a Python consumer with side signals (16 MiB slots) warns when
# CUDA_DEVICE_MAX_CONNECTIONS is unset, and not with 8. From the repo root after staging.
#   bash docs/experiments/2026-11-23-side-signals/py-side-warning.sh    # under a minute
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
mps_on
limit 120 python3 docs/experiments/2026-11-23-side-signals/py_side_warning.py; rc=$?
mps_off
exit $rc
