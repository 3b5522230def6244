#!/usr/bin/env python3
"""The fan-out's baselines: the same models and frames without gpipe.

inproc    One process, no hand-off: the frame is filled in place (as the gpipe source fills
          a slot) and the models run on it. Prints one JSON line per run:
            solo        each model alone (--modes eager,graph);
                        (--barrier: one such process per model, started together, time
                        the same seconds; run_all.py's "together" part)
            sequential  all the models one after the other on each frame (eager: op by op;
                        graph: their graphs replayed one after the other on one stream);
            streams     graph mode only: each model's graph replayed on a stream of its own,
                        with --slots frame buffers (one graph per model and buffer), so the
                        models overlap as separate processes would.
mp-queue  What a PyTorch user writes instead of gpipe: one producer (this process) and one
          torch.multiprocessing (spawn) process per model, a queue of CUDA tensors to each.
          The producer keeps --slots frame tensors and reuses one only after every model
          process acknowledged the frame in it, as torch requires (a received CUDA tensor is
          the sender's memory). It finishes each frame on the device (a stream synchronize)
          before putting it on the queues: once a receiver has the storage cached, torch
          gives it no stream ordering with the sender. A receiver sees each frame as a tensor
          it did not allocate, with no promise about its address, so graph mode copies each
          frame into a static input first. Prints one JSON line.

The timing follows the gpipe fan-out's (see source.py and model.py): --warmup frames, all
finished, then timed frames (--frames, or --duration seconds), at --rate or as fast as
possible; --latency (mp-queue) makes each model wait for its result and record its latency
from the time stamped just before the frame was handed over.

    python3 apps/fanout/baselines.py inproc --models resnet50,vit_b_16,convnext_tiny
    python3 apps/fanout/baselines.py mp-queue --mode graph --rate 150 --latency
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import queue
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from fanout_common import (  # noqa: E402
    add_frame_args,
    EXTRA_MODELS,
    MODELS,
    OutputRing,
    SyntheticFrames,
    Tally,
    build_model,
    capture,
    check_marker,
    dtype_of,
    emit,
    log,
    setup_torch,
    sleep_until,
    sync,
    warm_up,
)
from fanout_records import fanout_record  # noqa: E402


def common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated models (default: the three)"
    )
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument(
        "--slots",
        type=int,
        default=8,
        help="frame buffers (streams) or frame tensors (mp-queue), as gpipe's slots",
    )
    ap.add_argument("--frames", type=int, default=600, help="timed frames per run (default 600)")
    ap.add_argument(
        "--duration",
        type=float,
        default=0.0,
        help="stop a run's timed frames after this many seconds (0: no limit)",
    )
    ap.add_argument("--warmup", type=int, default=24, help="untimed frames first (default 24)")
    add_frame_args(ap)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    ip = sub.add_parser("inproc", help="solo, sequential and streams runs in this process")
    common_args(ip)
    ip.add_argument("--modes", default="eager,graph", help="eager, graph or both (default both)")
    ip.add_argument(
        "--runs", default="solo,sequential,streams", help="which runs (default all three)"
    )
    ip.add_argument(
        "--barrier",
        default="",
        help="a folder: after its warm-up, wait until --barrier-count processes reached it "
        "(several processes, one model each, timing the same seconds)",
    )
    ip.add_argument("--barrier-count", type=int, default=1)
    ip.add_argument("--barrier-timeout", type=float, default=120.0)
    mq = sub.add_parser("mp-queue", help="torch.multiprocessing queues to one process per model")
    common_args(mq)
    mq.add_argument("--mode", choices=("eager", "graph"), default="eager")
    mq.add_argument(
        "--rate", type=float, default=0.0, help="frames per second (0: as fast as possible)"
    )
    mq.add_argument(
        "--latency",
        action="store_true",
        help="each model waits for its result and records its latency",
    )
    mq.add_argument("--check", action="store_true", help="each model checks each frame's marker")
    mq.add_argument("--timeout", type=float, default=120.0, help="seconds any one wait may take")
    a = ap.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    for m in a.models:
        if m not in MODELS + EXTRA_MODELS:
            ap.error(f"unknown model {m!r}")
    return a


def device_of(a: argparse.Namespace) -> torch.device:
    d = torch.device(a.device)
    return torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d


# ---------------------------------------------------------------------------------------
# inproc


def timed_loop(step, finish, a: argparse.Namespace, device: torch.device) -> tuple[int, float]:
    """Runs step(frame_no) for the warm-up frames, waits for them, then for the timed frames
    (--frames or --duration); finish() then waits for everything. Returns (timed, seconds)."""
    for i in range(a.warmup):
        step(i)
    finish()
    if getattr(a, "barrier", None):
        meet(a.barrier, a.barrier_count, a.barrier_timeout)
    t0 = time.monotonic_ns()
    deadline = t0 + int(a.duration * 1e9) if a.duration > 0 else None
    n = 0
    while n < a.frames and (deadline is None or time.monotonic_ns() < deadline):
        step(a.warmup + n)
        n += 1
    finish()
    return n, (time.monotonic_ns() - t0) / 1e9


_MEETINGS = [0]


def meet(folder: str, count: int, timeout: float) -> None:
    """Waits until `count` processes (this one included) reached this point: each leaves a
    file named by its pid in `folder`. So processes started together time the same seconds.
    Each call meets in a subfolder of its own (the processes run the same timed loops)."""
    _MEETINGS[0] += 1
    folder = os.path.join(folder, str(_MEETINGS[0]))
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(folder)) < count:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"baselines: {len(os.listdir(folder))} of {count} processes reached the barrier "
                f"{folder} in {timeout:.0f} s"
            )
        time.sleep(0.001)


def inproc(a: argparse.Namespace) -> int:
    device = device_of(a)
    setup_torch(device, a.threads)
    dtype = dtype_of(a.dtype)
    shape = (3, a.height, a.width)
    modes = [m for m in a.modes.split(",") if m]
    runs = [r for r in a.runs.split(",") if r]
    if "graph" in modes and device.type != "cuda":
        log("inproc: graph mode needs CUDA; running eager only")
        modes = [m for m in modes if m != "graph"]
    frames = SyntheticFrames(shape, dtype, device)
    work = torch.cuda.Stream(device) if device.type == "cuda" else None
    ctx = torch.cuda.stream(work) if work is not None else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        # Models are numbered by their place in --models (a name may come twice).
        models = []
        for name in a.models:
            models.append(build_model(name, device, dtype, a.size))
            warm_up(models[-1], shape, dtype, device)
        real = [k for k, name in enumerate(a.models) if name != "empty"]
        buf = torch.zeros(shape, dtype=dtype, device=device)

        def report(run: str, mode: str, ks: list, rings: dict, n: int, secs: float) -> None:
            emit(
                {
                    "run": run,
                    "mode": mode,
                    "models": [a.models[k] for k in ks],
                    "rate": 0.0,
                    "timed": n,
                    "fps": round(n / secs, 1) if secs > 0 else None,
                    "ok": all(rings[k].count == a.warmup + n for k in ks),
                    "consumers": [{"model": a.models[k], **rings[k].summary()} for k in ks],
                }
            )

        def one_stream(run: str, mode: str, ks: list) -> None:
            """solo (one model) or sequential (several), on one stream and one buffer."""
            rings = {k: OutputRing(device) for k in ks}
            if mode == "graph":
                graphs = {k: capture(models[k], buf) for k in ks}

            def step(i: int) -> None:
                frames.fill(buf, i)
                for k in ks:
                    if mode == "graph":
                        g, out = graphs[k]
                        g.replay()
                    else:
                        out = models[k](buf)
                    rings[k].push(out)

            def finish() -> None:
                for r in rings.values():
                    r.drain()
                sync(device)

            n, secs = timed_loop(step, finish, a, device)
            report(run, mode, ks, rings, n, secs)

        def streams_run(ks: list) -> None:
            """Each model's graphs replayed on a stream of its own, --slots frame buffers."""
            bufs = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(a.slots)]
            graphs = {k: [capture(models[k], b) for b in bufs] for k in ks}
            mstreams = {k: torch.cuda.Stream(device) for k in ks}
            filled = [torch.cuda.Event() for _ in bufs]
            done = {k: [torch.cuda.Event() for _ in bufs] for k in ks}
            # A model may run up to --slots frames ahead of the slowest, as a gpipe consumer.
            rings = {k: OutputRing(device, depth=a.slots) for k in ks}

            def step(i: int) -> None:
                b = i % len(bufs)
                cur = torch.cuda.current_stream()
                for k in ks:  # buffer b is free once every model finished its last frame in it
                    cur.wait_event(done[k][b])
                frames.fill(bufs[b], i)
                filled[b].record(cur)
                for k in ks:
                    with torch.cuda.stream(mstreams[k]):
                        mstreams[k].wait_event(filled[b])
                        g, out = graphs[k][b]
                        g.replay()
                        rings[k].push(out)
                        done[k][b].record(mstreams[k])

            def finish() -> None:
                for r in rings.values():
                    r.drain()
                torch.cuda.synchronize(device)

            n, secs = timed_loop(step, finish, a, device)
            report("streams", "graph", ks, rings, n, secs)

        for mode in modes:
            if "solo" in runs:
                for k in real:
                    one_stream("solo", mode, [k])
            if "sequential" in runs and len(real) > 1:
                one_stream("sequential", mode, real)
            if "streams" in runs and mode == "graph" and real:
                streams_run(real)
    return 0


