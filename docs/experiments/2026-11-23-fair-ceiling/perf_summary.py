#!/usr/bin/env python3
"""Summarises docs/experiments/2026-11-23-fair-ceiling/perf.sh's perf.jsonl: per configuration the median (min..max) of
batches/s and of the ratio to the fair ceiling over the repetitions, the round-trip overhead,
and the targets. A tag that appears on several lines (rounds of one script) gets a
row per line; the targets use its last. Usage: perf_summary.py perf.jsonl"""
import json
import statistics
import sys


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by = {r["tag"]: r["report"] for r in rows}
    print(f"{'configuration':28} {'batches/s (median, min..max)':32} {'ratio to fair ceiling':26} lead")
    for tag, r in ((x["tag"], x["report"]) for x in rows):
        rep = r.get("repetitions") or {}
        b = rep.get("batches_per_s") or {"median": r["batches_per_s"], "min": r["batches_per_s"], "max": r["batches_per_s"]}
        f = rep.get("ratio_to_fair_ceiling") or {"median": r["extra"]["ratio_to_fair_ceiling"]}
        fr = f"{f['median']:.3f} ({f.get('min', f['median']):.3f}..{f.get('max', f['median']):.3f})"
        print(f"{tag:28} {b['median']:>9.0f} ({b['min']:.0f}..{b['max']:.0f}){'':8} {fr:26} {r.get('max_lead')}")
    print()
    print("round trip at 2 MiB, 1 slot (p50 per repetition, minus the one-process fill + verify time):")
    for tag, r in ((x["tag"], x["report"]) for x in rows):
        if "rtt" not in tag:
            continue
        runs = (r.get("repetitions") or {}).get("runs") or [r]
        over = []
        for x in runs:
            fair = x.get("fair_ceiling_batches_per_s") or r["extra"]["fair_ceiling_batches_per_s"]
            p50 = x.get("round_trip_p50_us") or r["round_trip_p50_us"]
            over.append(p50 - 1e6 / fair)
        print(f"  {tag}: p50 {r['round_trip_p50_us']:.1f} us; overhead median {statistics.median(over):.1f} us ({min(over):.1f}..{max(over):.1f})")
    print()
    print("targets , median ratio to the fair ceiling:")
    def ratio(tag):
        r = by.get(tag)
        if not r:
            return None
        rep = r.get("repetitions") or {}
        return (rep.get("ratio_to_fair_ceiling") or {"median": r["extra"]["ratio_to_fair_ceiling"]})["median"]
    for name, tags, goal in [
        ("MPS 1 consumer 2 MiB >= 0.9", ["mps-1c-2MiB-lead-ring", "mps-1c-2MiB-lead-auto"], 0.9),
        ("MPS 1 consumer 8 MiB >= 0.9", ["mps-1c-8MiB-lead-ring", "mps-1c-8MiB-lead-auto"], 0.9),
        ("MPS 1 consumer 64 MiB >= 0.97", ["mps-1c-64MiB-lead-ring", "mps-1c-64MiB-lead-auto"], 0.97),
        ("MPS 4 consumers broadcast 2 MiB >= 0.8", ["mps-4c-broadcast-2MiB"], 0.8),
        ("no MPS 2 MiB >= 0.5", ["nomps-1c-2MiB-slots8", "nomps-1c-2MiB-slots32"], 0.5),
    ]:
        got = [(t, ratio(t)) for t in tags if ratio(t) is not None]
        if not got:
            continue
        best = max(got, key=lambda x: x[1])
        print(f"  {name}: " + ", ".join(f"{t} {v:.3f}" for t, v in got) + f" -> {'met' if best[1] >= goal else 'MISSED'}")


if __name__ == "__main__":
    main(sys.argv[1])
