#!/usr/bin/env bash
# The standalone commands with 64 MiB batches under MPS, as the README runs them:
# `gpipe produce` (which sets CUDA_DEVICE_MAX_CONNECTIONS=8 itself for slots of 16 MiB and
# more) and `gpipe consume --verify` (which says when the variable is missing), first with it
# unset, then set. From the repo root after staging; output on stdout.
#   bash docs/experiments/2026-11-23-side-signals/produce-consume-64.sh    # about 20 seconds on an H100
set -u
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps_on
for env in unset 8; do
  sock=/tmp/gpipe-pc-$env.sock; rm -f "$sock"
  limit 60 gpipe produce --socket "$sock" --batch-bytes 64MiB --slots 8 --batches 3000 \
    --wait-for-consumers 1 2>"/tmp/pc-produce-$env.err" >/dev/null &
  for _ in $(seq 50); do [ -S "$sock" ] && break; sleep 0.1; done
  if [ "$env" = 8 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=8; fi
  echo "== consumer with CUDA_DEVICE_MAX_CONNECTIONS $env"
  limit 60 gpipe consume --socket "$sock" --verify --json 2>"/tmp/pc-consume-$env.err" |
    python3 -c 'import json,sys; r=json.load(sys.stdin); print({k: r.get(k) for k in ("received","mismatches","elapsed_s","error")}, "side signals:", (r.get("attach") or {}).get("side_signals"))'
  unset CUDA_DEVICE_MAX_CONNECTIONS
  wait
  grep -h "CUDA_DEVICE_MAX_CONNECTIONS" "/tmp/pc-produce-$env.err" "/tmp/pc-consume-$env.err" | sed 's/^/  stderr: /'
done
mps_off