# ---------------------------------------------------------------------------------------
# mp-queue


def mp_consumer(
    index: int, model_name: str, a: argparse.Namespace, frames_q, acks_q, results_q
) -> None:
    """One model process of the mp-queue baseline (spawned). Gets (frame_no, t_handover,
    warmup, tensor index, tensor) items until None; acknowledges each frame once its work on
    the tensor is finished on the device; puts its result on results_q."""
    tally = None
    try:
        device = device_of(a)
        setup_torch(device, a.threads)
        dtype = dtype_of(a.dtype)
        shape = (3, a.height, a.width)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            model = build_model(model_name, device, dtype, a.size)
            warm_up(model, shape, dtype, device)
            graph = None
            if a.mode == "graph" and model_name != "empty":
                static_in = torch.zeros(shape, dtype=dtype, device=device)
                graph, static_out = capture(model, static_in)
            ring = OutputRing(device)
            tally = Tally(model_name, a.mode, device, ring)
            tally.graphs = 1 if graph is not None else 0
            # Frames whose work may still run on the device: (tensor index, frame_no, event).
            pending: collections.deque = collections.deque()

            def ack_done(keep: int) -> None:
                """Acknowledges finished frames, oldest first, waiting for the oldest while
                more than `keep` are pending."""
                while pending:
                    j, frame_no, ev = pending[0]
                    if ev is not None:
                        if len(pending) <= keep and not ev.query():
                            return
                        ev.synchronize()
                    pending.popleft()
                    acks_q.put((index, j, frame_no))

            results_q.put(("ready", index, None))
            while True:
                if pending:
                    try:
                        item = frames_q.get_nowait()
                    except queue.Empty:
                        ack_done(keep=0)  # about to wait: let the producer reuse them all
                        item = frames_q.get(timeout=a.timeout)
                else:
                    item = frames_q.get(timeout=a.timeout)
                if item is None:
                    break
                frame_no, t_pub, warmup, j, x = item
                del item
                timed = tally.frame(frame_no, warmup)
                if a.check and not check_marker(x, frame_no):
                    tally.check_failures += 1
                if graph is not None:
                    static_in.copy_(x)  # the received tensor's address is not ours to keep
                    graph.replay()
                    out = static_out
                else:
                    out = model(x)
                del x
                if a.latency:
                    if out is None:
                        sync(device)
                        ring.push(None)
                    else:
                        ring.record(int(out))  # waits for the result
                    if timed:
                        tally.latency(t_pub)
                    acks_q.put((index, j, frame_no))
                else:
                    ring.push(out)
                    ev = None
                    if device.type == "cuda":
                        ev = torch.cuda.Event()
                        ev.record()
                    pending.append((j, frame_no, ev))
                    ack_done(keep=2)
                del out
            ack_done(keep=0)
            tally.finish()
        results_q.put(("result", index, tally.result("closed")))
    except BaseException as e:  # report, so the producer does not wait for nothing
        detail = f"{type(e).__name__}: {e}"
        log(f"mp-queue consumer {index} ({model_name}): {detail}\n{traceback.format_exc()}")
        res = (
            tally.result(detail)
            if tally is not None
            else {"role": "consumer", "model": model_name, "end": detail}
        )
        results_q.put(("result", index, res))


