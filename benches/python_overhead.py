#!/usr/bin/env python3
"""What the gpipe Python package costs per batch, on the host backend.

One process holds a producer and a consumer of one ring (64 slots). Each round publishes 64
batches (timed: the producer's cost) and then receives and releases them (timed: the
consumer's cost), so neither side ever waits for the other and the figures are the
package's own cost. Prints the median over rounds of the per-batch cost, in microseconds,
as a table (or JSON with --json).

Usage: python3 benches/python_overhead.py [--rounds 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np

import gpipe

SLOTS = 64


def median_per_batch(samples: list[float]) -> float:
    return statistics.median(samples) / SLOTS * 1e6


def run(rounds: int) -> dict:
    sock = os.path.join(tempfile.mkdtemp(prefix="gp-bench-"), "ring.sock")
    p = gpipe.Producer(sock, slots=SLOTS, batch_bytes=2 << 20, backend="host")
    c = gpipe.Consumer(sock)
    p.wait_for_consumers(1, timeout=5)
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False

    def produce_raw():
        for _ in range(SLOTS):
            with p.acquire() as s:
                s.publish(nbytes=4096)

    def produce_tensor():
        for _ in range(SLOTS):
            with p.acquire() as s:
                s.tensor("x", "float32", (1024,))
                s.publish()

    def consume(make):
        for _ in range(SLOTS):
            b = c.recv()
            x = make(b)
            del x
            b.release()

    def consume_with():
        for _ in range(SLOTS):
            with c.recv() as b:
                x = np.from_dlpack(b)
                del x

    cases: dict[str, tuple] = {
        "producer: acquire + publish (raw bytes)": (produce_raw, None),
        "producer: acquire + tensor() + publish": (produce_tensor, None),
        "consumer: recv + release": (None, lambda b: None),
        "consumer: recv + numpy.from_dlpack + release": (None, np.from_dlpack),
        "consumer: recv + numpy.from_dlpack, with-block": (None, "with"),
    }
    if have_torch:
        import torch

        cases["consumer: recv + torch.from_dlpack + release"] = (None, torch.from_dlpack)
    samples: dict[str, list[float]] = {k: [] for k in cases}
    producers = [k for k, (f, _) in cases.items() if f is not None]
    consumers = [k for k, (f, _) in cases.items() if f is None]
    # Warm up, then interleave the cases round by round so drift hits them alike.
    for r in range(rounds + 5):
        for i, ck in enumerate(consumers):
            pk = producers[(r + i) % len(producers)]
            t0 = time.perf_counter()
            cases[pk][0]()
            t1 = time.perf_counter()
            make = cases[ck][1]
            if make == "with":
                consume_with()
            else:
                consume(make)
            t2 = time.perf_counter()
            if r >= 5:
                samples[pk].append(t1 - t0)
                samples[ck].append(t2 - t1)
    c.close()
    p.close()
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": __import__("torch").__version__ if have_torch else None,
        "gpipe": gpipe.__version__,
        "cpu": platform.processor() or platform.machine(),
        "rounds": rounds,
        "per_batch_us": {k: round(median_per_batch(v), 2) for k, v in samples.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.rounds)
    if args.json:
        print(json.dumps(res))
        return
    print(f"gpipe {res['gpipe']}, Python {res['python']}, NumPy {res['numpy']}, torch {res['torch']}")
    print(f"median per-batch cost over {res['rounds']} rounds of {SLOTS} batches:")
    for k, v in res["per_batch_us"].items():
        print(f"  {k:<52} {v:7.2f} us")


if __name__ == "__main__":
    main()
