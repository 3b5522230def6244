"""The torch.multiprocessing peer: CUDA IPC on the trainer's GPU (shared memory on the
host). Each update, the trainer sends every tensor's ``reduce_tensor`` (the handle torch's
queues send) through a pipe; the receiver rebuilds each tensor, copies it into its own
tensors, synchronises, checks the marks and acks. Timed from the trainer's first
``reduce_tensor`` to the receiver's copies being done, and split at the moment the receiver
had rebuilt every tensor (``handles_ms``, then ``copies_ms``).

  python3 ipc.py --size tiny --device cpu --receivers 1 --out ipc.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.multiprocessing as tmp
from torch.multiprocessing.reductions import reduce_tensor

import state


def receiver(idx: int, dev: str, conn: Any, args: dict[str, Any], acks: Any) -> None:
    torch.set_num_threads(1)
    device = torch.device(dev)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dst = list(state.make_state(args["size"], device, fill="zeros").values())
    marks = state.Marks(dst)
    mem = state.Memory(device)
    out: dict[str, Any] = {"idx": idx, "versions": [], "bad": [], "error": None}
    acks.put(("attached", idx, 0, 0, None, 0))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            v, handles = msg
            src = [fn(*fargs) for fn, fargs in handles]
            t_rebuilt = state.now_ns()
            for d, s in zip(dst, src):
                d.copy_(s)
            state.sync(device)
            t1 = state.now_ns()
            del src, handles, msg
            bad = marks.check(v)
            state.note_check(out, v, bad)
            mem.sample()
            acks.put(("ack", idx, v, t1, bad, t_rebuilt))
    except BaseException as e:
        out["error"] = state.error_of(e)
    out["memory"] = mem.summary(args["warmup"])
    state.write_json(os.path.join(args["dir"], f"ipc-rx{idx}.json"), out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    state.add_common_args(ap)
    ap.add_argument("--receivers", type=int, default=1)
    a = state.parse_peer_args(ap)
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    src = list(state.make_state(a.size, device).values())
    marks = state.Marks(src)
    mem = state.Memory(device)
    ctx = tmp.get_context("spawn")
    acks = ctx.Queue()
    cfg = {"size": a.size, "warmup": a.warmup, "dir": a.dir}
    procs, conns = [], []
    for i in range(a.receivers):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=receiver, args=(i, str(device), theirs, cfg, acks))
        p.start()
        procs.append(p)
        conns.append(mine)
    for _ in range(a.receivers):
        acks.get(timeout=180.0)
    problems: list[str] = []
    update_ns, send_ns, rebuild_ns, copy_ns = [], [], [], []
    for v in range(1, a.updates + 1):
        marks.write(v)
        state.sync(device)
        t0 = state.now_ns()
        handles = [reduce_tensor(t) for t in src]
        for c in conns:
            c.send((v, handles))
        t_sent = state.now_ns()
        del handles
        last, got = state.wait_acks(acks, set(range(a.receivers)), v, a.ack_timeout, "receiver",
                                    problems, t0)
        if 0 in got:
            *_, t1, _, t_rebuilt = got[0]
            rebuild_ns.append(t_rebuilt - t0)
            copy_ns.append(t1 - t_rebuilt)
        if len(got) < a.receivers:
            break
        update_ns.append(last - t0)
        send_ns.append(t_sent - t0)
        mem.sample()
    for c in conns:
        c.send(None)
    state.join_all(procs, "receiver", problems)
    record: dict[str, Any] = {
        **state.record_head("ipc", a, device, src), "receivers": a.receivers,
        "update_ms": state.stats_ms(update_ns[a.warmup:]),
        "send_ms": state.stats_ms(send_ns[a.warmup:]),
        # receiver 0: from the first reduce_tensor to its tensors rebuilt, then its copies
        "handles_ms": state.stats_ms(rebuild_ns[a.warmup:]),
        "copies_ms": state.stats_ms(copy_ns[a.warmup:]),
        "memory": {"trainer": mem.summary(a.warmup)},
    }
    results = [(f"receiver {i}", f"rx{i}", os.path.join(a.dir, f"ipc-rx{i}.json"))
               for i in range(a.receivers)]
    verified = state.gather(record, results, problems)
    record.update({"problems": problems, "verified_updates": verified, "ok": not problems})
    return state.finish(a.out, record)


if __name__ == "__main__":
    sys.exit(main())
