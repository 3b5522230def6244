#!/usr/bin/env python3
"""How the loader's stages scale with processes on one node: which one stops the node's decode.

Runs P worker processes at once (P from ``--procs``), spread over ``--devices`` in turn, each
doing one stage of the producer's work for ``--seconds``, and reports the images/s of all of
them together:

- ``read``: the files' bytes only, on ``--threads`` threads per process (for a pack, slices of
  the pack in memory, which is what the producer then does);
- ``decode``: nvJPEG's batched decode only, of batches read before the clock starts (no file
  system, no augmentation);
- ``pipeline``: read, decode and augment as the producer does it (DecodedBatches + Augment),
  without publishing.

If one stage's total stays flat as P grows while another's grows, the flat one is what the
processes share. Run it with the folder and with its pack (pack_dataset.py) to tell the file
system's share apart::

    python3 apps/loader/scaling.py /tmp/loader-data /tmp/loader-data.pack --procs 1,2,4 --devices all

Every worker is started first and told to go when all are ready (so their timed windows
overlap), under a hard limit; one JSON line per (source, stage, P) goes to stdout or
``--json-out``, and a table to stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STAGES = ("read", "decode", "pipeline")


def int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, not {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be at least 1")
    return vals


# ---- one worker -------------------------------------------------------------------------------

def worker(a: argparse.Namespace) -> int:
    """Prepares its stage, says 'ready', waits for 'go' on stdin, works for a.seconds, reports."""
    import torch

    from gpu_decode import Augment, DecodedBatches, EpochPlan, decode, open_images

    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    images = open_images(a.data)
    plan = EpochPlan(len(images), a.batch, shard=a.index, shards=a.of, seed=a.seed)
    rows = plan.epoch(0)
    report = {"index": a.index, "device": str(dev), "pid": os.getpid()}

    if a.stage == "read":
        pool = concurrent.futures.ThreadPoolExecutor(a.threads)
        pool.submit(images.read, 0).result()

        def one(i: int) -> int:
            row = rows[i % rows.shape[0]].tolist()
            return sum(t.numel() for t in pool.map(images.read, row))
    elif a.stage == "decode":
        held = [[images.read(i) for i in rows[k].tolist()] for k in range(min(a.held, rows.shape[0]))]
        decode(held[0], dev)  # nvJPEG's state and the hardware decoder's first use
        sync()

        def one(i: int) -> int:
            batch = held[i % len(held)]
            decode(batch, dev)
            return sum(t.numel() for t in batch)
    else:
        aug = Augment(a.size, dev, seed=a.seed + a.index)
        src = DecodedBatches(images, plan, dev, prefetch=a.prefetch, read_threads=a.threads)
        aug(next(src).images)
        sync()
        # Where a pipeline worker's time goes, per batch: waiting for a decoded batch, the
        # augment call (host side), and, in the decode thread, waiting for the files and the
        # decode call itself.
        spent = {"wait_s": 0.0, "augment_s": 0.0, "read_s": 0.0, "decode_s": 0.0}

        def one(i: int) -> int:
            t0 = time.perf_counter()
            item = next(src)
            t1 = time.perf_counter()
            aug(item.images)
            spent["wait_s"] += t1 - t0
            spent["augment_s"] += time.perf_counter() - t1
            spent["read_s"] += item.read_s
            spent["decode_s"] += item.decode_s
            return 0

    # The pipeline's augmentation on a stream of its own (--side-stream) instead of the
    # device's default stream, which synchronises with every blocking stream of the process.
    side = torch.cuda.Stream(dev) if cuda and a.side_stream else None
    profiling = bool(a.profile) and a.index == 0
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    with contextlib.ExitStack() as scope:
        if side is not None:
            scope.enter_context(torch.cuda.stream(side))
        prof = None
        if profiling:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            prof = scope.enter_context(profile(activities=acts))
        t0 = time.perf_counter()
        deadline = t0 + a.seconds
        batches = nbytes = 0
        while time.perf_counter() < deadline:
            nbytes += one(batches)
            batches += 1
        sync()
        wall = time.perf_counter() - t0
    if prof is not None:
        # CPU-side time per operator and CUDA API call (cudaStreamSynchronize, cudaHostAlloc,
        # ...): which call grows when more processes run is what they share.
        path = os.path.join(a.profile, f"profile-{a.stage}-{a.of}procs-{os.path.basename(a.data)}.txt")
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        report["profile"] = path
    if a.stage == "pipeline":
        src.close()
        report.update({f"{k[:-2]}_ms_per_batch": round(v / max(batches, 1) * 1e3, 2) for k, v in spent.items()})
    report.update({"batches": batches, "images": batches * a.batch, "seconds": round(wall, 3),
                   "images_per_s": round(batches * a.batch / wall, 1)})
    if nbytes:
        report["mb_per_s"] = round(nbytes / wall / 1e6, 1)
    print(json.dumps(report), flush=True)
    return 0


# ---- the parent -------------------------------------------------------------------------------

def devices_for(spec: str, cpu: bool) -> list[str]:
    if cpu:
        return ["cpu"]
    if spec == "all":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise SystemExit("scaling: no CUDA device (use --cpu to run on the CPU)")
        return [f"cuda:{i}" for i in range(n)]
    return [f"cuda:{int(d)}" for d in spec.split(",")]


def run_point(a: argparse.Namespace, data: str, stage: str, procs: int, devices: list[str]) -> dict:
    """P workers of one stage on one data source; their reports and the total."""
    kids = []
    base = [sys.executable, os.path.abspath(__file__), "--worker", data, "--stage", stage,
            *(["--side-stream"] if a.side_stream else []), *(["--profile", a.profile] if a.profile else []),
            *(["--torch-threads", str(a.torch_threads)] if a.torch_threads else []),
            "--seconds", str(a.seconds), "--threads", str(a.threads), "--batch", str(a.batch),
            "--size", str(a.size), "--held", str(a.held), "--prefetch", str(a.prefetch),
            "--seed", str(a.seed), "--of", str(procs)]
    limit = a.seconds + a.setup_timeout + 30
    point = {"what": "scaling", "source": "pack" if os.path.isfile(data) else "folder", "data": data,
             "stage": stage, "procs": procs, "threads": a.threads, "batch": a.batch,
             "side_stream": a.side_stream, "profiled": bool(a.profile), "torch_threads": a.torch_threads,
             "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
             "devices": [devices[k % len(devices)] for k in range(procs)]}
    try:
        for k in range(procs):
            cmd = base + ["--index", str(k), "--device", devices[k % len(devices)]]
            kids.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         start_new_session=True))
        watchdog = threading.Timer(limit, lambda: [_kill(p) for p in kids])
        watchdog.daemon = True
        watchdog.start()
        t0 = time.monotonic()
        for p in kids:  # every worker ready before any starts
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"worker {p.pid} did not get ready (said {line!r}, "
                                   f"exit {p.poll()}); its stderr is above")
        point["setup_s"] = round(time.monotonic() - t0, 1)
        for p in kids:
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in kids:
            out = p.stdout.read()
            rc = p.wait()
            lines = [x for x in out.splitlines() if x.startswith("{")]
            if rc != 0 or not lines:
                raise RuntimeError(f"worker {p.pid} failed (exit {rc})")
            reports.append(json.loads(lines[-1]))
        watchdog.cancel()
        point["per_process"] = reports
        point["images_per_s"] = round(sum(r["images_per_s"] for r in reports), 1)
        if all("mb_per_s" in r for r in reports):
            point["mb_per_s"] = round(sum(r["mb_per_s"] for r in reports), 1)
    except (RuntimeError, OSError) as e:
        point["error"] = str(e)
    finally:
        for p in kids:
            if p.poll() is None:
                _kill(p)
                p.wait()
    return point


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="*", help="data sets: folders (make_dataset.py) and/or packs (pack_dataset.py)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"stages to run (default {','.join(STAGES)})")
    ap.add_argument("--procs", type=int_list, default=[1, 2, 4], help="process counts (default 1,2,4)")
    ap.add_argument("--devices", default="all", help="GPUs the processes go to in turn (default all)")
    ap.add_argument("--cpu", action="store_true", help="run every stage on the CPU (tests)")
    ap.add_argument("--seconds", type=float, default=6.0, help="timed seconds per point (default 6)")
    ap.add_argument("--threads", type=int, default=8, help="file-reading threads per process (default 8)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--held", type=int, default=4, help="batches each decode worker holds in memory")
    ap.add_argument("--prefetch", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setup-timeout", type=float, default=90.0, help="seconds a worker may take to get ready")
    ap.add_argument("--json-out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--torch-threads", type=int, default=None, metavar="N",
                    help="torch's CPU threads per worker (default: torch's own, one per core; the "
                         "producer uses 1)")
    ap.add_argument("--side-stream", action="store_true",
                    help="run each worker's work on a stream of its own, not the default stream")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="profile worker 0 of every point (torch.profiler) into DIR/profile-*.txt")
    # The worker's own arguments.
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        if len(a.data) != 1:
            ap.error("a worker takes one data set")
        a.data = a.data[0]
        return worker(a)
    if not a.data:
        ap.error("name at least one data set")
    stages = [s for s in a.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stage(s) {', '.join(bad)} (expected {', '.join(STAGES)})")
    devices = devices_for(a.devices, a.cpu)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    facts = {"what": "scaling-host", "kernel": platform.release(), "cpus": os.cpu_count(),
             "devices": devices, "python": platform.python_version()}
    lines = [facts]
    print(json.dumps(facts), flush=True)
    print(f"{'source':>7} {'stage':>9} {'procs':>5} {'images/s':>10} {'per process':>30}", file=sys.stderr, flush=True)
    failed = 0
    for data in a.data:
        for stage in stages:
            for procs in a.procs:
                point = run_point(a, data, stage, procs, devices)
                lines.append(point)
                print(json.dumps(point), flush=True)
                if "error" in point:
                    failed += 1
                    row = f"{'failed':>10}  {point['error']}"
                else:
                    each = " ".join(f"{r['images_per_s']:.0f}" for r in point["per_process"])
                    row = f"{point['images_per_s']:>10.0f} {each:>30}"
                print(f"{point['source']:>7} {stage:>9} {procs:>5} {row}", file=sys.stderr, flush=True)
    if a.json_out:
        with open(a.json_out, "a") as f:
            for x in lines:
                f.write(json.dumps(x) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
