#!/usr/bin/env python3
"""Summarises scripts/gpu/multi-gpu.sh's bench.jsonl: per configuration the median (and
min..max) of batches/s and GB/s, each run's ratio to its own same-run ceilings, and the
targets of docs/multi-gpu.md. Usage: multi_gpu_summary.py bench.jsonl"""
import json
import statistics
import sys
from collections import defaultdict


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def span(xs):
    return f"{min(xs):.3g}..{max(xs):.3g}" if xs else "-"


def consumer_gbps(c, batch_bytes):
    return c["received"] * batch_bytes / c["elapsed_s"] / 1e9 if c["elapsed_s"] > 0 else 0.0


def main(path):
    runs = defaultdict(list)
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            runs[r["tag"]].append(r["report"])
    out = []
    targets = []
    out.append(f"{'configuration':34} {'n':>2} {'batches/s':>10} {'GB/s':>8}  ratio to same-run ceiling (median, range)")
    for tag in sorted(runs):
        rs = runs[tag]
        bps = [r["batches_per_s"] for r in rs]
        gbs = [r["gb_per_s"] for r in rs]
        note = ""
        if tag.startswith("gpu1-") or tag.startswith("path-"):
            mirror = "-mirror-" in tag
            key = "peer_copy_ceiling_batches_per_s" if mirror else "remote_read_ceiling_batches_per_s"
            ratios = [r["batches_per_s"] / r["extra"]["peer_ceilings"][0][key] for r in rs]
            ceil_gb = med([r["extra"]["peer_ceilings"][0][key.replace("batches_per_s", "gb_per_s")] for r in rs])
            name = "peer copy" if mirror else "remote read"
            note = f"{med(ratios):.2f}x ({span(ratios)}) of {name} {ceil_gb:.0f} GB/s"
            if tag.startswith("gpu1-") and mirror and "-64MiB" in tag:
                targets.append(("mirror at 64 MiB >= 0.9x peer copy", med(ratios), 0.9))
            if tag.startswith("gpu1-") and not mirror:
                targets.append((f"in place {tag.split('-')[-1]} >= 0.9x remote read", med(ratios), 0.9))
        elif tag.startswith("egress-") or tag.startswith("bcast-"):
            per = [[consumer_gbps(c, r["batch_bytes"]) for c in r["per_consumer"]] for r in rs]
            tot = [sum(p) for p in per]
            copy = med([r["extra"]["peer_ceilings"][0]["peer_copy_ceiling_gb_per_s"] for r in rs])
            note = (f"per consumer {', '.join(f'{med([p[i] for p in per]):.0f}' for i in range(len(per[0])))} GB/s, "
                    f"sum {med(tot):.0f} GB/s (peer copy ceiling {copy:.0f} GB/s)")
        elif tag.startswith("gpu0-"):
            ratios = [r["extra"]["ratio_to_ceiling"] for r in rs]
            note = f"{med(ratios):.2f}x ({span(ratios)}) of the one-GPU ceiling"
        elif tag.startswith("cost-"):
            passes = rs[0].get("passes", [])
            note = f"passes per consumer {passes}; the ring's rate is GPU 0's consumer's"
        elif tag.startswith("shared-"):
            g0 = [consumer_gbps(next(c for c in r["per_consumer"] if c.get("device") == 0), r["batch_bytes"]) for r in rs]
            note = f"GPU 0 consumer {med(g0):.0f} GB/s ({span(g0)})"
            others = [consumer_gbps(c, r["batch_bytes"]) for r in rs for c in r["per_consumer"] if c.get("device") == 1]
            if others:
                note += f"; GPU 1 consumer {med(others):.0f} GB/s"
        out.append(f"{tag:34} {len(rs):>2} {med(bps):>10.0f} {med(gbs):>8.1f}  {note}")
    # "A consumer on GPU 0 loses nothing": one on GPU 0 that works on each batch (--passes),
    # alone and with a consumer on GPU 1 beside it (multi-gpu.sh cost). The ring moves at
    # GPU 0's consumer's pace, so the ring's rate is that consumer's throughput.
    for size in ("2MiB", "64MiB"):
        alone = runs.get(f"cost-alone-{size}")
        for tag in sorted(t for t in runs if t.startswith("cost-with-") and t.endswith(f"-{size}")):
            if alone:
                got = med([r["batches_per_s"] for r in runs[tag]]) / med([r["batches_per_s"] for r in alone])
                targets.append((f"GPU 0 consumer beside a GPU 1 one >= 0.95x alone ({tag[10:]})", got, 0.95))
    out.append("")
    out.append("targets (docs/multi-gpu.md):")
    for name, got, goal in targets:
        out.append(f"  {name}: {got:.2f}x -> {'met' if got >= goal else 'MISSED'}")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
