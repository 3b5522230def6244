"""How fast one GPU-to-GPU hop can go, by copy engine and by SM copy kernels, alone and
with every hop of a 4-GPU chain running at once (what gpipe's chain fan-out does at steady
state). Question: is there a faster way to move a hop than the copy engine's ~340 GB/s that
the chain forwarders get at 256 MiB, against NCCL broadcast's ~348 GB/s?

  python3 copy_paths.py --sizes 64,256 --reps 20 > copy_paths.jsonl
"""

import argparse
import json
import sys

import cupy as cp

KERNEL = r"""
extern "C" __global__ void copy16(const int4* __restrict__ src, int4* __restrict__ dst,
                                  unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  // four loads in flight per thread before the stores
  for (; i + 3 * step < n; i += 4 * step) {
    int4 a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
    dst[i] = a; dst[i + step] = b; dst[i + 2 * step] = c; dst[i + 3 * step] = d;
  }
  for (; i < n; i += step) dst[i] = src[i];
}
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256", help="MiB")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks", default="33,66,132,264")
    ap.add_argument("--threads", type=int, default=512)
    a = ap.parse_args()
    n = cp.cuda.runtime.getDeviceCount()
    if n < 2:
        print(json.dumps({"error": f"needs 2 or more GPUs, found {n}"}))
        return 2
    for i in range(n):
        with cp.cuda.Device(i):
            for j in range(n):
                if i != j and cp.cuda.runtime.deviceCanAccessPeer(i, j):
                    try:
                        cp.cuda.runtime.deviceEnablePeerAccess(j)
                    except cp.cuda.runtime.CUDARuntimeError:
                        pass
    kern = {}
    for i in range(n):
        with cp.cuda.Device(i):
            kern[i] = cp.RawKernel(KERNEL, "copy16")
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(json.dumps({"device": props["name"].decode(), "gpus": n,
                      "sms": props["multiProcessorCount"]}), flush=True)

    for mib in (int(s) for s in a.sizes.split(",")):
        nbytes = mib << 20
        bufs = []
        for i in range(n):
            with cp.cuda.Device(i):
                bufs.append((cp.arange(nbytes // 4, dtype=cp.uint32), cp.empty(nbytes // 4, dtype=cp.uint32)))
        streams = {}
        for i in range(n):
            with cp.cuda.Device(i):
                streams[i] = cp.cuda.Stream(non_blocking=True)

        def hop(src, dst, how, blocks):
            """Queues one copy of GPU src's buffer into GPU dst's; returns nothing."""
            s_arr, d_arr = bufs[src][0], bufs[dst][1]
            if how == "ce":
                dev = dst
                with cp.cuda.Device(dev):
                    cp.cuda.runtime.memcpyPeerAsync(d_arr.data.ptr, dst, s_arr.data.ptr, src,
                                                    nbytes, streams[dev].ptr)
                return
            dev = dst if how == "sm-pull" else src
            with cp.cuda.Device(dev):
                kern[dev]((blocks,), (a.threads,), (s_arr, d_arr, cp.uint64(nbytes // 16)),
                          stream=streams[dev])

        def timed(pairs, how, blocks):
            devs = sorted({(d if how in ("ce", "sm-pull") else s) for s, d in pairs})
            for _ in range(2):  # warm-up
                for s, d in pairs:
                    hop(s, d, how, blocks)
            for d in devs:
                streams[d].synchronize()
            starts, ends = {}, {}
            for d in devs:
                with cp.cuda.Device(d):
                    starts[d] = cp.cuda.Event(); ends[d] = cp.cuda.Event()
                    starts[d].record(streams[d])
            for _ in range(a.reps):
                for s, d in pairs:
                    hop(s, d, how, blocks)
            for d in devs:
                with cp.cuda.Device(d):
                    ends[d].record(streams[d])
            for d in devs:
                ends[d].synchronize()
            ms = max(cp.cuda.get_elapsed_time(starts[d], ends[d]) for d in devs)
            return a.reps * nbytes / (ms / 1e3) / 1e9

        def check(pairs):
            for s, d in pairs:
                with cp.cuda.Device(d):
                    got = bufs[d][1][:: (1 << 16)].get()
                with cp.cuda.Device(s):
                    want = bufs[s][0][:: (1 << 16)].get()
                if not (got == want).all():
                    return False
            return True

        shapes = {"one-hop": [(0, 1)]}
        if n >= 3:
            shapes["chain"] = [(i, i + 1) for i in range(n - 1)]
            shapes["star"] = [(0, i) for i in range(1, n)]
        for shape, pairs in shapes.items():
            for how in ("ce", "sm-pull") + (("sm-push",) if shape != "star" else ()):
                for blocks in ([0] if how == "ce" else [int(b) for b in a.blocks.split(",")]):
                    for d in range(n):
                        bufs[d][1].fill(0)
                    gbps = timed(pairs, how, blocks)
                    print(json.dumps({"mib": mib, "shape": shape, "how": how, "blocks": blocks,
                                      "threads": a.threads if blocks else None,
                                      "gb_per_s_per_hop": round(gbps, 1),
                                      "verified": check(pairs)}), flush=True)
        del bufs
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
