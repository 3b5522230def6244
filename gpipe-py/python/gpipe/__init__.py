"""gpipe: zero-copy batch rings between processes, in GPU or host memory.

A :class:`Producer` fills batches in a ring of slots and publishes them; :class:`Consumer`
processes attach over a Unix socket and use each batch in place, as DLPack tensors
(``torch.from_dlpack(batch)``, ``numpy.from_dlpack(batch["images"])``), then release it.
See docs/python.md for the lifetime and write rules. ``gpipe.torch`` has PyTorch helpers.
"""

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
    PinError,
    ProducerDied,
    ProtocolError,
    Slot,
    Tensor,
    Timeout,
    __version__,
    fanout_plan,
    forward,
    resolve,
)
from ._producer import Producer

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
    "PinError",
    "Producer",
    "ProducerDied",
    "ProtocolError",
    "Slot",
    "Tensor",
    "Timeout",
    "__version__",
    "fanout_plan",
    "forward",
    "resolve",
]
