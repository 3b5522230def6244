#!/usr/bin/env python3
"""The fan-out's source: one gpipe producer publishing frames in broadcast mode.

Every consumer attached gets every frame. Each frame is one tensor named "frame" (3×H×W,
fp16 by default), written in place in the slot on the device from a pool of random frames,
with its number in pixel (c, 0, 0). Its header (meta) is

    [frame number, publish time (CLOCK_MONOTONIC, ns), number of warm-up frames]

The run: wait for --consumers consumers; publish --warmup frames as fast as possible (the
consumers capture their CUDA graphs on these) and wait until every consumer has released
them all (flush); then the timed frames: --frames of them, or as many as fit in --duration
seconds, at --rate frames/s (0: as fast as the consumers take them; the ring's back-pressure
paces the source). Then the ring is closed, the consumers finish what was published, and
the source prints one JSON line on stdout.

The publish time: at a fixed rate the source waits for its frame to be written on the
device (a stream synchronize) and stamps the time just before publishing, as a camera
would deliver a finished frame; a consumer's latency (its result time minus this stamp) is
then gpipe's hand-off plus the model, not the source's own fill. At the maximum rate there
is no synchronize: the fill, the hand-off and the models all overlap on the device.

    python3 apps/fanout/source.py --socket /tmp/fan.sock --consumers 3 --rate 150
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
from fanout_common import (
    add_frame_args,
    FRAME,
    SyntheticFrames,
    dtype_of,
    emit,
    log,
    setup_torch,
    sleep_until,
    sync,
)  # noqa: E402
from fanout_records import latency_summary  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--socket", required=True, help="the ring's Unix socket path")
    ap.add_argument(
        "--backend",
        choices=("cuda", "host"),
        default="cuda",
        help="slots in GPU or host memory (default cuda)",
    )
    ap.add_argument(
        "--consumers",
        type=int,
        default=3,
        help="consumers to wait for before publishing (default 3)",
    )
    ap.add_argument("--slots", type=int, default=8, help="slots in the ring (default 8)")
    add_frame_args(ap, size=False)
    ap.add_argument("--frames", type=int, default=600, help="timed frames to publish (default 600)")
    ap.add_argument(
        "--duration",
        type=float,
        default=0.0,
        help="stop the timed frames after this many seconds (0: no limit)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=24,
        help="untimed frames first (default 24; at least --slots, so every slot is seen)",
    )
    ap.add_argument(
        "--rate", type=float, default=0.0, help="frames per second (0: as fast as possible)"
    )
    ap.add_argument(
        "--wait-timeout",
        type=float,
        default=180.0,
        help="seconds to wait for the consumers to attach",
    )
    ap.add_argument(
        "--timeout", type=float, default=60.0, help="seconds any one acquire or flush may wait"
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    dtype = dtype_of(a.dtype)
    shape = (3, a.height, a.width)
    nbytes = torch.empty((), dtype=dtype).element_size() * shape[0] * shape[1] * shape[2]
    p = gpipe.Producer(
        a.socket,
        backend=a.backend,
        mode="broadcast",
        slots=a.slots,
        batch_bytes=nbytes,
        drain_timeout=a.timeout,
    )
    device = torch.device(p.device)
    setup_torch(device, a.threads)
    frames = SyntheticFrames(shape, dtype, device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    log(f"source: {p!r} memory={p.memory} waiting for {a.consumers} consumers")
    p.wait_for_consumers(a.consumers, timeout=a.wait_timeout)

    late = 0
    publish_ns: list[int] = []  # how long each timed publish call took
    period_ns = int(1e9 / a.rate) if a.rate > 0 else 0

    def publish(frame_no: int) -> int:
        with p.acquire(timeout=a.timeout) as slot:
            f = as_tensor(slot.tensor(FRAME, dtype, shape))
            frames.fill(f, frame_no)
            del f
            if period_ns and frame_no >= a.warmup:
                sync(device)  # the frame is complete on the device before it is stamped
            t = time.monotonic_ns()
            # ready is recorded after the fill on this (the current) stream
            slot.publish(meta=[frame_no, t, a.warmup])
            if frame_no >= a.warmup:
                publish_ns.append(time.monotonic_ns() - t)
            return t

    with (
        torch.inference_mode(),
        torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
    ):
        for i in range(a.warmup):
            publish(i)
        if a.warmup:
            # Every consumer has processed every warm-up frame, graph captures included:
            # nothing but the steady state is timed.
            p.flush(timeout=a.timeout)
        t_start = time.monotonic_ns()
        deadline = t_start + int(a.duration * 1e9) if a.duration > 0 else None
        timed = 0
        t_last = t_start
        while timed < a.frames:
            now = time.monotonic_ns()
            if deadline is not None and now >= deadline:
                break
            if period_ns:
                due = t_start + timed * period_ns
                sleep_until(due)
            t_last = publish(a.warmup + timed)
            if period_ns and t_last - due > period_ns:
                late += 1
            timed += 1
    counters = p.close()
    span = (t_last - t_start) / 1e9
    emit(
        {
            "role": "source",
            "backend": p.backend,
            "memory": p.memory,
            "device": str(device),
            "slots": a.slots,
            "warmup": a.warmup,
            "timed": timed,
            "rate": a.rate,
            "late": late,
            "t_start_ns": t_start,
            "t_last_publish_ns": t_last,
            "publish_fps": round(timed / span, 1) if span > 0 and timed > 1 else None,
            "counters": counters,
            "publish_call": latency_summary(publish_ns),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
