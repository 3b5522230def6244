#!/usr/bin/env python3
"""Runs the data loader's measurements on a GPU machine and summarises them.

One invocation runs every configuration for every model, one after the other, each in fresh
processes under a hard time limit, and appends one JSON line per run to ``OUT/loader.jsonl``:

- ``loader``: ``gpipe.torch.Loader`` in the trainer's process (loader_lib.py): decode workers
  it starts itself, ``--loader-workers`` of them or ``auto``;
- ``ceiling``: the training step on synthetic GPU tensors (baselines.py);
- ``dataloader``: torch DataLoader, PIL decode in worker processes (baselines.py);
- ``inprocess``: GPU decode + augment in the training process on a side stream (baselines.py);
- ``gpipe``: producer.py and train.py as separate processes, one producer per GPU, or
  ``--decoders K`` per GPU (each its own ring and shard, read by the trainer in turn);
- ``producer``: producer.py feeding a trainer that only receives (``--model none``): the
  producer's own images/s.

With ``--world-size 2`` (the 2-GPU machine; or 4) it runs the ResNet-50 ``loader`` and ``gpipe``
configurations on one GPU and on all (DDP, one loader or producer per GPU, each rank its part
of the epoch), and the DDP ceiling.
``--probe`` first measures what decoding costs per image (gpu_decode.py), the figure that
places the decode.

Every invocation ends with the summary of everything in ``OUT/loader.jsonl`` (so a run
without MPS and one with MPS appear side by side), written to ``OUT/summary.txt``;
``--summary-only`` prints it and runs nothing. Labels name the runs (``--label nomps``).

    python3 apps/loader/run_all.py --data /tmp/loader-data --out /tmp/o --label nomps --probe
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
CONFIGS = ("loader", "gpipe", "inprocess", "dataloader", "ceiling", "producer")
# Only NVLink multicast is switched off; it must stay off on the shared machines.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Runner:
    """Starts child processes, each in its own session under ``timeout -k 5``, and never lets
    one outlive the invocation's deadline. Their stderr goes to OUT/logs.txt."""

    def __init__(self, out_dir: str, budget_s: float):
        self.out_dir = out_dir
        self.deadline = time.monotonic() + budget_s
        self.live: list[subprocess.Popen] = []
        self.env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"}
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.kill_all()
        sys.exit(128 + signum)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, name: str, cmd: list[str], limit: float, env: Optional[dict] = None) -> subprocess.Popen:
        limit = max(1, int(min(limit, self.remaining())))
        out = tempfile.TemporaryFile("w+")
        err = tempfile.TemporaryFile("w+")
        p = subprocess.Popen(
            ["timeout", "-k", "5", str(limit), *cmd], stdout=out, stderr=err, env={**self.env, **(env or {})},
            start_new_session=True, text=True,
        )
        p.name, p.cmd, p.out, p.err = name, cmd, out, err  # type: ignore[attr-defined]
        self.live.append(p)
        return p

    def finish(self, p: subprocess.Popen, wait_s: float) -> tuple[int, Optional[dict], str]:
        """Waits up to wait_s (then kills its process group); returns rc, its last JSON line, and
        the tail of its stderr."""
        try:
            rc = p.wait(timeout=max(1.0, min(wait_s, self.remaining() + 6)))
        except subprocess.TimeoutExpired:
            self._kill(p)
            rc = p.wait()
        if p in self.live:
            self.live.remove(p)
        p.out.seek(0)  # type: ignore[attr-defined]
        p.err.seek(0)  # type: ignore[attr-defined]
        stdout, stderr = p.out.read(), p.err.read()  # type: ignore[attr-defined]
        with open(os.path.join(self.out_dir, "logs.txt"), "a") as log:
            log.write(f"== {p.name} (rc {rc}): {' '.join(p.cmd)}\n{stderr}")  # type: ignore[attr-defined]
            if rc != 0:
                log.write(f"-- stdout\n{stdout}")
        record = None
        for line in reversed(stdout.splitlines()):
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                    break
                except ValueError:
                    pass
        return rc, record, "\n".join(stderr.strip().splitlines()[-6:])

    def _kill(self, p: subprocess.Popen) -> None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill_all(self) -> None:
        for p in list(self.live):
            self._kill(p)


