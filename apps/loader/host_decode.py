"""The loader's host-decode mode: JPEGs decoded on the CPU in the loader's workers, cropped,
resized, flipped and normalised on the GPU in the trainer's own process.

Why: without MPS, decode processes on the trainer's GPU take turns with the trainer on it
(time slices between processes), and the trainer lost 35-55% (docs/examples.md). Here no
process but the trainer's touches the GPU. The workers (processes of ``gpipe.torch.Loader``
on host rings) decode with Pillow and pack a batch's images, 3 x H x W uint8 one after the
other, into one buffer of the slot, with a table of where each one is. The trainer's
:class:`Upload` copies the used part of that buffer to the GPU in one transfer (from the slot
itself, page-locked in place once per slot), then runs the fused augmentation kernel
(``fused_augment.py``) on a side stream; the training stream waits for it. On the CPU (tests)
the same unpacking feeds ``gpu_decode.Augment``'s torch path.

    python3 apps/loader/loader_lib.py --data /tmp/loader-data --host-decode
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any, Iterator, Optional

import torch

from gpu_decode import Augment

# The table's columns: where an image starts in the buffer, its height and width.
_OFFSET, _HEIGHT, _WIDTH = 0, 1, 2


def largest_image(path: str) -> tuple[int, int]:
    """(height, width) of the largest image make_dataset.py made for the data set at `path`
    (its dataset.json; a pack's folder is the pack's name without .pack)."""
    folder = path[: -len(".pack")] if path.endswith(".pack") else path
    meta = os.path.join(folder, "dataset.json")
    try:
        with open(meta) as f:
            w, h = json.load(f)["params"]["max_size"]
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"host decode: cannot read the largest image size from {meta} ({e}); "
                         "make the data set with apps/loader/make_dataset.py") from e
    return int(h), int(w)


class HostDecode:
    """decode(samples, device) for the loader's workers, on the CPU: each JPEG decoded by
    Pillow into 3 x H x W uint8, packed into one buffer sized for `batch` images of at most
    `max_hw`; returns (buffer, table, labels)."""

    def __init__(self, batch: int, max_hw: tuple[int, int]) -> None:
        self.batch, self.max_hw = batch, max_hw

    def __call__(self, samples: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import numpy as np
        from PIL import Image

        if len(samples) != self.batch:
            raise ValueError(f"host decode packs batches of {self.batch} images; got {len(samples)}")
        mh, mw = self.max_hw
        buf = torch.empty(self.batch * 3 * mh * mw, dtype=torch.uint8)
        flat = buf.numpy()
        table = torch.empty((self.batch, 3), dtype=torch.int64)
        at = 0
        for i, (data, _) in enumerate(samples):
            with Image.open(io.BytesIO(data.numpy().tobytes())) as im:
                rgb = np.asarray(im.convert("RGB"))
            h, w = rgb.shape[0], rgb.shape[1]
            if h > mh or w > mw:
                raise ValueError(f"image {i} of the batch is {w}x{h}, larger than the {mw}x{mh} the "
                                 "buffer was sized for (the data set's dataset.json max_size)")
            n = 3 * h * w
            # numpy's strided copy: a third of the time of torch's on one thread
            flat[at : at + n].reshape(3, h, w)[:] = rgb.transpose(2, 0, 1)
            table[i, _OFFSET], table[i, _HEIGHT], table[i, _WIDTH] = at, h, w
            at += n
        labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
        return buf, table, labels


class Upload:
    """The trainer's side of host decode: batches of (buffer, table, labels) in a host ring's
    slot become (images, labels) on `device`, augmented (random-resized crop to `size`, flip,
    normalise; float16 channels_last).

    On CUDA, per batch: the buffer's used bytes go to the GPU in one copy on a side stream,
    the fused kernel reads the images there, and the current stream waits for the side
    stream. The copy reads the slot directly: each slot is page-locked in place the first
    time it is seen (``cudaHostRegister``; where that fails, the buffer goes through a
    page-locked staging copy instead, and ``pinned`` says so). A batch is let go one step
    later, once its copy has run, so its slot is not refilled under the copy.

    A registration outlives its slot's mapping if the loader closes that ring, and a later
    mapping at the same address would then read the old pages. This relies on the loader
    opening no ring after it closed one (rings close when their worker retires, which stops
    ``auto``, or when the epochs are done); :meth:`close` unpins before the loader unmaps.
    """

    def __init__(self, batches: Iterator, device: torch.device, size: int, seed: int) -> None:
        self.batches, self.device, self.size = batches, device, size
        self.augment = Augment(size, "cpu", seed=seed)  # its boxes and flips; CPU generator
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.registered: dict[int, int] = {}
        self.pinned: Optional[bool] = None
        self.held: Optional[tuple[Any, Any]] = None
        if self.cuda:
            import fused_augment

            if not fused_augment.ready(device):
                raise SystemExit("host decode needs the fused augmentation kernel (CuPy); it is not "
                                 f"available on {device}")

    def __iter__(self) -> "Upload":
        return self

    def _register(self, t: torch.Tensor) -> bool:
        """Page-locks the slot under `t` in place, once; False where CUDA refuses."""
        ptr, size = t.data_ptr(), t.numel() * t.element_size()
        if self.registered.get(ptr) == size:
            return True
        # 8: cudaHostRegisterReadOnly; a consumer maps its slots read-only, and the GPU only
        # reads them
        if int(torch.cuda.cudart().cudaHostRegister(ptr, size, 8)) == 0:
            self.registered[ptr] = size
            return True
        _clear_cuda_error()
        return False

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        buf, table, labels, info = next(self.batches)
        rows = table.tolist()
        used = max(o + 3 * h * w for o, h, w in rows)
        heights = torch.tensor([h for _, h, _ in rows])
        widths = torch.tensor([w for _, _, w in rows])
        boxes = self.augment.boxes(heights, widths)
        flips = torch.rand(len(rows), generator=self.augment.generator) < self.augment.flip_p
        if not self.cuda:
            images = [buf[o : o + 3 * h * w].view(3, h, w) for o, h, w in rows]
            out = _augment_cpu(self.augment, images, boxes, flips, self.size)
            return out, labels.clone(), info
        import fused_augment

        dev = self.device
        if self.pinned is None or self.pinned:
            ok = self._register(buf)
            if self.pinned is None and not ok:
                print("host decode: cudaHostRegister refused the ring's slots; copying through "
                      "page-locked memory instead", file=sys.stderr)
            self.pinned = ok
        src = buf[:used] if self.pinned else buf[:used].pin_memory()
        cur = torch.cuda.current_stream(dev)
        with torch.cuda.stream(self.side):
            staging = torch.empty(used, dtype=torch.uint8, device=dev)
            staging.copy_(src, non_blocking=True)
            images = [staging[o : o + 3 * h * w].view(3, h, w) for o, h, w in rows]
            out = fused_augment.crop_resize(images, boxes, flips, self.size, self.augment.mul_c,
                                            self.augment.add_c)
            labels_d = labels.pin_memory().to(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        cur.wait_event(done)
        out.record_stream(cur)
        labels_d.record_stream(cur)
        # the last batch's copy has long run by now: let its slot go
        if self.held is not None:
            self.held[1].synchronize()
        self.held = ((buf, table, labels, src), done)
        return out, labels_d, info

    def close(self) -> None:
        """Waits for the last copy and unpins the slots (before the loader unmaps them)."""
        if self.held is not None:
            self.held[1].synchronize()
            self.held = None
        if self.cuda:
            rt = torch.cuda.cudart()
            for ptr in self.registered:
                rt.cudaHostUnregister(ptr)
            self.registered.clear()


def _clear_cuda_error() -> None:
    """Resets the CUDA runtime's last error after a refused cudaHostRegister, which torch
    would otherwise report at its next kernel launch as that kernel's error."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # torch's own copy
        except OSError:
            continue
        lib.cudaGetLastError()
        return


def _augment_cpu(aug: Augment, images: list, boxes: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """Augment's torch path with the given boxes and flips (on the CPU)."""
    from torchvision.ops import roi_align

    n = len(images)
    hmax = max(im.shape[1] for im in images)
    wmax = max(im.shape[2] for im in images)
    pad = torch.zeros((n, 3, hmax, wmax), dtype=torch.float32)
    for i, im in enumerate(images):
        pad[i, :, : im.shape[1], : im.shape[2]] = im
    rois = torch.cat([torch.arange(n, dtype=torch.float32)[:, None], boxes.float()], dim=1)
    crops = roi_align(pad, rois, output_size=(size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=False)
    crops = torch.where(flips.view(n, 1, 1, 1), crops.flip(3), crops)
    out = torch.empty((n, 3, size, size), dtype=torch.float16, memory_format=torch.channels_last)
    torch.addcmul(aug.add, crops, aug.mul, out=out)
    return out
