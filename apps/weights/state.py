"""What every run of the weights benchmark shares: the synthetic state dicts, the marks a
trainer writes into its tensors at each version and the check of them on the receiving side,
memory samples, the statistics of a run, and the plumbing of its programs (their common
options, the head of a record, waiting for acks, gathering the receivers' results, and the
record written at the end).

A state dict here is transformer-like: layers of norms, attention and MLP matrices, in bf16
(the tiny size for CI mixes float32 and an int64 buffer in, as real state dicts do). At
version v the trainer writes a mark into three elements of every tensor (the first, the
middle and the last), a small integer that bf16 holds exactly; a receiver reads the same
elements back after it loaded an update. All three marks of every tensor must say the same
version: a mix would be a half-written update.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import time
import traceback
from typing import Any, Optional

import torch

# name -> (layers, (hidden, ffn) or None for the tiny mix, tensors per layer)
SIZES: dict[str, dict[str, Any]] = {
    # 32 layers x 6 tensors (norm, qkv, o, norm, up, down), hidden 2048, ffn 8192: 3.22 GB
    "3.2GB": {"layers": 32, "hidden": 2048, "ffn": 8192, "split_qkv": False},
    # 16 layers x 8 tensors (norm, q, k, v, o, norm, up, down), hidden 4096, ffn 24576: 8.59 GB
    "8.6GB": {"layers": 16, "hidden": 4096, "ffn": 24576, "split_qkv": True},
    # for the fault runs: 8 layers x 6 tensors, hidden 1024, ffn 12288: 470 MB
    "fault": {"layers": 8, "hidden": 1024, "ffn": 12288, "split_qkv": False},
    # CI: 4 layers x 6 tensors and two extras of other dtypes, about 0.4 MB
    "tiny": {"layers": 4, "hidden": 64, "ffn": 256, "split_qkv": False, "extras": True},
}


def shapes(size: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The (name, dtype, shape) of every tensor of a size, in state-dict order."""
    s = SIZES[size]
    h, f = s["hidden"], s["ffn"]
    bf = torch.bfloat16
    out = []
    for i in range(s["layers"]):
        p = f"layers.{i}."
        out.append((p + "attn_norm.weight", bf, (h,)))
        if s["split_qkv"]:
            for n in ("q", "k", "v"):
                out.append((p + f"attn.{n}.weight", bf, (h, h)))
        else:
            out.append((p + "attn.qkv.weight", bf, (3 * h, h)))
        out.append((p + "attn.o.weight", bf, (h, h)))
        out.append((p + "mlp_norm.weight", bf, (h,)))
        out.append((p + "mlp.up.weight", bf, (f, h)))
        out.append((p + "mlp.down.weight", bf, (h, f)))
    if s.get("extras"):
        out.append(("head.weight", torch.float32, (16, h)))
        out.append(("steps", torch.int64, (3,)))
    return out


def nbytes_of(size: str) -> int:
    return sum(dt.itemsize * _numel(shape) for _, dt, shape in shapes(size))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_state(size: str, device: torch.device, fill: str = "random") -> dict[str, torch.Tensor]:
    """A state dict of `size` on `device`: random values (a trainer) or zeros (a receiver)."""
    sd = {}
    g = torch.Generator(device=device).manual_seed(0) if fill == "random" else None
    for name, dt, shape in shapes(size):
        t = torch.zeros(shape, dtype=dt, device=device)
        if g is not None:
            if dt.is_floating_point:
                t.normal_(generator=g)
            else:
                t.random_(0, 100, generator=g)
        sd[name] = t
    return sd


def mark_of(version: int, index: int) -> int:
    """The mark of tensor `index` at `version`: 1..250, exact in bf16, never 0 (zeros are
    what a receiver starts with)."""
    return (version * 7 + index * 3) % 250 + 1


