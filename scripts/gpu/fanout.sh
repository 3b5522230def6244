#!/usr/bin/env bash
# Fan-out shapes (docs/multi-gpu.md) on every GPU of the machine (2 or more), MPS off then on,
# from the repository root after scripts/gpu/build: one producer on GPU 0, a consumer on every
# other GPU (every batch verified), against NCCL broadcast from GPU 0 to the same GPUs in the
# same run and MPS setting. Shapes (issue #34; the tag in the summary, then what it runs):
#   auto                   what `--fanout auto` picks (the shape and forwarders it resolves to)
#   direct-mirror          every consumer mirrors GPU 0's ring (no forwarders)
#   chain-whole-proc       chain, whole batches, a forwarder process per GPU (the shape measured
#                          before #34, with `ready` now written on a stream of its own)
#   chain-whole-inproc     the same, each forwarder in its GPU's consumer process (gpipe's `auto`)
#   tree-whole-inproc      binary tree, whole batches, forwarders in the consumers (2 MiB only)
#   chain-chunk-proc       chain, chunks of a quarter batch, forwarder processes (`auto` forwards
#                          whole batches: measured faster; these rows keep the comparison)
#   chain-chunk-inproc     chain, chunks of a quarter batch, forwarders in the consumers
#   chain-chunk-<S>-inproc the same with chunks of S (the chunk-size rule's alternatives)
#   chain-chunk-d6-inproc  the same as chain-chunk-inproc with 6 copies in flight per forwarder
#   *-s16                  256 MiB only: chain-whole-proc and chain-chunk-inproc with 16 slots
#                          per ring instead of 8 (were the old chain's slots too few?)
#   chain-chunk-inproc-pool the same as chain-chunk-inproc with the rings in a memory pool
#                          (64 MiB only; in-consumer rings default to VMM, which the consumer
#                          in the same process imports: does the pool import there too?)
#   tree-chunk-inproc      binary tree, chunks of a quarter batch, forwarders in the consumers
# The main shapes run at 64, 256 and 2 MiB (chunked ones at 64 and 256 MiB only), then the
# variants at 64 and 256 MiB. Every bench has a hard limit (60 s), and each
# MPS setting stops starting benches past its half of the time budget (BUDGET seconds in all,
# default 440), so that the run ends within 9 minutes.
# DRY=1 prints the gpipe commands instead of running anything (no GPU needed; GPUS=N: as
# on N GPUs, default 4).
# Results under $OUT: fanout.jsonl (tagged `gpipe bench --json` reports), fanout.err,
# nccl.jsonl, nccl.err, fanout-summary.txt (per-GPU GB/s and the ratio to NCCL broadcast of
# the same MPS setting).
#   bash scripts/gpu/fanout.sh         REPS=2 BUDGET=900 bash scripts/gpu/fanout.sh
set -u
. "$(dirname "$0")/lib.sh"
O=${OUT:-/tmp/o}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0
REPS=${REPS:-1}
BUDGET=${BUDGET:-440}
half_end=$((BUDGET / 2))
G=${DRY:+${GPUS:-4}}
G=${G:-$(gpu_count)}
[ "$G" -ge 2 ] || { echo "scripts/gpu/fanout.sh: needs 2 or more GPUs; this machine has $G"; exit 2; }
others=$(seq -s, 1 $((G - 1)))
n=$((G - 1))
echo "== $G GPUs; consumers on GPUs $others; budget ${BUDGET}s"
[ -n "${DRY:-}" ] || nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | sed 's/^/   /'
: >"$O/fanout.jsonl"; : >"$O/nccl.jsonl"
mps_started=
stop_mps() {
  if [ -n "$mps_started" ]; then
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    mps_started=
    sleep 2
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap stop_mps EXIT
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/gpipe-fanout-mps CUDA_MPS_LOG_DIRECTORY=/tmp/gpipe-fanout-mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    mps_started=1; sleep 1; echo "MPS on"
  else
    echo "MPS did not start: the MPS-on half is skipped"; return 1
  fi
}

# bench MPS TAG SECONDS ARGS...: one report into fanout.jsonl, tagged MPS|TAG.
bench() {
  local mps=$1 tag=$2 secs=$3
  shift 3
  if [ -n "${DRY:-}" ]; then
    echo gpipe bench --backend cuda --json --consumers $n --consumer-devices "$others" "$@"
    return
  fi
  if [ "$SECONDS" -ge "$half_end" ]; then
    echo "SKIPPED (past this MPS setting's share of the ${BUDGET}s budget): $mps|$tag"
    return
  fi
  local t0=$SECONDS
  bench_into "$O/fanout.jsonl" "$secs" "$mps|$tag" --consumers $n --consumer-devices "$others" "$@"
  echo "   $mps|$tag $((SECONDS - t0))s"
}

