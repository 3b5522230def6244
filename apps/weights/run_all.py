"""Weight updates, every way, in one run: for each state dict size, the in-process copy
(ceiling), torch.multiprocessing CUDA IPC on the trainer's GPU, gpipe on the trainer's GPU
(loaded into the receiver's tensors, and read in place), and with 2 or more GPUs NCCL
broadcast to the other GPUs beside gpipe to the other GPUs (read directly by peer access,
and through forwarders in the shape gpipe.fanout_plan picks); then the faults (a receiver
SIGKILLed, the trainer SIGKILLed). Every run is a process group of its own under a hard time
limit; one JSON line per run in OUT/weights.jsonl, each program's output in OUT/logs/, and
the table with the issue's targets in OUT/summary.txt (and on stdout).

  python3 apps/weights/run_all.py --out /tmp/w                      # GPU: 3.2GB and 8.6GB
  python3 apps/weights/run_all.py --device cpu --sizes tiny --out /tmp/w   # host backend (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Optional

APP = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
# A side's memory is flat when it grew by at most this much from the first update after the
# warm-up to the last (torch's reserved bytes and the device's used bytes; host: RSS).
FLAT_BYTES = 2 * MiB
TARGET_SAME = 0.2  # gpipe on the trainer's GPU, at most this times torch.mp IPC's p50
TARGET_OTHERS = 1.0  # gpipe to the other GPUs, at most this times NCCL broadcast's p50


class Runner:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = a.out
        self.logs = os.path.join(a.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.jsonl = os.path.join(a.out, "weights.jsonl")
        open(self.jsonl, "w").close()
        self.start = time.monotonic()
        self.records: list[dict[str, Any]] = []

    def left(self) -> float:
        return self.a.budget - (time.monotonic() - self.start)

    def run(self, tag: str, script: str, args: list[str], *, size: str,
            wait_files: Optional[list[str]] = None) -> dict[str, Any]:
        """Runs `script` in a process group of its own under the time limit; its record."""
        rundir = os.path.join("/tmp", f"gpipe-weights-{os.getpid()}-{tag}")
        os.makedirs(rundir, exist_ok=True)
        out = os.path.join(rundir, "record.json")
        limit = min(self.a.run_timeout, self.left())
        if limit < 20:
            rec = {"run": tag, "size": size, "skipped": f"time budget ({self.a.budget} s) spent"}
            return self._keep(rec)
        cmd = [sys.executable, os.path.join(APP, script), "--dir", rundir, "--out", out,
               "--device", self.a.device, "--size", size, "--updates", str(self.a.updates),
               "--warmup", str(self.a.warmup), *args]
        log = os.path.join(self.logs, f"{tag}.log")
        t = time.monotonic()
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
            f.flush()
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
            _RUNNING.append(p.pid)
            timed_out = False
            try:
                rc = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = None
            if wait_files:  # the leader died on purpose: wait for the others' results
                deadline = time.monotonic() + self.a.fault_wait
                while time.monotonic() < deadline and not all(
                        os.path.exists(os.path.join(rundir, w)) for w in wait_files):
                    time.sleep(0.1)
            _killpg(p.pid)
            _RUNNING.remove(p.pid)
            if rc is None:
                p.wait()
        rec: dict[str, Any]
        try:
            with open(out) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            rec = {"run": tag, "size": size, "ok": False}
        rec["tag"] = tag
        rec["rc"] = p.returncode
        rec["wall_s"] = round(time.monotonic() - t, 1)
        if timed_out:
            rec["ok"] = False
            rec.setdefault("problems", []).append(f"killed after the run's time limit of {limit:.0f} s")
        if wait_files is not None:  # judged by the caller, which removes the directory
            rec["rundir"] = rundir
            return rec
        shutil.rmtree(rundir, ignore_errors=True)
        if not rec.get("ok"):
            rec.setdefault("problems", []).append(f"failed (rc {p.returncode}); log: {log}: " + _tail(log))
        return self._keep(rec)

    def _keep(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Appends the run's record to the JSONL and says how it went."""
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.records.append(rec)
        status = "skipped: " + rec["skipped"] if "skipped" in rec else ("ok" if rec.get("ok") else "FAILED")
        p50 = rec.get("update_ms", {}).get("p50")
        print(f"-- {rec.get('tag', rec['run'])} [{rec.get('size')}] {status}"
              + (f", p50 {p50:.3f} ms" if p50 is not None else "")
              + (f"; {rec['problems'][:2]}" if rec.get("problems") else ""), flush=True)
        return rec


