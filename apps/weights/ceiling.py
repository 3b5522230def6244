"""The ceiling: a state dict copied into another on the same device, in one process
(HBM bandwidth on a GPU). Each update writes the version's marks into the source, then times
the copies (``copy_`` per tensor, and ``torch._foreach_copy_``) until the device is done, and
checks the marks of the copy.

  python3 ceiling.py --size tiny --device cpu --out ceiling.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    state.add_common_args(ap)
    ap.add_argument("--dir", help="unused: every program of run_all.py takes it")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    src = list(state.make_state(a.size, device).values())
    dst = list(state.make_state(a.size, device, fill="zeros").values())
    marks, dmarks = state.Marks(src), state.Marks(dst)
    mem = state.Memory(device)
    record: dict[str, Any] = {**state.record_head("ceiling", a, device, src), "problems": []}
    v = 0
    for how in ("each", "foreach"):
        times = []
        for _ in range(a.updates):
            v += 1
            marks.write(v)
            state.sync(device)
            t0 = state.now_ns()
            if how == "each":
                for d, s in zip(dst, src):
                    d.copy_(s)
            else:
                torch._foreach_copy_(dst, src)
            state.sync(device)
            times.append(state.now_ns() - t0)
            bad = dmarks.check(v)
            if bad:
                record["problems"].append(f"{how} update {v}: {bad}")
            mem.sample()
        record[f"update_ms_{how}"] = state.stats_ms(times[a.warmup:])
    best = min(("each", "foreach"), key=lambda h: record[f"update_ms_{h}"]["p50"])
    record["update_ms"] = dict(record[f"update_ms_{best}"], how=best)
    record["memory"] = {"trainer": mem.summary(a.warmup)}
    record["verified_updates"] = v - len(record["problems"])
    record["ok"] = not record["problems"]
    return state.finish(a.out, record)


if __name__ == "__main__":
    sys.exit(main())
