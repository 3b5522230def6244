"""PyTorch helpers: an IterableDataset over a gpipe consumer.

``DataLoader(gpipe.torch.BatchDataset(socket), batch_size=None, num_workers=0)`` or a plain
``for x in BatchDataset(socket):`` loop yields each batch as torch tensors over the slot
itself. The slot returns to the producer when those tensors are gone.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.utils.data

from . import Consumer, Error

try:  # what torch.from_dlpack uses inside, minus its per-call Python stream object
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
    from torch._C import _from_dlpack
except ImportError:  # an unusual torch: as_tensor falls back on torch.from_dlpack
    _raw_stream = None
    _from_dlpack = None

_CUDA = 2  # DLPack's device type for CUDA


def as_tensor(obj: Any) -> torch.Tensor:
    """``torch.from_dlpack(obj)`` for ``obj``, a gpipe Batch (of one tensor), Tensor or slot
    tensor, with the same result and the same stream rule (the current stream waits for
    ``ready``), at less cost per call: torch's own version builds a Python stream object each
    time, which costs several microseconds per tensor on the GPU. A torch tensor (what
    ``slot.tensor(name, torch_dtype, shape)`` returns) is returned as it is. Falls back on
    ``torch.from_dlpack`` where torch lacks the internals it uses."""
    if isinstance(obj, torch.Tensor):
        return obj
    if _from_dlpack is None or _raw_stream is None:
        return torch.from_dlpack(obj)
    kind, index = obj.__dlpack_device__()
    if kind == _CUDA:
        stream = _raw_stream(index) or 1  # torch's default stream is the legacy one
        return _from_dlpack(obj.__dlpack__(stream=stream, max_version=(1, 0)))
    return _from_dlpack(obj.__dlpack__(max_version=(1, 0)))


class BatchDataset(torch.utils.data.IterableDataset):
    """Yields every batch of a ring as a tensor (a batch with one tensor) or a dict of named
    tensors, made with ``torch.from_dlpack``: no copy.

    DataLoader workers: each worker process attaches as a consumer of its own. In shared
    mode the ring hands each batch to exactly one of them, which is correct; in broadcast
    mode every worker would get every batch, so more than one worker is refused.
    Tensors that cross from a worker to the main process are copied by the DataLoader, so
    ``num_workers=0`` is the zero-copy choice.
    """

    def __init__(
        self,
        socket: str,
        *,
        timeout: Optional[float] = None,
        with_meta: bool = False,
        device: Any = None,
    ) -> None:
        super().__init__()
        self.socket = str(socket)
        self.timeout = timeout
        self.with_meta = with_meta
        self.device = device

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        consumer = Consumer(self.socket, device=self.device)
        if info is not None and info.num_workers > 1 and consumer.mode == "broadcast":
            consumer.close()
            raise Error(
                f"the ring at {self.socket} is in broadcast mode, so each of the {info.num_workers} "
                "DataLoader workers would receive every batch; use num_workers=0 (zero-copy) or a "
                "producer in shared mode"
            )
        with consumer:
            while True:
                try:
                    batch = consumer.recv(timeout=self.timeout)
                except Exception as e:  # the end of the stream ends the iteration
                    from . import Closed

                    if isinstance(e, Closed):
                        return
                    raise
                with batch:
                    names = batch.names
                    if len(names) == 1:
                        out: Any = as_tensor(batch)
                    else:
                        out = {n: as_tensor(batch[n]) for n in names}
                    item = (out, batch.meta) if self.with_meta else out
                yield item


from ._loader import Loader  # noqa: E402
from ._weights import WeightError, WeightPublisher, WeightReceiver, WeightUpdate  # noqa: E402

__all__ = [
    "BatchDataset",
    "Loader",
    "WeightError",
    "WeightPublisher",
    "WeightReceiver",
    "WeightUpdate",
    "as_tensor",
]
