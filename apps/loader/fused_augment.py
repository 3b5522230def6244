"""The loader's augmentation as one CUDA kernel: random-resized crop, resize, flip and
normalise of a whole batch, read straight from the decoded images.

:class:`gpu_decode.Augment` does the same with a handful of torch kernels: a copy of every
image into a padded float32 batch (one kernel per image), ``torchvision.ops.roi_align``, a
flip and a fused multiply-add. On an H100 that cost about 10 µs of GPU time per image, more
than the decode itself, and every microsecond of it is taken from the trainer that shares the
GPU. This kernel computes what ``roi_align(aligned=False, sampling_ratio=-1)`` computes (the
same adaptive grid of bilinear samples per output pixel, so it does not alias when it
shrinks), for every image of the batch at once, from a table of the images' addresses, and
writes the float16 channels_last output (a gpipe slot, say) directly.

It is compiled at run time by CuPy (NVRTC) and launched on torch's current stream. Without
CuPy (or where it cannot compile the kernel), :func:`ready` is False and ``Augment`` keeps its
torch path.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

_SOURCE = r"""
extern "C" __global__ void gpipe_crop_resize(
    const unsigned long long* images,  // n addresses of uint8 images, 3 x H x W or H x W x 3
    const float* params,               // n x 8: H, W, x1, y1, x2, y2, flip, H x W x 3
    unsigned short* out,               // n x S x S x 3 float16 (channels_last)
    int n, int s,
    float m0, float m1, float m2, float a0, float a1, float a2)
{
    // a grid of n rows of blocks: blockIdx.y is the image, the threads of a row its S x S
    // output pixels (no 64-bit division a thread)
    int b = blockIdx.y;
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n || r >= s * s) return;
    long long i = (long long)b * s * s + r;
    int oy = r / s, ox = r - oy * s;
    const float* p = params + 8 * b;
    int H = (int)p[0], W = (int)p[1];
    const unsigned char* img = (const unsigned char*)images[b];
    int px = p[6] > 0.5f ? s - 1 - ox : ox;  // a flipped output column reads the mirror one
    // roi_align, aligned=False: the box's corners are pixel centres, its size at least 1
    float rw = fmaxf(p[4] - p[2], 1.f), rh = fmaxf(p[5] - p[3], 1.f);
    float bw = rw / s, bh = rh / s;
    int gw = (int)ceilf(rw / s), gh = (int)ceilf(rh / s);
    float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f;
    // where the next channel, and the next pixel of a row, are
    long long plane = p[7] > 0.5f ? 1 : (long long)H * W;
    long long step = p[7] > 0.5f ? 3 : 1;
    // the samples' first row and column, and their spacing, once a thread
    float y0 = p[3] + oy * bh, x0 = p[2] + px * bw, dy = bh / gh, dx = bw / gw;
    for (int iy = 0; iy < gh; ++iy) {
        float y = y0 + (iy + .5f) * dy;
        for (int ix = 0; ix < gw; ++ix) {
            float x = x0 + (ix + .5f) * dx;
            if (y < -1.f || y > H || x < -1.f || x > W) continue;
            float yy = fmaxf(y, 0.f), xx = fmaxf(x, 0.f);
            int yl = (int)yy, xl = (int)xx, yh, xh;
            if (yl >= H - 1) { yh = yl = H - 1; yy = (float)yl; } else { yh = yl + 1; }
            if (xl >= W - 1) { xh = xl = W - 1; xx = (float)xl; } else { xh = xl + 1; }
            float ly = yy - yl, lx = xx - xl, hy = 1.f - ly, hx = 1.f - lx;
            float w1 = hy * hx, w2 = hy * lx, w3 = ly * hx, w4 = ly * lx;
            long long o1 = ((long long)yl * W + xl) * step, o2 = ((long long)yl * W + xh) * step;
            long long o3 = ((long long)yh * W + xl) * step, o4 = ((long long)yh * W + xh) * step;
            acc0 += w1 * img[o1] + w2 * img[o2] + w3 * img[o3] + w4 * img[o4];
            acc1 += w1 * img[plane + o1] + w2 * img[plane + o2] + w3 * img[plane + o3] + w4 * img[plane + o4];
            acc2 += w1 * img[2 * plane + o1] + w2 * img[2 * plane + o2] + w3 * img[2 * plane + o3]
                  + w4 * img[2 * plane + o4];
        }
    }
    float c = 1.f / (float)max(gh * gw, 1);
    unsigned short* o = out + 3 * i;
    o[0] = __half_as_ushort(__float2half(acc0 * c * m0 + a0));
    o[1] = __half_as_ushort(__float2half(acc1 * c * m1 + a1));
    o[2] = __half_as_ushort(__float2half(acc2 * c * m2 + a2));
}
"""

_kernels: dict[int, Any] = {}


def ready(device: torch.device) -> bool:
    """Whether the fused kernel runs on ``device``: CuPy imports and compiles it there (a CuPy
    built for another CUDA, or without NVRTC, fails here rather than at the first batch)."""
    try:
        _kernel(device)
    except Exception as e:  # noqa: BLE001 - any failure means: use the torch path
        import sys

        print(f"fused_augment: the fused kernel is not available on {device} ({type(e).__name__}: {e}); "
              "the torch kernels augment instead", file=sys.stderr)
        return False
    return True


def _kernel(device: torch.device) -> Any:
    import cupy

    k = _kernels.get(device.index or 0)
    if k is None:
        with cupy.cuda.Device(device.index or 0):
            k = cupy.RawKernel("#include <cuda_fp16.h>\n" + _SOURCE, "gpipe_crop_resize")
            k.compile()
        _kernels[device.index or 0] = k
    return k


def crop_resize(images: Sequence[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, size: int,
                mul: Sequence[float], add: Sequence[float], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``images``: 3 x H x W uint8 CUDA tensors of one device, each laid out as 3 x H x W
    (contiguous) or as H x W x 3 (``hwc.permute(2, 0, 1)`` of a contiguous one, as a CPU
    JPEG decoder writes them); ``boxes``: n x 4 (x1, y1, x2,
    y2) as ``roi_align`` takes them; ``flips``: n flags. Returns (or fills ``out``) the n x 3 x
    size x size float16 channels_last batch ``crop * mul + add``, enqueued on the current
    stream. The images must stay alive until it has run (record them on the stream)."""
    import numpy as np

    n = len(images)
    dev = images[0].device
    for im in images:
        if (im.dtype != torch.uint8 or im.dim() != 3 or im.shape[0] != 3 or im.device != dev
                or not (im.is_contiguous() or _hwc(im))):
            raise ValueError(f"crop_resize takes 3 x H x W uint8 images on {dev}, laid out as 3 x H x W "
                             f"or H x W x 3; got {im.dtype} {tuple(im.shape)} (strides {im.stride()}) "
                             f"on {im.device}")
    ptrs = np.array([im.data_ptr() for im in images], dtype=np.int64)
    heights = np.array([im.shape[1] for im in images])
    widths = np.array([im.shape[2] for im in images])
    hwc = np.array([_hwc(im) and not im.is_contiguous() for im in images])
    return _launch(dev, ptrs, heights, widths, hwc, boxes, flips, size, mul, add, out)


