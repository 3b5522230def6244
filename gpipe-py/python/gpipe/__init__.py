"""gpipe: zero-copy batch rings between processes, in GPU or host memory.

A :class:`Producer` fills batches in a ring of slots and publishes them; :class:`Consumer`
processes attach over a Unix socket and use each batch in place, as DLPack tensors
(``torch.from_dlpack(batch)``, ``numpy.from_dlpack(batch["images"])``), then release it.
See docs/python.md for the lifetime and write rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Sequence

from . import _gpipe
from ._gpipe import (
    DTYPES,
    MAX_DIMS,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    TENSOR_ALIGN,
    AttachError,
    BackendError,
    Batch,
    Closed,
    Consumer,
    Deadlock,
    Detached,
    Error,
    ProducerDied,
    ProtocolError,
    Slot,
    Tensor,
    Timeout,
    __version__,
    fanout_plan,
    forward,
)

__all__ = [
    "DTYPES",
    "MAX_DIMS",
    "MAX_TENSORS",
    "PROTOCOL_VERSION",
    "TENSOR_ALIGN",
    "AttachError",
    "BackendError",
    "Batch",
    "Closed",
    "Consumer",
    "Deadlock",
    "Detached",
    "Error",
    "Producer",
    "ProducerDied",
    "ProtocolError",
    "Slot",
    "Tensor",
    "Timeout",
    "__version__",
    "fanout_plan",
    "forward",
]


def _dense_strides(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when `strides` (in elements) lay `shape` out densely in some dimension order,
    e.g. row-major or channels_last: such a layout is kept as it is."""
    dims = sorted((s, n) for s, n in zip(strides, shape) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True


def _layout_of(obj: Any) -> tuple[str, list[int], Optional[list[int]], str]:
    """(dtype name, shape, strides in elements or None, kind) of a torch tensor or an array."""
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch":
        shape = list(obj.shape)
        tstrides = list(obj.stride())
        dtype = str(obj.dtype).removeprefix("torch.")
        return dtype, shape, tstrides if _dense_strides(shape, tstrides) else None, "torch"
    import numpy as np

    arr = obj if isinstance(obj, np.ndarray) else np.from_dlpack(obj)
    shape = list(arr.shape)
    item = arr.dtype.itemsize
    strides: Optional[list[int]] = None
    if all(s >= 0 and s % item == 0 for s in arr.strides):
        strides = [s // item for s in arr.strides]
    if strides is not None and not _dense_strides(shape, strides):
        strides = None
    return arr.dtype.name, shape, strides, "numpy"


def _copy_into(slot: Slot, name: str, src: Any) -> None:
    dtype, shape, strides, kind = _layout_of(src)
    dst = slot.tensor(name, dtype, shape, strides)
    on_gpu = dst.__dlpack_device__()[0] == 2
    if kind == "torch":
        import torch  # type: ignore[import-not-found]

        if src.device.type == "cuda":
            if not on_gpu:
                raise ValueError(
                    f"tensor {name!r} is on {src.device}, but this ring is in host memory; "
                    "move it with .cpu() or use a CUDA ring"
                )
            ring_dev = dst.__dlpack_device__()[1]
            if src.device.index != ring_dev:
                raise ValueError(
                    f"tensor {name!r} is on {src.device}, but this ring's slots are on "
                    f"cuda:{ring_dev}; move it with .to('cuda:{ring_dev}')"
                )
        elif src.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {src.device}, which gpipe cannot copy from")
        torch.from_dlpack(dst).copy_(src)
        return
    import numpy as np

    arr = src if isinstance(src, np.ndarray) else np.from_dlpack(src)
    if on_gpu:
        try:
            import torch  # type: ignore[import-not-found]
        except ImportError:
            raise ValueError(
                f"copying the NumPy array {name!r} into a CUDA ring needs torch; "
                "or write the slot with CuPy: cupy.from_dlpack(slot.tensor(...))"
            ) from None
        torch.from_dlpack(dst).copy_(torch.from_numpy(np.ascontiguousarray(arr)).reshape(shape))
        return
    np.copyto(np.from_dlpack(dst), arr)


class Producer(_gpipe.Producer):
    """The producing side of a ring.

    ``Producer(socket, *, slots=8, batch_bytes=8 MiB, mode="broadcast", backend="auto",
    device=0, detach_after_ms=None, max_consumers=16, drain_timeout=5.0, sync="auto",
    max_lead=None, depth_budget=2 GiB, timeline_memory="host")``; ``slots="auto"`` picks
    the depth (see ``slots_auto``). ``timeline_memory``: where the ``ready`` and ``finished``
    words live on the CUDA backend: ``"host"``, ``"device"`` (faster; see docs/python.md for
    when it is safe) or ``"auto"``.
    """

    def send(
        self,
        tensors: Any,
        meta: Optional[Sequence[int]] = None,
        timeout: Optional[float] = None,
    ) -> int:
        """Copies a tensor (or a dict of named tensors: torch tensors, NumPy arrays or any
        DLPack object) into the next slot, keeping each one's dtype, shape and dense layout
        (channels_last stays channels_last), and publishes it. Returns the sequence number."""
        items = tensors.items() if isinstance(tensors, Mapping) else [("data", tensors)]
        with self.acquire(timeout=timeout) as slot:
            for name, t in items:
                _copy_into(slot, name, t)
            return slot.publish(meta=meta)
