#!/usr/bin/env python3
"""Draws scripts/gpu/multi-gpu.sh's bench.jsonl: GB/s moved to one consumer on GPU 1, in place
and mirrored, by batch size, against the same-run link ceilings (median of the repetitions).
Usage: multi_gpu_plot.py bench.jsonl out.svg"""
import json
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SIZES = ["2MiB", "8MiB", "64MiB", "256MiB"]


def main(src, out):
    runs = defaultdict(list)
    for line in open(src):
        if line.strip():
            r = json.loads(line)
            runs[r["tag"]].append(r["report"])
    med = statistics.median
    series = {
        "in place (kernel on GPU 1 reads GPU 0)": [med([r["gb_per_s"] for r in runs[f"gpu1-in-place-{s}"]]) for s in SIZES],
        "mirror (copy engine, then local read)": [med([r["gb_per_s"] for r in runs[f"gpu1-mirror-{s}"]]) for s in SIZES],
    }
    ceil = {
        "remote-read ceiling (one process)": [med([r["extra"]["peer_ceilings"][0]["remote_read_ceiling_gb_per_s"] for r in runs[f"gpu1-in-place-{s}"]]) for s in SIZES],
        "peer-copy ceiling (one process)": [med([r["extra"]["peer_ceilings"][0]["peer_copy_ceiling_gb_per_s"] for r in runs[f"gpu1-mirror-{s}"]]) for s in SIZES],
    }
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = range(len(SIZES))
    w = 0.38
    for i, (name, ys) in enumerate(series.items()):
        ax.bar([xi + (i - 0.5) * w for xi in x], ys, w, label=name)
    for (name, ys), style in zip(ceil.items(), ["k--", "k:"]):
        ax.plot(list(x), ys, style, marker="o", label=name)
    ax.set_xticks(list(x), SIZES)
    ax.set_xlabel("batch size")
    ax.set_ylabel("GB/s to one consumer on GPU 1")
    ax.set_title("Producer on GPU 0, consumer on GPU 1 (2x H200, NVLink), median of 3")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
