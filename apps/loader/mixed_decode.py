"""The loader's mixed mode: a few of the loader's workers decode on the trainer's GPU, the
rest on the CPU.

Why: with MPS, ResNet-18 on 4 H100s reached 0.86x its DDP ceiling with every batch decoded on
the GPUs. The trainers did not wait, so what they lost was the decode's own GPU time. Host
decode takes that off the GPU, but a 64-core node decodes at most about 30.7k images/s on
its CPUs, and four ResNet-18 trainers take 47.7k
(docs/experiments/2026-11-28-decode-cost). Here the first ``gpu_workers`` workers to make a
batch decode on the GPU, as ``loader_lib.DecodeAugment`` does; every later one decodes on
the CPU, as ``host_decode.HostDecode`` does. So ``auto``, which starts with one worker and
adds more, adds host workers once the GPU ones are running.

A GPU worker's ring is on the trainer's GPU (the Loader reads where a worker's first batch
was made), and its batches come already augmented: (images, labels). A host worker's batches
are (buffer, table, labels) in a page-locked host ring; the trainer augments them with
``host_decode.Upload``, which passes the GPU batches through as they are.

The two kinds differ about tenfold in speed: on 4 H200s with MPS (ResNet-18, 2026-11-28) one
GPU worker fed its trainer 28 batches/s, and a CPU worker makes about 3 (256 images at 1.3 ms
each, docs/experiments/2026-11-28-decode-cost/bench.py). So the Loader is made with
``in_order=False``: in order, the GPU worker's ring filled and the trainer waited for the CPU
worker's batch, taking 7 batches/s. ``auto`` sizes its steps in workers of the newest kind.

    python3 apps/loader/loader_lib.py --data /tmp/loader-data --mixed 1   # with MPS running
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Optional

import torch


class MixedDecode:
    """decode(samples, device) for a CPU Loader (``device="cpu"``, ``pin_memory=True``): in
    the first `gpu_workers` processes that call it, ``on_gpu(samples, gpu)`` with that
    process's current CUDA device set to `gpu` (a CUDA device, but for tests); in the others,
    ``on_host(samples, cpu)``. A GPU place whose process has ended (a worker the Loader
    retired or killed, say) goes to the next process that asks.
    ``on_host`` must have ``slot_bytes`` and ``batch`` (the Loader's room for its batches, and
    their size), ``on_gpu`` ``batch_bytes(batch)`` (the room one of its batches takes)."""

    def __init__(self, gpu_workers: int, gpu: torch.device, on_gpu: Any, on_host: Any) -> None:
        if not isinstance(gpu_workers, int) or gpu_workers < 0:
            raise ValueError(f"gpu_workers must be an int of 0 or more; got {gpu_workers!r}")
        self.gpu_workers = gpu_workers
        self.gpu, self.on_gpu, self.on_host = gpu, on_gpu, on_host
        # the process holding each GPU place (0: none), handed to the workers with the
        # Loader's arguments when they start (spawn)
        self._places = multiprocessing.get_context("spawn").Array("q", max(1, gpu_workers))
        self.role: Optional[str] = None  # this process's: "gpu" or "host", at its first batch

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["role"] = None
        return state

    @property
    def slot_bytes(self) -> int:
        """The room for a batch of either decoder (the Loader gives every ring the same)."""
        return max(self.on_host.slot_bytes, self.on_gpu.batch_bytes(self.on_host.batch))

    @property
    def gpu_workers_now(self) -> int:
        """How many live processes hold the GPU decoder now."""
        with self._places.get_lock():
            return sum(_alive(pid) for pid in self._places[: self.gpu_workers])

    def __call__(self, samples: list, device: torch.device) -> tuple:
        if self.role is None:
            self.role = "host"
            with self._places.get_lock():
                for i in range(self.gpu_workers):
                    if not _alive(self._places[i]):
                        self._places[i] = os.getpid()
                        self.role = "gpu"
                        break
            if self.role == "gpu" and self.gpu.type == "cuda":
                torch.cuda.set_device(self.gpu)
        if self.role == "gpu":
            return self.on_gpu(samples, self.gpu)
        return self.on_host(samples, torch.device("cpu"))


def _alive(pid: int) -> bool:
    """Whether process `pid` (0: none) is running: not ended, nor a zombie its parent has not
    reaped yet (a worker killed by the Loader is one until it is joined)."""
    if pid == 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