class Marks:
    """Writes (trainer) and reads (receiver) the three marked elements of every tensor."""

    def __init__(self, tensors: list[torch.Tensor], device: Optional[torch.device] = None) -> None:
        """`tensors`: those to mark or read (meta tensors for a receiver that reads an update
        in place: only their shapes count; then `device` is where the updates are)."""
        self.flat = [t.detach().view(-1) for t in tensors]
        self.idx = [
            torch.tensor(sorted({0, f.numel() // 2, f.numel() - 1}), device=device or f.device)
            for f in self.flat
        ]

    def write(self, version: int) -> None:
        with torch.no_grad():
            for i, (f, ix) in enumerate(zip(self.flat, self.idx)):
                f.index_fill_(0, ix, mark_of(version, i))

    def versions(self, flats: Optional[list[torch.Tensor]] = None) -> list[set[int]]:
        """For each tensor, the versions its marks say (one element when consistent)."""
        flats = self.flat if flats is None else [t.reshape(-1) for t in flats]
        got = torch.cat([f.index_select(0, ix).to(torch.float64) for f, ix in zip(flats, self.idx)])
        vals = [int(x) for x in got.cpu().tolist()]
        out, k = [], 0
        for i, ix in enumerate(self.idx):
            marks = vals[k : k + len(ix)]
            k += len(ix)
            out.append({_version_of(m, i) for m in marks})
        return out

    def check(self, version: int, flats: Optional[list[torch.Tensor]] = None) -> Optional[str]:
        """None when every mark of every tensor says `version`, else what is wrong."""
        for i, vs in enumerate(self.versions(flats)):
            if vs != {version % 250}:
                return f"tensor {i}: marks say version(s) {sorted(vs)} mod 250, expected {version % 250}"
        return None

    def consistent_version(self, flats: Optional[list[torch.Tensor]] = None) -> Optional[int]:
        """The one version (mod 250) every mark says, or None when they disagree (a torn load)."""
        all_vs = set().union(*self.versions(flats))
        return next(iter(all_vs)) if len(all_vs) == 1 else None


def _version_of(mark: int, index: int) -> int:
    """The version (mod 250) whose mark for tensor `index` is `mark`; -1 for no mark (0)."""
    if mark == 0:
        return -1
    # mark - 1 = 7 v + 3 i (mod 250); 7 * 143 = 1001 = 1 (mod 250)
    return ((mark - 1 - 3 * index) * 143) % 250


class Memory:
    """Memory samples of this process, one per update: torch's allocated and reserved bytes
    and the device's used bytes (CUDA), or the resident set (host)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: list[dict[str, int]] = []

    def sample(self) -> None:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self.samples.append({
                "allocated": torch.cuda.memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device),
                "device_used": total - free,
            })
        else:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            self.samples.append({"rss": rss})

    def summary(self, skip: int) -> dict[str, Any]:
        """First and last sample after `skip` updates, and the growth of each measure."""
        s = self.samples[skip:] or self.samples
        if not s:
            return {}
        out: dict[str, Any] = {"updates": len(self.samples), "first": s[0], "last": s[-1]}
        out["growth"] = {k: s[-1][k] - s[0][k] for k in s[0]}
        out["span"] = {k: max(x[k] for x in s) - min(x[k] for x in s) for k in s[0]}
        return out


def stats_ms(values_ns: list[int]) -> dict[str, float]:
    """p50, p99, mean, min and max in milliseconds."""
    if not values_ns:
        return {}
    v = sorted(x / 1e6 for x in values_ns)
    p99 = v[min(len(v) - 1, int(round(0.99 * (len(v) - 1))))]
    return {"n": len(v), "p50": statistics.median(v), "p99": p99, "mean": statistics.fmean(v),
            "min": v[0], "max": v[-1]}


def now_ns() -> int:
    """CLOCK_MONOTONIC, which every process of the machine shares."""
    return time.monotonic_ns()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def add_common_args(ap: Any) -> None:
    """The options every program of the benchmark takes: the size, the device, how many
    updates and how many of them are warm-up."""
    ap.add_argument("--size", default="tiny", choices=list(SIZES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)


def parse_peer_args(ap: Any) -> Any:
    """Adds the options of a peer run with processes of its own (how long to wait for an ack,
    the run directory for their results, the record's path), parses the command line, and
    prepares the run: one torch thread, the run directory made. Returns the options."""
    ap.add_argument("--ack-timeout", type=float, default=60.0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.dir, exist_ok=True)
    return a


def record_head(run: str, a: Any, device: torch.device, src: list[torch.Tensor]) -> dict[str, Any]:
    """The first fields of a run's record: what ran, where, and on how much state."""
    return {"run": run, "size": a.size, "backend": "cuda" if device.type == "cuda" else "host",
            "device": device_name(device), "tensors": len(src),
            "bytes": sum(t.numel() * t.element_size() for t in src), "updates": a.updates,
            "warmup": a.warmup}


def error_of(e: BaseException) -> dict[str, str]:
    """What a receiving process records of the exception that ended it."""
    return {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}


def note_check(out: dict[str, Any], version: int, bad: Optional[str]) -> None:
    """Records in a receiver's results that it loaded `version`, and what its check found."""
    out["versions"].append(version)
    if bad:
        out["bad"].append([version, bad])


def join_all(procs: list[Any], what: str, problems: list[str]) -> None:
    """Waits up to 60 s for each process; kills one that does not end and says so."""
    for p in procs:
        p.join(timeout=60.0)
        if p.is_alive():
            p.kill()
            problems.append(f"{what} {p.pid} did not end")


def gather(record: dict[str, Any], results: list[tuple[str, str, str]], problems: list[str]) -> int:
    """Reads each receiver's results, (label, key, path): its memory into the record's
    memory under `key`, its errors into `problems`; returns how many updates the receivers
    verified."""
    verified = 0
    for label, key, path in results:
        try:
            with open(path) as f:
                r = json.load(f)
        except OSError:
            problems.append(f"{label} wrote no result")
            continue
        record["memory"][key] = r["memory"]
        verified += len(r["versions"]) - len(r["bad"])
        if r["error"]:
            problems.append(f"{label}: {r['error']['type']}: {r['error']['message']}")
    return verified


def finish(out: Optional[str], record: dict[str, Any]) -> int:
    """Writes the record to `out` (when given) and stdout; the exit status of the run."""
    if out:
        write_json(out, record)
    print(json.dumps(record))
    return 0 if record["ok"] else 1


def wait_acks(acks: Any, expect: set[int], v: int, timeout: float, who: str, problems: list[str],
              last: int) -> tuple[int, dict[int, tuple]]:
    """Waits for the ack of update `v` from each of `expect` (receiver or rank numbers, each
    a `who`, which the ack tuple carries second), noting in `problems` a wrong version, a
    failed check, or no ack within `timeout` s. Returns the latest ack time (`last` at least)
    and each ack that came, by number: fewer than `expect` when one did not come."""
    waiting, got = set(expect), {}
    while waiting:
        try:
            ack = acks.get(timeout=timeout)
        except queue.Empty:
            problems.append(f"update {v}: no ack from {who}s {sorted(waiting)} in {timeout} s")
            break
        _, i, rv, t1, bad = ack[:5]
        if rv != v or bad:
            problems.append(f"{who} {i} update {v}: version {rv}, {bad}")
        waiting.discard(i)
        got[i] = ack
        last = max(last, t1)
    return last, got
