#!/usr/bin/env python3
"""The table of a JSONL file of tagged `gpipe bench --json` reports ({"tag": ..., "report":
...} per line, as scripts/gpu/lib.sh's bench_into writes them): per tag the batches/s (median
and range over the repetitions), GB/s, the ratio to the fair ceiling (the run's own work in one
process), the slots (the depth chosen for --slots auto), the round trip's p50 and its overhead
(p50 minus one fill and verify in one process), and whether every batch arrived verified.

    python3 scripts/gpu/bench_summary.py bench.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys


def field(rep: dict, key: str):
    """A report field, at the top level or under `extra` (where older reports keep it)."""
    if key in rep:
        return rep[key]
    return (rep.get("extra") or {}).get(key)


def row(tag: str, rep: dict) -> str:
    reps = rep.get("repetitions") or {}
    bps = reps.get("batches_per_s") or {}
    rate = f"{rep['batches_per_s']:>9.0f}"
    if bps:
        rate += f" ({bps['min']:.0f}..{bps['max']:.0f})"
    ratio = (reps.get("ratio_to_fair_ceiling") or {}).get("median", field(rep, "ratio_to_fair_ceiling"))
    ratio_s = f"{ratio:.3f}" if isinstance(ratio, (int, float)) else "-"
    rtt = ""
    p50 = rep.get("round_trip_p50_us")
    if p50:
        over = []
        for run in reps.get("runs") or [rep]:
            fair = run.get("fair_ceiling_batches_per_s") or field(rep, "fair_ceiling_batches_per_s")
            run_p50 = run.get("round_trip_p50_us") or p50
            if fair:
                over.append(run_p50 - 1e6 / fair)
        rtt = f"p50 {p50:.1f} us"
        if over:
            rtt += f", overhead {statistics.median(over):.1f} us"
    bad = rep.get("mismatches", 0) + rep.get("lost", 0) + rep.get("duplicated", 0)
    ok = "ok" if bad == 0 and not rep.get("problems") else f"PROBLEMS {bad} {rep.get('problems')}"
    return (f"{tag:30} {rate:28} {rep.get('gb_per_s', 0):7.1f} {ratio_s:>6} {rep.get('slots', '-'):>5}"
            f"  {rtt:32} {ok}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(f"{'tag':30} {'batches/s median (min..max)':28} {'GB/s':>7} {'ratio':>6} {'slots':>5}  "
          f"{'round trip':32} batches")
    for line in open(argv[0]):
        if line.strip():
            r = json.loads(line)
            print(row(r["tag"], r["report"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
