#!/usr/bin/env python3
"""Bar chart of the loader's results (run_all.py's loader.jsonl): images/s per configuration,
one panel per model (and one for the 2-GPU runs), one bar colour per run (e.g. without and
with MPS), the training-only ceiling as a dashed line. Needs matplotlib; without it, says so
and exits 0.

    python3 apps/loader/plot.py /tmp/o/loader.jsonl /tmp/o/loader.svg
"""

from __future__ import annotations

import argparse
import json
import sys

# The producer's own rate (config "producer") is in the summary table; as a bar it would dwarf
# the training rates.
ORDER = ("dataloader", "inprocess", "gpipe", "ceiling")
NAMES = {"dataloader": "DataLoader\n(16 workers)", "inprocess": "in-process\nGPU decode", "gpipe": "gpipe"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("output", help="image file; the extension picks the format (.svg, .png)")
    a = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed; no chart", file=sys.stderr)
        return 0
    recs = [json.loads(line) for line in open(a.jsonl) if line.strip()]
    recs = [r for r in recs if r.get("config") in ORDER and r.get("images_per_s")]
    if not recs:
        print("plot.py: no results to plot", file=sys.stderr)
        return 0
    panels = list(dict.fromkeys((r["model"], r.get("world_size", 1)) for r in recs))
    runs = list(dict.fromkeys(r["run"] for r in recs))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (model, world) in zip(axes[0], panels):
        mine = [r for r in recs if r["model"] == model and r.get("world_size", 1) == world]
        configs = [c for c in ORDER if any(r["config"] == c for r in mine) and c != "ceiling"]
        width = 0.8 / max(1, len(runs))
        for k, run in enumerate(runs):
            vals = []
            for c in configs:
                hit = [r["images_per_s"] for r in mine if r["run"] == run and r["config"] == c]
                vals.append(hit[-1] if hit else 0)
            xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(configs))]
            bars = ax.bar(xs, vals, width, label=run)
            for b, v in zip(bars, vals):
                if v:
                    ax.text(b.get_x() + b.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
        ceil = [r["images_per_s"] for r in mine if r["config"] == "ceiling"]
        if ceil:
            ax.axhline(max(ceil), ls="--", color="grey", lw=1)
            ax.text(len(configs) - 0.5, max(ceil), f"ceiling {max(ceil):,.0f}", ha="right", va="bottom", fontsize=8)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([NAMES[c] for c in configs], fontsize=8)
        ax.set_title(f"{model}" + (f", {world} GPUs (DDP)" if world > 1 else ", 1 GPU"))
        ax.set_ylabel("images/s")
        ax.legend(fontsize=8)
    gpu = next((r.get("gpu") for r in recs if r.get("gpu")), "")
    fig.suptitle(f"gpipe data loader: training images/s {gpu}", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.output)
    print(f"plot.py: wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
