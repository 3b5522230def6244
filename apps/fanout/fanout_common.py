"""Pieces shared by the inference fan-out programs (source, model, baselines, run_all).

- `build_model`: the models (torchvision's ResNet-50, ViT-B/16 and ConvNeXt-T with random
  weights, a `tiny` conv net for CPU tests, and `empty`), each wrapped as one function from
  a frame (3×H×W) to a class index: resize on the device to size×size, batch of 1, forward,
  argmax. Everything it does is on the device, so it can be captured as a CUDA graph.
- `SyntheticFrames`: the frames the source publishes, copied from a small pool of random
  frames, with the frame number written in pixel (c, 0, 0) so a consumer can check it got
  the frame it was told it got.
- `capture`: one CUDA graph of a model on one fixed input tensor.
- `OutputRing`: reads each frame's class index back to the host without a host
  synchronisation per frame.
- `Tally`: what a consumer counts (order, timing, latency, outputs) and reports as JSON.

Nothing here downloads anything: every model is built with `weights=None`.
"""

from __future__ import annotations

import collections
import gc
import json
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from fanout_records import EXTRA_MODELS, MODELS, latency_summary

# Frame numbers are written into the frame modulo this: every integer up to 2048 is exact in
# fp16, so the marker survives any of the dtypes used here.
MARKER_PERIOD = 1024
# The tensor's name in every gpipe batch.
FRAME = "frame"

Model = Callable[[torch.Tensor], Optional[torch.Tensor]]


def log(*parts: Any) -> None:
    """One line on stderr (stdout is kept for the JSON result)."""
    print(*parts, file=sys.stderr, flush=True)


def emit(record: dict) -> None:
    """One JSON line on stdout: a program's result."""
    print(json.dumps(record), flush=True)


def add_frame_args(ap: Any, *, size: bool = True) -> None:
    """The frame and torch options every fan-out program takes: element type, frame height
    and width, the model's input size (`size`), and torch's CPU threads."""
    ap.add_argument("--dtype", default="float16", help="frame element type (default float16)")
    if size:
        ap.add_argument("--size", type=int, default=224, help="the model's input size (default 224)")
    ap.add_argument("--height", type=int, default=720, help="frame height (default 720)")
    ap.add_argument("--width", type=int, default=1280, help="frame width (default 1280)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads of this process (default 1; 0 keeps torch's default)",
    )


def dtype_of(name: str) -> torch.dtype:
    """torch dtype from its name ("float16", "float32", "bfloat16")."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def setup_torch(device: torch.device, threads: int) -> None:
    """Few torch CPU threads (`threads`; 0 keeps torch's default of one per core): several
    processes share the machine's cores, on CI and on the GPU host alike, where the models'
    work is on the GPU and each process's own thread launches it."""
    del device  # the same rule on the CPU and on the GPU
    if threads > 0:
        torch.set_num_threads(threads)


def sync(device: torch.device) -> None:
    """Waits for the work enqueued on the current stream (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _tiny_net() -> torch.nn.Module:
    """A small conv net that runs in milliseconds on a CPU: for tests."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def _torchvision_net(name: str, size: int) -> torch.nn.Module:
    import torchvision.models as tvm

    if name == "vit_b_16":
        # ViT's position embeddings are sized for its input; without weights any size
        # divisible by the patch size (16) can be built.
        return tvm.vit_b_16(weights=None, image_size=size)
    return getattr(tvm, name)(weights=None)


def build_model(
    name: str, device: torch.device, dtype: torch.dtype, size: int, seed: int = 0
) -> Model:
    """The model `name` as one function frame -> class index (a 0-d int64 tensor on the
    device), or None for `empty`.

    The frame (3×H×W, any dtype) is resized to size×size (bilinear, on the device), made a
    batch of 1 and run through the network in `dtype`, in eval mode. Weights are random but
    seeded, so every process building the same model gets the same one. Call it under
    torch.inference_mode(). `empty` does nothing: it is the model of the latency that gpipe
    (or a baseline) itself adds.
    """
    if name == "empty":
        return lambda frame: None
    torch.manual_seed(seed)
    if name == "tiny":
        net = _tiny_net()
    elif name in MODELS:
        net = _torchvision_net(name, size)
    else:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS + EXTRA_MODELS)}")
    net = net.to(device=device, dtype=dtype).eval()

    def run(frame: torch.Tensor) -> torch.Tensor:
        x = frame.unsqueeze(0)
        if x.dtype != dtype:
            x = x.to(dtype)
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        return net(x).argmax()

    return run