def mp_queue(a: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    device = device_of(a)
    setup_torch(device, a.threads)
    dtype = dtype_of(a.dtype)
    shape = (3, a.height, a.width)
    ctx = mp.get_context("spawn")
    n = len(a.models)
    frames_qs = [ctx.Queue() for _ in range(n)]
    acks_q = ctx.Queue()
    results_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=mp_consumer, args=(k, m, a, frames_qs[k], acks_q, results_q), daemon=True
        )
        for k, m in enumerate(a.models)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    rec = None
    try:

        def check_alive() -> None:
            dead = [k for k, p in enumerate(procs) if not p.is_alive()]
            if dead:
                codes = [procs[k].exitcode for k in dead]
                raise RuntimeError(f"model process(es) {dead} ended early (exit codes {codes})")

        ready = 0
        deadline = time.monotonic() + a.timeout
        while ready < n:  # every model built, warmed up and (graph) captured
            try:
                kind, k, res = results_q.get(timeout=0.5)
            except queue.Empty:
                check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the model processes were not ready in {a.timeout:.0f}s"
                    ) from None
                continue
            if kind != "ready":
                raise RuntimeError(f"model process {k} failed while starting: {res.get('end')}")
            ready += 1
        frames = SyntheticFrames(shape, dtype, device)
        pool = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(a.slots)]
        if device.type == "cpu":
            for t in pool:
                t.share_memory_()
        outstanding = [0] * a.slots
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        sctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        period_ns = int(1e9 / a.rate) if a.rate > 0 else 0

        def take_ack() -> None:
            """Takes one acknowledgement, failing early if a model process died or failed."""
            deadline = time.monotonic() + a.timeout
            while True:
                try:
                    _, j, _ = acks_q.get(timeout=0.5)
                    outstanding[j] -= 1
                    return
                except queue.Empty:
                    check_alive()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no acknowledgement in {a.timeout:.0f}s") from None

        def hand_over(frame_no: int) -> int:
            j = frame_no % a.slots
            while outstanding[j]:
                take_ack()
            frames.fill(pool[j], frame_no)
            sync(device)  # finished before handing over: torch gives the receivers no stream order
            t = time.monotonic_ns()
            for q in frames_qs:
                q.put((frame_no, t, a.warmup, j, pool[j]))
            outstanding[j] = n
            return t

        with torch.inference_mode(), sctx:
            for i in range(a.warmup):
                hand_over(i)
            while any(outstanding):
                take_ack()
            t_start = time.monotonic_ns()
            deadline = t_start + int(a.duration * 1e9) if a.duration > 0 else None
            timed = 0
            late = 0
            while timed < a.frames and (deadline is None or time.monotonic_ns() < deadline):
                if period_ns:
                    due = t_start + timed * period_ns
                    sleep_until(due)
                t = hand_over(a.warmup + timed)
                if period_ns and t - due > period_ns:
                    late += 1
                timed += 1
            for q in frames_qs:
                q.put(None)
            while len(results) < n:
                kind, k, res = results_q.get(timeout=a.timeout)
                if kind == "result":
                    results[k] = res
        rec = fanout_record(
            "mp-queue",
            a.mode,
            a.rate,
            t_start,
            timed,
            [results[k] for k in range(n)],
            {"late": late, "device": str(device), "slots": a.slots},
        )
    except Exception as e:
        log(f"mp-queue: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        rec = {
            "run": "mp-queue",
            "mode": a.mode,
            "models": a.models,
            "rate": a.rate,
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "consumers": [results.get(k) for k in range(n)],
        }
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    emit(rec)
    return 0 if rec.get("ok") else 1


def main(argv=None) -> int:
    a = parse_args(argv)
    return inproc(a) if a.cmd == "inproc" else mp_queue(a)


if __name__ == "__main__":
    sys.exit(main())
