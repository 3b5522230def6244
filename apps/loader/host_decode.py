"""The loader's host-decode mode: JPEGs decoded on the CPU in the loader's workers, cropped,
resized, flipped and normalised on the GPU in the trainer's own process.

Why: without MPS, decode processes on the trainer's GPU take turns with the trainer on it
(time slices between processes), and the trainer lost 35-55% (docs/examples.md). Here no
process but the trainer's touches the GPU. The workers (processes of ``gpipe.torch.Loader``
on host rings) decode with libjpeg-turbo (torchvision's CPU ``decode_jpeg``) and pack a
batch's images, H x W x 3 uint8 as the decoder writes them, one after the other, into one
buffer of the slot, with a table of where each one is. On a 64-core node with every core
decoding, that made 2.9x the images a second of Pillow, its RGB conversion and a 3 x H x W
repack (docs/experiments/2026-11-28-decode-cost); the fused kernel reads either layout. Like
nvJPEG, it takes JPEG files only (Pillow also read PNGs with a .jpg name). The trainer's
:class:`Upload` copies the used part of that buffer to the GPU in one transfer (from the slot
itself, which the Loader page-locks: ``pin_memory=True``), then runs the fused augmentation kernel
(``fused_augment.py``) on a side stream; the training stream waits for it. On the CPU (tests)
the same unpacking feeds ``gpu_decode.Augment``'s torch path.

    python3 apps/loader/loader_lib.py --data /tmp/loader-data --host-decode
"""

from __future__ import annotations