def crop_resize_packed(flat: torch.Tensor, table: Any, boxes: torch.Tensor, flips: torch.Tensor, size: int,
                       mul: Sequence[float], add: Sequence[float], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What :func:`crop_resize` does, for images packed one after the other in ``flat`` (a
    contiguous uint8 CUDA tensor), each H x W x 3, where ``table``'s rows (offset, height,
    width; n x 3 integers, a tensor or an array) say. No tensor is made per image: a
    trainer that augments a batch of 256 spends its CPU time on the batch, not on 256 views
    of it (host_decode.py's Upload). ``flat`` must stay alive until it has run."""
    import numpy as np

    t = np.asarray(table.numpy() if isinstance(table, torch.Tensor) else table, dtype=np.int64)
    if (flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous() or flat.device.type != "cuda"
            or t.ndim != 2 or t.shape[1] != 3 or t.shape[0] == 0):
        raise ValueError(f"crop_resize_packed takes a contiguous 1-D uint8 CUDA tensor and an n x 3 table "
                         f"(offset, height, width); got {flat.dtype} {tuple(flat.shape)} on {flat.device} "
                         f"and a table of shape {t.shape}")
    offsets, heights, widths = t[:, 0], t[:, 1], t[:, 2]
    ends = offsets + 3 * heights * widths
    if (offsets < 0).any() or (heights < 1).any() or (widths < 1).any() or ends.max() > flat.numel():
        raise ValueError(f"crop_resize_packed: the table's images do not all lie in the {flat.numel()} "
                         "bytes given (a negative offset, an empty image, or one past the end)")
    return _launch(flat.device, flat.data_ptr() + offsets, heights, widths, np.ones(len(t), dtype=bool),
                   boxes, flips, size, mul, add, out)


def _launch(dev: torch.device, ptrs: Any, heights: Any, widths: Any, hwc: Any, boxes: torch.Tensor,
            flips: torch.Tensor, size: int, mul: Sequence[float], add: Sequence[float],
            out: Optional[torch.Tensor]) -> torch.Tensor:
    """Enqueues the kernel on the current stream for n images at the addresses ``ptrs`` (their
    heights, widths and whether each is H x W x 3: NumPy arrays of n)."""
    import cupy
    import numpy as np

    n = len(ptrs)
    if n > 65535:  # the grid's rows: one an image
        raise ValueError(f"the fused kernel takes at most 65535 images a call; got {n}")
    if out is None:
        out = torch.empty((n, 3, size, size), dtype=torch.float16, device=dev, memory_format=torch.channels_last)
    elif (tuple(out.shape) != (n, 3, size, size) or out.dtype != torch.float16
          or not out.is_contiguous(memory_format=torch.channels_last) or out.device != dev):
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; expected a channels_last "
                         f"float16 {(n, 3, size, size)} on {dev}")
    # built with NumPy on this thread: torch's CPU ops would go through its intra-op pool
    # (see gpu_decode.Augment.boxes)
    params = np.empty((n, 8), dtype=np.float32)
    params[:, 0], params[:, 1] = heights, widths
    params[:, 2:6] = boxes.cpu().numpy()
    params[:, 6] = flips.cpu().numpy()
    params[:, 7] = hwc
    params_d = torch.from_numpy(params).pin_memory().to(dev, non_blocking=True)
    ptrs_d = torch.from_numpy(np.asarray(ptrs, dtype=np.int64)).pin_memory().to(dev, non_blocking=True)
    threads = 256
    stream = torch.cuda.current_stream(dev)
    with cupy.cuda.Device(dev.index or 0), cupy.cuda.ExternalStream(stream.cuda_stream):
        _kernel(dev)(
            ((size * size + threads - 1) // threads, n), (threads,),  # a row of blocks an image
            (np.uint64(ptrs_d.data_ptr()), np.uint64(params_d.data_ptr()), np.uint64(out.data_ptr()),
             np.int32(n), np.int32(size), *(np.float32(v) for v in mul), *(np.float32(v) for v in add)),
        )
    return out


def _hwc(im: torch.Tensor) -> bool:
    """Whether a 3 x H x W image is laid out as H x W x 3 (a channel's values 1 apart)."""
    return im.permute(1, 2, 0).is_contiguous()
