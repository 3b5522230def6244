#!/usr/bin/env python3
"""The loader's fused crop kernel (apps/loader/fused_augment.py) against an earlier version of
it, in one process on the same decoded batch, the same crops and flips: the GPU time of each
kernel by torch.profiler, per image, and how far apart their outputs are. Prints one JSON
object.

    python3 docs/experiments/2026-11-28-crop-kernel/bench.py /tmp/loader-data --before OLD.py

OLD.py: the earlier fused_augment.py, e.g. `git show e989fb6:apps/loader/fused_augment.py`.
"""

import argparse
import importlib.util
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../apps/loader"))
import fused_augment  # noqa: E402
import gpu_decode  # noqa: E402
from torchvision.io import ImageReadMode, decode_jpeg  # noqa: E402


def kernel_us(module, images, boxes, flips, aug, repeat):
    """Microseconds of GPU time of the module's kernel a call (summed by the profiler), and
    its output."""
    args = (images, boxes, flips, 224, aug.mul_c, aug.add_c)
    out = module.crop_resize(*args)  # compiles it
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            module.crop_resize(*args, out=out)
        torch.cuda.synchronize()
    t = sum(e.device_time_total for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "gpipe_crop_resize" in e.name)
    return t / repeat, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--before", required=True, help="the earlier fused_augment.py")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("fused_augment_before", a.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    images_set = gpu_decode.open_images(a.data)
    images = decode_jpeg([images_set.read(i) for i in range(a.batch)], mode=ImageReadMode.RGB, device=dev)
    aug = gpu_decode.Augment(224, dev, seed=1)
    boxes = aug.boxes(torch.tensor([im.shape[1] for im in images]), torch.tensor([im.shape[2] for im in images]))
    flips = aug.flips(len(images))
    rounds = []
    for _ in range(3):  # alternated, in case the GPU's clocks move
        t_before, out_before = kernel_us(before, images, boxes, flips, aug, a.repeat)
        t_now, out_now = kernel_us(fused_augment, images, boxes, flips, aug, a.repeat)
        rounds.append((t_before, t_now))
    diff = (out_before.float() - out_now.float()).abs()
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(0), "batch": a.batch,
        "before_us_per_image": [round(b / a.batch, 3) for b, _ in rounds],
        "now_us_per_image": [round(n / a.batch, 3) for _, n in rounds],
        "now_over_before": [round(n / b, 3) for b, n in rounds],
        "outputs_max_abs_diff": diff.max().item(), "outputs_mean_abs_diff": diff.mean().item()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