import json
import os
import sys
import time
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
    """decode(samples, device) for the loader's workers, on the CPU: each JPEG decoded into
    H x W x 3 uint8 (RGB; a greyscale one too), packed into one buffer sized for `batch` images
    of at most `max_hw`; returns (the buffer's used part, table, labels). Its batches vary
    in size: give the Loader ``slot_bytes=decode.slot_bytes``."""

    def __init__(self, batch: int, max_hw: tuple[int, int]) -> None:
        self.batch, self.max_hw = batch, max_hw
        self._buf: Optional[torch.Tensor] = None

    def __getstate__(self) -> dict:
        return {"batch": self.batch, "max_hw": self.max_hw, "_buf": None}

    def __call__(self, samples: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        if len(samples) != self.batch:
            raise ValueError(f"host decode packs batches of {self.batch} images; got {len(samples)}")
        mh, mw = self.max_hw
        if self._buf is None:  # one per worker: the loader copies its used part into the slot
            self._buf = torch.empty(self.batch * 3 * mh * mw, dtype=torch.uint8)
        buf = self._buf
        table = torch.empty((self.batch, 3), dtype=torch.int64)
        at = 0
        for i, (data, _) in enumerate(samples):
            # 3 x H x W over H x W x 3 memory, as libjpeg-turbo writes it
            chw = decode_jpeg(data, mode=ImageReadMode.RGB)
            h, w = chw.shape[1], chw.shape[2]
            if h > mh or w > mw:
                raise ValueError(f"image {i} of the batch is {w}x{h}, larger than the {mw}x{mh} the "
                                 "buffer was sized for (the data set's dataset.json max_size)")
            n = 3 * h * w
            buf[at : at + n].view(h, w, 3).copy_(chw.permute(1, 2, 0))  # one contiguous copy
            table[i, _OFFSET], table[i, _HEIGHT], table[i, _WIDTH] = at, h, w
            at += n
        labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
        return buf[:at], table, labels  # the used part: the worker copies no more

    @property
    def slot_bytes(self) -> int:
        """The most a batch takes in a Loader's slot."""
        mh, mw = self.max_hw
        return room(self.batch * 3 * mh * mw, self.batch * 3 * 8, self.batch * 8)  # images, table, labels


def room(*nbytes: int) -> int:
    """The bytes a Loader's slot takes for tensors of these sizes: each at a TENSOR_ALIGN
    boundary."""
    from gpipe import TENSOR_ALIGN

    return sum(-(-n // TENSOR_ALIGN) * TENSOR_ALIGN for n in nbytes)


class Upload:
    """The trainer's side of host decode: batches of (buffer, table, labels) in a host ring's
    slot become (images, labels) on `device`, augmented (random-resized crop to `size`, flip,
    normalise; float16 channels_last).

    On CUDA, per batch: the used part of the buffer is copied to the GPU in one transfer on a
    side stream, straight from the slot (the Loader's ``pin_memory=True`` page-locks its
    rings, so the copy is a DMA that returns at once), and read there by the fused kernel;
    the current stream waits for the side stream. The batch is held until the next one has
    been taken; then the trainer waits for its copy (long done by then) and lets it go, so
    the slot is not refilled while the copy reads it. Where the slot is not page-locked, the
    buffer goes through a page-locked copy instead (``pinned`` is then False) and the slot
    goes at once. ``pinned`` says whether every batch so far came page-locked,
    ``batches_pinned`` how many did. ``seconds`` says where this process's time went, over
    ``batches_uploaded`` batches: reading the table and drawing the crops, the copy's and
    the kernel's calls (which should return at once), the labels' copy, waiting for the last
    batch's copy, and all of it.
    """

    def __init__(self, batches: Iterator, device: torch.device, size: int, seed: int) -> None:
        self.batches, self.device, self.size = batches, device, size
        self.augment = Augment(size, device, seed=seed)  # draws on the CPU, applies on device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        # the last batch (its tensors, or the page-locked copy made of it) and its copy's event
        self.held: Optional[tuple[Any, Any]] = None
        self.seconds = {"prepare": 0.0, "copy_call": 0.0, "augment_call": 0.0, "labels": 0.0,
                        "wait_last_copy": 0.0, "upload": 0.0}
        self.batches_uploaded = 0
        self.batches_pinned = 0  # of those, copied straight from a page-locked slot
        if self.cuda and self.augment.kernel != "fused":
            raise SystemExit("host decode needs the fused augmentation kernel (CuPy, and "
                             f"GPIPE_AUGMENT not 'torch'); it is not available on {device}")

    @property
    def pinned(self) -> Optional[bool]:
        """Whether every batch so far came page-locked (None before the first)."""
        return self.batches_pinned == self.batches_uploaded if self.batches_uploaded else None

    def __iter__(self) -> "Upload":
        return self

    def _let_go(self) -> None:
        """Waits for the held batch's copy and drops it (its slot goes back)."""
        if self.held is None:
            return
        t0 = time.perf_counter()
        self.held[1].synchronize()
        self.seconds["wait_last_copy"] += time.perf_counter() - t0
        self.held = None

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        batch = next(self.batches)
        if len(batch) == 3:  # (images, labels, info): made on the GPU (mixed_decode.py), as is
            return batch
        buf, table, labels, info = batch
        t_start = time.perf_counter()
        rows = table.numpy()  # the slot's own table: read here, held with the batch
        used = int((rows[:, _OFFSET] + 3 * rows[:, _HEIGHT] * rows[:, _WIDTH]).max())
        boxes = self.augment.boxes(torch.from_numpy(rows[:, _HEIGHT]), torch.from_numpy(rows[:, _WIDTH]))
        flips = self.augment.flips(len(rows))
        if not self.cuda:
            return self.augment.apply_packed(buf, table, boxes, flips), labels.clone(), info
        dev = self.device
        self.seconds["prepare"] += time.perf_counter() - t_start
        pinned = buf.is_pinned()  # per batch: a ring the driver refused to lock is not
        if not pinned and self.batches_pinned == self.batches_uploaded:  # the first such batch
            print("host decode: the loader's slots are not page-locked (Loader(pin_memory="
                  "True)); copying such batches through page-locked memory instead",
                  file=sys.stderr)
        self.batches_pinned += pinned
        src = buf[:used] if pinned else buf[:used].pin_memory()
        cur = torch.cuda.current_stream(dev)
        with torch.cuda.stream(self.side):
            staging = torch.empty(used, dtype=torch.uint8, device=dev)
            t0 = time.perf_counter()
            staging.copy_(src, non_blocking=True)  # returns at once: the source is page-locked
            t1 = time.perf_counter()
            out = self.augment.apply_packed(staging, table, boxes, flips)  # the fused kernel
            t2 = time.perf_counter()
            labels_d = labels.pin_memory().to(dev, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # a wait for it sleeps: the CPUs decode
            done.record(self.side)
        self.seconds["copy_call"] += t1 - t0
        self.seconds["augment_call"] += t2 - t1
        self.seconds["labels"] += time.perf_counter() - t2
        cur.wait_event(done)
        out.record_stream(cur)
        labels_d.record_stream(cur)
        self._let_go()
        # the slot is held until its copy has run; a page-locked copy of it, in its stead
        self.held = ((buf, table, labels) if pinned else (src,), done)
        self.seconds["upload"] += time.perf_counter() - t_start
        self.batches_uploaded += 1
        return out, labels_d, info

    def close(self) -> None:
        """Waits for the last copy and lets its batch go."""
        if self.cuda:
            self._let_go()

