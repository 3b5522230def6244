"""The training step and its measurement, shared by train.py (gpipe-fed) and baselines.py.

Every configuration runs :func:`measure` over an iterator of batches, so they differ only in
where the batches come from:

- :class:`TrainStep`: torchvision ResNet-50 or ResNet-18 (weights=None), channels_last, SGD
  (lr 0.1, momentum 0.9, weight decay 1e-4), cross-entropy; bf16 autocast on CUDA, float32 on
  the CPU; optionally wrapped in DistributedDataParallel. ``model="none"`` does no work: it
  measures how fast batches arrive (the producer's own rate).
- :func:`measure`: ``warmup`` steps, then ``steps`` timed steps. On CUDA, three events per
  step split the stream's time into *wait* (from the end of the previous step until the batch
  is usable on the stream: the host blocked in the loader, or the stream waiting for the
  producer's ready signal or a copy) and *step*. Nothing synchronises inside the timed window;
  the events are read at the end. GPU utilisation is sampled through NVML on a thread.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch

MODELS = ("resnet50", "resnet18", "none")


class TrainStep:
    """One SGD step of a torchvision classifier on (images, labels)."""

    def __init__(self, model: str, num_classes: int, device: torch.device, *, ddp: bool = False, lr: float = 0.1):
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        self.name, self.device = model, device
        self.cuda = device.type == "cuda"
        self.model: Optional[torch.nn.Module] = None
        if model == "none":
            return
        import torchvision.models

        net = getattr(torchvision.models, model)(weights=None, num_classes=num_classes)
        net = net.to(device=device, memory_format=torch.channels_last)
        if ddp:
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(net, device_ids=[device.index] if self.cuda else None)
        self.model = net
        self.opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
        # Stepped once per epoch from the batches' epoch marks.
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=30, gamma=0.1)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> Optional[torch.Tensor]:
        """Enqueues one step on the current stream; returns the loss tensor (not synchronised)."""
        if self.model is None:
            return None
        if not self.cuda and images.dtype != torch.float32:
            images = images.float()  # the CPU step runs in float32 (CI)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.loss_fn(self.model(images), labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def new_epoch(self) -> None:
        if self.model is not None:
            self.scheduler.step()


class UtilSampler:
    """Samples the GPU's utilisation (NVML: percent of time a kernel ran) every `period` s.
    `mean()` is None where NVML (nvidia-ml-py) is not available, or on the CPU."""

    def __init__(self, device: torch.device, period: float = 0.1):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if device.type != "cuda":
            return
        try:
            torch.cuda.utilization(device)
        except Exception:  # no pynvml, or NVML refused
            return
        self._thread = threading.Thread(target=self._run, args=(device, period), daemon=True)

    def _run(self, device: torch.device, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.samples.append(float(torch.cuda.utilization(device)))
            except Exception:
                return

    def start(self) -> "UtilSampler":
        if self._thread is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()

    def mean(self) -> Optional[float]:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


Batch = tuple[torch.Tensor, torch.Tensor, dict]


def measure(
    step: TrainStep,
    batches: Iterator[Batch],
    *,
    steps: int,
    warmup: int,
    batch_size: int,
    profile: int = 0,
    profile_path: Optional[str] = None,
    on_batch: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Runs warmup + steps training steps over `batches`; returns the figures.

    `batches` yields (images, labels, info); info may hold "epoch" (a change steps the LR
    scheduler). The iterator is advanced inside the timed window, so its own time (waiting for
    data) counts. `steps <= 0` runs until the iterator ends (all batches are timed after
    warm-up). `profile` > 0 runs that many more steps after the timed ones under
    torch.profiler (so it does not slow the timed window) and appends the summary table to
    `profile_path`.
    """
    dev = step.device
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    events: list[tuple[Any, Any, Any]] = []
    host_wait: list[float] = []
    host_step: list[float] = []
    epochs: dict[int, int] = {}
    last_epoch: Optional[int] = None
    util = UtilSampler(dev)
    prof = None
    done = 0
    t_start = time.perf_counter()
    t0 = t1 = t_start
    window_end = warmup + steps if steps > 0 else None
    total = window_end + max(0, profile) if window_end is not None else None
    loss = None
    closed = False  # the timed window is over
    while total is None or done < total:
        if done == warmup:
            sync()
            t0 = time.perf_counter()
            util.start()
        if window_end is not None and done == window_end:
            sync()
            t1 = time.perf_counter()
            util.stop()
            closed = True
            prof = _start_profiler(cuda)
        timed = done >= warmup and (window_end is None or done < window_end)
        e_start = e_ready = None
        if cuda and timed:
            e_start = torch.cuda.Event(enable_timing=True)
            e_start.record()
        h0 = time.perf_counter()
        try:
            images, labels, info = next(batches)
        except StopIteration:
            break
        h1 = time.perf_counter()
        if cuda and timed:
            e_ready = torch.cuda.Event(enable_timing=True)
            e_ready.record()
        epoch = info.get("epoch")
        if epoch is not None:
            epochs[epoch] = epochs.get(epoch, 0) + 1
            if last_epoch is not None and epoch != last_epoch:
                step.new_epoch()
            last_epoch = epoch
        if on_batch is not None:
            on_batch(info)
        loss = step(images, labels)
        del images, labels  # hands a gpipe slot back before the next batch is asked for
        h2 = time.perf_counter()
        if timed:
            host_wait.append(h1 - h0)
            host_step.append(h2 - h1)
            if cuda:
                e_end = torch.cuda.Event(enable_timing=True)
                e_end.record()
                events.append((e_start, e_ready, e_end))
        done += 1
    sync()
    if not closed:  # the window ran to its end or to the end of the data
        t1 = time.perf_counter()
        util.stop()
    if prof is not None:
        _write_profile(prof, profile_path)
    timed_steps = len(host_wait)
    wall = t1 - t0 if timed_steps else 0.0
    out: dict[str, Any] = {
        "steps": timed_steps,
        "warmup": min(done, warmup),
        "batch": batch_size,
        "seconds": round(wall, 4),
        "images_per_s": round(timed_steps * batch_size / wall, 1) if wall > 0 else None,
        "startup_s": round(t0 - t_start, 2),
        "host_wait_fraction": round(sum(host_wait) / wall, 4) if wall > 0 else None,
        "gpu_util": util.mean(),
        "epochs": {str(k): v for k, v in sorted(epochs.items())},
        "loss": round(float(loss), 4) if loss is not None else None,
    }
    if cuda and events:
        wait_ms = [a.elapsed_time(b) for a, b, _ in events]
        step_ms = [b.elapsed_time(c) for _, b, c in events]
        busy = sum(wait_ms) + sum(step_ms)
        out["wait_fraction"] = round(sum(wait_ms) / busy, 4) if busy > 0 else None
        out["timeline"] = {"wait_ms": [round(v, 2) for v in wait_ms], "step_ms": [round(v, 2) for v in step_ms]}
    else:
        # CPU work is synchronous: host times are the timeline.
        busy = sum(host_wait) + sum(host_step)
        out["wait_fraction"] = round(sum(host_wait) / busy, 4) if busy > 0 else None
        out["timeline"] = {
            "wait_ms": [round(v * 1e3, 2) for v in host_wait],
            "step_ms": [round(v * 1e3, 2) for v in host_step],
        }
    return out


