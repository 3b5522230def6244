#!/usr/bin/env bash
# Side signals and the number of hardware queues under MPS. 64 MiB, 1 consumer,
# semaphores on device words, MPS on; side signals on and off, 8 and 16 slots, with
# CUDA_DEVICE_MAX_CONNECTIONS=8 and =32 set for every process; per run the batches/s, the
# ratio to the fair ceiling, the GPU gap between consecutive verifies (from every stamp of
# 500 batches) and each side's host µs per batch. From the repo root after staging; raw
# stamps and reports under $OUT, the table on stdout.
#   bash docs/experiments/2026-11-23-side-signals/side-signals-queues.sh   # under a minute on an H100
set -u
OUT=${OUT:-/tmp/o}; mkdir -p "$OUT"; export OUT
. "$(dirname "$0")/../../../scripts/gpu/lib.sh"; mps_on >/dev/null
for conn in 8 32; do for slots in 8 16; do for s in on off; do
  tag=c$conn-s$slots-$s
  CUDA_DEVICE_MAX_CONNECTIONS=$conn limit 120 gpipe bench --backend cuda --json --gpu-timeline 500 --gpu-timeline-out $OUT/raw-$tag.json --consumers 1 --batch-bytes 64MiB --batches 3000 --slots $slots --side-signals $s --timeline-memory device --sync semaphore > $OUT/r-$tag.json 2>$OUT/err-$tag.txt || echo "FAILED $tag"
done; done; done
mps_off
python3 - <<'PY'
import json,os,glob
O=os.environ['OUT']
for p in sorted(glob.glob(f'{O}/raw-*.json')):
    tag=p.split('raw-')[1][:-5]
    raw=json.load(open(p)); F=raw['fills']; V=raw['verifies'][0]
    vv=sorted((V[i+1][0]-V[i][1])/1e3 for i in range(len(V)-1) if V[i][0] and V[i+1][0])
    r=json.load(open(f'{O}/r-{tag}.json')); c=r['per_consumer'][0]; n=c['host_timed']
    print(tag, 'b/s %.0f ratio %.3f'%(r['batches_per_s'], r['extra']['ratio_to_fair_ceiling']), 'verify gap p10/p50/p90 %.2f %.2f %.2f'%(vv[len(vv)//10],vv[len(vv)//2],vv[len(vv)*9//10]),
      'cons check %.1f recvwait %.1f prod fill %.1f acqwait %.1f us/batch'%(c['check_s']/n*1e6, c['recv_wait_s']/n*1e6, r['producer_fill_s']/r['producer_host_timed']*1e6, r['producer_acquire_wait_s']/r['producer_host_timed']*1e6))
PY