# shapes MPS: the main shapes at every size, then the variants (so that, past the budget,
# what is left out is a variant).
# quarter SIZE: a quarter of 64MiB or 256MiB (the chunk the chunked rows use).
quarter() { case $1 in 64MiB) echo 16MiB ;; 256MiB) echo 64MiB ;; *) echo off ;; esac; }
shapes() {
  local mps=$1 b k c q
  # runs of about a second at 64 and 256 MiB: in shorter ones the start and the end of a
  # chain weigh a few percent (docs/experiments/2026-11-27-fanout-steady-state)
  for size in 64MiB:4000 256MiB:1500 2MiB:5000; do
    b=${size%%:*}; k=${size##*:}
    local s=(--batch-bytes "$b" --batches "$k")
    bench "$mps" "auto-$b" 60 --fanout auto "${s[@]}"
    bench "$mps" "direct-mirror-$b" 60 --delivery mirror --fanout direct "${s[@]}"
    bench "$mps" "chain-whole-proc-$b" 60 --fanout chain --chunk off --forwarders process "${s[@]}"
    bench "$mps" "chain-whole-inproc-$b" 60 --fanout chain --chunk off --forwarders in-consumer "${s[@]}"
    if [ "$b" = 2MiB ]; then
      [ "$G" -gt 2 ] && bench "$mps" "tree-whole-inproc-$b" 60 --fanout tree --chunk off --forwarders in-consumer "${s[@]}"
      continue
    fi
    q=$(quarter "$b")
    bench "$mps" "chain-chunk-proc-$b" 60 --fanout chain --chunk "$q" --forwarders process "${s[@]}"
    bench "$mps" "chain-chunk-inproc-$b" 60 --fanout chain --chunk "$q" --forwarders in-consumer "${s[@]}"
    [ "$G" -gt 2 ] && bench "$mps" "tree-chunk-inproc-$b" 60 --fanout tree --chunk "$q" --forwarders in-consumer "${s[@]}"
  done
  for size in 64MiB:4000 256MiB:1500; do
    b=${size%%:*}; k=${size##*:}
    local s=(--batch-bytes "$b" --batches "$k")
    if [ "$b" = 64MiB ]; then alts="8MiB 32MiB"; else alts="16MiB 128MiB"; fi
    for c in $alts; do
      bench "$mps" "chain-chunk-$c-inproc-$b" 60 --fanout chain --chunk "$c" --forwarders in-consumer "${s[@]}"
    done
    q=$(quarter "$b")
    bench "$mps" "chain-chunk-d6-inproc-$b" 60 --fanout chain --chunk "$q" --forwarders in-consumer --forward-depth 6 "${s[@]}"
    if [ "$b" = 64MiB ]; then
      bench "$mps" "chain-chunk-inproc-pool-$b" 60 --fanout chain --chunk "$q" --forwarders in-consumer --forward-memory pool "${s[@]}"
    else
      bench "$mps" "chain-whole-proc-s16-$b" 60 --fanout chain --chunk off --forwarders process --slots 16 "${s[@]}"
      bench "$mps" "chain-chunk-inproc-s16-$b" 60 --fanout chain --chunk "$q" --forwarders in-consumer --slots 16 "${s[@]}"
    fi
  done
}

nccl() {
  local mps=$1
  echo "== NCCL broadcast from GPU 0 to the others ($mps)"
  limit 150 python3 scripts/gpu/nccl_broadcast.py --sizes 2MiB,64MiB,256MiB --gib 64 2>>"$O/nccl.err" |
    python3 -c 'import json,sys
for l in sys.stdin:
    try: r = json.loads(l)
    except ValueError: continue
    r["mps"] = sys.argv[1]; print(json.dumps(r), flush=True)' "$mps" | tee -a "$O/nccl.jsonl"
}

if [ -n "${DRY:-}" ]; then
  shapes off
  exit 0
fi
for rep in $(seq "$REPS"); do
  echo "== repetition $rep of $REPS: MPS off"
  half_end=$((SECONDS + BUDGET / (2 * REPS)))
  nccl off
  shapes off
  echo "== repetition $rep of $REPS: MPS on"
  half_end=$((BUDGET * rep / REPS))
  if start_mps; then
    nccl on
    shapes on
    stop_mps
  fi
done
echo "== ${SECONDS}s in all"

python3 - "$O/fanout.jsonl" "$O/nccl.jsonl" <<'PY' | tee "$O/fanout-summary.txt"
import json, sys, statistics
from collections import defaultdict
rows = defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); rows[r["tag"]].append(r["report"])
nccl = defaultdict(list)
for l in open(sys.argv[2]):
    try:
        r = json.loads(l); nccl[(r["mps"], r["bytes"])].append(r["per_gpu_gb_per_s"])
    except (ValueError, KeyError):
        pass
print("per consumer GPU; ratio = gpipe / NCCL broadcast of the same MPS setting; median of the repetitions")
print(f"{'MPS':4} {'shape':24} {'batch':7} {'GB/s':>7} {'NCCL':>7} {'ratio':>6} {'chunk':>7} {'ahead':>6} {'fwd':>11}  problems")
best = {}
for tag, rs in rows.items():
    mps, rest = tag.split("|", 1)
    shape, size = rest.rsplit("-", 1)
    per = statistics.median(r["gb_per_s"] for r in rs)
    b = rs[0]["batch_bytes"]
    nc = statistics.median(nccl[(mps, b)]) if nccl.get((mps, b)) else 0
    fan = rs[0].get("fanout") or {}
    chunk = fan.get("chunk_bytes")
    ahead = sum((g.get("forwarder") or {}).get("copied_ahead", 0) for g in fan.get("rings", []))
    probs = sum(len(r["problems"]) for r in rs)
    ratio = per / nc if nc else 0
    print(f"{mps:4} {shape:24} {size:7} {per:7.1f} {nc:7.1f} {ratio:6.2f} "
          f"{(str(chunk >> 20) + 'MiB') if chunk else 'whole':>7} {ahead:6d} {fan.get('forwarders', '-'):>11}  {probs}"
          + ("" if not probs else "  " + "; ".join(rs[0]["problems"])[:200]))
    if probs == 0 and per > best.get((mps, size), ("", 0))[1]:
        best[(mps, size)] = (shape, per, ratio)
print("\nbest shape per MPS setting and batch (target: >= 1.0x NCCL at 64 and 256 MiB, >= 2x at 2 MiB)")
for (mps, size), (shape, per, ratio) in sorted(best.items()):
    print(f"  MPS {mps:3} {size:7} {shape:24} {per:7.1f} GB/s  {ratio:.2f}x NCCL")
PY
