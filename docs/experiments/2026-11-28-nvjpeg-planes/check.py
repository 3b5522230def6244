#!/usr/bin/env python3
"""Are nvjpeg_planes.py's planes what the JPEG holds? For each image: its Y, Cb and Cr planes
(copied back to the host) against PIL's decode of the same file converted to YCbCr (its chroma
averaged over the subsampled block), and the planes kernel's crops against the RGB decode's,
per image. Then each plane alignment's decode under torch.profiler: what it ran on the GPU.

    python3 docs/experiments/2026-11-28-nvjpeg-planes/check.py /tmp/loader-data

Needs planes.patch applied (README.md).
"""

import io
import json
import os
import sys
import time

import numpy as np
import torch
from PIL import Image
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../apps/loader"))
import gpu_decode  # noqa: E402
import make_dataset  # noqa: E402
import nvjpeg_planes  # noqa: E402
from torchvision.io import ImageReadMode, decode_jpeg  # noqa: E402


def encode(img, **kw):
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **kw)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def main() -> int:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    images = gpu_decode.open_images(sys.argv[1])
    big = make_dataset.draw_image(3, {"min_size": (300, 400), "max_size": (301, 401), "seed": 1, "noise": 8,
                                      "classes": 3})
    jpegs = [encode(big, subsampling=2), encode(big, subsampling=0), encode(big, subsampling=1)]
    jpegs += [images.read(i) for i in range(6)]
    out = {"images": []}
    for align in (1, 256):
        dec = nvjpeg_planes.PlanesDecoder(dev, align=align)
        planes = dec(jpegs)
        torch.cuda.synchronize()
        buf = planes.buffer.cpu().numpy()
        rgb = decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=dev)
        a, b = gpu_decode.Augment(64, dev, seed=3), gpu_decode.Augment(64, dev, seed=3)
        x, y = a(planes), b(rgb)
        torch.cuda.synchronize()
        for i, j in enumerate(jpegs):
            row = [int(v) for v in planes.table[i]]
            pil = np.asarray(Image.open(io.BytesIO(j.numpy().tobytes())).convert("YCbCr")).astype(np.float32)
            h, w, ch, cw, p0, p1 = row[3], row[4], row[5], row[6], row[8], row[9]
            yp = buf[row[0]: row[0] + h * p0].reshape(h, p0)[:, :w].astype(np.float32)
            cb = buf[row[1]: row[1] + ch * p1].reshape(ch, p1)[:, :cw].astype(np.float32)
            fy, fx = max(1, round(h / ch)), max(1, round(w / cw))
            padded = np.pad(pil[:, :, 1], ((0, ch * fy - h), (0, cw * fx - w)), mode="edge")
            pcb = padded.reshape(ch, fy, cw, fx).mean(axis=(1, 3))
            gpu_rgb = rgb[i].permute(1, 2, 0).cpu().numpy().astype(np.float32)
            pil_rgb = np.asarray(Image.open(io.BytesIO(j.numpy().tobytes())).convert("RGB")).astype(np.float32)
            out["images"].append({
                "align": align, "row": row,
                "y_vs_pil": round(float(np.abs(yp - pil[:, :, 0]).mean()), 2),
                "cb_vs_pil_block_mean": round(float(np.abs(cb[: pcb.shape[0], : pcb.shape[1]] - pcb).mean()), 2),
                "nvjpeg_rgb_vs_pil_rgb": round(float(np.abs(gpu_rgb - pil_rgb).mean()), 2),
                "crop_diff_mean": round(float((x[i].float() - y[i].float()).abs().mean()), 4),
                "crop_diff_max": round(float((x[i].float() - y[i].float()).abs().max()), 4)})
        datas = [images.read(i) for i in range(256)]
        for _ in range(3):
            dec(datas)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dec(datas)
        wall = (time.perf_counter() - t0) / (5 * 256) * 1e6
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec(datas)
            torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:60]] = round(per.get(e.name[:60], 0) + e.device_time_total / 256, 2)
        out[f"align{align}"] = {"wall_us_per_image": round(wall, 1), "gpu_us_per_image": per}
    for r in out["images"]:
        print(json.dumps(r))
    print(json.dumps({k: v for k, v in out.items() if k != "images"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
