#!/usr/bin/env python3
"""What the GPU decode costs the GPU, and which nvJPEG engine does it: decodes one batch of
the data set's JPEGs with torchvision's ``decode_jpeg(list, device="cuda")`` (the loader's
GPU decode) under torch.profiler, prints the CUDA kernels it ran and their time per image,
then asks nvJPEG itself whether this GPU has its hardware decoder (nvjpegCreateEx with the
hardware backend, and nvjpegGetHardwareDecoderInfo).

    python3 docs/experiments/2026-11-28-nvjpeg-probe/probe.py /tmp/loader-data --batch 256
"""

import argparse
import ctypes
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../apps/loader"))
from gpu_decode import open_images  # noqa: E402


def nvjpeg_library() -> str:
    """The libnvjpeg this process has loaded (torchvision's), from /proc/self/maps."""
    for line in open("/proc/self/maps"):
        if "libnvjpeg" in line:
            return line.split()[-1]
    return ""


def hardware_info(path: str) -> dict:
    lib = ctypes.CDLL(path)
    handle = ctypes.c_void_p()
    out = {"library": path}
    # nvjpegCreateEx(backend, dev_allocator, pinned_allocator, flags, &handle); 3: HARDWARE
    status = lib.nvjpegCreateEx(3, None, None, 0, ctypes.byref(handle))
    out["create_hardware_status"] = status  # 0: success; 7: not supported here
    if status == 0:
        engines, cores = ctypes.c_uint(), ctypes.c_uint()
        st = lib.nvjpegGetHardwareDecoderInfo(handle, ctypes.byref(engines), ctypes.byref(cores))
        out.update(info_status=st, engines=engines.value, cores_per_engine=cores.value)
        lib.nvjpegDestroy(handle)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    images = open_images(a.data)
    datas = [images.read(i) for i in range(a.batch)]
    dev = torch.device("cuda", 0)
    for _ in range(3):  # warm up: the decoder's state, its buffers
        decode_jpeg(datas, mode=ImageReadMode.RGB, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.repeat):
        decode_jpeg(datas, mode=ImageReadMode.RGB, device=dev)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / (a.repeat * a.batch) * 1e6
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.repeat):
            decode_jpeg(datas, mode=ImageReadMode.RGB, device=dev)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    per_image = {n: round(t / (a.repeat * a.batch), 2) for n, (c, t) in kernels.items()}
    top = sorted(per_image.items(), key=lambda kv: -kv[1])[:12]
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "batch": a.batch,
                      "wall_us_per_image": round(wall_us, 2),
                      "gpu_us_per_image_all_kernels": round(sum(per_image.values()), 2),
                      "top_kernels_us_per_image": top,
                      "nvjpeg": hardware_info(nvjpeg_library())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
