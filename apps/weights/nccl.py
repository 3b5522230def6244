"""The NCCL peer: the trainer (rank 0, GPU 0) broadcasts every tensor of its state dict to
one rank on each other GPU (torch.distributed, one ``broadcast`` per tensor, as weight-sync
code does); gloo on the host. Each update is timed from rank 0's first broadcast to the
last rank's tensors being done, and every rank checks the marks.

  python3 nccl.py --size tiny --device cpu --ranks 2 --dir /tmp/n --out nccl.json
"""

from __future__ import annotations

import argparse
import os
import sys
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
            state.note_check(out, v, bad)
            mem.sample()
            acks.put(("ack", rank, v, t1, bad))
        dist.destroy_process_group()
    except BaseException as e:
        out["error"] = state.error_of(e)
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
    state.add_common_args(ap)
    ap.add_argument("--ranks", type=int, default=0, help="0: one per GPU (2 on the host)")
    a = state.parse_peer_args(ap)
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
        last, got = state.wait_acks(acks, set(range(1, ranks)), v, a.ack_timeout, "rank", problems,
                                    state.now_ns())
        if len(got) < ranks - 1:
            break
        update_ns.append(last - t0)
        mem.sample()
    if not problems:
        dist.destroy_process_group()
    state.join_all(procs, "rank process", problems)
    record: dict[str, Any] = {
        **state.record_head("nccl", a, device, src), "ranks": ranks,
        "collective": "nccl" if cuda else "gloo",
        "update_ms": state.stats_ms(update_ns[a.warmup:]),
        "memory": {"trainer": mem.summary(a.warmup)},
    }
    results = [(f"rank {r}", f"rank{r}", os.path.join(a.dir, f"nccl-rank{r}.json"))
               for r in range(1, ranks)]
    verified = state.gather(record, results, problems)
    record.update({"problems": problems, "verified_updates": verified, "ok": not problems})
    return state.finish(a.out, record)


if __name__ == "__main__":
    sys.exit(main())
