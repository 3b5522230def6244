"""The NCCL peer: the trainer (rank 0, GPU 0) broadcasts every tensor of its state dict to
one rank on each other GPU (torch.distributed, one ``broadcast`` per tensor, as weight-sync
code does); gloo on the host. Each update is timed from rank 0's first broadcast to the
last rank's tensors being done, and every rank checks the marks.

  python3 nccl.py --size tiny --device cpu --ranks 2 --dir /tmp/n --out nccl.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import state


def rank_main(rank: int, args: dict[str, Any], acks: Any) -> None:
    """Ranks 1..: receive every update, check it, ack it, write the results."""
    torch.set_num_threads(1)
    cuda = args["device"] == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    out: dict[str, Any] = {"rank": rank, "versions": [], "bad": [], "error": None}
    mem = state.Memory(device)
    try:
        _init(rank, args)
        dst = list(state.make_state(args["size"], device, fill="zeros").values())
        marks = state.Marks(dst)
        acks.put(("attached", rank, 0, 0, None))
        for v in range(1, args["updates"] + 1):
            for t in dst:
                dist.broadcast(t, src=0)
            state.sync(device)
            t1 = state.now_ns()
            bad = marks.check(v)
            out["versions"].append(v)
            if bad:
                out["bad"].append([v, bad])
            mem.sample()
            acks.put(("ack", rank, v, t1, bad))
        dist.destroy_process_group()
    except BaseException as e:
        out["error"] = {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    out["memory"] = mem.summary(args["warmup"])
    state.write_json(os.path.join(args["dir"], f"nccl-rank{rank}.json"), out)


def _init(rank: int, args: dict[str, Any]) -> None:
    cuda = args["device"] == "cuda"
    kw: dict[str, Any] = {}
    if cuda:
        kw["device_id"] = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{args['dir']}/pg",
                            world_size=args["ranks"], rank=rank, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=list(state.SIZES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", type=int, default=0, help="0: one per GPU (2 on the host)")
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ack-timeout", type=float, default=60.0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.dir, exist_ok=True)
    cuda = a.device == "cuda"
    ranks = a.ranks or (torch.cuda.device_count() if cuda else 2)
    if ranks < 2:
        raise SystemExit(f"nccl.py: needs 2 or more ranks (GPUs); this machine has {ranks}")
    args = {"size": a.size, "device": a.device, "ranks": ranks, "updates": a.updates,
            "warmup": a.warmup, "dir": a.dir}
    ctx = tmp.get_context("spawn")
    acks = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, acks)) for r in range(1, ranks)]
    for p in procs:
        p.start()
    device = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    _init(0, args)
    src = list(state.make_state(a.size, device).values())
    marks = state.Marks(src)
    mem = state.Memory(device)
    for _ in procs:
        acks.get(timeout=180.0)
    problems: list[str] = []
    update_ns = []
    for v in range(1, a.updates + 1):
        marks.write(v)
        state.sync(device)
        t0 = state.now_ns()
        for t in src:
            dist.broadcast(t, src=0)
        state.sync(device)
        last, waiting = state.now_ns(), set(range(1, ranks))
        while waiting:
            try:
                kind, r, rv, t1, bad = acks.get(timeout=a.ack_timeout)
            except queue.Empty:
                problems.append(f"update {v}: no ack from ranks {sorted(waiting)}")
                break
            if rv != v or bad:
                problems.append(f"rank {r} update {v}: version {rv}, {bad}")
            waiting.discard(r)
            last = max(last, t1)
        if waiting:
            break
        update_ns.append(last - t0)
        mem.sample()
    if not problems:
        dist.destroy_process_group()
    for p in procs:
        p.join(timeout=60.0)
        if p.is_alive():
            p.kill()
            problems.append(f"rank process {p.pid} did not end")
    record: dict[str, Any] = {
        "run": "nccl", "size": a.size, "backend": "cuda" if cuda else "host",
        "device": state.device_name(device), "tensors": len(src),
        "bytes": sum(t.numel() * t.element_size() for t in src), "updates": a.updates,
        "warmup": a.warmup, "ranks": ranks, "collective": "nccl" if cuda else "gloo",
        "update_ms": state.stats_ms(update_ns[a.warmup:]),
        "memory": {"trainer": mem.summary(a.warmup)},
    }
    verified = 0
    for r in range(1, ranks):
        try:
            with open(os.path.join(a.dir, f"nccl-rank{r}.json")) as f:
                res = json.load(f)
        except OSError:
            problems.append(f"rank {r} wrote no result")
            continue
        record["memory"][f"rank{r}"] = res["memory"]
        verified += len(res["versions"]) - len(res["bad"])
        if res["error"]:
            problems.append(f"rank {r}: {res['error']['type']}: {res['error']['message']}")
    record.update({"problems": problems, "verified_updates": verified, "ok": not problems})
    if a.out:
        state.write_json(a.out, record)
    print(json.dumps(record))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
