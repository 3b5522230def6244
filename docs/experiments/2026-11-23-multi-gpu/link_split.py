"""How much GPU 0 -> GPU 1 copy bandwidth one copy gets against the same bytes split over
several streams (copy engines). Peer copies with cudaMemcpyPeerAsync from CuPy, back to back
over 4 source/destination buffer pairs, timed with events on the GPU 1 streams.

    python3 docs/experiments/2026-11-23-multi-gpu/link_split.py [--sizes 64,256] [--streams 1,2,4,8] [--iters 200]
"""
import argparse
import json
import time

import cupy as cp


def measure(size, streams, iters):
    rt = cp.cuda.runtime
    with cp.cuda.Device(0):
        src = [cp.cuda.alloc(size) for _ in range(4)]
    with cp.cuda.Device(1):
        dst = [cp.cuda.alloc(size) for _ in range(4)]
        ss = [cp.cuda.Stream(non_blocking=True) for _ in range(streams)]
        chunk = size // streams

        def run(n):
            for i in range(n):
                s, d = src[i % 4], dst[i % 4]
                for k, st in enumerate(ss):
                    rt.memcpyPeerAsync(d.ptr + k * chunk, 1, s.ptr + k * chunk, 0, chunk, st.ptr)

        run(4)
        for st in ss:
            st.synchronize()
        t = time.perf_counter()
        run(iters)
        for st in ss:
            st.synchronize()
        dt = time.perf_counter() - t
    return size * iters / dt / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,64,256", help="MiB, comma-separated")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    for dev in (0, 1):
        for peer in (0, 1):
            if dev != peer:
                with cp.cuda.Device(dev):
                    try:
                        rt = cp.cuda.runtime
                        rt.deviceEnablePeerAccess(peer)
                    except cp.cuda.runtime.CUDARuntimeError:
                        pass
    for mib in [int(x) for x in a.sizes.split(",")]:
        for n in [int(x) for x in a.streams.split(",")]:
            iters = a.iters if mib >= 64 else a.iters * 20
            gbs = [measure(mib << 20, n, iters) for _ in range(3)]
            print(json.dumps({"mib": mib, "streams": n, "gb_per_s": sorted(gbs)[1], "all": gbs}))


if __name__ == "__main__":
    main()
