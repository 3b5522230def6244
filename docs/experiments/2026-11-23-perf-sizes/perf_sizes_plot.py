"""Draws the plot from docs/experiments/2026-11-23-perf-sizes/perf-sizes.sh's sizes.jsonl: batches/s against batch
size with the fair ceiling (the run's own work in one process), for 1 and 4 broadcast
consumers, MPS on and off; the median of the repetitions with their min..max as error bars.

    python3 docs/experiments/2026-11-23-perf-sizes/perf_sizes_plot.py docs/experiments/2026-11-23-perf-sizes/2026-11-23-h100-perf-sizes.jsonl docs/experiments/2026-11-23-perf-sizes/2026-11-23-h100-perf-sizes.svg
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1 << 20


def main(src, dst):
    rows = {}
    for line in open(src):
        r = json.loads(line)
        tag, rep = r["tag"], r["report"]
        if "slots-auto" in tag:
            continue
        mps, cons, _ = tag.split("-", 2)
        x = rep["extra"]
        runs = (rep.get("repetitions") or {}).get("batches_per_s") or {}
        rows.setdefault((mps, cons), []).append(
            (
                rep["batch_bytes"] / MIB,
                rep["batches_per_s"],
                runs.get("min", rep["batches_per_s"]),
                runs.get("max", rep["batches_per_s"]),
                x["fair_ceiling_batches_per_s"],
            )
        )
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, cons in zip(axes, ["1c", "4c"]):
        for mps, color in [("on", "tab:blue"), ("off", "tab:red")]:
            pts = sorted(rows.get((mps, cons), []))
            if not pts:
                continue
            xs = [p[0] for p in pts]
            med = [p[1] for p in pts]
            lo = [p[1] - p[2] for p in pts]
            hi = [p[3] - p[1] for p in pts]
            ax.errorbar(xs, med, yerr=[lo, hi], color=color, marker="o", capsize=3,
                        label=f"gpipe, MPS {mps}")
            ax.plot(xs, [p[4] for p in pts], color=color, linestyle="--", alpha=0.7,
                    label=f"fair ceiling (MPS {mps} run)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (MiB)")
        ax.set_title(f"{cons[0]} broadcast consumer{'s' if cons != '1c' else ''}, 8 slots")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("batches/s (median of 3; bars: min..max)")
    fig.suptitle("gpipe bench on an NVIDIA H100, driver 580.159.04, 2026-11-23", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
