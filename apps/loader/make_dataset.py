#!/usr/bin/env python3
"""Writes a folder of synthetic JPEG files to train on, with no download.

Layout: ``ROOT/class_XXX/NNNNNNN.jpg`` (image NNNNNNN belongs to class NNNNNNN % classes), the
layout ``torchvision.datasets.ImageFolder`` reads. Each image is drawn from its own seed
(``--seed`` and its index), so the same arguments always give the same bytes, whatever the
number of processes:

- a two-colour linear gradient at a random angle, whose hue follows the class (so a model
  has something to learn);
- Gaussian noise of random strength (which sets most of the file size);
- 3 to 10 shapes (ellipses, rectangles, polygons, lines) in random colours;
- 1 to 3 short words of text in random sizes.

Sizes are uniform in ``--min-size``..``--max-size`` (width x height); baseline JPEG with 4:2:0
chroma subsampling, the kind the GPU's hardware decoder takes. With the defaults (20000 images,
400-640 x 300-480, quality 90) the files average about 55 KB, about 1.1 GB in all.

``ROOT/dataset.json`` records the arguments, the count and the total size; a second run with
the same arguments finds it and does nothing (``--force`` makes the images again).

    python3 apps/loader/make_dataset.py /tmp/loader-data --count 20000
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WORDS = (
    "gpipe", "ring", "slot", "batch", "tensor", "publish", "release", "epoch", "stream",
    "decode", "crop", "flip", "zero-copy", "H100", "broadcast", "shared", "ready", "finished",
)


def parse_size(text: str) -> tuple[int, int]:
    """'400x300' -> (400, 300): width by height in pixels."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 400x300, not {text!r}")
    if w < 8 or h < 8:
        raise argparse.ArgumentTypeError(f"{text}: images must be at least 8x8")
    return w, h


def image_path(root: str, index: int, classes: int) -> str:
    return os.path.join(root, f"class_{index % classes:03d}", f"{index:07d}.jpg")


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    """One HSV colour (each in 0..1) as an RGB float vector in 0..255."""
    i = int(h * 6) % 6
    f = h * 6 - math.floor(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]
    return np.array(rgb, dtype=np.float32) * 255.0


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, 3))  # type: ignore[return-value]