def _start_profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts)
    prof.__enter__()
    return prof


def _write_profile(prof, path: Optional[str]) -> None:
    prof.__exit__(None, None, None)
    table = None
    keys = ("self_device_time_total", "self_cuda_time_total") if torch.cuda.is_available() else ()
    for key in (*keys, "self_cpu_time_total"):
        try:
            table = prof.key_averages().table(sort_by=key, row_limit=25)
            break
        except Exception:
            continue
    if table is None:
        return
    if path:
        with open(path, "a") as f:
            f.write(table + "\n")
    else:
        print(table, file=sys.stderr)


def setup_device(device: str) -> torch.device:
    """torch.device for "cpu", "cuda", "cuda:N" or "N"; on CUDA also makes it current and
    turns on cuDNN's autotuner (the same in every configuration)."""
    dev = torch.device(f"cuda:{device}" if device.isdigit() else device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        torch.backends.cudnn.benchmark = True
    return dev


def setup_rank(device: str, world_size: int, rank: int, dist_url: str, *,
               nccl_high_priority: bool = False) -> torch.device:
    """The device of this rank (`setup_device`; with DDP on CUDA, cuda:RANK) and, with
    `world_size` > 1, the process group joined (NCCL on CUDA, gloo on the CPU; NCCL on
    high-priority streams if `nccl_high_priority`)."""
    ddp = world_size > 1
    dev = setup_device(f"cuda:{rank}" if ddp and device == "cuda" else device)
    if ddp:
        import torch.distributed as dist

        opts = None
        if nccl_high_priority and dev.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=dist_url,
                                rank=rank, world_size=world_size, pg_options=opts)
    return dev


def leave_group() -> None:
    """Waits for every rank, then leaves the process group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def emit(record: dict, path: Optional[str] = None) -> None:
    """Prints one JSON line (and appends it to `path` if given)."""
    line = json.dumps(record)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def environment() -> dict:
    """What the run ran on, for the record."""
    env = {"torch": torch.__version__, "pid": os.getpid(), "kernel": platform.release(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    env["mps"] = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) and os.path.exists(
        os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""), "control")
    )
    return env
