"""What host decode's upload pays per batch, apart from the loader: page-locking a shared
mapping in place (cudaHostRegister) and unlocking it, against the copy itself from that
memory pageable, registered, and from torch's own page-locked memory.

    python3 docs/experiments/2026-11-27-host-upload/pin_cost.py [MB] [REPEATS]

One JSON line on stdout: the median seconds of each step and the copies' GB/s.
"""

import json
import mmap
import statistics
import sys
import time

import torch


def median_s(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 156
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    n = mb << 20
    dev = torch.device("cuda", 0)
    # a shared mapping like a host ring's slot (MAP_SHARED, anonymous here)
    m = mmap.mmap(-1, n, flags=mmap.MAP_SHARED)
    host = torch.frombuffer(m, dtype=torch.uint8)
    host.fill_(7)
    ptr, rt = host.data_ptr(), torch.cuda.cudart()
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    out = {"mb": mb, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__}

    def copy(src):
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            call = time.perf_counter() - t0
        stream.synchronize()
        return call

    def timed_copy(src, key):
        calls, totals = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            calls.append(copy(src))
            totals.append(time.perf_counter() - t0)
        out[key + "_call_s"] = statistics.median(calls)
        out[key + "_s"] = statistics.median(totals)
        out[key + "_GBps"] = n / out[key + "_s"] / 1e9

    copy(host)
    timed_copy(host, "pageable")

    def register():
        assert int(rt.cudaHostRegister(ptr, n, 8)) == 0, "cudaHostRegister refused"

    def unregister():
        assert int(rt.cudaHostUnregister(ptr)) == 0, "cudaHostUnregister failed"

    regs, unregs = [], []
    for _ in range(repeats):
        regs.append(median_s(register, 1))
        unregs.append(median_s(unregister, 1))
    out["register_s"], out["unregister_s"] = statistics.median(regs), statistics.median(unregs)
    out["is_pinned_unregistered"] = bool(host.is_pinned())
    register()
    out["is_pinned_registered"] = bool(host.is_pinned())
    copy(host)
    timed_copy(host, "registered")
    unregister()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(7)
    copy(pinned)
    timed_copy(pinned, "torch_pinned")
    out["host_memcpy_to_pinned_s"] = median_s(lambda: pinned.copy_(host), repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
