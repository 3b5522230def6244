#!/usr/bin/env python3
"""The loader's baselines: the same training step (step.py) fed three other ways.

- ``ceiling``: synthetic batches already on the GPU (float16 channels_last, the layout gpipe
  delivers): the training-only rate, the most any loader can reach.
- ``dataloader``: ``torch.utils.data.DataLoader`` over the same folder, decoding with PIL in
  worker processes (RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize),
  ``pin_memory=True``, persistent workers; each batch is copied to the GPU (non_blocking) and
  made channels_last float16 there.
- ``inprocess``: the producer's own GPU decode and augmentation (gpu_decode.py) in the
  training process, DALI-like: background threads read and decode, an augment thread writes
  each batch on a side stream, two batches ahead; the training stream waits on an event per
  batch and marks the tensors as used on it (``record_stream``).

Each mode prints one JSON line with the same figures as train.py.

    python3 apps/loader/baselines.py ceiling --model resnet50
    python3 apps/loader/baselines.py dataloader --data /tmp/loader-data --workers 16
    python3 apps/loader/baselines.py inprocess --data /tmp/loader-data
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import sys
import threading
from typing import Iterator, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_decode import IMAGENET_MEAN, IMAGENET_STD, Augment, DecodedBatches, EpochPlan, open_images  # noqa: E402
from step import MODELS, TrainStep, emit, environment, leave_group, measure, setup_rank  # noqa: E402

MODES = ("ceiling", "dataloader", "inprocess")


class Synthetic:
    """The same batch every time, already on the device."""

    def __init__(self, batch: int, size: int, classes: int, dev: torch.device):
        fmt = torch.channels_last
        self.images = torch.randn(batch, 3, size, size, device=dev).to(torch.float16, memory_format=fmt)
        self.labels = torch.randint(0, classes, (batch,), device=dev)

    def __iter__(self) -> "Synthetic":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        return self.images, self.labels, {"epoch": 0}


class FolderDataset(torch.utils.data.Dataset):
    """The data set (a folder or a pack) as (CHW float tensor, label) with torchvision's PIL
    transforms."""

    def __init__(self, images, size: int):
        from torchvision import transforms

        self.images, self.labels = images, images.labels.tolist()
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.images.pil_source(i)) as img:
            return self.transform(img.convert("RGB")), self.labels[i]


class LoaderBatches:
    """Epochs of a DataLoader, each batch moved to the device as channels_last float16."""

    def __init__(self, loader: torch.utils.data.DataLoader, dev: torch.device):
        self.loader, self.dev = loader, dev
        self.epoch = 0
        self._it = iter(loader)

    def __iter__(self) -> "LoaderBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        try:
            x, y = next(self._it)
        except StopIteration:
            self.epoch += 1
            self._it = iter(self.loader)
            x, y = next(self._it)
        nb = self.dev.type == "cuda"
        x = x.to(self.dev, non_blocking=nb).to(torch.float16, memory_format=torch.channels_last)
        return x, y.to(self.dev, non_blocking=nb), {"epoch": self.epoch}


class InProcess:
    """GPU decode + augment in this process, on a side stream, `depth` batches ahead."""

    _END = object()

    def __init__(self, source: DecodedBatches, aug: Augment, dev: torch.device, depth: int = 2):
        self.source, self.aug, self.dev = source, aug, dev
        self.cuda = dev.type == "cuda"
        self.side = torch.cuda.Stream(dev) if self.cuda else None
        self._queue: "queue.Queue[object]" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="augment", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.dev)
            with torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext():
                # next() orders this thread's current stream (the side stream) after the decode.
                for item in self.source:
                    if self._stop.is_set():
                        return
                    images = self.aug(item.images)
                    ready = None
                    if self.cuda:
                        labels = item.labels.pin_memory().to(self.dev, non_blocking=True)
                        ready = torch.cuda.Event()
                        ready.record()
                    else:
                        labels = item.labels
                    info = {"epoch": item.epoch, "index": item.index}
                    del item
                    self._put((images, labels, ready, info))
                    del images, labels
            self._put(self._END)
        except BaseException as e:
            self._put(e)

    def _put(self, obj: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(obj, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> "InProcess":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        obj = self._queue.get()
        if obj is self._END:
            raise StopIteration
        if isinstance(obj, BaseException):
            raise RuntimeError("the in-process loader failed") from obj
        images, labels, ready, info = obj  # type: ignore[misc]
        if ready is not None:
            cur = torch.cuda.current_stream(self.dev)
            cur.wait_event(ready)
            images.record_stream(cur)  # allocated on the side stream, read on this one
            labels.record_stream(cur)
        return images, labels, info

    def close(self) -> None:
        self._stop.set()
        self.source.close()
        self._thread.join(timeout=30)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--data", help="data set folder or pack (dataloader, inprocess)")
    ap.add_argument("--model", choices=MODELS, default="resnet50")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--classes", type=int, default=100, help="classes (ceiling; the others read the folder)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="steps before timing starts")
    ap.add_argument("--workers", type=int, default=16, help="DataLoader worker processes")
    ap.add_argument("--prefetch", type=int, default=3, help="decoded batches kept ready (inprocess)")
    ap.add_argument("--read-threads", type=int, default=8, help="file-reading threads (inprocess)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1, help="DDP ranks (ceiling only; 1: no process group)")
    ap.add_argument("--rank", type=int, default=0, help="this rank; with --device cuda it runs on cuda:RANK")
    ap.add_argument("--dist-url", default="env://", help="process-group rendezvous, e.g. file:///tmp/pg")
    ap.add_argument("--profile", type=int, default=0,
                    help="run this many more steps under torch.profiler after the timed ones")
    ap.add_argument("--profile-out", default=None, help="append the profiler table here (default: stderr)")
    ap.add_argument("--label", default=None, help="a name for this run in the JSON (default: the mode)")
    ap.add_argument("--json-out", default=None, help="also append the JSON line to this file")
    a = ap.parse_args(argv)
    if a.mode != "ceiling" and not a.data:
        ap.error(f"{a.mode} needs --data")
    if a.world_size > 1 and a.mode != "ceiling":
        ap.error("--world-size > 1 is for the ceiling only (the gpipe runs shard the data per rank)")

    ddp = a.world_size > 1
    dev = setup_rank(a.device, a.world_size, a.rank, a.dist_url)
    torch.manual_seed(a.seed)
    closer = None
    batches: Iterator
    extra: dict = {}
    if a.mode == "ceiling":
        classes = a.classes
        batches = Synthetic(a.batch, a.size, classes, dev)
    elif a.mode == "dataloader":
        folder = open_images(a.data)
        classes = len(folder.classes)
        extra["source"] = folder.kind
        loader = torch.utils.data.DataLoader(
            FolderDataset(folder, a.size), batch_size=a.batch, shuffle=True, drop_last=True,
            num_workers=a.workers, pin_memory=dev.type == "cuda", persistent_workers=a.workers > 0,
            prefetch_factor=2 if a.workers > 0 else None,  # torch's default
        )
        batches = LoaderBatches(loader, dev)
        extra["workers"] = a.workers
    else:
        folder = open_images(a.data)
        classes = len(folder.classes)
        extra["source"] = folder.kind
        plan = EpochPlan(len(folder), a.batch, seed=a.seed)
        source = DecodedBatches(folder, plan, dev, prefetch=a.prefetch, read_threads=a.read_threads)
        inproc = InProcess(source, Augment(a.size, dev, seed=a.seed), dev)
        batches, closer = inproc, inproc.close

    step = TrainStep(a.model, classes, dev, ddp=ddp)
    try:
        out = measure(step, batches, steps=a.steps, warmup=a.warmup, batch_size=a.batch,
                      profile=a.profile, profile_path=a.profile_out)
    finally:
        if closer is not None:
            closer()
    leave_group()
    emit({"role": "trainer", "label": a.label or a.mode, "mode": a.mode, "model": a.model,
          "device": str(dev), "rank": a.rank, "world_size": a.world_size, **extra, **out, **environment()},
         a.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
