#!/usr/bin/env python3
"""Reading, GPU decoding and batched augmentation of JPEG files: the loader's shared half.

The producer (producer.py) and the in-process baseline (baselines.py inprocess) both use this
module, so the two compare the same work:

- :class:`ImageFolder` lists ``ROOT/<class>/<file>.jpg`` (the layout make_dataset.py writes);
  :class:`PackedImages` holds the same images packed into one file (pack_dataset.py), read into
  memory with a few large reads, so a batch costs no file system call at all.
  :func:`open_images` takes either.
- :class:`EpochPlan` says which images make up each batch: one shuffle per epoch (the same for
  every shard), an optional shard of it, and a fixed number of whole batches per epoch.
- :class:`DecodedBatches` reads the files with a thread pool and decodes each batch with
  ``torchvision.io.decode_jpeg(list, device=...)`` (nvJPEG, batched; the hardware decoder on an
  A100/H100) on a thread of its own, a few batches ahead of its user.
- :class:`Augment` turns a list of decoded images of any sizes into one ``B x 3 x S x S``
  float16 channels_last batch with a handful of kernels: the images are copied into one padded
  batch, ``torchvision.ops.roi_align`` cuts each one's random-resized-crop box and resizes it to
  S x S (one kernel for the batch; it averages several samples per output pixel when it shrinks,
  so it does not alias), a random half is flipped, and one fused multiply-add normalises and
  writes the channels_last output, in place if given one (a gpipe slot). On a GPU with CuPy
  it is one kernel instead (fused_augment.py, the same samples; ``GPIPE_AUGMENT=torch`` keeps
  the torch kernels).

Everything also runs on the CPU (``device="cpu"``), which is what CI tests.

Run as a script, it measures what decoding and augmenting cost per image on a device (the
figure that decides where to place the decode: one producer per node or per GPU)::

    python3 apps/loader/gpu_decode.py /tmp/loader-data --device cuda:0 --batch 256
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

# Header words of a published batch (gpipe carries 8 per batch).
META_EPOCH = 0  # epoch number, from 0
META_INDEX = 1  # batch number within the epoch, from 0
META_PER_EPOCH = 2  # batches in each epoch (the same every epoch)
META_GLOBAL = 3  # batch number since the start, from 0
META_CLASSES = 4  # number of classes in the data set
META_SHARD = 5  # this producer's shard of each epoch
META_SHARDS = 6  # number of shards

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
JPEG_EXTENSIONS = (".jpg", ".jpeg", ".JPG", ".JPEG")


def channels_last_strides(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """Element strides of an N x C x H x W tensor laid out channels_last (NHWC in memory)."""
    _, c, h, w = shape
    return (c * h * w, 1, w * c, c)


class ImageFolder:
    """The JPEG files of ``root/<class>/``: classes are the sub-folders in sorted order.

    Reading an image opens, reads and closes its file (three system calls per image)."""

    kind = "folder"

    def __init__(self, root: str):
        self.root = root
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"{root}: no class folders; make the data with make_dataset.py")
        paths: list[str] = []
        labels: list[int] = []
        for label, name in enumerate(self.classes):
            folder = os.path.join(root, name)
            for f in sorted(os.listdir(folder)):
                if f.endswith(JPEG_EXTENSIONS):
                    paths.append(os.path.join(folder, f))
                    labels.append(label)
        if not paths:
            raise FileNotFoundError(f"{root}: no .jpg files under its class folders")
        self.paths = paths
        self.labels = torch.tensor(labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, i: int) -> torch.Tensor:
        """Image i's bytes as a 1-D uint8 CPU tensor (the input decode_jpeg takes)."""
        return read_file(self.paths[i])

    def pil_source(self, i: int) -> object:
        """What PIL's Image.open takes for image i: its path."""
        return self.paths[i]


# A pack: MAGIC, the index's length (8 bytes, little-endian), the index (UTF-8 JSON: version,
# classes, labels, offsets, lengths; offsets count from the start of the data), then the data:
# every JPEG file's bytes, one after the other.
PACK_MAGIC = b"GPIPEPK1"
PACK_VERSION = 1
_PACK_CHUNK = 64 << 20