# The process group of the run under way: each run has a session of its own, so a limit that
# kills this script's group would miss it; SIGTERM (what `timeout` sends first) kills it here.
_RUNNING: list[int] = []


def _on_sigterm(signum: int, frame: Any) -> None:
    for pgid in _RUNNING:
        _killpg(pgid)
    raise SystemExit(f"run_all.py: stopped by signal {signum}; the run under way was killed")


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: str, n: int = 6) -> str:
    try:
        with open(path) as f:
            return " | ".join(f.read().strip().splitlines()[-n:])
    except OSError:
        return ""


def gpu_count(device: str) -> int:
    if device != "cuda":
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU"))
    except (OSError, subprocess.SubprocessError):
        return 0


def fault_runs(r: Runner, size: str, gpus: int) -> None:
    """A receiver SIGKILLed mid-run; the trainer SIGKILLed right after a publish. Receivers on
    the trainer's GPU (loading and in place) and, where there is another GPU (or on the host),
    one there: read directly in the first run, behind a forwarder in the second."""
    a = r.a
    another = gpus >= 2 or a.device == "cpu"
    upd = ["--updates", str(a.fault_updates)]
    r.run("fault-kill-receiver", "gpipe_run.py",
          ["--receivers", "load@0,inplace@0,load@0" + (",load@1" if another else ""),
           "--kill-receiver-at", str(a.fault_at), *upd], size=size)
    specs = ["load@0", "inplace@0", "load@0"] + (["load@1"] if another else [])
    rec = r.run("fault-kill-trainer", "gpipe_run.py",
                ["--receivers", ",".join(specs), "--shape", "chain", "--die-at", str(a.fault_at), *upd],
                size=size, wait_files=[f"rx{i}.json" for i in range(len(specs))])
    if "skipped" in rec:
        return
    # The trainer died, so this run's record is made here from the receivers' results.
    rxs, problems = [], []
    for i, spec in enumerate(specs):
        try:
            with open(os.path.join(rec["rundir"], f"rx{i}.json")) as f:
                x = json.load(f)
        except (OSError, ValueError):
            problems.append(f"receiver {i} ({spec}) wrote no result within {a.fault_wait} s")
            continue
        err = x.get("error") or {}
        rxs.append({"receiver": spec, "last_version": x.get("last_version"),
                    "error": err, "model_whole": x.get("model_whole"), "bad": x.get("bad")})
        if err.get("type") not in ("ProducerDied", "WeightError"):
            problems.append(f"receiver {i} ({spec}) ended with {err or 'no error'}, not ProducerDied/WeightError")
        if x.get("bad"):
            problems.append(f"receiver {i} ({spec}) loaded bad updates: {x['bad'][:2]}")
        if spec.startswith("load") and not x.get("model_whole"):
            problems.append(f"receiver {i} ({spec}): its model does not hold one whole version "
                            f"(marks say {x.get('model_version_mod250')}, last version {x.get('last_version')})")
        if not (a.fault_at - 1 <= (x.get("last_version") or 0) <= a.fault_at):
            problems.append(f"receiver {i} ({spec}) ended at version {x.get('last_version')}, "
                            f"expected {a.fault_at - 1} or {a.fault_at}")
    if rec.get("rc") != -signal.SIGKILL:
        problems.append(f"the trainer ended with rc {rec.get('rc')}, not killed by its SIGKILL: "
                        f"see {r.logs}/fault-kill-trainer.log")
    rec.update({"trainer_rc": rec.get("rc"), "receivers_after": rxs, "problems": problems,
                "ok": not problems})
    shutil.rmtree(rec.pop("rundir"), ignore_errors=True)
    r._keep(rec)


