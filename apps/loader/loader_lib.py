#!/usr/bin/env python3
"""A trainer fed by ``gpipe.torch.Loader``: the loader as a library feature, in one process.

The trainer makes the loader with the data set (a folder or a pack, read by index) and a
decode function (nvJPEG decode, random-resized crop, flip and normalise: gpu_decode.py's, on
the trainer's GPU); the loader starts decode worker processes, each publishing into a gpipe
ring of its own, and the trainer reads the batches in place. ``--workers auto`` (the
default) lets the loader add workers while the trainer waits for data. DDP: ``--world-size W
--rank R`` joins a process group first; the loader then takes rank R's part of each epoch.

Prints one JSON line with the same figures as train.py and baselines.py, and the loader's
workers and why.

    python3 apps/loader/loader_lib.py --data /tmp/loader-data --model resnet50 --steps 60

``--host-decode``: the workers decode on the CPU into host rings and this process augments
on its GPU (host_decode.py), for a GPU without MPS, where decode processes on it would take
turns with the trainer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Iterator, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpipe.torch  # noqa: E402
from gpu_decode import Augment, decode, open_images  # noqa: E402
from step import MODELS, TrainStep, emit, environment, leave_group, measure, setup_rank  # noqa: E402


class EncodedImages:
    """The data set by index: (the image's JPEG bytes, its label). Pickled by its path: each
    worker opens the folder or pack itself."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._images: Any = open_images(path)
        self.classes = len(self._images.classes)
        self.kind = self._images.kind

    def __getstate__(self) -> dict:
        return {"path": self.path, "classes": self.classes, "kind": self.kind, "_images": None}

    def __len__(self) -> int:
        return len(self.images)

    @property
    def images(self) -> Any:
        if self._images is None:
            self._images = open_images(self.path)
        return self._images

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images.read(i), int(self.images.labels[i])


class DecodeAugment:
    """decode(samples, device) for the loader: one batch of JPEGs decoded on the device
    (nvJPEG; the CPU on the host), augmented into float16 channels_last images, with labels."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.augment: Optional[Augment] = None

    def __getstate__(self) -> dict:
        return {"size": self.size, "seed": self.seed, "augment": None}

    def batch_bytes(self, batch: int) -> int:
        """The room a batch of `batch` takes in a Loader's slot: float16 images, int64 labels."""
        from host_decode import room

        return room(batch * 3 * self.size * self.size * 2, batch * 8)

    def __call__(self, samples: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.augment is None:  # per worker: its own random stream
            self.augment = Augment(self.size, device, seed=self.seed * 1000 + os.getpid())
        images = self.augment(decode([s[0] for s in samples], device))
        labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
        return images, labels.to(device, non_blocking=True)


def epochs(loader: gpipe.torch.Loader) -> Iterator[tuple]:
    """Batches for measure(), epoch after epoch: what decode returned, then {"epoch": N}."""
    epoch = 0
    while True:
        for batch in loader:
            assert isinstance(batch, tuple), "this app's decode functions return tuples"
            yield (*batch, {"epoch": epoch})
            del batch
        epoch += 1


def settle(loader: gpipe.torch.Loader, step: TrainStep, batches: Iterator, ddp: bool, most: int) -> int:
    """Trains until the loader's ``auto`` has its workers (``loader.settled``), at most `most`
    steps; under DDP until every rank's has (the ranks agree every 8 steps, so they all run
    the same number of steps). Returns the steps run."""
    import torch.distributed as dist

    done, why, t0 = 0, None, time.monotonic()
    while done < most:
        images, labels, _ = next(batches)
        step(images, labels)
        del images, labels
        done += 1
        if loader.why != why or done % 64 == 0:  # progress on stderr: a killed run still tells
            news = f": {loader.why}" if loader.why != why else ""
            why = loader.why
            print(f"settle: step {done} at {time.monotonic() - t0:.1f} s, {loader.workers} "
                  f"worker(s), settled {loader.settled}{news}", file=sys.stderr, flush=True)
        if done % 8 == 0:
            flag = torch.tensor([1 if loader.settled else 0], device=step.device)
            if ddp:
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item():
                break
    return done


def cpu_list(spec: str) -> list[int]:
    """CPU numbers from a list as taskset writes them: "0-3,8" is [0, 1, 2, 3, 8]."""
    cpus: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def env_setting(text: str) -> tuple[str, str]:
    """NAME=VALUE, as --worker-env takes it."""
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE")
    return name, value


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="data set folder or pack")
    ap.add_argument("--model", choices=MODELS, default="resnet50")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=60, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="steps before timing starts")
    ap.add_argument("--workers", default="auto", help="decode worker processes: a number or auto")
    ap.add_argument("--max-workers", type=int, default=None, help="auto's limit (default: the loader's)")
    ap.add_argument("--settle", type=int, default=600,
                    help="most steps to let workers=auto find its workers before warm-up and timing")
    ap.add_argument("--slots", type=int, default=4, help="batches in each worker's ring")
    ap.add_argument("--worker-cpus", type=cpu_list, default=None,
                    help="the CPUs the decode workers run on, as taskset writes them, e.g. 4-63 "
                    "(default: any; the others stay free for the trainers)")
    ap.add_argument("--worker-nice", type=int, default=None,
                    help="how much nicer the workers run than the trainer (default: the loader's)")
    ap.add_argument("--stream-priority", type=int, default=None,
                    help="train on a CUDA stream of this priority (lower is higher; -1 is the highest "
                    "torch gives): with MPS, the GPU then runs the trainer's kernels before the decode "
                    "workers' (default: torch's current stream, the default priority)")
    ap.add_argument("--nccl-high-priority", action="store_true",
                    help="DDP: NCCL's collectives on high-priority streams too")
    ap.add_argument("--worker-env", action="append", default=[], type=env_setting, metavar="NAME=VALUE",
                    help="set in the decode workers' environment only (this process has made its CUDA "
                    "context before), e.g. CUDA_MPS_CLIENT_PRIORITY=1 or "
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 with MPS; may repeat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1, help="DDP ranks (1: no process group)")
    ap.add_argument("--rank", type=int, default=0, help="this rank; with --device cuda it runs on cuda:RANK")
    ap.add_argument("--dist-url", default="env://", help="process-group rendezvous, e.g. file:///tmp/pg")
    ap.add_argument("--profile", type=int, default=0, help="steps under torch.profiler after the timed ones")
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--label", default="loader")
    ap.add_argument("--mixed", type=int, default=0, metavar="N",
                    help="with MPS: the first N workers decode on the GPU, the rest on the CPU, "
                         "their batches augmented in this process (mixed_decode.py)")
    ap.add_argument("--host-decode", action="store_true",
                    help="decode on the CPU in the workers (host rings), augment on the GPU in this "
                         "process (host_decode.py): no other process touches the GPU")
    a = ap.parse_args(argv)
    workers: Any = a.workers if a.workers == "auto" else int(a.workers)

    ddp = a.world_size > 1
    dev = setup_rank(a.device, a.world_size, a.rank, a.dist_url, nccl_high_priority=a.nccl_high_priority)
    torch.manual_seed(a.seed)
    data = EncodedImages(a.data)
    if a.worker_env:
        # CUDA reads such settings when a process makes its CUDA context: this process makes
        # its own first, so only the workers, started later with this environment, get them
        if dev.type == "cuda":
            torch.zeros(1, device=dev)
        os.environ.update(dict(a.worker_env))
    upload = None
    on_host = a.host_decode or a.mixed > 0  # workers that decode on the CPU: Upload augments
    if a.stream_priority is not None and dev.type != "cuda":
        raise SystemExit("--stream-priority sets a CUDA stream's priority: it needs --device cuda")
    if a.mixed > 0 and dev.type != "cuda":
        raise SystemExit("--mixed puts some decode workers on the trainer's GPU: it needs --device cuda")
    if on_host:
        from host_decode import HostDecode, Upload, largest_image

        decode_fn: Any = HostDecode(a.batch, largest_image(a.data))
        if a.mixed > 0:
            from mixed_decode import MixedDecode

            decode_fn = MixedDecode(a.mixed, dev, DecodeAugment(a.size, a.seed), decode_fn)
        ring_device = torch.device("cpu")
    else:
        decode_fn = DecodeAugment(a.size, a.seed)
        ring_device = dev
    with gpipe.torch.Loader(data, decode_fn, batch_size=a.batch, device=ring_device,
                            workers=workers, max_workers=a.max_workers, slots=a.slots,
                            slot_bytes=decode_fn.slot_bytes if on_host else None,
                            **({} if a.worker_nice is None else {"worker_nice": a.worker_nice}),
                            worker_cpus=a.worker_cpus,
                            seed=a.seed, pin_memory=on_host and dev.type == "cuda",
                            # a GPU decoder and CPU ones: in order, the fast one's ring fills
                            # and waits for a CPU one's batch
                            in_order=a.mixed == 0) as loader:
        if a.stream_priority is not None:
            # from here on the trainer's work, and its waits for the loader's batches, go to this stream
            stream = torch.cuda.Stream(dev, priority=a.stream_priority)
            stream.wait_stream(torch.cuda.current_stream(dev))
            torch.cuda.set_stream(stream)
        step = TrainStep(a.model, data.classes, dev, ddp=ddp)
        batches: Iterator = epochs(loader)
        if on_host:
            batches = upload = Upload(batches, dev, a.size, seed=a.seed * 1000 + a.rank)
        try:
            settled = settle(loader, step, batches, ddp, a.settle)
            was_settled = loader.settled  # False: timed at the cap, auto still at work
            print(f"settle: {settled} steps, {loader.workers} worker(s); now {a.warmup} warm-up "
                  f"and {a.steps} timed steps", file=sys.stderr, flush=True)
            out = measure(step, batches, steps=a.steps, warmup=a.warmup, batch_size=a.batch,
                          profile=a.profile, profile_path=a.profile_out)
        finally:
            if upload is not None:
                upload.close()
        figures = {"workers": loader.workers, "workers_why": loader.why, "settle_steps": settled,
                   "settled": was_settled,
                   "batches_per_epoch": len(loader), "host_decode": a.host_decode,
                   "stream_priority": torch.cuda.current_stream(dev).priority if dev.type == "cuda" else None,
                   "worker_env": dict(a.worker_env), "nccl_high_priority": a.nccl_high_priority,
                   "mixed_gpu_workers": decode_fn.gpu_workers_now if a.mixed > 0 else 0}
        if upload is not None:
            figures["slots_pinned_in_place"] = upload.pinned
            figures["upload_s"] = {k: round(v, 3) for k, v in upload.seconds.items()}
            figures["batches_uploaded"] = upload.batches_uploaded
            figures["batches_pinned"] = upload.batches_pinned
    leave_group()
    emit({"role": "trainer", "label": a.label, "mode": "loader", "model": a.model, "device": str(dev),
          "rank": a.rank, "world_size": a.world_size, "source": data.kind, **figures, **out,
          **environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