def draw_image(index: int, cfg: dict) -> Image.Image:
    """The image with this index: deterministic in (cfg["seed"], index)."""
    rng = np.random.default_rng([cfg["seed"], index])
    label = index % cfg["classes"]
    (wmin, hmin), (wmax, hmax) = cfg["min_size"], cfg["max_size"]
    w = int(rng.integers(wmin, wmax + 1))
    h = int(rng.integers(hmin, hmax + 1))

    # Gradient between two colours whose hue is set by the class.
    hue = (label / cfg["classes"] + rng.normal(0.0, 0.02)) % 1.0
    c0 = _hsv(hue, rng.uniform(0.4, 1.0), rng.uniform(0.4, 1.0))
    c1 = _hsv((hue + rng.uniform(0.05, 0.25)) % 1.0, rng.uniform(0.2, 1.0), rng.uniform(0.2, 1.0))
    angle = rng.uniform(0.0, 2.0 * math.pi)
    xs = np.linspace(0.0, 1.0, w, dtype=np.float32) * math.cos(angle)
    ys = np.linspace(0.0, 1.0, h, dtype=np.float32) * math.sin(angle)
    t = ys[:, None] + xs[None, :]
    t -= t.min()
    t /= max(float(t.max()), 1e-6)
    pixels = c0 + (c1 - c0) * t[:, :, None]
    # Noise: its strength sets most of the compressed size.
    pixels += rng.standard_normal((h, w, 3), dtype=np.float32) * rng.uniform(4.0, cfg["noise"])
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")

    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 11))):
        kind = int(rng.integers(0, 4))
        x0, x1 = sorted(int(v) for v in rng.integers(0, w, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, h, 2))
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=_colour(rng))
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=_colour(rng), outline=_colour(rng))
        elif kind == 2:
            pts = [(int(rng.integers(0, w)), int(rng.integers(0, h))) for _ in range(int(rng.integers(3, 7)))]
            draw.polygon(pts, fill=_colour(rng))
        else:
            draw.line((x0, y0, x1, y1), fill=_colour(rng), width=int(rng.integers(1, 8)))
    for _ in range(int(rng.integers(1, 4))):
        size = int(rng.integers(max(8, h // 20), max(9, h // 5)))
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1: the fixed bitmap font
            font = ImageFont.load_default()
        word = WORDS[int(rng.integers(0, len(WORDS)))]
        pos = (int(rng.integers(0, max(1, w - size))), int(rng.integers(0, max(1, h - size))))
        draw.text(pos, word, fill=_colour(rng), font=font)
    return img


def _write_range(job: tuple[int, int, dict]) -> int:
    """Writes images [start, stop) and returns the bytes written."""
    start, stop, cfg = job
    total = 0
    for i in range(start, stop):
        path = image_path(cfg["root"], i, cfg["classes"])
        draw_image(i, cfg).save(path, format="JPEG", quality=cfg["quality"], subsampling=2)
        total += os.path.getsize(path)
    return total


def make_dataset(
    root: str,
    count: int = 20000,
    classes: int = 100,
    min_size: tuple[int, int] = (400, 300),
    max_size: tuple[int, int] = (640, 480),
    quality: int = 90,
    noise: float = 18.0,
    seed: int = 0,
    processes: int | None = None,
    force: bool = False,
    quiet: bool = False,
) -> dict:
    """Makes the data set (or finds it made with the same arguments); returns its record."""
    if count < 1 or classes < 1:
        raise ValueError("count and classes must be at least 1")
    if min_size[0] > max_size[0] or min_size[1] > max_size[1]:
        raise ValueError(f"--min-size {min_size} is larger than --max-size {max_size}")
    params = {
        "count": count, "classes": classes, "min_size": list(min_size), "max_size": list(max_size),
        "quality": quality, "noise": noise, "seed": seed,
    }
    record_path = os.path.join(root, "dataset.json")
    if not force and os.path.exists(record_path):
        with open(record_path) as f:
            record = json.load(f)
        if record.get("params") == params:
            if not quiet:
                print(f"{root}: already made with these arguments ({record['bytes'] / 1e6:.0f} MB)", flush=True)
            return record
    os.makedirs(root, exist_ok=True)
    if os.path.exists(record_path):
        os.remove(record_path)
    for c in range(min(classes, count)):
        os.makedirs(os.path.join(root, f"class_{c:03d}"), exist_ok=True)

    cfg = {**params, "root": root, "min_size": tuple(min_size), "max_size": tuple(max_size)}
    processes = processes or os.cpu_count() or 1
    chunk = max(1, min(256, count // (processes * 8) or 1))
    jobs = [(s, min(s + chunk, count), cfg) for s in range(0, count, chunk)]
    t0 = time.perf_counter()
    written, done, next_report = 0, 0, 0.0
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ctx.Pool(processes) as pool:
        for (start, stop, _), nbytes in zip(jobs, pool.imap(_write_range, jobs)):
            written += nbytes
            done += stop - start
            now = time.perf_counter() - t0
            if not quiet and (now >= next_report or done == count):
                print(f"  {done}/{count} images, {written / 1e6:.0f} MB, {now:.1f} s", flush=True)
                next_report = now + 5.0
    seconds = time.perf_counter() - t0
    record = {
        "params": params, "bytes": written, "seconds": round(seconds, 2),
        "mean_kb": round(written / count / 1e3, 1), "processes": processes,
    }
    with open(record_path, "w") as f:
        json.dump(record, f)
    if not quiet:
        print(
            f"{root}: {count} images in {classes} classes, {written / 1e6:.0f} MB "
            f"({record['mean_kb']} KB each), {seconds:.1f} s with {processes} processes",
            flush=True,
        )
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="folder to write (made if missing)")
    ap.add_argument("--count", type=int, default=20000, help="number of images (default 20000)")
    ap.add_argument("--classes", type=int, default=100, help="number of classes (default 100)")
    ap.add_argument("--min-size", type=parse_size, default=(400, 300), help="smallest WxH (default 400x300)")
    ap.add_argument("--max-size", type=parse_size, default=(640, 480), help="largest WxH (default 640x480)")
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality 1-95 (default 90)")
    ap.add_argument("--noise", type=float, default=18.0, help="largest noise std in 0-255 units (default 18)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=None, help="worker processes (default: every core)")
    ap.add_argument("--force", action="store_true", help="make the images even if ROOT/dataset.json matches")
    a = ap.parse_args(argv)
    make_dataset(
        a.root, a.count, a.classes, a.min_size, a.max_size, a.quality, a.noise, a.seed,
        a.processes, a.force,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