def size_runs(r: Runner, size: str, gpus: int) -> None:
    r.run(f"ceiling-{size}", "ceiling.py", [], size=size)
    r.run(f"ipc-{size}", "ipc.py", ["--receivers", "1"], size=size)
    r.run(f"gpipe-same-load-{size}", "gpipe_run.py",
          ["--receivers", "load@0", "--name", "gpipe-same-load"], size=size)
    r.run(f"gpipe-same-inplace-{size}", "gpipe_run.py",
          ["--receivers", "inplace@0", "--name", "gpipe-same-inplace"], size=size)
    r.run(f"gpipe-same-load-inslot-{size}", "gpipe_run.py",
          ["--receivers", "load@0", "--in-slot", "--name", "gpipe-same-load-inslot"], size=size)
    r.run(f"gpipe-same-inplace-inslot-{size}", "gpipe_run.py",
          ["--receivers", "inplace@0", "--in-slot", "--name", "gpipe-same-inplace-inslot"], size=size)
    # The chunked chain: the fan-out plan's chunk for one update at a time on the GPU; on the
    # host, chunks small enough that the tiny update crosses in several.
    chunk = ["--shape", "chain", "--chunk", "auto" if r.a.device == "cuda" else str(16 << 10)]
    if r.a.device == "cpu":  # gloo for NCCL; forwarders in host memory for the plan
        r.run(f"nccl-{size}", "nccl.py", ["--ranks", "2"], size=size)
        r.run(f"gpipe-others-plan-{size}", "gpipe_run.py",
              ["--receivers", "load@1,inplace@2", "--shape", "chain", "--name", "gpipe-others-plan"],
              size=size)
        r.run(f"gpipe-others-chunked-{size}", "gpipe_run.py",
              ["--receivers", "load@1,inplace@2", *chunk, "--name", "gpipe-others-chunked"], size=size)
        return
    if gpus < 2:
        print(f"-- {size}: one GPU, so no NCCL broadcast and no gpipe to other GPUs", flush=True)
        return
    others = ",".join(f"load@{g}" for g in range(1, gpus))
    r.run(f"nccl-{size}", "nccl.py", ["--ranks", str(gpus)], size=size)
    r.run(f"gpipe-others-direct-{size}", "gpipe_run.py",
          ["--receivers", others, "--shape", "direct", "--name", "gpipe-others-direct"], size=size)
    r.run(f"gpipe-others-plan-{size}", "gpipe_run.py",
          ["--receivers", others, "--shape", "auto", "--name", "gpipe-others-plan"], size=size)
    inplace = ",".join(f"inplace@{g}" for g in range(1, gpus))
    r.run(f"gpipe-others-chunked-{size}", "gpipe_run.py",
          ["--receivers", others, *chunk, "--name", "gpipe-others-chunked"], size=size)
    r.run(f"gpipe-others-chunked-inplace-{size}", "gpipe_run.py",
          ["--receivers", inplace, *chunk, "--name", "gpipe-others-chunked-inplace"], size=size)
    r.run(f"gpipe-others-chunked-inplace-inslot-{size}", "gpipe_run.py",
          ["--receivers", inplace, *chunk, "--in-slot", "--name", "gpipe-others-chunked-inplace-inslot"],
          size=size)


def memory_growth(rec: dict[str, Any]) -> Optional[int]:
    """The largest growth of any side's measures over the run (bytes), or None."""
    grows = []
    for side in rec.get("memory", {}).values():
        for k, v in side.get("growth", {}).items():
            if k != "allocated":
                grows.append(v)
    return max(grows) if grows else None


def _ran(x: Optional[dict], label: str, lines: list[str]) -> Optional[dict]:
    """The record of a run that ran; None for one missing or skipped (a skip gets a line)."""
    if x is not None and "skipped" in x:
        lines.append(f"{label} skipped: {x['skipped']}")
        return None
    return x


