#!/usr/bin/env python3
"""A trainer fed by a gpipe ring: the consumer side of the data loader.

Attaches to the producer at ``--socket`` (producer.py), and trains on every batch in place: the
images and labels are the slot's own memory (``torch.from_dlpack``, no copy), read-only, and
the slot goes back to the producer once the step that reads them is enqueued (the GPU-side
release waits for the step's kernels). Batches carry their epoch in the header (meta), which
steps the learning-rate scheduler.

Distributed data parallel: ``--world-size W --rank R`` joins a process group (NCCL on CUDA,
gloo on the CPU). Three ways to feed the ranks:

- one producer per GPU (``producer.py --device R --shard R/W``; the trainer runs on its
  producer's GPU): each rank reads its own ring, all of whose batches are its own;
- several producers per GPU (``--socket A,B``, producers ``--shard`` R*K+k/W*K): the trainer
  reads K rings in turn, so K decode processes, each with its own interpreter, feed one GPU;
- one producer for several trainers on one device (``producer.py --consumers W --multiple W``
  and ``--take R/W`` here): the ring broadcasts every batch and trainer R keeps those whose
  batch number g has g % W == R, releasing the others at once.

Every way, every rank gets the same number of batches per epoch, so all-reduce never waits
for a rank that ran out.

Prints one JSON line: images/s, the fraction of the stream's time spent waiting for data,
GPU utilisation, epochs seen, and a per-step timeline (wait_ms, step_ms).

    python3 apps/loader/train.py --socket /tmp/loader.sock --model resnet50 --steps 60
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpipe  # noqa: E402
from gpu_decode import META_CLASSES, META_EPOCH, META_GLOBAL, META_INDEX, META_PER_EPOCH  # noqa: E402
from step import MODELS, TrainStep, emit, environment, measure, setup_device  # noqa: E402


class RingBatches:
    """Iterator of (images, labels, info) over a trainer's batches, without a copy.

    With several rings (one per decode process) it takes one batch from each in turn. Every
    producer publishes the same number of batches per epoch (its shard of the same plan), so
    taking them in turn keeps the rings' epochs together and never leaves one ring's batches
    waiting behind another's.

    A class rather than a generator: a generator's frame would keep the last tensors (and so
    their slot) alive while it waits for the next batch.
    """

    def __init__(self, consumers: list[gpipe.Consumer], take: tuple[int, int], timeout: float):
        self.consumers, self.take, self.timeout = consumers, take, timeout
        self.received = 0
        self.skipped = 0
        self.per_ring: list[list[int]] = [[] for _ in consumers]
        self.kept: list[int] = []
        self.wrong_order = 0
        self._last_global = [-1] * len(consumers)
        self._turn = 0

    @property
    def globals(self) -> list[int]:
        """The batch numbers kept, in the order received (each ring numbers its own)."""
        return self.kept

    def __iter__(self) -> "RingBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        rank, world = self.take
        while True:
            ring = self._turn
            try:
                batch = self.consumers[ring].recv(timeout=self.timeout)
            except gpipe.Closed:
                raise StopIteration
            self._turn = (ring + 1) % len(self.consumers)
            self.received += 1
            meta = batch.meta
            g = meta[META_GLOBAL]
            if g <= self._last_global[ring]:
                self.wrong_order += 1
            self._last_global[ring] = g
            if g % world != rank:
                batch.release()
                self.skipped += 1
                continue
            self.per_ring[ring].append(g)
            self.kept.append(g)
            with batch:
                return (
                    torch.from_dlpack(batch["images"]),
                    torch.from_dlpack(batch["labels"]),
                    {
                        "epoch": meta[META_EPOCH], "index": meta[META_INDEX], "per_epoch": meta[META_PER_EPOCH],
                        "global": g, "classes": meta[META_CLASSES], "ring": ring,
                    },
                )


def parse_fraction(text: str) -> tuple[int, int]:
    """'1/2' -> (1, 2)."""
    try:
        r, w = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R/W, e.g. 0/2, not {text!r}")
    if not 0 <= r < w:
        raise argparse.ArgumentTypeError(f"{text}: need 0 <= R < W")
    return r, w


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", required=True,
                    help="the producer's socket; several, comma-separated, to read one ring per decode "
                    "process in turn (producer.py --shard K/N each)")
    ap.add_argument("--model", choices=MODELS, default="resnet50", help="'none' only receives (measures the producer)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps (0: until the producer closes the ring)")
    ap.add_argument("--warmup", type=int, default=10, help="steps before timing starts")
    ap.add_argument("--take", type=parse_fraction, default=(0, 1), metavar="R/W",
                    help="keep batches whose number g has g %% W == R (one producer, W trainers)")
    ap.add_argument("--world-size", type=int, default=1, help="DDP ranks (1: no process group)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--dist-url", default="env://", help="process-group rendezvous, e.g. file:///tmp/pg or tcp://...")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one batch")
    ap.add_argument("--attach-timeout", type=float, default=60.0, help="seconds to keep trying to attach")
    ap.add_argument("--profile", type=int, default=0,
                    help="run this many more steps under torch.profiler after the timed ones")
    ap.add_argument("--profile-out", default=None, help="append the profiler table here (default: stderr)")
    ap.add_argument("--label", default="gpipe", help="a name for this run in the JSON")
    ap.add_argument("--json-out", default=None, help="also append the JSON line to this file")
    a = ap.parse_args(argv)

    paths = [p for p in a.socket.split(",") if p]
    if not paths:
        ap.error("--socket: no socket given")
    if len(paths) > 1 and a.take != (0, 1):
        ap.error("--take splits one ring between trainers; with several rings give each trainer its own")
    consumers = [attach(p, a.attach_timeout) for p in paths]
    devices = {c.device for c in consumers}
    if len(devices) > 1:
        ap.error(f"the rings are on different devices ({', '.join(sorted(devices))}): a trainer reads "
                 "rings on one device")
    dev = setup_device(consumers[0].device)
    if a.world_size > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo", init_method=a.dist_url,
            rank=a.rank, world_size=a.world_size,
        )
    batches = RingBatches(consumers, a.take, a.timeout)
    # The first batch says how many classes there are; then build the model.
    first = next(batches)
    batch_size, num_classes = int(first[0].shape[0]), int(first[2]["classes"])
    step = TrainStep(a.model, num_classes, dev, ddp=a.world_size > 1)
    stream = _prepend(first, batches)
    del first  # `stream` holds it until measure() takes it
    out = measure(
        step, stream, steps=a.steps, warmup=a.warmup, batch_size=batch_size,
        profile=a.profile, profile_path=a.profile_out,
    )
    received, skipped = batches.received, batches.skipped
    read_only = all(c.enforced_read_only for c in consumers)
    for c in consumers:
        c.close()
    if a.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    record = {
        "role": "trainer", "label": a.label, "model": a.model, "device": str(dev),
        "rank": a.rank, "world_size": a.world_size, "take": list(a.take),
        "received": received, "skipped": skipped, "kept": len(batches.globals),
        "globals": batches.globals, "rings": len(consumers),
        "per_ring": batches.per_ring if len(consumers) > 1 else None, "out_of_order": batches.wrong_order,
        "enforced_read_only": read_only, **out, **environment(),
    }
    emit(record, a.json_out)
    return 0


def attach(socket: str, timeout: float) -> gpipe.Consumer:
    """Attaches, retrying until the producer listens (it may still be starting).

    Side signals off: a training step takes tens of milliseconds, so the few µs of GPU time a
    side stream saves per batch do not matter, and under MPS they would want
    CUDA_DEVICE_MAX_CONNECTIONS=8 for the whole trainer, training streams included (the
    loader's figures in docs/examples.md were measured without both)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return gpipe.Consumer(socket, side_signals=False)
        except gpipe.AttachError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class _prepend:
    """An iterator that yields `first`, then the rest of `rest` (without keeping either)."""

    def __init__(self, first, rest):
        self._first, self._rest = [first], rest

    def __iter__(self):
        return self

    def __next__(self):
        if self._first:
            return self._first.pop()
        return next(self._rest)


if __name__ == "__main__":
    sys.exit(main())
