"""Type stubs of gpipe's native module (gpipe._gpipe). Import from `gpipe`, not from here."""

from typing import Any, Iterator, Literal, Optional, Sequence, Union

__version__: str
PROTOCOL_VERSION: int
"""Version of the control segment and handshake; both sides must run the same one."""
MAX_TENSORS: int
"""Most named tensors in one batch (8)."""
MAX_DIMS: int
"""Most dimensions of one tensor (8)."""
TENSOR_ALIGN: int
"""Every tensor's byte offset in its slot is a multiple of this (256)."""
DTYPES: list[str]
"""The element types gpipe carries, by NumPy/PyTorch name."""

DType = Union[str, Any]
"""A dtype name ("float32"), a NumPy dtype or scalar type, or a torch dtype."""

class Error(Exception):
    """Base class of every error gpipe raises (bad arguments raise ValueError/TypeError)."""

class ProducerDied(Error):
    """The producer died without closing the ring; batches it had not published are lost."""

class Closed(Error):
    """The ring was closed cleanly and everything published was received, or this object
    was closed."""

class AttachError(Error):
    """Attaching failed: nothing listens on the socket, permission, or a version or backend
    mismatch. The message says which."""

class Detached(Error):
    """The producer detached this consumer (its lag policy, e.g. detach_after_ms, or a
    protocol violation). Tensors still held from its batches may see new data."""

class Timeout(Error):
    """A blocking call ran past its timeout. Nothing was lost: call it again."""

class Deadlock(Error):
    """The call could never return: this consumer holds (itself or through tensors) the
    batch in the slot the producer must refill before it can publish again."""

class ProtocolError(Error):
    """A peer broke the protocol: a corrupted control segment or a malformed message."""

class BackendError(Error):
    """The memory backend (host memory or CUDA) failed."""