def read_pack_index(f, path: str) -> tuple[object, int]:
    """A pack's index (parsed JSON, not yet checked) and the length of its data, from the open
    file `f`, left positioned at the data. Raises ValueError for anything that is not a pack."""
    head = f.read(len(PACK_MAGIC) + 8)
    if len(head) < len(PACK_MAGIC) + 8 or head[: len(PACK_MAGIC)] != PACK_MAGIC:
        raise ValueError(f"{path}: not an image pack (pack_dataset.py writes them)")
    index_len = int.from_bytes(head[len(PACK_MAGIC):], "little")
    size = os.fstat(f.fileno()).st_size
    start = len(head) + index_len
    if start > size:
        raise ValueError(f"{path}: truncated (its index says {index_len} bytes, the file has {size})")
    try:
        index = json.loads(f.read(index_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable index: {e}") from None
    return index, size - start


class PackedImages:
    """Every JPEG of a data set in one file (pack_dataset.py writes it), read into memory whole.

    Loading makes a few large reads (64 MiB each); after that an image is a slice of one
    buffer: no system call, no copy. A process's pack stays in its memory (about 1.1 GB for
    the default 20 000 images); DataLoader workers forked after loading share it.
    """

    kind = "pack"

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            index, data_len = read_pack_index(f, path)
            self._check(index, data_len)
            buf = bytearray(data_len)
            view = memoryview(buf)
            done = 0
            while done < data_len:
                n = f.readinto(view[done : done + _PACK_CHUNK])
                if not n:
                    raise ValueError(f"{path}: ended after {done} of {data_len} data bytes")
                done += n
        self.classes: list[str] = list(index["classes"])
        self.labels = torch.tensor(index["labels"], dtype=torch.int64)
        self.offsets: list[int] = index["offsets"]
        self.lengths: list[int] = index["lengths"]
        self._buf = buf
        self.data = torch.frombuffer(buf, dtype=torch.uint8)
        self.nbytes = data_len

    def _check(self, index: object, data_len: int) -> None:
        """Refuses an index that does not describe this file's data, naming what is wrong."""
        where = self.path
        if not isinstance(index, dict) or index.get("version") != PACK_VERSION:
            got = index.get("version") if isinstance(index, dict) else type(index).__name__
            raise ValueError(f"{where}: pack version {got!r}, this reader takes {PACK_VERSION}")
        fields = ("classes", "labels", "offsets", "lengths")
        if not all(isinstance(index.get(k), list) for k in fields):
            raise ValueError(f"{where}: the index lacks one of {', '.join(fields)}")
        n = len(index["labels"])
        if n == 0 or len(index["offsets"]) != n or len(index["lengths"]) != n:
            raise ValueError(f"{where}: {n} labels, {len(index['offsets'])} offsets, "
                             f"{len(index['lengths'])} lengths (want the same number, at least 1)")
        classes = len(index["classes"])
        for i, (label, off, length) in enumerate(zip(index["labels"], index["offsets"], index["lengths"])):
            if not all(type(v) is int for v in (label, off, length)):
                raise ValueError(f"{where}: image {i}: label, offset and length must be integers")
            if not 0 <= label < classes:
                raise ValueError(f"{where}: image {i}: label {label} is not one of the {classes} classes")
            if length <= 0 or off < 0 or off + length > data_len:
                raise ValueError(f"{where}: image {i}: bytes {off}..{off + length} are outside the "
                                 f"{data_len} data bytes")

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, i: int) -> torch.Tensor:
        """Image i's bytes: a view of the pack (contiguous 1-D uint8; decode_jpeg takes it)."""
        off = self.offsets[i]
        return self.data[off : off + self.lengths[i]]

    def pil_source(self, i: int) -> object:
        """What PIL's Image.open takes for image i: its bytes as a file object."""
        off = self.offsets[i]
        return io.BytesIO(memoryview(self._buf)[off : off + self.lengths[i]])


def open_images(path: str) -> "ImageFolder | PackedImages":
    """The data set at `path`: a folder (make_dataset.py) or a pack of one (pack_dataset.py)."""
    if os.path.isdir(path):
        return ImageFolder(path)
    if os.path.isfile(path):
        return PackedImages(path)
    raise FileNotFoundError(f"{path}: no such folder or pack; make the data with make_dataset.py")


def write_pack(folder: ImageFolder, out: str) -> dict:
    """Packs `folder` into the file `out` (written beside it and renamed: never half a pack)."""
    lengths = [os.path.getsize(p) for p in folder.paths]
    offsets, total = [], 0
    for n in lengths:
        offsets.append(total)
        total += n
    index = {"version": PACK_VERSION, "classes": folder.classes, "labels": folder.labels.tolist(),
             "offsets": offsets, "lengths": lengths, "source": os.path.abspath(folder.root)}
    blob = json.dumps(index, separators=(",", ":")).encode("utf-8")
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(PACK_MAGIC + len(blob).to_bytes(8, "little") + blob)
            for p, n in zip(folder.paths, lengths):
                with open(p, "rb") as src:
                    data = src.read()
                if len(data) != n:
                    raise OSError(f"{p} changed size while it was packed")
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return {"images": len(lengths), "bytes": total, "classes": len(folder.classes), "path": out}


class EpochPlan:
    """Which images each batch holds.

    Every epoch is one random permutation of the data set, drawn from ``seed + epoch`` (so all
    shards draw the same one); shard ``k`` of ``n`` takes every n-th image of it, starting at k.
    Each epoch has ``batches_per_epoch`` whole batches (the rest is dropped), rounded down to a
    multiple of ``multiple``: a producer that feeds W trainers taking turns (batch g to trainer
    g % W) publishes a multiple of W per epoch, so every trainer gets the same count.
    """

    def __init__(self, count: int, batch: int, *, shard: int = 0, shards: int = 1, multiple: int = 1, seed: int = 0):
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not in 0..{shards - 1}")
        self.count, self.batch, self.shard, self.shards, self.seed = count, batch, shard, shards, seed
        per_shard = count // shards
        self.batches_per_epoch = (per_shard // batch) // multiple * multiple
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{count} images in {shards} shard(s) make no whole batch of {batch} "
                f"(times {multiple}); use a smaller batch or more images"
            )

    def epoch(self, epoch: int) -> torch.Tensor:
        """This shard's image indices for `epoch`, batches_per_epoch x batch."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.count, generator=g)
        mine = perm[self.shard :: self.shards][: self.batches_per_epoch * self.batch]
        return mine.view(self.batches_per_epoch, self.batch)


def read_file(path: str) -> torch.Tensor:
    """The file's bytes as a 1-D uint8 CPU tensor (the input decode_jpeg takes)."""
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Decodes encoded JPEGs to 3 x H x W uint8 RGB images on `device`, as one batch.

    On CUDA this is nvJPEG's batched decode (hardware decoder where there is one). The call
    returns when the images are decoded (torchvision waits on its own stream) and orders the
    caller's current stream after them.
    """
    from torchvision.io import ImageReadMode, decode_jpeg  # here, so importing this module is cheap

    if device.type == "cuda":
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return decode_jpeg(data, mode=ImageReadMode.RGB)


@dataclass
class Decoded:
    """One decoded batch, not yet augmented."""

    epoch: int
    index: int  # in the epoch
    global_index: int
    images: list[torch.Tensor]  # 3 x H x W uint8, on the device
    labels: torch.Tensor  # int64, on the CPU
    read_s: float  # seconds the decode thread waited for the files
    decode_s: float  # seconds the decode call took


class DecodedBatches:
    """Iterates over decoded batches, reading and decoding on background threads.

    A pool of ``read_threads`` threads reads the next batch's files (a pack needs none: its images
    are slices of memory) while a decode thread decodes the current one (torchvision's decode releases the GIL), up to ``prefetch``
    batches ahead of the caller. On CUDA the decode thread works on a stream of its own; the
    batch returned by ``next()`` is ordered before the caller's current stream, and
    :class:`Augment` marks the images as used there, so their memory is reused safely.

    Runs ``epochs`` epochs (None: until ``limit`` batches or ``close()``). Errors in the
    background threads are raised by ``next()``.
    """

    _END = object()

    def __init__(
        self,
        images: "ImageFolder | PackedImages",
        plan: EpochPlan,
        device: torch.device | str,
        *,
        epochs: Optional[int] = None,
        limit: Optional[int] = None,
        prefetch: int = 2,
        read_threads: int = 8,
    ):
        self.images, self.plan, self.device = images, plan, torch.device(device)
        self.epochs, self.limit = epochs, limit
        self.read_threads = max(1, read_threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.read_threads, thread_name_prefix="read")
        self._queue: "queue.Queue[object]" = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    def _schedule(self) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        g = 0
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = self.plan.epoch(epoch)
            for i in range(order.shape[0]):
                if self.limit is not None and g >= self.limit:
                    return
                yield epoch, i, g, order[i]
                g += 1
            epoch += 1

    def _submit(self, indices: torch.Tensor) -> list[concurrent.futures.Future]:
        idx = indices.tolist()
        read = self.images.read
        if isinstance(self.images, PackedImages):  # slices of memory: nothing to wait for
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result([read(i) for i in idx])
            return [done]
        step = math.ceil(len(idx) / self.read_threads)
        chunks = [idx[k : k + step] for k in range(0, len(idx), step)]
        return [self._pool.submit(lambda c: [read(i) for i in c], c) for c in chunks]

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
            with ctx:
                plan = self._schedule()
                nxt = next(plan, None)
                pending = self._submit(nxt[3]) if nxt else None
                while nxt is not None and not self._stop.is_set():
                    epoch, index, g, indices = nxt
                    nxt = next(plan, None)
                    upcoming = self._submit(nxt[3]) if nxt else None
                    t0 = time.perf_counter()
                    data = [t for f in pending for t in f.result()]
                    t1 = time.perf_counter()
                    images = decode(data, self.device)
                    t2 = time.perf_counter()
                    item = Decoded(epoch, index, g, images, self.images.labels[indices], t1 - t0, t2 - t1)
                    if not self._put(item):
                        return
                    pending = upcoming
            self._put(self._END)
        except BaseException as e:  # handed to the caller's next()
            self._put(e)

    def __iter__(self) -> "DecodedBatches":
        return self

    def __next__(self) -> Decoded:
        item = self._queue.get()
        if item is self._END:
            self._queue.put(item)  # stays at the end for further calls
            raise StopIteration
        if isinstance(item, BaseException):
            raise RuntimeError("reading or decoding failed") from item
        assert isinstance(item, Decoded)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "DecodedBatches":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Augment:
    """Random-resized crop to ``size``, horizontal flip and normalisation of a whole batch.

    ``scale`` and ``ratio`` are those of torchvision's RandomResizedCrop (area fraction, and
    aspect ratio drawn log-uniformly; 10 tries, then the centre crop of the clamped ratio).
    Calling it with a list of 3 x H x W uint8 images returns (or writes into ``out``) a
    ``B x 3 x size x size`` float16 channels_last batch on the images' device, enqueued on the
    current stream. Randomness comes from a NumPy generator seeded with ``seed``.
    """

    def __init__(
        self,
        size: int = 224,
        device: torch.device | str = "cpu",
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        seed: int = 0,
    ):
        self.size, self.scale, self.ratio, self.flip_p = size, scale, ratio, flip_p
        self.device = torch.device(device)
        self.rng = np.random.default_rng(seed)
        # (x / 255 - mean) / std  ==  x * scale + bias
        self.mul_c = [1.0 / (255.0 * v) for v in std]
        self.add_c = [-m / v for m, v in zip(mean, std)]
        self.mul = torch.tensor(self.mul_c, dtype=torch.float32).view(1, 3, 1, 1).to(self.device)
        self.add = torch.tensor(self.add_c, dtype=torch.float32).view(1, 3, 1, 1).to(self.device)
        # On a GPU with CuPy, one fused kernel (fused_augment.py) unless GPIPE_AUGMENT=torch.
        self.kernel = "torch"
        if self.device.type == "cuda" and os.environ.get("GPIPE_AUGMENT", "fused") != "torch":
            import fused_augment

            if fused_augment.ready(self.device):
                self.kernel = "fused"

    def boxes(self, heights: torch.Tensor, widths: torch.Tensor, tries: int = 10) -> torch.Tensor:
        """B x 4 crop boxes (x1, y1, x2, y2) in pixel-centre coordinates, inside each image.

        Drawn with NumPy on the calling thread: torch's CPU ops on these few thousand numbers
        go through its intra-op thread pool, and in a trainer whose cores are busy decoding
        (host decode) each such op waited for a descheduled pool thread: 35-70 ms a batch
        against 1 ms (docs/experiments/2026-11-27-host-upload)."""
        g = self.rng
        n = heights.numel()
        h, w = heights.numpy().astype(np.float64), widths.numpy().astype(np.float64)
        area = (h * w)[:, None] * g.uniform(self.scale[0], self.scale[1], (n, tries))
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = np.exp(g.uniform(lo, hi, (n, tries)))
        cw = np.round(np.sqrt(area * aspect))
        ch = np.round(np.sqrt(area / aspect))
        fits = (cw >= 1) & (ch >= 1) & (cw <= w[:, None]) & (ch <= h[:, None])
        first = fits.argmax(axis=1)  # the first try that fits
        cw, ch = cw[np.arange(n), first], ch[np.arange(n), first]
        # None fits: the centre crop of the whole image, its ratio clamped into range.
        img_ratio = w / h
        fw = np.where(img_ratio > self.ratio[1], np.round(h * self.ratio[1]), w)
        fh = np.where(img_ratio < self.ratio[0], np.round(w / self.ratio[0]), h)
        ok = fits.any(axis=1)
        cw, ch = np.where(ok, cw, fw), np.where(ok, ch, fh)
        u = np.where(ok[:, None], g.random((n, 2)), 0.5)
        x1 = np.minimum(np.floor(u[:, 0] * (w - cw + 1)), w - cw)
        y1 = np.minimum(np.floor(u[:, 1] * (h - ch + 1)), h - ch)
        # roi_align(aligned=False) samples [x1, x2] in pixel-centre coordinates: a crop of cw
        # pixels starting at x1 spans centres x1 .. x1 + cw - 1, all inside the image.
        return torch.from_numpy(np.stack([x1, y1, x1 + cw - 1, y1 + ch - 1], axis=1).astype(np.float32))

    def flips(self, n: int) -> torch.Tensor:
        """B flags: which images to flip (with probability ``flip_p``), drawn as :meth:`boxes`."""
        return torch.from_numpy(self.rng.random(n) < self.flip_p)

    def __call__(self, images: list[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        heights = torch.tensor([im.shape[-2] for im in images])
        widths = torch.tensor([im.shape[-1] for im in images])
        return self.apply(images, self.boxes(heights, widths), self.flips(len(images)), out)

    def apply(self, images: list[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The crops ``boxes`` (B x 4, as :meth:`boxes` draws them) of ``images``, flipped where
        ``flips`` (B flags), resized and normalised: what ``__call__`` does once it has drawn
        them. The fused kernel where it runs, else the torch kernels."""
        from torchvision.ops import roi_align

        n, s = len(images), self.size
        dev = images[0].device
        if dev.type == "cuda":
            stream = torch.cuda.current_stream(dev)
            for im in images:  # used on this stream: their memory waits for it
                im.record_stream(stream)
        if self.kernel == "fused" and dev.type == "cuda":
            import fused_augment

            return fused_augment.crop_resize(images, boxes, flips, s, self.mul_c, self.add_c, out)
        heights = torch.tensor([im.shape[-2] for im in images])
        widths = torch.tensor([im.shape[-1] for im in images])
        pad = torch.zeros((n, 3, int(heights.max()), int(widths.max())), dtype=torch.float32, device=dev)
        views = [pad[i, :, : im.shape[-2], : im.shape[-1]] for i, im in enumerate(images)]
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(views, images)  # one C++ loop, no Python per image
        else:
            for v, im in zip(views, images):
                v.copy_(im)
        rois = torch.empty(n, 6, dtype=torch.float32)
        rois[:, 0] = torch.arange(n, dtype=torch.float32)
        rois[:, 1:5] = boxes
        rois[:, 5] = flips.float()
        if dev.type == "cuda":
            rois = rois.pin_memory().to(dev, non_blocking=True)
        crops = roi_align(pad, rois[:, :5], output_size=(s, s), spatial_scale=1.0, sampling_ratio=-1, aligned=False)
        flip = rois[:, 5].view(n, 1, 1, 1) > 0.5
        crops = torch.where(flip, crops.flip(3), crops)
        if out is None:
            out = torch.empty((n, 3, s, s), dtype=torch.float16, device=dev, memory_format=torch.channels_last)
        elif tuple(out.shape) != (n, 3, s, s) or out.dtype != torch.float16:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; expected {(n, 3, s, s)} float16")
        torch.addcmul(self.add, crops, self.mul, out=out)  # normalise, cast, lay out: one kernel
        return out

    def apply_packed(self, flat: torch.Tensor, table: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`apply` for images packed in ``flat`` (1-D uint8), each H x W x 3 where
        ``table``'s rows (offset, height, width) say, as host_decode.py packs them. The fused
        kernel reads them where they lie, with no tensor made per image; the torch path takes
        views of them."""
        if self.kernel == "fused" and flat.device.type == "cuda":
            import fused_augment

            flat.record_stream(torch.cuda.current_stream(flat.device))  # used on this stream
            return fused_augment.crop_resize_packed(flat, table, boxes, flips, self.size, self.mul_c,
                                                    self.add_c, out)
        return self.apply(unpack(flat, table), boxes, flips, out)


def unpack(flat: torch.Tensor, table: torch.Tensor) -> list[torch.Tensor]:
    """The images packed in ``flat`` as H x W x 3, by ``table``'s rows (offset, height,
    width): 3 x H x W views of them."""
    return [flat[o : o + 3 * h * w].view(h, w, 3).permute(2, 0, 1) for o, h, w in table.tolist()]


def _bench(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="data set: a folder (make_dataset.py) or a pack (pack_dataset.py)")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=12, help="batches to time (after 2 of warm-up)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--read-threads", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="also sum the GPU kernel time of decode with torch.profiler")
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    images_set = open_images(a.data)
    plan = EpochPlan(len(images_set), a.batch)
    n = min(a.batches + 2, plan.batches_per_epoch)
    order = plan.epoch(0)[:n]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    with concurrent.futures.ThreadPoolExecutor(a.read_threads) as pool:
        t0 = time.perf_counter()
        data = [list(pool.map(images_set.read, row.tolist())) for row in order]
        read_s = time.perf_counter() - t0
    nbytes = sum(t.numel() for batch in data for t in batch)
    aug = Augment(a.size, dev)

    # Decode alone, then decode + augment, batch after batch on one thread.
    for batch in data[:2]:
        aug(decode(batch, dev))
    sync()
    t0 = time.perf_counter()
    for batch in data[2:]:
        decode(batch, dev)
    sync()
    decode_s = time.perf_counter() - t0
    images = [decode(batch, dev) for batch in data[2:]]
    sync()
    t0 = time.perf_counter()
    for imgs in images:
        aug(imgs)
    sync()
    aug_s = time.perf_counter() - t0
    timed = sum(len(b) for b in data[2:])

    # The whole pipeline as the producer runs it: background read + decode, then augment.
    with DecodedBatches(images_set, plan, dev, limit=n, read_threads=a.read_threads) as src:
        first = next(src)
        aug(first.images)
        sync()
        t0 = time.perf_counter()
        count = 0
        for item in src:
            aug(item.images)
            count += len(item.images)
        sync()
        pipe_s = time.perf_counter() - t0

    report = {
        "what": "decode", "device": str(dev), "source": images_set.kind, "batch": a.batch, "images": timed,
        "mean_file_kb": round(nbytes / sum(len(b) for b in data) / 1e3, 1),
        "read_us_per_image": round(read_s / sum(len(b) for b in data) * 1e6, 1),
        "decode_us_per_image": round(decode_s / timed * 1e6, 1),
        "decode_images_per_s": round(timed / decode_s),
        "augment_us_per_image": round(aug_s / timed * 1e6, 1),
        "pipeline_images_per_s": round(count / pipe_s),
    }
    if cuda and a.profile:
        report.update(_kernel_time(data[2:], dev, aug))
    if a.json:
        print(json.dumps(report), flush=True)
    else:
        for k, v in report.items():
            print(f"{k:>28}: {v}")
    return 0


def _kernel_time(data: list[list[torch.Tensor]], dev: torch.device, aug: Augment) -> dict:
    """GPU kernel time per image of decode and of augment, summed by torch.profiler (CUPTI).
    The hardware JPEG engine's own time is not a kernel: it shows only in decode's wall time."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    try:
        images = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for batch in data:
                images.append(decode(batch, dev))
            torch.cuda.synchronize()
        out["decode_gpu_us_per_image"] = round(_device_us(prof) / sum(len(b) for b in data), 2)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for imgs in images:
                aug(imgs)
            torch.cuda.synchronize()
        out["augment_gpu_us_per_image"] = round(_device_us(prof) / sum(len(b) for b in data), 2)
    except Exception as e:  # the profiler is a nice-to-have here
        out["profile_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def _device_us(prof) -> float:
    """Microseconds of GPU activity (kernels, copies, memsets) the profiler recorded."""
    from torch.autograd import DeviceType

    return sum(ev.time_range.elapsed_us() for ev in prof.events() if ev.device_type == DeviceType.CUDA)


if __name__ == "__main__":
    sys.exit(_bench())
