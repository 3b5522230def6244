#!/usr/bin/env python3
"""Where a Python gpipe batch spends its time on the GPU, phase by phase.

One producer (this process) and one consumer process move 2 MiB batches of the
torch_ring_bench work (producer: one `random_`; consumer: one `sum`). Each side adds up the
host time of each phase of its loop with `perf_counter_ns`; the report gives microseconds per
batch for each phase and the overall rate. A phase that blocks (`acquire`, `recv`) shows the
other side being the bound.

    python3 benches/py_phase_profile.py --sync semaphore --batches 4000
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

import torch


def consumer(sock: str, total: int, variant: str, stream: str, out) -> None:
    import gpipe

    torch.cuda.init()
    if stream == "side":
        torch.cuda.set_stream(torch.cuda.Stream())
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    acc += torch.ones(4, dtype=torch.int32, device="cuda").sum()  # load the kernels first
    c = gpipe.Consumer(sock)
    ph = {"recv": 0, "getitem": 0, "from_dlpack": 0, "sum": 0, "add": 0, "release": 0}
    pc = time.perf_counter_ns
    n = 0
    t_first = 0.0
    while n < total:
        a = pc()
        b = c.recv(timeout=60)
        t1 = pc()
        if n == 0:
            t_first = time.monotonic()
        t = b["x"]
        t2 = pc()
        x = torch.from_dlpack(t)
        t3 = pc()
        if variant != "nowork":
            r = x.sum()
            t35 = pc()
            acc += r
        else:
            t35 = pc()
        t4 = pc()
        del x, t
        b.release()
        t5 = pc()
        if n >= total // 8:  # skip the warm-up eighth
            ph["recv"] += t1 - a
            ph["getitem"] += t2 - t1
            ph["from_dlpack"] += t3 - t2
            ph["sum"] += t35 - t3
            ph["add"] += t4 - t35
            ph["release"] += t5 - t4
        n += 1
    torch.cuda.synchronize()
    out.put({"side": "consumer", "phases": ph, "counted": total - total // 8, "end": time.monotonic(), "first": t_first})
    c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=4000)
    ap.add_argument("--bytes", type=int, default=2 << 20)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--sync", default="auto")
    ap.add_argument("--variant", default="full", choices=["full", "nowork"])
    ap.add_argument("--label", default="")
    ap.add_argument("--pstream", default="default", choices=["default", "side"], help="producer's stream")
    ap.add_argument("--cstream", default="default", choices=["default", "side"], help="consumer's stream")
    args = ap.parse_args()
    import gpipe

    words = args.bytes // 4
    sock = os.path.join(tempfile.mkdtemp(prefix="gp-prof-"), "p.sock")
    p = gpipe.Producer(sock, slots=args.slots, batch_bytes=args.bytes, backend="cuda", sync=args.sync)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=consumer, args=(sock, args.batches, args.variant, args.cstream, q), daemon=True)
    proc.start()
    p.wait_for_consumers(1, timeout=120)
    if args.pstream == "side":
        torch.cuda.set_stream(torch.cuda.Stream())
    warm = torch.empty(words, dtype=torch.int32, device="cuda")
    warm.random_()
    torch.cuda.synchronize()
    ph = {"acquire": 0, "tensor": 0, "from_dlpack": 0, "torch_work": 0, "publish": 0}
    pc = time.perf_counter_ns
    t0 = 0.0
    skip = args.batches // 8
    for s in range(args.batches):
        if s == skip:
            t0 = time.monotonic()
        a = pc()
        slot = p.acquire(timeout=60)
        t1 = pc()
        t = slot.tensor("x", torch.int32, (words,))
        t2 = pc()
        x = torch.from_dlpack(t)
        t3 = pc()
        if args.variant != "nowork":
            x.random_()
        t4 = pc()
        del x, t
        slot.publish()
        t5 = pc()
        if s >= skip:
            ph["acquire"] += t1 - a
            ph["tensor"] += t2 - t1
            ph["from_dlpack"] += t3 - t2
            ph["torch_work"] += t4 - t3
            ph["publish"] += t5 - t4
    r = q.get(timeout=120)
    proc.join(timeout=30)
    p.close()
    n = args.batches - skip
    rate = n / (r["end"] - t0)
    row = {
        "label": args.label,
        "sync": args.sync,
        "variant": args.variant,
        "streams": f"{args.pstream}/{args.cstream}",
        "slots": args.slots,
        "bytes": args.bytes,
        "batches_per_s": round(rate),
        "producer_us": {k: round(v / n / 1e3, 2) for k, v in ph.items()},
        "consumer_us": {k: round(v / r["counted"] / 1e3, 2) for k, v in r["phases"].items()},
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