class Tensor:
    """One named tensor of a batch or a slot, exported through DLPack.

    ``torch.from_dlpack(t)``, ``numpy.from_dlpack(t)``, ``cupy.from_dlpack(t)`` give an array
    over the memory itself (no copy). A batch's slot stays held until every array made from
    it is gone. Arrays of a consumer's batch are read-only (NumPy enforces it; torch does
    not: an in-place write there kills the writing process, never another's data).
    """

    name: str
    """The tensor's name."""
    dtype: str
    """Element type name."""
    shape: list[int]
    """Dimensions."""
    strides: list[int]
    """Strides in elements (PyTorch's convention; NumPy's byte strides are these times the
    item size)."""
    offset: int
    """Byte offset in the slot (a multiple of TENSOR_ALIGN)."""
    nbytes: int
    """Bytes from the first element to the end of the last."""
    data_ptr: int
    """Address of element 0. The same declaration in the same slot always gives the same
    address, so a consumer may capture a CUDA graph per slot."""
    readonly: bool
    """True for a consumer's batch."""
    def __dlpack__(
        self,
        stream: Optional[int] = None,
        *,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """DLPack export (array API standard). A versioned capsule (with the read-only flag)
        when max_version >= (1, 0) is given, else the unversioned one. copy=True gives a
        private writable copy (host memory)."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """(1, 0) for host memory, (2, n) for CUDA device n."""
    def copy(self) -> Tensor:
        """A private, writable copy (host memory), independent of the slot."""

class Batch:
    """One batch, received in place.

    Release it with ``release()``, a ``with`` block, or by dropping it. Its slot returns to
    the producer once that has happened and every tensor made from it is gone, so
    ``with batch: x = torch.from_dlpack(batch); loss = step(x)`` is correct even when x
    outlives the block. A batch may be sent to and released from another thread.
    """

    seq: int
    """Sequence number."""
    slot: int
    """Slot index."""
    meta: tuple[int, ...]
    """The 8-word user header the producer published."""
    nbytes: int
    """Length in bytes."""
    names: list[str]
    """Names of the tensors, in the producer's order ("data" for a raw batch)."""
    released: bool
    """True after release() (tensors made before may still hold the slot)."""
    def __getitem__(self, name: str) -> Tensor:
        """The named tensor (KeyError if there is none)."""
    def __contains__(self, name: str) -> bool: ...
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor, by name."""
    def __dlpack__(
        self,
        stream: Optional[int] = None,
        *,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """DLPack export of the batch's only tensor (BufferError if it has several: use
        batch[name])."""
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def copy(self, name: Optional[str] = None) -> Tensor:
        """A private, writable copy of a tensor (the only one when name is None)."""
    def record_stream(self, stream: Any) -> None:
        """Declares that work on this batch's tensors also runs on `stream` (a torch or CuPy
        stream, or a handle): it waits for the batch to be ready, and the slot goes back only
        after the work enqueued on it by the release. A no-op for host batches."""
    def verify_pattern(self) -> bool:
        """True if the batch holds the test pattern `gpipe produce` (or Slot.fill_pattern)
        writes, with the header `gpipe consume --verify` checks."""
    def release(self) -> None:
        """Releases the batch now (idempotent). The slot goes back at once unless tensors
        made from the batch are alive; then when the last of them is gone."""
    def __enter__(self) -> Batch: ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

class Consumer:
    """Attaches to the producer listening on `socket`.

    ``device``: None (or "cpu") for a ring in host memory; on a CUDA ring None means the
    producer's GPU, and ``"cuda:N"`` (or ``N``) consumes on GPU N, reading the slots in place
    by peer access (the attach fails, naming both GPUs, where N cannot reach the producer's).
    ``timeout``: seconds each step of the attach handshake may take. Iterating yields batches until the producer closes the
    ring. Several batches may be held at once and released in any order.
    """

    index: int
    """This consumer's index in the ring."""
    mode: str
    """"broadcast" (every consumer gets every batch) or "shared" (each batch to one)."""
    backend: str
    """"host" or "cuda"."""
    socket: str
    slots: int
    slot_bytes: int
    held: int
    """Batches received and not yet released (directly or through tensors)."""
    device: str
    """Where the batches are: "cpu" or "cuda:N"."""
    enforced_read_only: bool
    """True when a write into a batch faults in this process alone (host rings; CUDA broadcast
    rings on the VMM path)."""
    delivery: str
    """"in-place" (batches are the producer's slots) or "mirror" (copies in this consumer's
    own memory; the producer's slot is released as soon as the copy is made)."""
    side_signals: bool
    """CUDA: True when the consumer waits for `ready` and writes `finished` on side streams of
    its own, joined to the tensors' streams by in-process events (see `side_signals=`)."""
    closed: bool
    def __init__(
        self,
        socket: str,
        *,
        device: Any = None,
        timeout: float = 5.0,
        spin: Optional[float] = None,
        delivery: str = "auto",
        mirror_buffers: Optional[int] = None,
        side_signals: Optional[bool] = None,
    ) -> None:
        """Attaches to the producer at `socket` (handshake steps time out after `timeout` s).
        spin: seconds recv() busy-waits for a batch before it sleeps (default 100 µs). A
        sleeping consumer is woken by the producer's publish, which costs a wake-up (tens to
        hundreds of µs on a VM); a latency-critical consumer that receives a batch every few
        milliseconds can spin that long instead, at the cost of a CPU core while it waits.
        delivery: "in-place", "mirror" or "auto" (in place on the producer's GPU, mirrored on
        another; host rings: in place). A mirroring consumer may hold up to `mirror_buffers`
        batches (default: the ring's slot count) and raises Deadlock when it asks for more.
        On another GPU, mirror copies each batch over the link once with the copy engine,
        overlapped with your kernels; in place reads the link on every access.
        side_signals (CUDA, in place): True waits for the producer's `ready` and writes
        `finished` on streams of the consumer's own, joined to your streams by in-process
        events, so your stream carries no cross-process signal between its kernels (a few µs
        of GPU time per batch saved, a few µs of host time spent); False keeps both on your
        stream; None (default) takes side streams for slots of 16 MiB and more. With them
        on under MPS and CUDA_DEVICE_MAX_CONNECTIONS unset or below 8, it warns
        (RuntimeWarning) saying what to set."""
    def recv(self, timeout: Optional[float] = None) -> Batch:
        """The next batch, waiting up to `timeout` seconds (None: until one comes). Raises
        Timeout, Closed at the end of the stream, ProducerDied, Detached, or Deadlock. The
        GIL is released while it waits; Ctrl-C interrupts it."""
    def __iter__(self) -> Iterator[Batch]: ...
    def __next__(self) -> Batch: ...
    def close(self) -> None:
        """Detaches. Batches still held stay valid; the producer is told goodbye once the
        last of them is released."""
    def __enter__(self) -> Consumer: ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

class Slot:
    """A slot the producer acquired: declare tensors, write them, publish. Leaving its
    ``with`` block without publish() gives it back unpublished."""

    seq: int
    """The sequence number this batch will have."""
    index: int
    """The slot index."""
    capacity: int
    """Capacity in bytes."""
    names: list[str]
    """Tensors declared so far."""
    def tensor(
        self,
        name: str,
        dtype: Optional[DType] = None,
        shape: Optional[Sequence[int]] = None,
        strides: Optional[Sequence[int]] = None,
    ) -> Tensor:
        """Declares a tensor (or returns the one declared under `name`) and returns a
        writable Tensor over it. Tensors are placed in declaration order, each at the end
        of the previous one rounded up to 256 bytes: the same declaration gives the same
        addresses. `strides` are in elements (default row-major); channels_last stays
        channels_last. Raises ValueError if it does not fit the slot."""
    def fill_pattern(self, nbytes: int) -> tuple[int, ...]:
        """Writes the CLI's test pattern over `nbytes` bytes and returns the header to
        publish with (publish(meta=..., nbytes=...)), for `gpipe consume --verify`."""
    def publish(
        self,
        meta: Optional[Sequence[int]] = None,
        nbytes: Optional[int] = None,
        stream: Any = None,
    ) -> int:
        """Publishes the declared tensors (or `nbytes` raw bytes) with up to 8 header
        words; returns the sequence number. On CUDA, `ready` is recorded after the work on
        `stream` (default: torch's current stream, else the legacy default stream) and on
        every stream the slot's tensors were made for. Do not write the slot's tensors
        afterwards."""
    def abandon(self) -> None:
        """Gives the slot back unpublished."""
    def __enter__(self) -> Slot: ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

class Producer:
    """The producing side of a ring (use gpipe.Producer, which adds send())."""

    socket: str
    backend: str
    mode: str
    slots: int
    slot_bytes: int
    """batch_bytes rounded up to 2 MiB."""
    device: str
    """"cpu" or "cuda:N"."""
    memory: str
    """Where the slots live: "host", or the CUDA memory path ("vmm", "pool", "legacy")."""
    consumers: int
    """Consumers attached now."""
    next_seq: int
    closed: bool
    max_lead: Optional[int]
    """The producer-lead bound in batches (None: the ring's own); "auto" resolved."""
    slots_auto: Optional[str]
    """With slots="auto": the depth chosen and why; None otherwise."""
    def __init__(
        self,
        socket: str,
        *,
        slots: Union[int, str, None] = 8,
        batch_bytes: int = 8 << 20,
        mode: str = "broadcast",
        backend: str = "auto",
        device: int = 0,
        detach_after_ms: Optional[int] = None,
        max_consumers: int = 16,
        drain_timeout: float = 5.0,
        sync: str = "auto",
        max_lead: Union[int, str, None] = None,
        depth_budget: int = 2 << 30,
    ) -> None:
        """Creates the ring and listens on `socket` (mode 0600). detach_after_ms: detach a
        consumer that holds a slot the producer needs for longer than this (default: wait
        for it, i.e. back-pressure). backend: "auto" (CUDA when usable, else host), "cuda" or
        "host". sync (CUDA): "auto" = timeline words, which consumers release when the
        producer dies; "events" = IPC events. max_lead: write a batch only once the batch
        this many back was consumed by everyone who got it (default: the ring's own bound,
        slots); below slots it keeps the data in flight small enough for a GPU's L2 cache;
        "auto" derives it from the GPU's L2 size and batch_bytes (host rings: None).
        slots="auto": 8 with MPS running (and on the host); without MPS, where the GPU
        time-slices between processes and a deeper ring moves more, the deepest of 8, 16, 32
        and 64 whose slots fit depth_budget bytes (`slots_auto` says which and why)."""
    def acquire(self, timeout: Optional[float] = None, stream: Any = None) -> Slot:
        """The next slot, once every consumer that had its previous batch released it.
        One slot at a time. On CUDA, `stream` (default: torch's current stream, else the
        legacy default stream) is ordered after the slot's previous consumers. Raises
        Timeout, Closed."""
    def wait_for_consumers(self, n: int = 1, timeout: Optional[float] = None) -> None:
        """Waits until at least n consumers are attached."""
    def flush(self, timeout: Optional[float] = None) -> None:
        """Waits until every published batch was released by everyone that got it."""
    def close(self) -> dict[str, int]:
        """Closes the ring cleanly (consumers receive everything published, then Closed),
        waiting up to drain_timeout for them. Returns the run's counters."""
    def __enter__(self) -> Producer: ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

def forward(
    upstream: str,
    socket: str,
    *,
    device: Optional[int] = None,
    slots: int = 8,
    max_consumers: int = 16,
    wait_for_consumers: int = 0,
) -> dict[str, Any]:
    """Consumes the ring at `upstream` and re-publishes every batch in a ring of its own at
    `socket` (same slot size and mode) on CUDA device `device` (default: the upstream
    producer's), so that consumers on that GPU read their own memory; forwarders chain.
    Blocks until the upstream ring closes, then closes its own ring once its consumers are
    done, and returns {"backend", "batches", "bytes", "elapsed_s", "gb_per_s", "error"}.
    wait_for_consumers: take no batch until that many consumers attached downstream. Raises
    Error if the upstream ring fails (its consumers then see the producer die);
    KeyboardInterrupt stops it."""

def fanout_plan(
    consumer_devices: Sequence[int],
    shape: str = "auto",
    batch_bytes: int = 64 << 20,
    producer_device: int = 0,
) -> dict[str, Any]:
    """How `shape` ("direct", "chain", "tree" or "auto") reaches one consumer per entry of
    `consumer_devices` from a producer on `producer_device`: {"shape", "rings": [{"device",
    "parent"}], "consumer_ring", "depth"}. Ring 0 is the producer's; run one forward() per
    other ring, from its parent's socket, on its device."""
