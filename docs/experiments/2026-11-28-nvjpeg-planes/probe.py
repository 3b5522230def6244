#!/usr/bin/env python3
"""The loader's GPU decode and augmentation, both ways, on one batch: torchvision's RGB decode
then the fused crop kernel, against nvjpeg_planes.py's decode into the JPEGs' planes then the
planes kernel. For each: wall time of decode alone and of decode + augment (one thread, the
batch after batch a worker runs), and the GPU time of every kernel and copy, by
torch.profiler, per image. Prints one JSON object.

    python3 docs/experiments/2026-11-28-nvjpeg-planes/probe.py /tmp/loader-data --batch 256

Needs planes.patch applied (README.md).
"""

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../apps/loader"))
import gpu_decode  # noqa: E402
import nvjpeg_planes  # noqa: E402
from torchvision.io import ImageReadMode, decode_jpeg  # noqa: E402


def measure(name, decode, datas, dev, repeat):
    aug = gpu_decode.Augment(224, dev, seed=1)
    for _ in range(3):
        aug(decode(datas))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        decode(datas)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(repeat):
        aug(decode(datas))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            aug(decode(datas))
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name[:80]] = per.get(e.name[:80], 0.0) + t
    n = repeat * len(datas)
    kernels = {k: round(v / n, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v / n >= 0.01}
    return {"path": name, "decode_wall_us_per_image": round((t1 - t0) / n * 1e6, 2),
            "decode_augment_wall_us_per_image": round((t2 - t1) / n * 1e6, 2),
            "gpu_us_per_image_kernels": round(sum(v for k, v in kernels.items() if "Memcpy" not in k
                                                  and "Memset" not in k), 2),
            "gpu_us_per_image_all": round(sum(kernels.values()), 2), "by_name": kernels}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    images = gpu_decode.open_images(a.data)
    datas = [images.read(i) for i in range(a.batch)]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    planes = nvjpeg_planes.decoder_for(dev)
    out = {"gpu": torch.cuda.get_device_name(0), "batch": a.batch, "runs": [
        measure("torchvision RGB + fused kernel", lambda d: decode_jpeg(d, mode=ImageReadMode.RGB, device=dev),
                datas, dev, a.repeat),
        measure("nvjpeg planes + planes kernel", planes, datas, dev, a.repeat)]}
    kinds = planes(datas).table[:, 7]
    out["planes_decoded_by_hardware"] = int((kinds == nvjpeg_planes.KIND_YCBCR).sum())
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
