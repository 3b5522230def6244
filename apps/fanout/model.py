#!/usr/bin/env python3
"""One model of the fan-out: a gpipe consumer process that runs a model on every frame.

It builds the model (random weights, --dtype, eval mode) and warms it up, then attaches to
the source's ring (retrying until the source is there), so being attached means being
ready. For each frame: the frame tensor over the slot itself (gpipe.torch.as_tensor, which is
torch.from_dlpack without its per-call stream object; no copy, read-only: never written), resized on the device to --size, a batch of 1, the model, the
argmax. At the end (the source closed the ring) it prints one JSON line on stdout: frames
seen, whether they came in order, frames/s, latency, outputs.

--mode eager runs the model op by op. --mode graph captures one CUDA graph per slot, the
first time it sees the slot, and replays it on every later frame in that slot: gpipe's
slots keep their addresses, so the graph's input is the slot itself and nothing is copied.

--latency: after each frame, wait for its result and record now minus the frame's publish
time (run the source at a fixed --rate for this). Without it, nothing synchronises the host
per frame (outputs are read back a few frames later), which is the throughput setting.

--model empty runs nothing on the frame: with --latency, the time from publish to the
frame being ready on this process's stream is what gpipe itself adds. Its graph mode is the
same as eager.

    python3 apps/fanout/model.py --socket /tmp/fan.sock --model resnet50 --mode graph
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpipe  # noqa: E402
import torch  # noqa: E402
from gpipe.torch import as_tensor  # noqa: E402
from fanout_common import (  # noqa: E402
    add_frame_args,
    EXTRA_MODELS,
    FRAME,
    MODELS,
    OutputRing,
    Tally,
    build_model,
    capture,
    check_marker,
    dtype_of,
    emit,
    log,
    setup_torch,
    sync,
    warm_up,
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--socket", required=True, help="the source's ring")
    ap.add_argument("--model", required=True, choices=MODELS + EXTRA_MODELS)
    ap.add_argument("--mode", choices=("eager", "graph"), default="eager")
    add_frame_args(ap)
    ap.add_argument(
        "--device", default="cuda", help="cuda or cpu: where the model runs; must match the ring"
    )
    ap.add_argument(
        "--latency", action="store_true", help="wait for each result and record its latency"
    )
    ap.add_argument(
        "--check", action="store_true", help="check each frame's marker (a host sync per frame)"
    )
    ap.add_argument(
        "--attach-timeout", type=float, default=180.0, help="seconds to keep trying to attach"
    )
    ap.add_argument(
        "--idle-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for one frame before giving up",
    )
    ap.add_argument(
        "--spin",
        type=float,
        default=None,
        help="seconds to busy-wait for a frame before sleeping (gpipe.Consumer(spin=...))",
    )
    ap.add_argument(
        "--delivery",
        choices=("auto", "in-place", "mirror"),
        default="auto",
        help="gpipe.Consumer(delivery=...): on another GPU than the source's, auto mirrors",
    )
    return ap.parse_args(argv)


def attach(
    socket: str, device: torch.device, timeout: float, spin=None, delivery: str = "auto"
) -> gpipe.Consumer:
    """Attaches once the source's socket exists (waiting up to `timeout` seconds for it).
    A refusal for another reason (a backend or device mismatch) is raised after a few tries."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(socket):
        if time.monotonic() > deadline:
            raise gpipe.AttachError(f"no source at {socket} after {timeout:.0f}s")
        time.sleep(0.05)
    for attempt in range(20):
        try:
            return gpipe.Consumer(socket, device=str(device), spin=spin, delivery=delivery)
        except gpipe.AttachError:
            if attempt == 19:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


class GraphPerSlot:
    """One CUDA graph of the model per slot, captured the first time the slot is seen.

    Why one replay is ordered right: as_tensor(batch[...]) made the frame tensor for
    the current stream, so gpipe enqueued on that stream the wait for the batch's `ready`;
    CUDAGraph.replay() launches the graph on the current stream, so it runs after that wait;
    releasing the batch records `finished` after the work enqueued by then on every stream a
    tensor of the batch was made for, here the current stream, so after the replay. The
    capture (first frame of a slot) runs the model once on a side stream that waits for the
    current stream, and the current stream waits for it in turn (see fanout_common.capture).
    """

    def __init__(self, model):
        self.model = model
        self.graphs: dict[int, tuple] = {}

    def __call__(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        entry = self.graphs.get(slot)
        if entry is None:
            graph, out = capture(self.model, x)
            entry = (graph, out, x.data_ptr(), tuple(x.shape), x.dtype)
            self.graphs[slot] = entry
        graph, out, ptr, shape, dtype = entry
        # gpipe's promise: the same declaration in the same slot has the same address.
        if (x.data_ptr(), tuple(x.shape), x.dtype) != (ptr, shape, dtype):
            raise RuntimeError(
                f"slot {slot} moved or changed: {x.data_ptr():#x} {tuple(x.shape)} {x.dtype}, "
                f"captured on {ptr:#x} {shape} {dtype}"
            )
        graph.replay()
        return out


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if a.mode == "graph" and device.type != "cuda":
        log("model: graph mode needs CUDA")
        return 2
    setup_torch(device, a.threads)
    dtype = dtype_of(a.dtype)
    shape = (3, a.height, a.width)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    use_graphs = a.mode == "graph" and a.model != "empty"
    ring = OutputRing(device)
    tally = Tally(a.model, a.mode, device, ring)
    end = "closed"
    with (
        torch.inference_mode(),
        torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
    ):
        model = build_model(a.model, device, dtype, a.size)
        warm_up(model, shape, dtype, device)
        graphs = GraphPerSlot(model) if use_graphs else None
        c = attach(a.socket, device, a.attach_timeout, a.spin, a.delivery)
        if c.device != str(device):
            log(f"model: the ring is on {c.device}, this model on {device}")
            return 2
        log(f"model {a.model} ({a.mode}): attached as consumer {c.index}, ready")
        try:
            while True:
                t_ask = time.monotonic_ns()
                try:
                    batch = c.recv(timeout=a.idle_timeout)
                except gpipe.Closed:
                    break
                t_recv = time.monotonic_ns()
                tally.waited(t_recv - t_ask)
                with batch:
                    frame_no, t_pub, warmup = batch.meta[0], batch.meta[1], batch.meta[2]
                    timed = tally.frame(frame_no, warmup)
                    x = as_tensor(batch[FRAME])
                    t_view = time.monotonic_ns()
                    if a.check and not check_marker(x, frame_no):
                        tally.check_failures += 1
                    out = graphs(batch.slot, x) if graphs is not None else model(x)
                    del x
                # Released: `finished` follows this frame's work on the stream, on the device.
                t_released = time.monotonic_ns()
                if a.latency:
                    if out is None:
                        sync(device)
                        ring.push(None)
                    else:
                        ring.record(int(out))  # waits for the result
                    if timed:
                        marks = {"recv": t_recv, "view": t_view, "model_release": t_released}
                        tally.latency(t_pub, marks)
                else:
                    ring.push(out)
                del out
        except gpipe.Error as e:
            end = f"{type(e).__name__}: {e}"
            log(f"model {a.model}: {end}")
        tally.graphs = len(graphs.graphs) if graphs is not None else 0
        tally.finish()
        c.close()
    emit(tally.result(end))
    return 0 if end == "closed" else 1


if __name__ == "__main__":
    sys.exit(main())
