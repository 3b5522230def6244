"""`gpipe.Producer`: the native producer, with ``send()`` and a signature that shows the real
defaults (the native class's come from the Rust side: ``_gpipe.Producer._defaults()``)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from . import _gpipe

# What send() takes, as its TypeError says.
_ONE = "a torch tensor, a NumPy array or any DLPack object (one with __dlpack__)"
_ANY = f"{_ONE}, or a dict of them by name"


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


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "stride")


def _check_tensor(obj: Any, where: str, accepted: str) -> None:
    """A TypeError naming `where` unless `obj` is something send() can copy."""
    if _is_torch(obj) or hasattr(obj, "__dlpack__"):
        return
    raise TypeError(f"{where} must be {accepted}; got {type(obj).__name__} ({obj!r:.60})")


def _layout_of(obj: Any) -> tuple[str, list[int], Optional[list[int]], str]:
    """(dtype name, shape, strides in elements or None, kind) of a torch tensor or an array."""
    if _is_torch(obj):
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


def _copy_into(slot: _gpipe.Slot, name: str, src: Any) -> None:
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


def _signature() -> Optional[inspect.Signature]:
    """The native constructor's signature with the defaults the Rust side gives. None on
    Python 3.9, where a native class carries no signature for ``inspect`` to read (the
    docstring still lists every argument and its default)."""
    try:
        native = inspect.signature(_gpipe.Producer)
    except ValueError:
        return None
    defaults = _gpipe.Producer._defaults()
    return native.replace(
        parameters=[
            p.replace(default=defaults[p.name]) if p.name in defaults else p
            for p in native.parameters.values()
        ]
    )


class Producer(_gpipe.Producer):
    __doc__ = _gpipe.Producer.__doc__
    __module__ = "gpipe"
    __signature__ = _signature()

    def send(
        self,
        tensors: Any,
        meta: Optional[Sequence[int]] = None,
        timeout: Optional[float] = None,
    ) -> int:
        """Copies ``tensors`` into the next slot and publishes it; returns the batch's
        sequence number.

        ``tensors``: a torch tensor, a NumPy array or any DLPack object (published under the
        name ``data``), or a dict of them by name. Each keeps its dtype, shape and dense
        layout (channels_last stays channels_last; a non-dense view is packed row-major).
        ``meta``: the batch's user header, up to 8 ints from 0 to 2**64 - 1. ``timeout``:
        seconds to wait for a free slot (None: as long as it takes; then Timeout). Anything
        else than these types raises TypeError before a slot is taken."""
        if isinstance(tensors, Mapping):
            items = list(tensors.items())
            for name, t in items:
                if not isinstance(name, str):
                    raise TypeError(
                        f"the names of tensors must be str; got {type(name).__name__} ({name!r:.60})"
                    )
                _check_tensor(t, f"tensors[{name!r}]", _ONE)
        else:
            _check_tensor(tensors, "tensors", _ANY)
            items = [("data", tensors)]
        with self.acquire(timeout=timeout) as slot:
            for name, t in items:
                _copy_into(slot, name, t)
            return slot.publish(meta=meta)