TRAINER_FIELDS = ("images_per_s", "workers", "workers_why", "settle_steps", "settled", "wait_fraction", "host_wait_fraction", "gpu_util", "steps", "seconds",
                  "startup_s", "epochs", "loss", "timeline", "mps", "gpu", "kernel", "cpus", "source",
                  "host_decode", "mixed_gpu_workers", "slots_pinned_in_place", "upload_s", "batches_uploaded",
                  "batches_pinned", "stream_priority", "worker_env", "nccl_high_priority")
PRODUCER_FIELDS = ("images_per_s", "steady_images_per_s", "busy_images_per_s", "decode_wait_s", "acquire_s",
                   "work_s", "read_s", "decode_s", "batches", "end", "source")


def run_config(r: Runner, a: argparse.Namespace, model: str, config: str, world: int) -> dict:
    base: dict[str, Any] = {"run": a.label, "config": config, "model": model, "world_size": world, "batch": a.batch}
    if config in ("gpipe", "producer"):
        base["decoders"] = a.decoders
        if a.producer_sm_percent:
            base["producer_sm_percent"] = a.producer_sm_percent
        if a.producer_side_stream:
            base["producer_side_stream"] = True
    dl = config == "dataloader"
    steps, warmup = (a.dl_steps, a.dl_warmup) if dl else (a.steps, a.warmup)
    if config == "producer":
        steps = max(steps, 2 * a.steps)
    first_model = a.models.split(",")[0]
    # One GPU: the gpipe and in-process runs of the first model. DDP: the 2-GPU runs, every
    # rank profiling the same extra steps (all-reduce needs them all), rank 0's table kept.
    profiled = a.profile and model == first_model and (
        config in ("gpipe", "inprocess") if world == 1 else config in ("gpipe", "ceiling") and world > 1)
    profile = ["--profile", str(a.profile), "--profile-out", os.path.join(a.out, "profile.txt")] if profiled else []

    def profile_for(rank: int) -> list[str]:
        return profile if rank == 0 or not profile else [*profile[:2], "--profile-out", os.devnull]

    if profile:
        with open(os.path.join(a.out, "profile.txt"), "a") as f:
            f.write(f"\n==== {a.label} {model} {config} W={world}: torch.profiler over {a.profile} steps "
                    f"after the timed ones{' (rank 0)' if world > 1 else ''}\n")
    tag = f"{a.label}-{model}-{config}-w{world}"
    pg = f"file://{tempfile.gettempdir()}/loader-pg-{os.getpid()}-{tag}"
    limit = a.run_limit
    if config in ("ceiling", "dataloader", "inprocess", "loader"):
        procs = []
        for rank in range(world):
            device = "cpu" if a.cpu else f"cuda:{rank}" if world == 1 else "cuda"
            if config == "loader":  # gpipe.torch.Loader: its decode workers are its own
                cmd = [PY, os.path.join(HERE, "loader_lib.py"), "--workers", a.loader_workers,
                       "--settle", str(a.loader_settle),
                       "--slots", str(a.slots)]
                if a.loader_host_decode:
                    cmd.append("--host-decode")
                if a.loader_mixed:
                    cmd += ["--mixed", str(a.loader_mixed)]
                if a.loader_max_workers:
                    cmd += ["--max-workers", str(a.loader_max_workers)]
                if a.loader_worker_nice is not None:
                    cmd += ["--worker-nice", str(a.loader_worker_nice)]
                if a.loader_worker_cpus:
                    cmd += ["--worker-cpus", a.loader_worker_cpus]
                if a.loader_stream_priority is not None:
                    cmd += ["--stream-priority", str(a.loader_stream_priority)]
                if a.loader_nccl_high_priority:
                    cmd.append("--nccl-high-priority")
                for kv in a.loader_worker_env:
                    cmd += ["--worker-env", kv]
            else:
                cmd = [PY, os.path.join(HERE, "baselines.py"), config, "--workers", str(a.workers)]
            cmd += ["--model", model, "--batch", str(a.batch), "--size", str(a.size), "--steps", str(steps),
                    "--warmup", str(warmup), "--device", device, *profile_for(rank)]
            if config != "ceiling":
                cmd += ["--data", a.data]
            if world > 1:
                cmd += ["--world-size", str(world), "--rank", str(rank), "--dist-url", pg]
            procs.append(r.start(f"{tag} rank {rank}", cmd, limit))
        results = [r.finish(p, limit) for p in procs]
        trainers = [res[1] for res in results]
        producers: list[Optional[dict]] = []
        errors = [f"rank {i}: rc {rc}: {tail}" for i, (rc, rec, tail) in enumerate(results) if rc != 0 or rec is None]
    else:
        tmp = tempfile.gettempdir()
        k = a.decoders
        socks = [[os.path.join(tmp, f"loader-{os.getpid()}-{tag}-{rank}-{d}.sock") for d in range(k)]
                 for rank in range(world)]
        prods = []
        for rank in range(world):
            for d in range(k):
                cmd = [PY, os.path.join(HERE, "producer.py"), "--data", a.data, "--socket", socks[rank][d],
                       "--backend", "host" if a.cpu else "cuda", "--device", str(rank), "--batch", str(a.batch),
                       "--size", str(a.size), "--shard", f"{rank * k + d}/{world * k}", "--slots", str(a.slots),
                       "--read-threads", str(max(2, a.read_threads // k)), "--warmup", str(warmup),
                       "--label", tag, *(["--side-stream"] if a.producer_side_stream else [])]
                # Under MPS, a producer limited to a share of the SMs leaves the rest to the
                # trainer (and its NCCL kernels, which wait for the other rank's).
                env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(a.producer_sm_percent)} if a.producer_sm_percent else None
                prods.append(r.start(f"{tag} producer {rank}.{d}", cmd, limit + 15, env))
        trains = []
        for rank in range(world):
            cmd = [PY, os.path.join(HERE, "train.py"), "--socket", ",".join(socks[rank]),
                   "--model", "none" if config == "producer" else model,
                   "--steps", str(steps), "--warmup", str(warmup), "--label", tag, *profile_for(rank)]
            if world > 1:
                cmd += ["--world-size", str(world), "--rank", str(rank), "--dist-url", pg]
            trains.append(r.start(f"{tag} trainer {rank}", cmd, limit))
        t_results = [r.finish(p, limit) for p in trains]
        p_results = [r.finish(p, 20) for p in prods]
        trainers = [res[1] for res in t_results]
        producers = [res[1] for res in p_results]
        errors = [f"trainer {i}: rc {rc}: {tail}"
                  for i, (rc, rec, tail) in enumerate(t_results) if rc != 0 or rec is None]
        errors += [f"producer {i}: rc {rc}: {tail}"
                   for i, (rc, rec, tail) in enumerate(p_results) if rc != 0 or rec is None]
        for s in (s for per_rank in socks for s in per_rank):
            if os.path.exists(s):
                os.unlink(s)
    rec = dict(base)
    if errors:
        rec["error"] = " | ".join(errors)[-1500:]
    ok = [t for t in trainers if t and t.get("images_per_s")]
    if ok and len(ok) == world:
        t0 = ok[0]
        rec.update({k: t0.get(k) for k in TRAINER_FIELDS})
        if world > 1:
            rec["images_per_s"] = round(sum(t["images_per_s"] for t in ok), 1)
            rec["per_rank_images_per_s"] = [t["images_per_s"] for t in ok]
            if all("workers" in t for t in ok):
                rec["per_rank_workers"] = [t["workers"] for t in ok]
            if any("settled" in t for t in ok):
                rec["settled"] = all(t.get("settled", True) for t in ok)
            rec["wait_fraction"] = _mean([t.get("wait_fraction") for t in ok])
            rec["gpu_util"] = _mean([t.get("gpu_util") for t in ok])
        if "enforced_read_only" in t0:
            rec["enforced_read_only"] = t0["enforced_read_only"]
    else:
        rec["images_per_s"] = None
    good = [p for p in producers if p]
    if good:
        rec["producer"] = {k: good[0].get(k) for k in PRODUCER_FIELDS}
        rates = [p.get("steady_images_per_s") or p.get("images_per_s") for p in good]
        if all(rates):
            rec["producer_images_per_s"] = round(sum(rates), 1)
        busy = [p.get("busy_images_per_s") for p in good]
        if all(busy):
            rec["producer_busy_images_per_s"] = round(sum(busy), 1)
    return rec


def _mean(vals: list) -> Optional[float]:
    vals = [v for v in vals if v is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def probe(r: Runner, a: argparse.Namespace) -> dict:
    cmd = [PY, os.path.join(HERE, "gpu_decode.py"), a.data, "--device", "cpu" if a.cpu else "cuda:0",
           "--batch", str(a.batch), "--json", "--batches", str(a.probe_batches), *([] if a.cpu else ["--profile"])]
    rc, rec, tail = r.finish(r.start(f"{a.label} decode probe", cmd, 120), 120)
    out = {"run": a.label, "config": "decode-probe", **(rec or {})}
    if rc != 0 or rec is None:
        out["error"] = f"rc {rc}: {tail}"
    return out


# ---------------------------------------------------------------------------------------------
# Summary


def _pct(v: Optional[float]) -> str:
    return f"{100 * v:.0f}%" if isinstance(v, (int, float)) else "-"


def _num(v: Optional[float]) -> str:
    return f"{v:,.0f}" if isinstance(v, (int, float)) else "-"


def timeline_summary(t: Optional[dict]) -> str:
    if not t or not t.get("wait_ms"):
        return "no timeline"
    w, s = t["wait_ms"], t["step_ms"]
    q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return (f"per step: wait median {statistics.median(w):.1f} ms (p90 {q(w, 0.9):.1f}, max {max(w):.1f}), "
            f"step median {statistics.median(s):.1f} ms (p90 {q(s, 0.9):.1f}, max {max(s):.1f})")


def summarize(path: str) -> str:
    if not os.path.exists(path):
        return f"{path}: no results"
    recs = [json.loads(line) for line in open(path) if line.strip()]
    lines: list[str] = []
    for p in (x for x in recs if x.get("config") == "decode-probe"):
        if "error" in p:
            lines.append(f"decode probe [{p['run']}]: failed: {p['error']}")
            continue
        lines.append(
            f"decode probe [{p['run']}] on {p.get('device')}, batches of {p.get('batch')}, "
            f"files {p.get('mean_file_kb')} KB: "
            f"decode {p.get('decode_us_per_image')} us/image wall ({_num(p.get('decode_images_per_s'))} img/s, "
            f"GPU kernels+copies {p.get('decode_gpu_us_per_image', '?')} us/image); "
            f"augment {p.get('augment_us_per_image')} "
            f"us/image wall (GPU {p.get('augment_gpu_us_per_image', '?')} us/image); read+decode+augment pipeline "
            f"{_num(p.get('pipeline_images_per_s'))} img/s"
        )
        gpu_us = (p.get("decode_gpu_us_per_image") or 0) + (p.get("augment_gpu_us_per_image") or 0)
        if gpu_us:
            lines.append(
                f"  placement: decode+augment use {gpu_us:.1f} us of GPU time per image, "
                f"{gpu_us * 4000 / 1e4:.1f}% of a GPU at 4,000 img/s (the ResNet-50 rate). "
                f"A producer for the whole node would need one GPU's decoder to feed "
                f"all of them and consumers on the other GPUs, which gpipe does not support yet: one producer per GPU "
                f"(producer.py --device RANK --shard RANK/WORLD) keeps every decode next to its trainer."
            )
    runs = list(dict.fromkeys(x["run"] for x in recs if x.get("config") != "decode-probe"))
    header = (f"{'run':<8} {'model':<9} {'W':>1} {'config':<10} {'img/s':>8} {'xDL':>5} {'wait':>5} {'GPU%':>5} "
              f"{'producer img/s':>15}  notes")
    for run in runs:
        rs = [x for x in recs if x.get("run") == run and x.get("config") != "decode-probe"]
        mps = next((x.get("mps") for x in rs if x.get("mps") is not None), None)
        gpu = next((x.get("gpu") for x in rs if x.get("gpu")), "?")
        lines += ["", f"== {run}: {gpu}, MPS {'on' if mps else 'off'}", header]
        find = {(x["model"], x["world_size"], x["config"]): x for x in rs}
        # A run without its own DataLoader baseline (it is CPU-bound: MPS does not change it)
        # is compared with the first run's.
        for x in recs:
            if x.get("config") == "dataloader" and x.get("images_per_s"):
                find.setdefault((x["model"], 1, "dataloader"), x)
        for x in rs:
            dlr = find.get((x["model"], 1, "dataloader"), {}).get("images_per_s")
            ips = x.get("images_per_s")
            ratio = f"{ips / dlr:.2f}" if ips and dlr else "-"
            prod = x.get("producer_images_per_s")
            note = x.get("error", "")[:150] if x.get("error") else ""
            if x.get("producer_sm_percent"):
                note = f"producers at {x['producer_sm_percent']}% of the SMs; " + note
            if (x.get("decoders") or 1) > 1:
                note = f"{x['decoders']} decode processes per GPU; " + note
            if x["config"] == "loader" and x.get("workers"):
                per = x.get("per_rank_workers")
                count = "/".join(map(str, per)) if per and len(set(per)) > 1 else x["workers"]
                note = f"{count} decode workers ({x.get('workers_why', '')[:120]}); " + note
                if x.get("settled") is False:
                    note = (f"timed unsettled: auto was still at work at the {x.get('settle_steps')}-"
                            f"step cap; " + note)
            if x.get("per_rank_images_per_s"):
                note = f"ranks {x['per_rank_images_per_s']} " + note
            wait = _pct(x.get("wait_fraction"))
            if x["config"] == "producer":
                note = "the trainer only receives: the producer's own rate " + note
                wait = "-"
            gu = x.get("gpu_util")
            lines.append(
                f"{run:<8} {x['model']:<9} {x['world_size']:>1} {x['config']:<10} {_num(ips):>8} {ratio:>5} "
                f"{wait:>5} {('-' if gu is None else f'{gu:.0f}'):>5} {_num(prod):>15}  {note}"
            )
        lines += check_targets(find)
    return "\n".join(lines)


def check_targets(find: dict) -> list[str]:
    """The issue's targets, each PASS or MISS, and for a miss where the time went."""
    out: list[str] = []

    def rate(model: str, world: int, config: str) -> Optional[float]:
        return find.get((model, world, config), {}).get("images_per_s")

    def explain(model: str, world: int) -> None:
        g = find.get((model, world, "gpipe"), {})
        if not g:
            return
        out.append(f"    gpipe {model} W={world}: {timeline_summary(g.get('timeline'))}; GPU util {g.get('gpu_util')}")
        p = g.get("producer") or {}
        if p:
            out.append(f"    its producer: {_num(p.get('steady_images_per_s'))} img/s steady, "
                       f"waited {p.get('decode_wait_s')} s for decoded batches and {p.get('acquire_s')} s "
                       f"for free slots; decode calls {p.get('decode_s')} s")
        own = find.get((model, 1, "producer"), {}).get("images_per_s") or next(
            (v.get("images_per_s") for k, v in find.items() if k[2] == "producer"), None)
        ceil = rate(model, world, "ceiling")
        if own and ceil:
            out.append(f"    producer alone {_num(own)} img/s vs training ceiling {_num(ceil)} img/s")

    def target(name: str, value: Optional[float], want: float, model: str, world: int, strict: bool = False) -> None:
        if value is None:
            out.append(f"  target {name}: not measured")
            return
        ok = value > want if strict else value >= want
        out.append(f"  target {name}: {value:.2f} (want {'>' if strict else '>='} {want}) {'PASS' if ok else 'MISS'}")
        if not ok:
            explain(model, world)

    g50, d50, i50 = rate("resnet50", 1, "gpipe"), rate("resnet50", 1, "dataloader"), rate("resnet50", 1, "inprocess")
    g18, d18 = rate("resnet18", 1, "gpipe"), rate("resnet18", 1, "dataloader")
    if g50 and d50:
        target("ResNet-50 gpipe / DataLoader", g50 / d50, 2.5, "resnet50", 1)
    if g50 and i50:
        target("ResNet-50 gpipe / in-process", g50 / i50, 1.0, "resnet50", 1, strict=True)
    if g18 and d18:
        target("ResNet-18 gpipe / DataLoader", g18 / d18, 3.0, "resnet18", 1)
    g2 = rate("resnet50", 2, "gpipe")
    if g2 and g50:
        target("ResNet-50 2 GPUs / 1 GPU (gpipe)", g2 / g50, 1.8, "resnet50", 2)
    # gpipe.torch.Loader against the training ceiling of the same GPUs: 0.95x for ResNet-50,
    # 0.9x for ResNet-18 (a faster step, so a harder feed)
    for model, want in (("resnet50", 0.95), ("resnet18", 0.9)):
        for world in sorted({k[1] for k in find if k[0] == model and k[2] == "loader"}):
            lo, ceil = rate(model, world, "loader"), rate(model, world, "ceiling")
            if lo and ceil:
                target(f"{model} W={world} loader / ceiling", lo / ceil, want, model, world)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="/tmp/loader-data", help="data set folder (make_dataset.py)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/loader-out"), help="folder for loader.jsonl and logs")
    ap.add_argument("--label", default="run", help="name of this invocation's runs (e.g. nomps, mps)")
    ap.add_argument("--models", default="resnet50,resnet18")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--world-size", type=int, default=1,
                    help="2 or more: the DDP runs (loader and gpipe on 1 GPU and on W, the DDP ceiling)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=16,
                    help="untimed steps first: at least twice the slots, so batches made while the "
                    "trainer started up are used up before the clock starts")
    ap.add_argument("--dl-steps", type=int, default=30, help="timed steps of the DataLoader runs (slow)")
    ap.add_argument("--dl-warmup", type=int, default=60,
                    help="untimed DataLoader steps: more than its workers' prefetched batches "
                    "(16 workers x 2 = 32), which would otherwise be timed as if free")
    ap.add_argument("--workers", type=int, default=16, help="DataLoader workers")
    ap.add_argument("--slots", type=int, default=6, help="gpipe ring slots")
    ap.add_argument("--ddp-only", action="store_true",
                    help="with --world-size: only the runs on every GPU (not the one-GPU ones beside them)")
    ap.add_argument("--loader-settle", type=int, default=600,
                    help="loader runs: most steps for workers=auto to find its workers before warm-up")
    ap.add_argument("--loader-workers", default="auto",
                    help="decode workers of gpipe.torch.Loader (the loader runs): a number or auto")
    ap.add_argument("--loader-host-decode", action="store_true",
                    help="loader runs: decode on the CPU in the workers, augment on the GPU in the "
                    "trainer's process (loader_lib.py --host-decode)")
    ap.add_argument("--loader-mixed", type=int, default=0, metavar="N",
                    help="loader runs, with MPS: the first N workers decode on the GPU, the rest on "
                    "the CPU (loader_lib.py --mixed)")
    ap.add_argument("--loader-max-workers", type=int, default=0,
                    help="loader runs: auto's most workers (0: the loader's default)")
    ap.add_argument("--loader-worker-cpus", default="",
                    help="loader runs: the CPUs the decode workers run on, e.g. 4-63 (default: any)")
    ap.add_argument("--loader-stream-priority", type=int, default=None,
                    help="loader runs: the trainers train on a CUDA stream of this priority, e.g. -1 "
                    "(the highest; the decode workers' streams keep the default, the lowest)")
    ap.add_argument("--loader-nccl-high-priority", action="store_true",
                    help="loader runs under DDP: NCCL's collectives on high-priority streams too "
                    "(loader_lib.py --nccl-high-priority)")
    ap.add_argument("--loader-worker-env", action="append", default=[], metavar="NAME=VALUE",
                    help="loader runs: set in the decode workers' environment only, e.g. "
                    "CUDA_MPS_CLIENT_PRIORITY=1 (loader_lib.py --worker-env; may repeat)")
    ap.add_argument("--loader-worker-nice", type=int, default=None,
                    help="loader runs: how much nicer the decode workers run than the trainer "
                    "(default: the loader's)")
    ap.add_argument("--decoders", type=int, default=1,
                    help="producer (decode) processes per GPU in the gpipe runs, each its own ring and "
                    "shard; the trainer reads them in turn")
    ap.add_argument("--producer-sm-percent", type=int, default=None, metavar="P",
                    help="with MPS: each producer may use P%% of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)")
    ap.add_argument("--producer-side-stream", action="store_true",
                    help="each producer augments and publishes on a stream of its own, not the default stream")
    ap.add_argument("--read-threads", type=int, default=8,
                    help="file-reading threads per GPU, split between its decode processes")
    ap.add_argument("--profile", type=int, default=0,
                    help="torch.profiler over N extra steps (gpipe and inprocess, first model; with --world-size: "
                    "the DDP gpipe and ceiling runs, rank 0)")
    ap.add_argument("--probe", action="store_true", help="first measure decode cost per image")
    ap.add_argument("--probe-batches", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="a handful of steps per run, to check that all runs work")
    ap.add_argument("--run-limit", type=float, default=150, help="seconds one run may take")
    ap.add_argument("--budget", type=float, default=400,
                    help="seconds this invocation may take; runs that would start later are skipped")
    ap.add_argument("--size", type=int, default=224, help="crop size")
    ap.add_argument("--cpu", action="store_true", help="run everything on the CPU and the host backend (to try it out)")
    ap.add_argument("--summary-only", action="store_true", help="print the summary of OUT/loader.jsonl; run nothing")
    ap.add_argument("--no-summary", action="store_true", help="run, but leave the summary to a later --summary-only")
    a = ap.parse_args(argv)
    if a.decoders < 1:
        ap.error("--decoders must be at least 1")
    if a.quick:
        a.steps, a.warmup, a.dl_steps, a.dl_warmup, a.probe_batches = 5, 3, 3, 2, 3
        a.loader_settle = 16
    os.makedirs(a.out, exist_ok=True)
    jsonl = os.path.join(a.out, "loader.jsonl")

    def save(rec: dict) -> None:
        with open(jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")

    if not a.summary_only:
        r = Runner(a.out, a.budget)
        models = [m for m in a.models.split(",") if m]
        configs = [c for c in a.configs.split(",") if c]
        bad = set(configs) - set(CONFIGS)
        if bad:
            ap.error(f"unknown configs {sorted(bad)}")
        if a.probe:
            rec = probe(r, a)
            save(rec)
            print(f"{a.label} decode probe: {json.dumps(rec)}", flush=True)
        if a.world_size > 1:
            w = a.world_size
            plan = []
            for m in models:  # each feed on one GPU and on all, then the DDP ceiling
                for c in ("loader", "gpipe"):
                    if c in configs:
                        plan += [(m, c, w)] if a.ddp_only else [(m, c, 1), (m, c, w)]
                if "ceiling" in configs:
                    plan.append((m, "ceiling", w))
        else:
            plan = [(m, c, 1) for m in models for c in configs if not (c == "producer" and m != models[0])]
        for model, config, world in plan:
            if r.remaining() < 20:
                save({"run": a.label, "config": config, "model": model, "world_size": world,
                      "images_per_s": None, "error": "skipped: out of time"})
                continue
            t0 = time.monotonic()
            rec = run_config(r, a, model, config, world)
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            save(rec)
            print(f"{a.label} {model} W={world} {config}: {_num(rec.get('images_per_s'))} img/s, wait "
                  f"{_pct(rec.get('wait_fraction'))}, GPU {rec.get('gpu_util')}%, {rec['wall_s']} s"
                  + (f"  ERROR {rec['error'][:300]}" if rec.get("error") else ""), flush=True)
    if a.no_summary and not a.summary_only:
        return 0
    text = summarize(jsonl)
    print(text, flush=True)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
