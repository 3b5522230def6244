#!/usr/bin/env python3
"""run.sh's table: each run's images/s against the ceiling, the trainer's wait, and its own
time a step (the step less its wait for data), median and mean over the timed steps.

    python3 docs/experiments/2026-11-28-worker-cpus/summary.py OUT/loader.jsonl
"""

import json
import statistics
import sys


def main() -> None:
    recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    ceiling = next((r["images_per_s"] for r in recs if r.get("config") == "ceiling"
                    and r.get("images_per_s")), None)
    print("| run | workers | images/s | / ceiling | waited | own ms a step: median, mean | GPU busy |")
    print("|---|---|---|---|---|---|---|")
    for r in recs:
        t = r.get("timeline") or {}
        own = [s - w for s, w in zip(t.get("step_ms", []), t.get("wait_ms", [0.0] * len(t.get("step_ms", []))))]
        ratio = f"{r['images_per_s'] / ceiling:.3f}" if ceiling and r.get("images_per_s") else "-"
        own_s = f"{statistics.median(own):.2f}, {statistics.mean(own):.2f}" if own else "-"
        wait = r.get("wait_fraction")
        print(f"| {r.get('run')} ({r.get('config')}) | {r.get('workers', '-')} | {r.get('images_per_s')} | "
              f"{ratio} | {'-' if wait is None else f'{wait:.1%}'} | {own_s} | {r.get('gpu_util')} |")


if __name__ == "__main__":
    main()
