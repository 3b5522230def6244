#!/usr/bin/env python3
"""The data loader's producer: reads JPEG files, decodes and augments them on the GPU, and
publishes each batch into a gpipe ring that trainers (train.py) read in place.

Per batch: the next decoded batch comes from gpu_decode.DecodedBatches (file reads on a thread
pool, nvJPEG batched decode on a thread of its own, a few batches ahead); the producer
acquires a slot, declares two tensors in it,

- ``images``: float16, B x 3 x S x S, channels_last (the layout the ResNet step wants),
- ``labels``: int64, B,

writes the random-resized-crop + flip + normalise output straight into ``images`` (one
roi_align and one fused normalise kernel for the batch: gpu_decode.Augment), copies the labels,
and publishes with the header (meta) words of gpu_decode (epoch, batch in epoch, batches per
epoch, batch number, classes, shard, shards). Ordering is gpipe's: ``acquire()`` makes the
producer's stream wait until the slot's previous readers are done, ``publish()`` signals
`ready` after the kernels that wrote it; nothing synchronises the host per batch.

It waits for ``--consumers`` trainers before publishing the first batch (broadcast delivers
only what is published after a consumer attached), and stops after ``--epochs`` epochs, after
``--batches`` batches, or when the trainers have gone. At the end it prints one JSON line:
its images/s (whole run and after ``--warmup`` batches), and where its time went (waiting for
decoded batches, for free slots, or working).

    python3 apps/loader/producer.py --data /tmp/loader-data --socket /tmp/loader.sock --device 0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpipe  # noqa: E402
from gpu_decode import (  # noqa: E402
    META_CLASSES, META_EPOCH, META_GLOBAL, META_INDEX, META_PER_EPOCH, META_SHARD, META_SHARDS,
    Augment, DecodedBatches, EpochPlan, channels_last_strides, open_images,
)
from step import emit  # noqa: E402
from train import parse_fraction  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="data set: a folder (make_dataset.py) or a pack (pack_dataset.py)")
    ap.add_argument("--socket", required=True, help="socket to listen on")
    ap.add_argument("--batch", type=int, default=256, help="images per batch (default 256)")
    ap.add_argument("--size", type=int, default=224, help="crop size S (default 224)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs to publish (default: until the trainers leave)")
    ap.add_argument("--batches", type=int, default=None, help="stop after this many batches")
    ap.add_argument("--backend", choices=("cuda", "host", "auto"), default="auto",
                    help="where the slots live; 'host' decodes on the CPU too (CI)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device of the slots and the decode")
    ap.add_argument("--slots", type=int, default=6, help="slots in the ring (default 6)")
    ap.add_argument("--consumers", type=int, default=1, help="trainers to wait for before publishing")
    ap.add_argument("--multiple", type=int, default=1,
                    help="batches per epoch are a multiple of this (W trainers taking turns: W)")
    ap.add_argument("--shard", type=parse_fraction, default=(0, 1), metavar="K/N",
                    help="publish only shard K of N of each epoch (one producer per GPU: K = rank)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed (the same for every shard)")
    ap.add_argument("--prefetch", type=int, default=3, help="decoded batches kept ready (default 3)")
    ap.add_argument("--read-threads", type=int, default=8, help="file-reading threads (default 8; a pack needs none)")
    ap.add_argument("--warmup", type=int, default=10, help="batches left out of the steady-state rate")
    ap.add_argument("--attach-timeout", type=float, default=120.0, help="seconds to wait for the trainers")
    ap.add_argument("--drain-timeout", type=float, default=600.0,
                    help="seconds the trainers may take with the last batches after the last is published "
                         "(default 600: a DDP rank may wait that long for a slower one; a trainer that dies "
                         "is let go at once)")
    ap.add_argument("--json-out", default=None, help="also append the JSON line to this file")
    ap.add_argument("--side-stream", action="store_true",
                    help="augment and publish on a stream of its own instead of the device's default stream "
                         "(which synchronises with every blocking stream of the process)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's CPU threads in this process (default 1: the producer's CPU tensors "
                         "are tiny, and several producers each with a thread per core starve each other)")
    ap.add_argument("--label", default="producer")
    a = ap.parse_args(argv)
    if a.torch_threads < 1:
        ap.error("--torch-threads must be at least 1")
    # Measured on the H100 (docs/examples.md): with torch's default of one intra-op thread per
    # core in every producer, 2-4 producers stopped near 6 000 images/s together, each small
    # CPU op waiting milliseconds for a core; with 1 thread each (OMP_NUM_THREADS=1), 4 made
    # 23 700 (apps/loader/scaling.py).
    torch.set_num_threads(a.torch_threads)

    backend = a.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "host"
    dev = torch.device("cuda", a.device) if backend == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    images_set = open_images(a.data)
    shard, shards = a.shard
    plan = EpochPlan(len(images_set), a.batch, shard=shard, shards=shards, multiple=a.multiple, seed=a.seed)
    aug = Augment(a.size, dev, seed=a.seed * 7919 + shard)
    shape = (a.batch, 3, a.size, a.size)
    image_bytes = a.batch * 3 * a.size * a.size * 2
    slot_bytes = image_bytes + gpipe.TENSOR_ALIGN + a.batch * 8

    producer = gpipe.Producer(
        a.socket, slots=a.slots, batch_bytes=slot_bytes, mode="broadcast", backend=backend, device=a.device,
        drain_timeout=a.drain_timeout,
    )
    print(f"listening on {a.socket} ({producer.device}, {producer.memory}, {a.slots} slots of "
          f"{producer.slot_bytes >> 20} MiB); {plan.batches_per_epoch} batches per epoch", file=sys.stderr, flush=True)
    stats = {"decode_wait_s": 0.0, "acquire_s": 0.0, "work_s": 0.0, "read_s": 0.0, "decode_s": 0.0}
    published = 0
    stamps: list[float] = []
    end = "done"
    source = None
    # gpipe orders acquire and publish on the caller's current stream: with --side-stream that
    # is this stream, for the whole loop.
    side = dev.type == "cuda" and a.side_stream
    work = torch.cuda.stream(torch.cuda.Stream(dev)) if side else contextlib.nullcontext()
    with work:
        try:
            producer.wait_for_consumers(a.consumers, timeout=a.attach_timeout)
            source = DecodedBatches(
                images_set, plan, dev, epochs=a.epochs, limit=a.batches, prefetch=a.prefetch,
                read_threads=a.read_threads,
            )
            t_start = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(source)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                if producer.consumers < a.consumers:
                    end = "trainers left"
                    break
                with producer.acquire() as slot:
                    t2 = time.perf_counter()
                    declared = slot.tensor("images", torch.float16, shape, strides=channels_last_strides(shape))
                    images = torch.from_dlpack(declared)
                    labels = torch.from_dlpack(slot.tensor("labels", torch.int64, (a.batch,)))
                    aug(item.images, out=images)
                    if dev.type == "cuda":  # a pinned source: no host synchronisation
                        labels.copy_(item.labels.pin_memory(), non_blocking=True)
                    else:
                        labels.copy_(item.labels)
                    meta = [0] * 7
                    meta[META_EPOCH], meta[META_INDEX], meta[META_GLOBAL] = item.epoch, item.index, item.global_index
                    meta[META_PER_EPOCH], meta[META_CLASSES] = plan.batches_per_epoch, len(images_set.classes)
                    meta[META_SHARD], meta[META_SHARDS] = shard, shards
                    del declared, images, labels
                    slot.publish(meta=meta)
                t3 = time.perf_counter()
                item_read, item_decode = item.read_s, item.decode_s
                del item
                published += 1
                stamps.append(t3)
                stats["decode_wait_s"] += t1 - t0
                stats["acquire_s"] += t2 - t1
                stats["work_s"] += t3 - t2
                stats["read_s"] += item_read
                stats["decode_s"] += item_decode
        except gpipe.Timeout:
            end = "no trainers attached"
        except gpipe.Closed:
            end = "closed"
        finally:
            if source is not None:
                source.close()
            counters = producer.close()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    record = {"role": "producer", "label": a.label, "device": str(dev), "source": images_set.kind,
              "side_stream": a.side_stream, "torch_threads": a.torch_threads,
              "end": end, "batches": published,
              "batch": a.batch, "images": published * a.batch, "batches_per_epoch": plan.batches_per_epoch,
              "shard": [shard, shards], "counters": counters}
    if stamps:
        wall = stamps[-1] - t_start
        record["seconds"] = round(wall, 3)
        record["images_per_s"] = round(published * a.batch / wall, 1) if wall > 0 else None
        if len(stamps) > a.warmup + 1:
            steady = stamps[-1] - stamps[a.warmup]
            record["steady_images_per_s"] = round((len(stamps) - 1 - a.warmup) * a.batch / steady, 1)
        record.update({k: round(v, 3) for k, v in stats.items()})
        # Time not spent waiting for trainers: what the producer could do on its own.
        busy = wall - stats["acquire_s"]
        record["busy_images_per_s"] = round(published * a.batch / busy, 1) if busy > 0 else None
    emit(record, a.json_out)
    return 0 if end in ("done", "trainers left", "closed") else 1


if __name__ == "__main__":
    sys.exit(main())
