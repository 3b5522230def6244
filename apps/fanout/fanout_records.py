"""Records of the inference fan-out's runs, without torch (run_all.py imports only this):
the model names, latency statistics and a fan-out run's record."""

from __future__ import annotations

import math
from typing import Optional

# The three models of the application, and the two that exist for tests and measurements.
MODELS = ("resnet50", "vit_b_16", "convnext_tiny")
EXTRA_MODELS = ("tiny", "empty")


def percentile(sorted_values: list, q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an already sorted list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def latency_summary(ns: list[int]) -> Optional[dict]:
    """p50/p99/max/mean in microseconds of a list of latencies in nanoseconds."""
    if not ns:
        return None
    s = sorted(ns)
    return {
        "n": len(s),
        "p50_us": round(percentile(s, 50) / 1e3, 1),
        "p99_us": round(percentile(s, 99) / 1e3, 1),
        "max_us": round(s[-1] / 1e3, 1),
        "mean_us": round(sum(s) / len(s) / 1e3, 1),
    }


def fanout_record(
    run: str,
    mode: str,
    rate: float,
    t_start_ns: Optional[int],
    timed: int,
    consumers: list[dict],
    extra: Optional[dict] = None,
) -> dict:
    """One fan-out run as a record: frames/s of the whole fan-out (timed frames over the time
    from the source's start of timing to the end of the last consumer's last frame), and
    every consumer's own result."""
    fps = None
    ends = [c.get("t_end_ns") for c in consumers]
    if t_start_ns is not None and timed and consumers and all(e is not None for e in ends):
        span = (max(ends) - t_start_ns) / 1e9
        fps = round(timed / span, 1) if span > 0 else None
    ok = bool(consumers) and all(
        c.get("end") == "closed"
        and c.get("out_of_order") == 0
        and c.get("check_failures") == 0
        and c.get("timed") == timed
        for c in consumers
    )
    rec = {
        "run": run,
        "mode": mode,
        "models": [c.get("model") for c in consumers],
        "rate": rate,
        "timed": timed,
        "fps": fps,
        "ok": ok,
        "consumers": consumers,
    }
    if extra:
        rec.update(extra)
    return rec