def warm_up(
    model: Model, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, n: int = 3
) -> None:
    """Runs the model a few times on a zero frame, so that library initialisation (cuBLAS,
    cuDNN, the caching allocator) is done before anything is timed or captured. Then moves
    every object alive so far (the model, torch's modules) out of the garbage collector's
    view: a full collection would otherwise walk them all, a pause of milliseconds at a time
    no frame can predict."""
    frame = torch.zeros(shape, dtype=dtype, device=device)
    for _ in range(n):
        model(frame)
    sync(device)
    gc.collect()
    gc.freeze()


class SyntheticFrames:
    """Frames for the source: a pool of `count` random frames on the device (the same in
    every process, from a seeded generator), copied into the destination, with the frame
    number modulo MARKER_PERIOD written into pixel (c, 0, 0) of every channel. Two small
    device operations per frame."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        count: int = 8,
        seed: int = 0,
    ):
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.rand((count, *shape), generator=g).to(device=device, dtype=dtype)

    def fill(self, dst: torch.Tensor, frame_no: int) -> None:
        """Writes frame `frame_no` into `dst` (enqueued on the current stream)."""
        dst.copy_(self.pool[frame_no % len(self.pool)])
        dst[:, 0, 0] = float(marker(frame_no))


def marker(frame_no: int) -> int:
    """The value SyntheticFrames writes into pixel (c, 0, 0) of frame `frame_no`."""
    return frame_no % MARKER_PERIOD


def check_marker(frame: torch.Tensor, frame_no: int) -> bool:
    """True if `frame` carries frame_no's marker. Reads the device (a host synchronisation):
    for tests and --check runs only."""
    return int(frame[0, 0, 0].item()) == marker(frame_no)


def capture(model: Model, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Captures model(x) as a CUDA graph; returns the graph and its static output.

    The graph reads x's address: replaying it later computes the model on whatever that
    memory then holds. x must be usable on the current stream when this is called (for a
    gpipe batch: made with gpipe.torch.as_tensor or torch.from_dlpack on it, which enqueued the
    wait for `ready`).

    As torch asks, the model runs once on a side stream first (outside the capture), and
    the current stream waits for that run, so that a gpipe release afterwards orders
    `finished` after it too. The capture itself runs nothing. capture_error_mode is
    "thread_local": a gpipe consumer has a watch thread of its own, and in "global" mode a
    potentially unsafe CUDA call (one that synchronises, for example) made by any other
    thread of the process during the capture makes the capture fail.
    """
    work = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(work)
    with torch.cuda.stream(side):
        model(x)
    work.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = model(x)
    if out is None:
        raise ValueError("a model that returns nothing (empty) has no graph to capture")
    return graph, out


class OutputRing:
    """Collects each frame's class index without a host synchronisation per frame.

    On CUDA, push() copies the index into a pinned host ring of `depth` entries on the
    current stream and records an event; the value is read `depth` frames later, after
    waiting for that event (which is long done by then, unless the host runs ahead of the
    device by more than `depth` frames: then it waits, which also bounds how far it runs
    ahead). On the CPU the value is read at once. `record()` stores a value read otherwise.
    Keeps the first `keep` outputs in frame order, and a histogram of all of them.
    """

    def __init__(self, device: torch.device, depth: int = 4, keep: int = 32):
        self.cuda = device.type == "cuda"
        self.depth = depth
        self.keep = keep
        self.head: list[int] = []
        self.hist: collections.Counter = collections.Counter()
        self.count = 0
        self.pending: collections.deque = collections.deque()
        self.next = 0
        if self.cuda:
            self.host = torch.zeros(depth, dtype=torch.int64, pin_memory=True)
            self.events = [torch.cuda.Event() for _ in range(depth)]

    def push(self, out: Optional[torch.Tensor]) -> None:
        """Records `out` (a 0-d index tensor, or None for the empty model)."""
        if out is None:
            self.count += 1
            return
        if not self.cuda:
            self.record(int(out))
            return
        if len(self.pending) == self.depth:
            self._pop()
        j = self.next
        self.next = (j + 1) % self.depth
        self.host[j].copy_(out, non_blocking=True)
        self.events[j].record()
        self.pending.append(j)

    def record(self, value: int) -> None:
        """Stores one frame's output value (frames must come in order)."""
        self.count += 1
        self.hist[value] += 1
        if len(self.head) < self.keep:
            self.head.append(value)

    def _pop(self) -> None:
        j = self.pending.popleft()
        self.events[j].synchronize()
        self.record(int(self.host[j]))

    def drain(self) -> None:
        """Reads every value still in flight."""
        while self.pending:
            self._pop()

    def summary(self) -> dict:
        return {
            "outputs_head": self.head,
            "classes": self.hist.most_common(5),
        }


