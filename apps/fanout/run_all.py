#!/usr/bin/env python3
"""Runs the whole inference fan-out comparison (issue #19) and reports it.

In order, each run in processes of its own, under a time limit:

1. inproc baselines (baselines.py inproc): each model alone, eager and graph; the models one
   after the other in one process, eager and graph; graph replays on three streams.
2. Throughput, the source as fast as possible: gpipe fan-out (source.py + one model.py
   process per model), eager and graph; the torch.multiprocessing baseline (baselines.py
   mp-queue), eager and graph. With --only together (not run by default), before them: each
   model alone in a process of its own (on its --model-devices GPU), all at once, no
   transport: what the machine gives the models at a time, to read the fan-out against.
3. Latency at a fixed rate (--rate, or 0.8× the lowest eager throughput measured above: the
   slowest model alone, the gpipe and the mp-queue fan-outs), every model waiting for each
   result: gpipe and mp-queue, eager and graph; then the same with the empty model in every
   process, which is the latency the hand-off itself adds.

Every run appends one JSON line to OUT/fanout.jsonl (OUT: --out, else $OUT, else
/tmp/gpipe-fanout), tagged with --mps; each process's stderr goes to OUT/logs/. At the end a
table on stdout, and the issue's targets: eager fan-out ≥ 0.9× the slowest model alone;
graph fan-out ≥ 0.9× the three-stream replay; added p99 latency ≤ 100 µs.

MPS is not started here: apps/fanout/gpu.sh runs this once without and once with
the MPS daemon. --backend host runs everything on CPU tensors (tests; use tiny models).

    python3 apps/fanout/run_all.py --mps off
    python3 apps/fanout/run_all.py --quick                      # a few frames per run
    python3 apps/fanout/run_all.py --backend host --models tiny,empty --modes eager --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fanout_records import MODELS, fanout_record  # noqa: E402

TARGET_EAGER = 0.9
TARGET_GRAPH = 0.9
TARGET_ADDED_P99_US = 100.0


@dataclasses.dataclass
class Config:
    """What every run shares."""

    backend: str = "cuda"  # "cuda" or "host"
    dtype: str = "float16"
    height: int = 720
    width: int = 1280
    size: int = 224
    slots: int = 8
    warmup: int = 24
    threads: int = 1
    python: str = sys.executable
    logdir: str = "/tmp/gpipe-fanout/logs"
    run_timeout: float = 120.0
    check: bool = False
    spin: float = 0.0
    # The GPU of each model's process in the gpipe runs (None: the source's, GPU 0).
    model_devices: Optional[list[int]] = None
    # gpipe.Consumer(delivery=...) of the models' processes.
    delivery: str = "auto"
    # Each process of a gpipe run on two CPUs of its own (the source on the first two of this
    # process's CPUs, model k on the next two after it), not wherever the scheduler puts it.
    pin_cpus: bool = False

    def cpus_of(self, k: int) -> Optional[set[int]]:
        """The CPUs of a gpipe run's process k (0: the source, k: model k - 1) with
        --pin-cpus; None without it, or where this machine has too few."""
        if not self.pin_cpus:
            return None
        mine = sorted(os.sched_getaffinity(0))
        return set(mine[2 * k:2 * k + 2]) if 2 * k + 2 <= len(mine) else None

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "cuda" else "cpu"

    def model_device(self, k: int) -> str:
        """Where model k's process runs: its --model-devices GPU, else the source's device."""
        if self.model_devices and self.backend == "cuda":
            return f"cuda:{self.model_devices[k]}"  # reads GPU 0's ring from its own GPU
        return self.device

    def shape_args(self) -> list[str]:
        return ["--dtype", self.dtype, "--height", str(self.height), "--width", str(self.width)]


class Proc:
    """A child process in its own process group, stdout to a file, stderr to a log."""

    def __init__(self, label: str, argv: list[str], cfg: Config, cpus: Optional[set[int]] = None):
        os.makedirs(cfg.logdir, exist_ok=True)
        self.label = label
        self.err_path = os.path.join(cfg.logdir, f"{label}.err")
        self.out = tempfile.TemporaryFile("w+")
        # on `cpus` from its first instruction: every thread it starts inherits them
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        with open(self.err_path, "w") as err:
            self.p = subprocess.Popen(
                argv, stdout=self.out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=pin,
            )

    def wait(self, deadline: float) -> Optional[int]:
        """The exit status, or None if it ran past the deadline (then it is killed)."""
        try:
            return self.p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait(timeout=10)

    def json_lines(self) -> list[dict]:
        self.out.seek(0)
        recs = []
        for line in self.out.read().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return recs

    def err_tail(self, n: int = 600) -> str:
        try:
            with open(self.err_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""


def _label(*parts) -> str:
    return (
        "-".join(str(p) for p in parts if p not in (None, "")).replace(",", "+").replace("/", "_")
    )


def run_gpipe(
    cfg: Config,
    mode: str,
    models: list[str],
    *,
    rate: float = 0.0,
    frames: int = 600,
    duration: float = 0.0,
    latency: bool = False,
    tag: str = "",
) -> dict:
    """One gpipe fan-out: a source and one consumer process per model; returns its record."""
    label = _label("gpipe", mode, "lat" if latency else "max", tag)
    sock_dir = tempfile.mkdtemp(prefix="fan-", dir="/tmp")
    sock = os.path.join(sock_dir, f"{uuid.uuid4().hex[:8]}.sock")
    py = [cfg.python]
    src = Proc(
        f"{label}-source",
        py
        + [os.path.join(HERE, "source.py"), "--socket", sock, "--backend", cfg.backend]
        + ["--consumers", str(len(models)), "--slots", str(cfg.slots), "--warmup", str(cfg.warmup)]
        + ["--frames", str(frames), "--duration", str(duration), "--rate", str(rate)]
        + ["--threads", str(cfg.threads), "--wait-timeout", str(cfg.run_timeout)]
        + cfg.shape_args(),
        cfg,
        cfg.cpus_of(0),
    )
    cons = []
    for k, m in enumerate(models):
        argv = py + [os.path.join(HERE, "model.py"), "--socket", sock, "--model", m, "--mode", mode]
        argv += ["--device", cfg.model_device(k), "--size", str(cfg.size)]
        argv += ["--threads", str(cfg.threads)]
        argv += ["--attach-timeout", str(cfg.run_timeout), "--idle-timeout", str(cfg.run_timeout)]
        argv += cfg.shape_args()
        if latency:
            argv.append("--latency")
        if cfg.check:
            argv.append("--check")
        if cfg.spin > 0:
            argv += ["--spin", str(cfg.spin)]
        if cfg.delivery != "auto":
            argv += ["--delivery", cfg.delivery]
        cons.append(Proc(f"{label}-{k}-{m}", argv, cfg, cfg.cpus_of(k + 1)))
    deadline = time.monotonic() + cfg.run_timeout
    t0 = time.monotonic()
    codes = [src.wait(deadline)] + [c.wait(deadline) for c in cons]
    for pr in [src] + cons:
        pr.kill()
    try:
        os.unlink(sock)
    except OSError:
        pass
    try:
        os.rmdir(sock_dir)
    except OSError:
        pass
    source = (src.json_lines() or [None])[-1]
    consumers = [(c.json_lines() or [None])[-1] for c in cons]
    errors = []
    for pr, code in zip([src] + cons, codes):
        if code != 0:
            why = "timed out" if code is None else f"exit {code}"
            errors.append(f"{pr.label}: {why}: {pr.err_tail(300)}")
    if source is None or any(c is None for c in consumers):
        rec = {"run": "gpipe", "mode": mode, "models": models, "rate": rate, "ok": False}
    else:
        rec = fanout_record(
            "gpipe",
            mode,
            rate,
            source["t_start_ns"],
            source["timed"],
            consumers,
            {
                "memory": source.get("memory"),
                "late": source.get("late"),
                "device": source.get("device"),
                "slots": cfg.slots,
                "publish_call": source.get("publish_call"),
            },
        )
    if errors:
        rec["ok"] = False
        rec["error"] = " | ".join(errors)
    rec["latency_run"] = latency
    if cfg.model_devices:
        rec["model_devices"] = cfg.model_devices
    if cfg.pin_cpus:
        rec["pinned_cpus"] = [sorted(c) if c else None for c in map(cfg.cpus_of, range(len(models) + 1))]
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    return rec


def baseline_argv(cfg: Config, args: list[str], device: str) -> list[str]:
    """The command line of baselines.py with `args` (a subcommand first) on `device`."""
    argv = [cfg.python, os.path.join(HERE, "baselines.py")] + args
    argv += ["--device", device, "--size", str(cfg.size), "--slots", str(cfg.slots)]
    return argv + ["--warmup", str(cfg.warmup), "--threads", str(cfg.threads)] + cfg.shape_args()


def run_baseline(
    cfg: Config, args: list[str], tag: str, timeout: Optional[float] = None
) -> list[dict]:
    """baselines.py with `args` (a subcommand first); returns its JSON lines."""
    argv = baseline_argv(cfg, args, cfg.device)
    t0 = time.monotonic()
    pr = Proc(_label("base", tag), argv, cfg)
    code = pr.wait(time.monotonic() + (timeout or cfg.run_timeout))
    recs = pr.json_lines()
    wall = round(time.monotonic() - t0, 1)
    for r in recs:
        r["wall_s"] = wall
    if code != 0:
        why = "timed out" if code is None else f"exit {code}"
        err = f"{pr.label}: {why}: {pr.err_tail(300)}"
        if not recs:
            recs = [{"run": args[0], "ok": False}]
        for r in recs:
            r.setdefault("error", err)
            if code is None:
                r["ok"] = False
    return recs


def run_together(cfg: Config, mode: str, models: list[str], frames: int, duration: float) -> dict:
    """Each model alone in a process of its own (on its --model-devices GPU), all at once,
    timing the same seconds (`duration`; `frames` only where no duration is given), no
    transport: what the machine gives the models at a time, against which a fan-out's
    consumers can be read. The record's frames/s is the slowest's."""
    devices = [cfg.model_device(k) for k in range(len(models))]
    # the empty model has no solo run: it is left out
    devices = [d for d, m in zip(devices, models) if m != "empty"]
    models = [m for m in models if m != "empty"]
    rec: dict = {"run": "together", "mode": mode, "models": models, "rate": 0.0, "fps": None}
    if not models:
        rec.update(ok=False, error="together: no model but empty to run")
        return rec
    folder = tempfile.mkdtemp(prefix="fan-barrier-", dir="/tmp")
    procs: list[Proc] = []
    t0 = time.monotonic()
    deadline = t0 + cfg.run_timeout
    codes: list[Optional[int]] = []
    try:
        for k, (m, device) in enumerate(zip(models, devices)):
            # all stop after the same seconds: a frame count that does not end it first
            args = ["inproc", "--models", m, "--modes", mode, "--runs", "solo"]
            args += ["--frames", str(10**9 if duration > 0 else frames), "--duration", str(duration)]
            args += ["--barrier", folder, "--barrier-count", str(len(models))]
            args += ["--barrier-timeout", str(max(1.0, 0.8 * cfg.run_timeout))]
            argv = baseline_argv(cfg, args, device)
            procs.append(Proc(f"together-{mode}-{k}-{m}", argv, cfg))
        # one failing process would leave the others at the barrier: end them all at once
        while time.monotonic() < deadline:
            codes = [pr.p.poll() for pr in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
        codes = [pr.p.poll() for pr in procs]
    finally:
        for pr in procs:
            pr.kill()
        shutil.rmtree(folder, ignore_errors=True)
    each = [(pr.json_lines() or [None])[-1] for pr in procs]
    fps = [r.get("fps") for r in each if r]
    rec.update(
        fps=min(fps) if len(fps) == len(models) and all(fps) else None,
        ok=all(c == 0 for c in codes) and all(r and r.get("ok") for r in each),
        consumers=[
            {"model": m, "fps": (r or {}).get("fps"), "device": d}
            for m, r, d in zip(models, each, devices)
        ],
        wall_s=round(time.monotonic() - t0, 1),
    )
    errors = [
        f"{pr.label}: {'timed out' if c is None else f'exit {c}'}: {pr.err_tail(300)}"
        for pr, c in zip(procs, codes)
        if c != 0
    ]
    if errors:
        rec["error"] = " | ".join(errors)
    if cfg.model_devices:
        rec["model_devices"] = cfg.model_devices
    return rec


# ---------------------------------------------------------------------------------------
# the report


def _fps(
    recs: list[dict], run: str, mode: str, models: Optional[list] = None, latency_run: bool = False
) -> Optional[float]:
    """The median frames/s of the matching runs (one per --repeat repetition)."""
    got = [
        r["fps"]
        for r in recs
        if r.get("run") == run
        and r.get("mode") == mode
        and bool(r.get("latency_run")) == latency_run
        and (models is None or r.get("models") == models)
        and r.get("fps")
    ]
    return statistics.median(got) if got else None


def _lat(c: Optional[dict]) -> str:
    lat = (c or {}).get("latency")
    return f"{lat['p50_us']:.0f}/{lat['p99_us']:.0f}" if lat else "-"


def summary(recs: list[dict], models: list[str], mps: str) -> list[str]:
    """The table and the targets, as lines."""
    out = [
        f"== inference fan-out, MPS {mps}",
        f"{'run':<11} {'mode':<6} {'frames/s':>9} {'ok':<3} models",
    ]
    for r in recs:
        if r.get("latency_run"):
            continue
        fps = r.get("fps")
        per = ""
        if r.get("run") in ("gpipe", "mp-queue", "together"):
            per = ", ".join(
                f"{c.get('model')} {c.get('fps')}" for c in r.get("consumers") or [] if c
            )
        else:
            per = ",".join(r.get("models") or [])
        rep = f" (repetition {r['repetition'] + 1})" if r.get("repetition") else ""
        out.append(
            f"{r.get('run', '?'):<11} {r.get('mode', '?'):<6} {fps if fps is not None else '-':>9} "
            f"{'ok' if r.get('ok') else 'NO':<3} {per}{rep}"
        )
    lat_recs = [r for r in recs if r.get("latency_run")]
    if lat_recs:
        rate = lat_recs[0].get("rate")
        out.append(f"latency p50/p99 µs from publish to each model's result, at {rate} frames/s:")
        for r in lat_recs:
            per = ", ".join(f"{c.get('model')} {_lat(c)}" for c in r.get("consumers") or [] if c)
            late = f" (source late {r['late']}x)" if r.get("late") else ""
            ok = "ok" if r.get("ok") else "NO"
            out.append(f"  {r.get('run', '?'):<9} {r.get('mode', '?'):<6} {ok:<3} {per}{late}")
            for c in r.get("consumers") or []:
                steps = (c or {}).get("latency_steps")
                if steps:
                    parts = ", ".join(f"{k} {_lat({'latency': v})}" for k, v in steps.items())
                    out.append(f"    {c.get('model')}: where it went, p50/p99 µs: {parts}")
            pub = r.get("publish_call")
            if pub:
                out.append(f"    the source's publish call: {_lat({'latency': pub})} µs")
    out.append("targets:")
    solo = [_fps(recs, "solo", "eager", [m]) for m in models if m != "empty"]
    solo = [s for s in solo if s]
    g_eager = _fps(recs, "gpipe", "eager")
    reps = 1 + max((r.get("repetition") or 0 for r in recs), default=0)
    med = f" (medians of {reps} repetitions)" if reps > 1 else ""
    if solo and g_eager:
        ratio = g_eager / min(solo)
        out.append(
            f"  eager: gpipe fan-out {g_eager} / slowest model alone {min(solo)} = {ratio:.2f}{med} "
            f"(target >= {TARGET_EAGER}) {'PASS' if ratio >= TARGET_EAGER else 'MISS'}"
        )
    together = _fps(recs, "together", "eager")
    if together and g_eager:
        # not a target: how much of a gap to the model alone is the machine's, running the
        # models at once without gpipe
        out.append(
            f"  eager: gpipe fan-out {g_eager} / the models alone at once, no transport "
            f"{together} = {g_eager / together:.2f}{med}"
        )
    g_graph = _fps(recs, "gpipe", "graph")
    streams = _fps(recs, "streams", "graph")
    if g_graph and streams:
        ratio = g_graph / streams
        out.append(
            f"  graph: gpipe fan-out {g_graph} / three-stream replay {streams} = {ratio:.2f}{med} "
            f"(target >= {TARGET_GRAPH}) {'PASS' if ratio >= TARGET_GRAPH else 'MISS'}"
        )
    for r in lat_recs:
        if r.get("models") and all(m == "empty" for m in r["models"]):
            p99s = [
                c["latency"]["p99_us"] for c in r.get("consumers") or [] if c and c.get("latency")
            ]
            if p99s:
                worst = max(p99s)
                verdict = (
                    ("PASS" if worst <= TARGET_ADDED_P99_US else "MISS")
                    if r["run"] == "gpipe"
                    else "(baseline)"
                )
                out.append(
                    f"  added latency, {r['run']} ({len(p99s)} empty models): p99 worst {worst} µs "
                    f"(target <= {TARGET_ADDED_P99_US:.0f}) {verdict}"
                )
    return out


# ---------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", default=os.environ.get("OUT") or "/tmp/gpipe-fanout", help="output folder"
    )
    ap.add_argument(
        "--mps", default="off", help="label of the MPS setting (this script does not start MPS)"
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: a few frames per run")
    ap.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated models (default the three)"
    )
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument(
        "--only",
        default="inproc,gpipe,mp-queue,latency,empty",
        help="which parts to run (default all but together: the models alone in processes of "
        "their own, all at once, no transport)",
    )
    ap.add_argument(
        "--frames", type=int, default=600, help="timed frames of a throughput run (default 600)"
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the throughput part this many times, interleaved; the targets use the "
        "median of each run's frames/s (default 1)",
    )
    ap.add_argument(
        "--duration",
        type=float,
        default=3.0,
        help="seconds cap of a throughput run's timed frames (default 3)",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="latency runs' frames/s (default 0.8x the lowest eager throughput)",
    )
    ap.add_argument(
        "--latency-seconds", type=float, default=3.0, help="length of a latency run (default 3 s)"
    )
    ap.add_argument("--warmup", type=int, default=0, help="warm-up frames (default 2x slots + 8)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads per process (default 1; 0 keeps torch's default)",
    )
    ap.add_argument(
        "--run-timeout", type=float, default=120.0, help="seconds one run may take in all"
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="start no run after this many seconds (0: no limit)",
    )
    ap.add_argument("--check", action="store_true", help="consumers check every frame's marker")
    ap.add_argument(
        "--model-devices",
        default="",
        help="the GPU of each model's process in the gpipe runs, e.g. 1,2,3: one source on GPU 0 "
        "feeding models on other GPUs (default: every model on GPU 0); the baselines stay on GPU 0",
    )
    ap.add_argument(
        "--spin",
        type=float,
        default=0.0,
        help="gpipe consumers busy-wait this many seconds for a frame before sleeping "
        "(gpipe.Consumer(spin=...); 0: the package's default, 100 µs)",
    )
    ap.add_argument(
        "--delivery",
        choices=("auto", "in-place", "mirror"),
        default="auto",
        help="the gpipe consumers' delivery (default auto: in place on GPU 0, mirrored on "
        "another GPU)",
    )
    ap.add_argument(
        "--pin-cpus",
        action="store_true",
        help="run each process of a gpipe run on two CPUs of its own (the source on the first "
        "two of this process's CPUs, model k on the next two after it; the record's 'pinned_cpus')",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    modes = [m for m in a.modes.split(",") if m]
    only = set(a.only.split(","))
    if a.backend == "host" and "graph" in modes:
        print("-- graph mode needs CUDA: the host backend runs eager only", flush=True)
        modes = [m for m in modes if m != "graph"]
    if a.quick:
        a.frames, a.duration, a.latency_seconds = (
            min(a.frames, 12),
            min(a.duration, 1.0),
            min(a.latency_seconds, 0.5),
        )
    warmup = a.warmup or 2 * a.slots + 8
    cfg = Config(
        backend=a.backend,
        dtype=a.dtype,
        height=a.height,
        width=a.width,
        size=a.size,
        slots=a.slots,
        warmup=warmup,
        threads=a.threads,
        logdir=os.path.join(a.out, "logs", f"mps-{a.mps}"),
        run_timeout=a.run_timeout,
        check=a.check,
        spin=a.spin,
        delivery=a.delivery,
        model_devices=[int(d) for d in a.model_devices.split(",")] if a.model_devices else None,
        pin_cpus=a.pin_cpus,
    )
    if cfg.model_devices is not None and len(cfg.model_devices) != len(models):
        raise SystemExit(
            f"--model-devices names {len(cfg.model_devices)} GPUs for {len(models)} models "
            f"({','.join(models)}): give one GPU per model"
        )
    os.makedirs(a.out, exist_ok=True)
    jsonl = os.path.join(a.out, "fanout.jsonl")
    t_begin = time.monotonic()
    recs: list[dict] = []

    def over_budget() -> bool:
        return a.budget > 0 and time.monotonic() - t_begin > a.budget

    def keep(rec: dict, rep: Optional[int] = None) -> None:
        if rep is not None:
            rec["repetition"] = rep
        rec["mps"] = a.mps
        rec["backend"] = a.backend
        rec["quick"] = a.quick
        rec["spin"] = a.spin
        rec["delivery"] = a.delivery
        rec["torch_threads"] = a.threads
        rec["cpus"] = os.cpu_count()
        recs.append(rec)
        with open(jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
        status = "ok" if rec.get("ok") else f"NOT OK {rec.get('error', '')[:300]}"
        print(
            f"-- {rec.get('run')} {rec.get('mode')} {','.join(map(str, rec.get('models') or []))} "
            f"rate={rec.get('rate')} fps={rec.get('fps')} ({rec.get('wall_s')}s) {status}",
            flush=True,
        )

    tput = dict(frames=a.frames, duration=a.duration)
    for rep in range(max(1, a.repeat)):
        if "inproc" in only and not over_budget():
            timeout = cfg.run_timeout * 3  # several runs in one process
            for rec in run_baseline(
                cfg,
                [
                    "inproc",
                    "--models",
                    ",".join(models),
                    "--modes",
                    ",".join(modes),
                    "--frames",
                    str(a.frames),
                    "--duration",
                    str(a.duration),
                ],
                "inproc",
                timeout,
            ):
                keep(rec, rep)
        for mode in modes:
            if "together" in only and not over_budget():
                keep(run_together(cfg, mode, models, a.frames, a.duration), rep)
            if "gpipe" in only and not over_budget():
                keep(run_gpipe(cfg, mode, models, **tput), rep)
            if "mp-queue" in only and not over_budget():
                for rec in run_baseline(
                    cfg,
                    [
                        "mp-queue",
                        "--models",
                        ",".join(models),
                        "--mode",
                        mode,
                        "--frames",
                        str(a.frames),
                        "--duration",
                        str(a.duration),
                    ],
                    f"mp-{mode}",
                ):
                    rec["latency_run"] = False
                    keep(rec, rep)

    rate = a.rate
    if not rate:
        eager = [_fps(recs, "solo", "eager", [m]) for m in models if m != "empty"]
        eager += [_fps(recs, "gpipe", "eager"), _fps(recs, "mp-queue", "eager")]
        eager = [f for f in eager if f]
        rate = round(0.8 * min(eager), 1) if eager else 30.0
    lat_frames = max(10, int(rate * a.latency_seconds))
    lat = dict(rate=rate, frames=lat_frames, duration=0.0)
    lat_models = [("latency", models)] if "latency" in only else []
    if "empty" in only:
        lat_models.append(("empty", ["empty"] * len(models)))
    for part, ms in lat_models:
        for mode in modes if part == "latency" else ["eager"]:
            if over_budget():
                break
            keep(run_gpipe(cfg, mode, ms, latency=True, tag=part, **lat))
            if over_budget():
                break
            for rec in run_baseline(
                cfg,
                [
                    "mp-queue",
                    "--models",
                    ",".join(ms),
                    "--mode",
                    mode,
                    "--latency",
                    "--rate",
                    str(rate),
                    "--frames",
                    str(lat_frames),
                ],
                f"mp-{mode}-{part}",
            ):
                rec["latency_run"] = True
                keep(rec)
    if over_budget():
        print(f"-- budget of {a.budget:.0f}s spent: later runs skipped", flush=True)
    for line in summary(recs, models, a.mps):
        print(line, flush=True)
    return 0 if recs and all(r.get("ok") for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
