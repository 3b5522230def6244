#!/usr/bin/env python3
"""gpipe's Python package against what PyTorch users write today, doing the same torch work.

Every program moves batches of `size` bytes from one producer to N consumer processes on one
GPU. The producer fills each batch with one torch op (`random_`), each consumer reduces it with
one (`sum`), accumulated on the GPU (no host synchronisation per batch anywhere it can be
avoided). The programs:

* ``gpipe``: the gpipe package (a CUDA ring, `producer.acquire()` / `slot.publish()`, consumers
  iterate a `gpipe.Consumer` and use `torch.from_dlpack(batch["x"])`);
* ``gpipe_cached``: the same, but the producer makes its torch tensor for slot k once and
  reuses it (the same declaration in slot k always has the same address);
* ``gpipe_fast``: the same as ``gpipe`` with `gpipe.torch.as_tensor` in place of
  `torch.from_dlpack` on both sides (the same tensor, without torch's per-call stream object);
* ``hand``: the best ring a PyTorch expert builds by hand: the slot tensors shared once with
  every consumer through torch.multiprocessing, interprocess `torch.cuda.Event`s for ready
  (per slot) and finished (per slot and consumer), slot indices over pipes; the producer waits
  for a consumer's "done" message only before reusing a slot, and orders its stream after
  that consumer's finished event;
* ``queue``: torch.multiprocessing queues of CUDA tensors (a pool of `slots` tensors, the
  producer synchronising its stream before each put and consumers acknowledging each batch
  after synchronising theirs, as CUDA IPC tensors carry no stream ordering);
* ``single``: the same torch work in one process and one stream (1 fill + N sums per batch):
  the Python ceiling.

One long-lived process set serves every cell (torch starts slowly): this process is the
producer of every program, four consumer processes take commands. Cells are run repetition by
repetition with the programs interleaved (A, B, C, D, A, B, ...), so drift on the machine hits
them alike; the report gives each program's median over the repetitions.

Usage (on a GPU machine with torch and the gpipe package):

    python3 benches/torch_ring_bench.py --sizes 2MiB,8MiB,64MiB --consumers 1,4 --reps 5 --json out.jsonl

Broadcast mode throughout (every consumer gets every batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

PROGRAMS = ("gpipe", "gpipe_fast", "gpipe_cached", "hand", "queue", "single")


def parse_size(s: str) -> int:
    s = s.strip()
    for suffix, mul in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mul)
    return int(s)


# ---------------------------------------------------------------------------------------------
# Consumer processes: each runs commands from its queue and answers on the results queue.


def consumer_main(idx: int, cmds, results, acks) -> None:
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # initialise CUDA once
    results.put(("up", idx))
    while True:
        cmd = cmds.get()
        kind = cmd[0]
        if kind == "quit":
            return
        try:
            if kind == "gpipe":
                results.put(consumer_gpipe(idx, *cmd[1:]))
            elif kind == "hand":
                results.put(consumer_hand(idx, cmds, results, acks, *cmd[1:]))
            elif kind == "queue":
                results.put(consumer_queue(idx, cmds, acks, *cmd[1:]))
        except Exception as e:  # report, keep serving
            results.put(("error", idx, f"{kind}: {type(e).__name__}: {e}"))


def consumer_gpipe(idx: int, sock: str, total: int, variant: str = "full"):
    import gpipe

    import gpipe.torch

    conv = gpipe.torch.as_tensor if variant == "fast" else torch.from_dlpack
    c = gpipe.Consumer(sock)
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    n = 0
    for b in c:
        with b:
            if variant != "nowork":
                acc += conv(b["x"]).sum()
        n += 1
    torch.cuda.synchronize()
    return ("done", idx, n, time.monotonic(), int(acc.item()) != 0)


def consumer_hand(idx, cmds, results, acks, slots, ready_handles, total):
    stream = torch.cuda.current_stream()
    ready = [torch.cuda.Event.from_ipc_handle(0, h) for h in ready_handles]
    finished = [torch.cuda.Event(interprocess=True) for _ in slots]
    results.put(("hand-events", idx, [e.ipc_handle() for e in finished]))
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    n = 0
    while True:
        s = cmds.get()
        if s is None:
            break
        k = s % len(slots)
        stream.wait_event(ready[k])
        acc += slots[k].sum()
        finished[k].record(stream)
        acks.put((idx, s))
        n += 1
    torch.cuda.synchronize()
    return ("done", idx, n, time.monotonic(), True)


def consumer_queue(idx, cmds, acks, total):
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    n = 0
    while True:
        item = cmds.get()
        if item is None:
            break
        s, x = item
        acc += x.sum()
        torch.cuda.current_stream().synchronize()  # the tensor goes back to the producer
        del x
        acks.put((idx, s))
        n += 1
    torch.cuda.synchronize()
    return ("done", idx, n, time.monotonic(), True)


# ---------------------------------------------------------------------------------------------
# The producer side of each program (in this process).


class Bench:
    def __init__(self, workers: int, sync: str = "auto", variant: str = "full"):
        self.sync = sync
        self.variant = variant
        ctx = mp.get_context("spawn")
        self.cmds = [ctx.Queue() for _ in range(workers)]
        self.results = ctx.Queue()
        self.acks = [ctx.Queue() for _ in range(workers)]
        self.procs = [
            ctx.Process(target=consumer_main, args=(i, self.cmds[i], self.results, self.acks[i]), daemon=True)
            for i in range(workers)
        ]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self.expect("up")
        self.tmp = tempfile.mkdtemp(prefix="gp-torch-")
        self.cell_no = 0

    def expect(self, kind, timeout=120):
        r = self.results.get(timeout=timeout)
        if r[0] == "error":
            raise RuntimeError(f"consumer {r[1]}: {r[2]}")
        if r[0] != kind:
            raise RuntimeError(f"expected {kind}, got {r}")
        return r

    def finish(self, n, t0, total):
        ends = [self.expect("done", timeout=300) for _ in range(n)]
        for e in ends:
            if e[2] != total:
                raise RuntimeError(f"consumer {e[1]} got {e[2]} of {total} batches")
        return max(e[3] for e in ends) - t0

    def run(self, program, size, n, slots, batches, warmup):
        total = warmup + batches
        words = size // 4
        if program == "single":
            return self.single(words, n, slots, batches, warmup)
        if program in ("gpipe_cached", "gpipe_fast"):
            saved, self.variant = self.variant, program[len("gpipe_"):]
            try:
                return self.gpipe(words, n, slots, batches, warmup, total)
            finally:
                self.variant = saved
        return getattr(self, program)(words, n, slots, batches, warmup, total)

    def single(self, words, n, slots, batches, warmup):
        ring = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(slots)]
        acc = torch.zeros((), dtype=torch.int64, device="cuda")
        t0 = 0.0
        for s in range(warmup + batches):
            if s == warmup:
                torch.cuda.synchronize()
                t0 = time.monotonic()
            x = ring[s % slots]
            x.random_()
            for _ in range(n):
                acc += x.sum()
        torch.cuda.synchronize()
        return batches / (time.monotonic() - t0)

    def gpipe(self, words, n, slots, batches, warmup, total):
        import gpipe
        import gpipe.torch

        self.cell_no += 1
        sock = os.path.join(self.tmp, f"c{self.cell_no}.sock")
        p = gpipe.Producer(
            sock, slots=slots, batch_bytes=words * 4, backend="cuda", max_consumers=8, sync=self.sync
        )
        for i in range(n):
            self.cmds[i].put(("gpipe", sock, total, self.variant))
        p.wait_for_consumers(n, timeout=60)
        cache: dict = {}
        t0 = 0.0
        for s in range(total):
            if s == warmup:
                p.flush(timeout=60)
                torch.cuda.synchronize()
                t0 = time.monotonic()
            with p.acquire() as slot:
                if self.variant == "nowork":
                    slot.tensor("x", torch.int32, (words,))
                elif self.variant == "cached":
                    # A tensor per slot, made once: the same declaration in slot k always
                    # has the same address, and acquire() orders the current stream.
                    x = cache.get(slot.index)
                    if x is None:
                        x = cache[slot.index] = torch.from_dlpack(slot.tensor("x", torch.int32, (words,)))
                    else:
                        slot.tensor("x", torch.int32, (words,))
                    x.random_()
                elif self.variant == "fast":
                    gpipe.torch.as_tensor(slot.tensor("x", torch.int32, (words,))).random_()
                else:
                    torch.from_dlpack(slot.tensor("x", torch.int32, (words,))).random_()
                slot.publish()
        p.close()
        cache.clear()
        return batches / self.finish(n, t0, total)

    def hand(self, words, n, slots, batches, warmup, total):
        ring = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(slots)]
        ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        stream = torch.cuda.current_stream()
        for k in range(slots):
            ready[k].record(stream)
        torch.cuda.synchronize()
        handles = [e.ipc_handle() for e in ready]
        for i in range(n):
            self.cmds[i].put(("hand", ring, handles, total))
        finished = {}
        for _ in range(n):
            r = self.expect("hand-events")
            finished[r[1]] = [torch.cuda.Event.from_ipc_handle(0, h) for h in r[2]]
        acked = [-1] * n  # highest sequence each consumer has finished enqueueing
        t0 = 0.0
        for s in range(total):
            if s == warmup:
                self.await_acks(acked, s - 1)
                torch.cuda.synchronize()
                t0 = time.monotonic()
            k = s % slots
            if s >= slots:
                # Every consumer recorded `finished` for batch s - slots: wait for it on the GPU.
                self.await_acks(acked, s - slots)
                for i in range(n):
                    stream.wait_event(finished[i][k])
            ring[k].random_()
            ready[k].record(stream)
            for i in range(n):
                self.cmds[i].put(s)
        for i in range(n):
            self.cmds[i].put(None)
        took = self.finish(n, t0, total)
        self.drain_acks(n)
        return batches / took

    def queue(self, words, n, slots, batches, warmup, total):
        ring = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(slots)]
        for i in range(n):
            self.cmds[i].put(("queue", total))
        acked = [-1] * n
        t0 = 0.0
        stream = torch.cuda.current_stream()
        for s in range(total):
            if s == warmup:
                self.await_acks(acked, s - 1)
                torch.cuda.synchronize()
                t0 = time.monotonic()
            k = s % slots
            if s >= slots:
                self.await_acks(acked, s - slots)
            ring[k].random_()
            stream.synchronize()
            for i in range(n):
                self.cmds[i].put((s, ring[k]))
        for i in range(n):
            self.cmds[i].put(None)
        took = self.finish(n, t0, total)
        self.drain_acks(n)
        return batches / took

    def await_acks(self, acked, upto):
        """Reads acknowledgements until every consumer has acknowledged batch `upto`."""
        for i in range(len(acked)):
            while acked[i] < upto:
                acked[i] = max(acked[i], self.acks[i].get()[1])

    def drain_acks(self, n):
        for i in range(n):
            while not self.acks[i].empty():
                self.acks[i].get()

    def close(self):
        for q in self.cmds:
            q.put(("quit",))
        for p in self.procs:
            p.join(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2MiB,8MiB,64MiB")
    ap.add_argument("--consumers", default="1,4")
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=0.6, help="target length of one timed run")
    ap.add_argument("--label", default="")
    ap.add_argument("--sync", default="auto", help="the gpipe producer's sync mode")
    ap.add_argument(
        "--gpipe-variant",
        default="full",
        choices=["full", "cached", "nowork"],
        help="full: what a user writes; cached: the producer keeps one tensor per slot; "
        "nowork: no torch work at all (the package's own cost)",
    )
    ap.add_argument("--json", help="append one JSON line per cell to this file")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    counts = [int(c) for c in args.consumers.split(",")]
    programs = args.programs.split(",")
    bench = Bench(max(counts), args.sync, args.gpipe_variant)
    # Batches per run: sized from a short probe of the single-process rate, so each run takes
    # about --seconds; the same count for every program of a cell.
    cells = []
    for size in sizes:
        for n in counts:
            rate = bench.run("single", size, n, args.slots, 200, 20)
            cells.append((size, n, max(200, min(20000, int(rate * args.seconds)))))
    rates = {(size, n, p): [] for size, n, _ in cells for p in programs}
    started = time.monotonic()
    for rep in range(args.reps):
        for size, n, batches in cells:
            for p in programs:
                r = bench.run(p, size, n, args.slots, batches, max(20, batches // 20))
                rates[(size, n, p)].append(r)
        print(f"rep {rep + 1}/{args.reps} done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    bench.close()
    for size, n, batches in cells:
        med = {p: statistics.median(rates[(size, n, p)]) for p in programs}
        row = {
            "label": args.label,
            "sync": args.sync,
            "gpipe_variant": args.gpipe_variant,
            "size": size,
            "consumers": n,
            "batches": batches,
            "median_batches_per_s": {p: round(v, 1) for p, v in med.items()},
            "all": {p: [round(v, 1) for v in rates[(size, n, p)]] for p in programs},
        }
        if "single" in med:
            row["ratio_to_single"] = {p: round(med[p] / med["single"], 3) for p in programs}
        line = json.dumps(row)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
