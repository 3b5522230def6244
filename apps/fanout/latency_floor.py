"""The machine's own floor under the fan-out's added-latency figure: how long it takes one
Python process to see a time stamp another one wrote, with no GPU and no gpipe.

A writer stamps `time.monotonic_ns()` into shared memory at a fixed rate; each of K readers
either spins on the memory (`--wait spin`, like `gpipe.Consumer(spin=...)`) or sleeps in a
blocking read of a pipe the writer writes a byte to (`--wait sleep`, a kernel wake-up, like a
consumer asleep in `recv()`). Each reader takes the clock as soon as it sees the stamp. The
latencies are what any transport between Python processes pays on this machine before it does
anything of its own; apps/fanout/run_all.py's empty-model runs add gpipe, DLPack and a device
synchronisation on top.

    python3 apps/fanout/latency_floor.py --readers 3 --rate 110 --seconds 3 --wait spin

Prints one JSON line: the settings and each reader's p50/p99/max in µs.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fanout_records import latency_summary  # noqa: E402  (no torch: plain Python)

STAMP = struct.Struct("<QQ")  # sequence number, then the stamp (ns)


def writer(shm: mmap.mmap, pipes: list[int], rate: float, count: int) -> None:
    """Writes `count` stamps at `rate` per second: sleeps until just before each one is due,
    then spins to the due time, stamps, and wakes the sleeping readers."""
    period = 1e9 / rate
    start = time.monotonic_ns() + 50_000_000
    for seq in range(1, count + 1):
        due = start + int(seq * period)
        ahead = (due - time.monotonic_ns()) / 1e9 - 0.0005
        if ahead > 0:
            time.sleep(ahead)
        while time.monotonic_ns() < due:
            pass
        # The sequence number the readers watch and the stamp, in one 16-byte store.
        shm[0:16] = STAMP.pack(seq, time.monotonic_ns())
        for w in pipes:
            os.write(w, b"x")
    shm[0:8] = struct.pack("<Q", 2**64 - 1)  # the end
    for w in pipes:
        os.write(w, b"e")


def reader(shm: mmap.mmap, rfd: int, wait: str, out, count: int) -> None:
    """Records, for each stamp, the time from the stamp to this process seeing it."""
    seen = 0
    lat: list[int] = []
    while True:
        if wait == "sleep":
            os.read(rfd, 1)
        while True:
            seq = struct.unpack("<Q", shm[0:8])[0]
            if seq != seen:
                break
        now = time.monotonic_ns()
        if seq == 2**64 - 1:
            break
        # Both words, read twice: a pair that changed between the reads was being written.
        pair = shm[0:16]
        if shm[0:16] != pair:
            continue
        seq, stamp = STAMP.unpack(pair)
        if seq == 2**64 - 1:
            break
        seen = seq
        lat.append(now - stamp)
        if len(lat) >= count:
            break
    out.send(lat)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--readers", type=int, default=3, help="reader processes (default 3)")
    ap.add_argument("--rate", type=float, default=110.0, help="stamps per second (default 110)")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of the run (default 3)")
    ap.add_argument(
        "--wait",
        choices=("spin", "sleep"),
        default="spin",
        help="readers spin on the memory, or sleep in a pipe read (default spin)",
    )
    a = ap.parse_args(argv)
    if a.readers < 1 or a.rate <= 0 or a.seconds <= 0:
        ap.error("--readers, --rate and --seconds must be positive")
    count = max(1, int(a.rate * a.seconds))
    ctx = mp.get_context("fork")
    shm = mmap.mmap(-1, 4096)
    pipes = [os.pipe() for _ in range(a.readers)]
    links = [ctx.Pipe(duplex=False) for _ in range(a.readers)]
    procs = [
        ctx.Process(target=reader, args=(shm, pipes[k][0], a.wait, links[k][1], count), daemon=True)
        for k in range(a.readers)
    ]
    for p in procs:
        p.start()
    time.sleep(0.2)  # the readers are waiting before the first stamp
    writer(shm, [w for _, w in pipes] if a.wait == "sleep" else [], a.rate, count)
    results = []
    for k, p in enumerate(procs):
        if not links[k][0].poll(10.0):
            print(f"latency_floor: reader {k} gave no result", file=sys.stderr)
            p.kill()
            return 1
        lat = links[k][0].recv()
        p.join(5.0)
        results.append({"reader": k, **(latency_summary(lat) or {"n": 0})})
    print(
        json.dumps(
            {
                "run": "latency-floor",
                "wait": a.wait,
                "readers": a.readers,
                "rate": a.rate,
                "stamps": count,
                "cpus": os.cpu_count(),
                "results": results,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
