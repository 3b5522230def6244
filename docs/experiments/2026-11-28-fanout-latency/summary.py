#!/usr/bin/env python3
"""The table of run.sh's results: per latency run (gpipe, and the torch.multiprocessing queues
run_all.py runs beside it), MPS, pinned or not, and each consumer's
p50/p99 µs with the steps' p99; then the floor's readers.

    python3 docs/experiments/2026-11-28-fanout-latency/summary.py OUT
"""

import json
import os
import sys


def main() -> None:
    out = sys.argv[1]
    print("| run | MPS | CPUs | consumers p50/p99 µs | p99 µs of recv, view, model+release, result (worst consumer) | publish call p50/p99 |")
    print("|---|---|---|---|---|---|")
    for line in open(os.path.join(out, "fanout.jsonl")):
        r = json.loads(line)
        if not r.get("latency_run"):
            continue
        cons = r.get("consumers") or []
        lat = ", ".join(f"{c['latency']['p50_us']:.0f}/{c['latency']['p99_us']:.0f}" for c in cons
                        if c.get("latency"))
        steps = [c.get("latency_steps") or {} for c in cons]
        worst = " / ".join(f"{max(s[k]['p99_us'] for s in steps if k in s):.0f}"
                           for k in ("recv", "view", "model_release", "result")
                           if any(k in s for s in steps))
        pub = r.get("publish_call") or {}
        pinned = "pinned" if r.get("pinned_cpus") else "scheduler"
        ok = "" if r.get("ok") else " (not ok)"
        print(f"| {r.get('run')} | {r.get('mps')} | {pinned} | {lat}{ok} | {worst} | "
              f"{pub.get('p50_us', '-')}/{pub.get('p99_us', '-')} |")
    floor = os.path.join(out, "floor.jsonl")
    if os.path.exists(floor):
        print()
        print("| floor: readers | p50/p99/max µs of each |")
        print("|---|---|")
        for line in open(floor):
            r = json.loads(line)
            each = ", ".join(f"{x['p50_us']:.0f}/{x['p99_us']:.0f}/{x['max_us']:.0f}"
                             for x in r["results"] if x.get("n"))
            print(f"| {r['readers']} {r['wait']} | {each} |")

if __name__ == "__main__":
    main()
