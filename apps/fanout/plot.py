#!/usr/bin/env python3
"""Charts of an inference fan-out run: reads run_all.py's fanout.jsonl and writes one figure
(PNG and SVG) with two panels: frames/s of every throughput run (the source as fast as
possible), MPS off and on side by side; and p50/p99 latency per model at the fixed rate,
gpipe against torch.multiprocessing, with the empty model's (the added latency).

Needs matplotlib; without it, says so and exits 0 (the JSONL and run_all's table have the
same figures).

    python3 apps/fanout/plot.py /tmp/gpipe-fanout/fanout.jsonl --out /tmp/gpipe-fanout/fanout
"""

from __future__ import annotations

import argparse
import json
import sys


def load(path: str) -> list[dict]:
    recs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                recs.append(json.loads(line))
    return recs


def throughput_bars(recs: list[dict]) -> tuple[list[str], dict[str, list]]:
    """Bar labels (run, mode, models) and, per MPS setting, the frames/s of each."""
    labels: list[str] = []
    values: dict[str, dict[str, float]] = {}
    for r in recs:
        if r.get("latency_run") or r.get("fps") is None:
            continue
        models = r.get("models") or []
        name = f"{r['run']} {r['mode']}"
        if r["run"] == "solo":
            name += f"\n{models[0]}"
        if name not in labels:
            labels.append(name)
        values.setdefault(str(r.get("mps")), {})[name] = r["fps"]
    return labels, {mps: [v.get(lb, 0.0) for lb in labels] for mps, v in values.items()}


def latency_bars(recs: list[dict]) -> tuple[list[str], dict[str, list], dict[str, list]]:
    """Bar labels (run, mode, model) and, per MPS setting, the p50 and p99 of each (ms)."""
    labels: list[str] = []
    p50: dict[str, dict] = {}
    p99: dict[str, dict] = {}
    for r in recs:
        if not r.get("latency_run"):
            continue
        for i, c in enumerate(r.get("consumers") or []):
            lat = (c or {}).get("latency")
            if not lat:
                continue
            model = c.get("model")
            if all(m == "empty" for m in r.get("models") or []):
                model = f"empty #{i + 1} (added)"
            name = f"{r['run']} {r['mode']}\n{model}"
            if name not in labels:
                labels.append(name)
            p50.setdefault(str(r.get("mps")), {})[name] = lat["p50_us"] / 1e3
            p99.setdefault(str(r.get("mps")), {})[name] = lat["p99_us"] / 1e3

    def cols(d):
        return {mps: [v.get(lb, 0.0) for lb in labels] for mps, v in d.items()}

    return labels, cols(p50), cols(p99)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("jsonl", help="run_all.py's fanout.jsonl")
    ap.add_argument(
        "--out", default="fanout", help="output path without extension (default ./fanout)"
    )
    a = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("plot: matplotlib is not installed; no chart written", file=sys.stderr)
        return 0
    recs = [r for r in load(a.jsonl) if not r.get("quick")] or load(a.jsonl)
    t_labels, t_vals = throughput_bars(recs)
    l_labels, l50, l99 = latency_bars(recs)
    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(max(10, 0.9 * max(len(t_labels), len(l_labels))), 10)
    )
    width = 0.8 / max(1, len(t_vals))
    for n, (mps, vals) in enumerate(sorted(t_vals.items())):
        xs = [i + n * width for i in range(len(t_labels))]
        ax1.bar(xs, vals, width, color=f"C{n}", label=f"MPS {mps}")
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(t_labels))], t_labels, fontsize=7)
    ax1.set_ylabel("frames/s")
    ax1.set_title("Throughput, source as fast as possible")
    ax1.legend()
    width = 0.8 / max(1, len(l50))
    for n, mps in enumerate(sorted(l50)):
        xs = [i + n * width for i in range(len(l_labels))]
        ax2.bar(xs, l99[mps], width, color=f"C{n}", alpha=0.4, label=f"p99, MPS {mps}")
        ax2.bar(xs, l50[mps], width, color=f"C{n}", label=f"p50, MPS {mps}")
    ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(l_labels))], l_labels, fontsize=7)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax2.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax2.set_ylabel("ms from publish to result")
    rates = sorted({r.get("rate") for r in recs if r.get("latency_run")})
    ax2.set_title(f"Latency at a fixed rate ({', '.join(str(x) for x in rates)} frames/s)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(f"{a.out}.{ext}")
    print(f"plot: wrote {a.out}.png and {a.out}.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