def summary(r: Runner, gpus: int) -> str:
    by = {x.get("tag", x["run"]): x for x in r.records}
    lines = [f"weights: device {r.a.device}, {gpus} GPUs, {r.a.updates} updates per run "
             f"({r.a.warmup} warm-up updates left out of the figures), budget {r.a.budget} s",
             "", f"{'run':34} {'p50 ms':>9} {'p99 ms':>9} {'x peer':>7} {'target':>8} "
             f"{'mem grew':>9} {'verified':>8}  status"]
    for size in r.a.sizes.split(","):
        ipc = by.get(f"ipc-{size}", {}).get("update_ms", {}).get("p50")
        ceiling = by.get(f"ceiling-{size}", {}).get("update_ms", {}).get("p50")
        nccl = by.get(f"nccl-{size}", {}).get("update_ms", {}).get("p50")
        runs = ("ceiling", "ipc", "gpipe-same-load", "gpipe-same-inplace", "gpipe-same-load-inslot",
                "gpipe-same-inplace-inslot", "nccl", "gpipe-others-direct", "gpipe-others-plan",
                "gpipe-others-chunked", "gpipe-others-chunked-inplace",
                "gpipe-others-chunked-inplace-inslot")
        for tag in (f"{run}-{size}" for run in runs):
            x = _ran(by.get(tag), f"{tag:34}", lines)
            if x is None:
                continue
            u = x.get("update_ms", {})
            peer, target = None, None
            if tag.startswith("gpipe-same") and ipc:
                peer, target = ipc, TARGET_SAME
            elif tag.startswith("gpipe-others") and nccl:
                peer, target = nccl, TARGET_OTHERS
            ratio = u.get("p50") / peer if peer and u.get("p50") else None
            grew = memory_growth(x)
            verdict = "ok" if x.get("ok") else "FAILED"
            if target is not None and ratio is not None:
                verdict += ", target " + ("PASS" if ratio <= target else "MISS")
            if grew is not None:
                verdict += ", memory " + ("flat" if grew <= FLAT_BYTES else "GREW")
            lines.append(
                f"{tag:34} {_f(u.get('p50')):>9} {_f(u.get('p99')):>9} "
                f"{(f'{ratio:.2f}' if ratio is not None else ''):>7} "
                f"{(f'<= {target}' if target is not None else ''):>8} "
                f"{(f'{grew / MiB:.1f}M' if grew is not None else ''):>9} "
                f"{x.get('verified_updates', ''):>8}  {verdict}")
            if x.get("run") == "ipc" and x.get("handles_ms"):
                lines.append(f"{'':4}handles sent and rebuilt p50 {_f(x['handles_ms'].get('p50'))} ms, "
                             f"then the copies p50 {_f(x['copies_ms'].get('p50'))} ms")
            if x.get("run", "").startswith("gpipe") and x.get("pack_ms"):
                if ceiling and u.get("p50"):
                    lines.append(f"{'':4}{u['p50'] / ceiling:.2f}x the in-process copy's p50")
                lines.append(f"{'':4}trainer: publish() call p50 {_f(x['publish_call_ms'].get('p50'))} ms, "
                             f"packed on the GPU p50 {_f(x['pack_ms'].get('p50'))} ms; copies: {x.get('copy')}"
                             + (f"; rings {len(x['rings'])} ({x.get('shape')})"
                                if x.get("shape") not in (None, "same-gpu") else "")
                             + (f", chunks of {x['chunk'] >> 20} MiB" if x.get("chunk") else ""))
    lines.append("")
    for tag in ("fault-kill-receiver", "fault-kill-trainer"):
        x = _ran(by.get(tag), f"{tag}:", lines)
        if x is None:
            continue
        lines.append(f"{tag}: {'PASS' if x.get('ok') else 'FAIL'}")
        if tag == "fault-kill-receiver" and x.get("before_kill_ms"):
            lines.append(f"    update p50 before the kill {_f(x['before_kill_ms'].get('p50'))} ms, after "
                         f"{_f(x['after_kill_ms'].get('p50'))} ms (p99 {_f(x['after_kill_ms'].get('p99'))}); "
                         f"the others verified {x.get('verified_updates')} updates")
        for rx in x.get("receivers_after", []):
            lines.append(f"    {rx['receiver']}: last version {rx['last_version']}, whole model: "
                         f"{rx['model_whole']}, {rx['error'].get('type')}: {rx['error'].get('message', '')[:150]}")
        for p in x.get("problems", [])[:4]:
            lines.append(f"    problem: {p[:300]}")
    for x in r.records:
        if not x.get("ok") and "skipped" not in x and not x.get("tag", "").startswith("fault"):
            for p in x.get("problems", [])[:3]:
                lines.append(f"{x.get('tag')}: {p[:300]}")
    return "\n".join(lines) + "\n"


def _f(v: Optional[float]) -> str:
    return "" if v is None else (f"{v:.3f}" if v < 100 else f"{v:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--sizes", default="3.2GB,8.6GB")
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fault-size", default="fault")
    ap.add_argument("--fault-updates", type=int, default=30)
    ap.add_argument("--fault-at", type=int, default=10)
    ap.add_argument("--fault-wait", type=float, default=30.0,
                    help="seconds the receivers have to report after the trainer was killed")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--run-timeout", type=float, default=120.0)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all the runs")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    r = Runner(a)
    gpus = gpu_count(a.device)
    if a.device == "cuda" and gpus == 0:
        print("run_all.py: no GPU found (nvidia-smi -L); use --device cpu for the host backend")
        return 2
    if not a.no_faults:
        fault_runs(r, a.fault_size, gpus)
    for size in a.sizes.split(","):
        size_runs(r, size, gpus)
    text = summary(r, gpus)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(x.get("ok") or "skipped" in x for x in r.records) else 1


if __name__ == "__main__":
    sys.exit(main())
