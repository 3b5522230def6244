#!/usr/bin/env python3
"""Tables of `gpipe bench --gpu-timeline` runs (docs/experiments/2026-11-23-gpu-timeline/gpu-timeline.sh).

    python3 docs/experiments/2026-11-23-gpu-timeline/timeline_summary.py timeline.jsonl [raw-TAG.json ...]

For each tagged report: batches/s, the ratio to the fair ceiling, and the GPU timeline of
the median repetition (busy, overlap, idle gaps, kernel times, handover). For each raw file
(`--gpu-timeline-out`): how the kernels of the two sides alternate, as runs of consecutive
kernels of one side, which is what time-slicing between processes looks like.
"""

from __future__ import annotations

import json
import sys


def table(path: str) -> None:
    cols = ("busy", "overlap", "per_batch_us", "fill_us_p50", "verify_us_p50",
            "handover_us_p50", "handover_us_p99", "idle_gaps", "idle_gap_us_total",
            "idle_gap_us_p50", "idle_gap_us_max")  # fmt: skip
    print(f"{'configuration':<28} {'batches/s':>10} {'ratio':>6} " + " ".join(f"{c:>8}" for c in cols))
    for line in open(path):
        r = json.loads(line)
        rep = r["report"]
        t = rep.get("extra", {}).get("gpu_timeline") or {}
        ratio = rep.get("extra", {}).get("ratio_to_fair_ceiling")
        cells = " ".join(f"{t.get(c, '-'):>8}" for c in cols)
        print(f"{r['tag']:<28} {rep['batches_per_s']:>10.0f} {ratio or 0:>6.3f} {cells}")


def runs(path: str) -> None:
    """Runs of consecutive kernels of one side, in GPU time order."""
    raw = json.load(open(path))
    spans = [(s, "P") for s in raw["fills"] if s[0]]
    for v in raw["verifies"]:
        spans += [(s, "C") for s in v if s[0]]
    spans.sort(key=lambda x: x[0][0])
    lengths = {"P": [], "C": []}
    side, n, last_end = None, 0, 0
    switches = []
    for (s, who) in spans:
        if who != side:
            if side is not None:
                lengths[side].append(n)
                # From the latest end so far (kernels may overlap with MPS): negative when
                # the next side's kernel started while the last was still running.
                switches.append(s[0] - last_end)
            side, n = who, 0
        n += 1
        last_end = max(last_end, s[1])
    if side is not None:
        lengths[side].append(n)

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else 0

    sw = sorted(switches)  # ns
    print(
        f"{path}: {len(spans)} kernels; runs of one side: producer median {med(lengths['P'])} "
        f"(max {max(lengths['P'], default=0)}), consumer median {med(lengths['C'])} "
        f"(max {max(lengths['C'], default=0)}); at a switch of side, the next kernel started "
        f"{med(sw) / 1e3:.1f} µs (median) / {(sw[int(0.9 * (len(sw) - 1))] if sw else 0) / 1e3:.1f} "
        f"µs (p90) after the latest end so far"
    )


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    table(argv[0])
    for p in argv[1:]:
        try:
            runs(p)
        except (OSError, ValueError, KeyError) as e:
            print(f"{p}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