class Tally:
    """What a consumer (a gpipe model process or a torch.multiprocessing one) counts.

    frame() is called for every frame received, in order of arrival, with its number and the
    number of warm-up frames (frames numbered below it are not timed). Frames are expected
    to come in order 0, 1, 2, ... from the first one seen.
    """

    def __init__(self, model: str, mode: str, device: torch.device, ring: OutputRing):
        self.model, self.mode, self.device, self.ring = model, mode, device, ring
        self.frames = 0
        self.timed = 0
        self.first: Optional[int] = None
        self.last: Optional[int] = None
        self.out_of_order = 0
        self.check_failures = 0
        self.t_first_timed_ns: Optional[int] = None
        self.t_end_ns: Optional[int] = None
        self.latencies: list[int] = []
        # Where a latency went, per timed frame: publish -> recv returned -> the frame's
        # tensor made (the stream waits for `ready`) -> the model enqueued and the batch
        # released -> the result on the host.
        self.steps: dict[str, list[int]] = {}
        self.graphs = 0
        # Host time spent waiting for timed frames (in recv): a consumer that waits little
        # is bound by its own work; one that waits much, by what feeds it.
        self.wait_ns = 0

    def frame(self, frame_no: int, warmup: int) -> bool:
        """Counts one frame; True if it is a timed one."""
        if self.last is not None and frame_no != self.last + 1:
            self.out_of_order += 1
        if self.first is None:
            self.first = frame_no
        self.last = frame_no
        self.frames += 1
        if frame_no < warmup:
            return False
        if self.t_first_timed_ns is None:
            self.t_first_timed_ns = time.monotonic_ns()
        self.timed += 1
        return True

    def waited(self, ns: int) -> None:
        """Host time spent in recv for the frame about to be counted (timed frames only
        count once the first timed frame arrived)."""
        if self.t_first_timed_ns is not None:
            self.wait_ns += ns

    def latency(self, t_publish_ns: int, marks: Optional[dict[str, int]] = None) -> None:
        """One timed frame's latency: now minus its publish time (CLOCK_MONOTONIC is the same
        clock in every process of the host). `marks`, in order, are the times the frame
        reached each named step; each step's share is its time minus the one before."""
        now = time.monotonic_ns()
        self.latencies.append(now - t_publish_ns)
        if marks:
            prev = t_publish_ns
            for name, t in list(marks.items()) + [("result", now)]:
                self.steps.setdefault(name, []).append(t - prev)
                prev = t

    def finish(self) -> None:
        """Waits for everything in flight and stamps the end."""
        self.ring.drain()
        sync(self.device)
        self.t_end_ns = time.monotonic_ns()

    def result(self, end: str) -> dict:
        fps = None
        if self.timed and self.t_first_timed_ns is not None and self.t_end_ns is not None:
            # From the arrival of the first timed frame to the end of the last one: the
            # first frame's processing is inside the span, so (timed) frames over it.
            span = (self.t_end_ns - self.t_first_timed_ns) / 1e9
            fps = round(self.timed / span, 1) if span > 0 else None
            wait_share = round(self.wait_ns / 1e9 / span, 3) if span > 0 else None
        else:
            wait_share = None
        return {
            "role": "consumer",
            "model": self.model,
            "mode": self.mode,
            "device": str(self.device),
            "frames": self.frames,
            "timed": self.timed,
            "first_frame": self.first,
            "last_frame": self.last,
            "out_of_order": self.out_of_order,
            "check_failures": self.check_failures,
            "graphs": self.graphs,
            "fps": fps,
            "wait_share": wait_share,
            "t_first_timed_ns": self.t_first_timed_ns,
            "t_end_ns": self.t_end_ns,
            "latency": latency_summary(self.latencies),
            "latency_steps": {k: latency_summary(v) for k, v in self.steps.items()} or None,
            "end": end,
            **self.ring.summary(),
        }


def sleep_until(t_ns: int) -> None:
    """Sleeps until CLOCK_MONOTONIC reaches t_ns: time.sleep for most of it, then a short
    spin for the last 200 µs (sleep overshoots by tens of microseconds)."""
    while True:
        left = t_ns - time.monotonic_ns()
        if left <= 0:
            return
        if left > 400_000:
            time.sleep((left - 200_000) / 1e9)
