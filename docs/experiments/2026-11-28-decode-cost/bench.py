"""The CPU cost of host decode's per-image work, the old way against the new, on one core
and on every core at once (a whole node's worth of decode workers, as the Loader runs them).

    python3 docs/experiments/2026-11-28-decode-cost/bench.py /tmp/loader-data [--procs N]

old: Pillow decode, convert("RGB"), numpy, a 3 x H x W repack (host_decode.py before
2026-11-28); new: torchvision's CPU decode_jpeg (libjpeg-turbo), one contiguous copy of its
H x W x 3 output (host_decode.py now). Prints ms per image on one core and images/s with
--procs processes, each decoding the same files; one JSON line at the end.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import multiprocessing
import os
import time


def _old(data: bytes, buf) -> None:
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        rgb = np.asarray(im.convert("RGB"))
    h, w = rgb.shape[:2]
    buf.numpy()[: 3 * h * w].reshape(3, h, w)[:] = rgb.transpose(2, 0, 1)


def _new(data, buf) -> None:
    from torchvision.io import ImageReadMode, decode_jpeg

    chw = decode_jpeg(data, mode=ImageReadMode.RGB)
    h, w = chw.shape[1], chw.shape[2]
    buf[: 3 * h * w].view(h, w, 3).copy_(chw.permute(1, 2, 0))


def _run(way: str, files: list[str], seconds: float, start: float, q) -> None:
    import torch

    torch.set_num_threads(1)
    raw = [open(f, "rb").read() for f in files]
    datas = raw if way == "old" else [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in raw]
    buf = torch.empty(3 * 1024 * 1024, dtype=torch.uint8)
    fn = _old if way == "old" else _new
    for d in datas[:20]:
        fn(d, buf)  # warm
    while time.time() < start:
        time.sleep(0.001)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(datas[n % len(datas)], buf)
        n += 1
    q.put((n, time.perf_counter() - t0))


def measure(way: str, files: list[str], procs: int, seconds: float) -> tuple[float, float]:
    """(images/s of all processes together, ms per image of one)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    start = time.time() + 3.0 + procs * 0.02
    ps = [ctx.Process(target=_run, args=(way, files, seconds, start, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    got = [q.get(timeout=120) for _ in ps]
    for p in ps:
        p.join()
    rate = sum(n / t for n, t in got)
    return rate, 1e3 * procs / rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data")
    ap.add_argument("--procs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--files", type=int, default=300)
    a = ap.parse_args()
    files = sorted(glob.glob(os.path.join(a.data, "*", "*.jpg")))[: a.files]
    if not files:
        raise SystemExit(f"no JPEGs under {a.data}/*/: make them with apps/loader/make_dataset.py")
    out = {"files": len(files), "cpus": len(os.sched_getaffinity(0)), "procs": a.procs}
    for way in ("old", "new"):
        one, ms = measure(way, files, 1, a.seconds)
        many, ms_many = measure(way, files, a.procs, a.seconds)
        out[way] = {"one_core_ms": round(ms, 3), "node_img_s": round(many), "procs_ms": round(ms_many, 3)}
        print(f"{way}: {ms:.3f} ms an image on one core; {many:,.0f} img/s with {a.procs} processes "
              f"({ms_many:.3f} ms an image each)", flush=True)
    print(f"new/old node images/s: {out['new']['node_img_s'] / out['old']['node_img_s']:.2f}x")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
