"""Type stubs of gpipe's native module (gpipe._gpipe). Import from `gpipe`, not from here."""

from os import PathLike
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

class PinError(AttachError):
    """``pin_memory=True`` could not page-lock the ring: no CUDA driver here, or the driver
    refused. Nothing else failed: the ring can be attached without ``pin_memory``, or with
    ``pin_memory="try"``, which reads it unlocked where the lock is refused."""

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
    """One named tensor of a batch or a slot: a DLPack view, not an array.

    Making a framework tensor from it (``torch.from_dlpack(t)``, ``gpipe.torch.as_tensor(t)``,
    ``numpy.from_dlpack(t)``, ``cupy.from_dlpack(t)``) gives an array over the memory itself,
    with no copy; the memory stays valid, and a batch's slot stays held, until every such array
    is gone. A slot's tensor declared with a torch dtype is returned as a ``torch.Tensor``
    already. Arrays of a consumer's batch are read-only (NumPy enforces it; torch does not: an
    in-place write there kills the writing process, never another's data).
    """

    name: str
    """The tensor's name."""
    dtype: str
    """Element type name ("float32", "uint8", ...)."""
    shape: list[int]
    """Dimensions."""
    strides: list[int]
    """Strides in elements (PyTorch's convention; NumPy's byte strides are these times the
    item size)."""
    offset: int
    """Byte offset of the tensor in its slot (a multiple of TENSOR_ALIGN)."""
    nbytes: int
    """Bytes from the first element to the end of the last."""
    data_ptr: int
    """The address of element 0 (host or device pointer). The same declaration in the same
    slot always gives the same address, so a consumer may capture a CUDA graph per slot."""
    readonly: bool
    """True when arrays made from it must not be written (a consumer's batch)."""
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
        private writable copy (host memory). `stream` is accepted and ignored for host
        memory."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """(1, 0) for host memory, (2, n) for CUDA device n."""
    def copy(self) -> Tensor:
        """A private, writable copy (host memory), as a new Tensor."""

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
    """Slot index: tensors of the same declaration from slot k always have the same address."""
    meta: tuple[int, ...]
    """The 8-word user header the producer published (a tuple of ints)."""
    nbytes: int
    """Length in bytes."""
    names: list[str]
    """The names of the batch's tensors, in the producer's order ("data" for a raw batch)."""
    released: bool
    """True once release() ran (tensors made before may still hold the slot)."""
    def __getitem__(self, name: str) -> Tensor:
        """The named tensor, as a DLPack-capable gpipe.Tensor (KeyError if there is none):
        ``torch.from_dlpack(batch[name])`` or ``gpipe.torch.as_tensor(batch[name])``."""
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
        """A private, writable copy of a tensor (the only one when `name` is None),
        independent of the slot."""
    def record_stream(self, stream: Any) -> None:
        """Declares that work on this batch's tensors also runs on `stream` (a CUDA stream
        handle, or an object with `cuda_stream` or `ptr`, e.g. a torch or CuPy stream), as
        torch's `Tensor.record_stream`: the stream waits for the batch to be ready, and the
        slot is handed back only after the work enqueued on it by then. A no-op for host
        batches."""
    def verify_pattern(self) -> bool:
        """Checks the batch against the test pattern `gpipe produce` writes (and
        `Slot.fill_pattern` writes): the header's checksum and sequence number."""
    def release(self) -> None:
        """Releases the batch now. The slot returns to the producer at once unless tensors
        made from the batch are still alive; then it returns when the last of them is gone."""
    def __enter__(self) -> Batch: ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

class Consumer:
    """The consuming side of a ring: attaches to the producer listening on ``socket`` and
    receives its batches in place, with ``recv()`` or by iterating (until the producer closes
    the ring). Several batches may be held at once and released in any order. Use it as a
    context manager: leaving the block detaches (``close()``).

    ``socket``: the producer's socket path. ``device``: None (or ``"cpu"``) for a ring in host
    memory; on a CUDA ring None means the producer's GPU, and ``"cuda:N"`` (or ``N``, or a
    torch.device) consumes on GPU N, reading the slots in place by peer access or mirroring
    them (see ``delivery``). ``timeout``: seconds the whole attach may take (connecting, the
    producer's answers, mapping the ring); past it the attach raises Timeout. It bounds the
    attach only: ``recv()`` has its own. ``spin``:
    seconds ``recv()`` busy-waits for a batch before it sleeps, 0 to 1 (None: 100 µs). A
    sleeping consumer is woken by the producer's publish, which costs a wake-up (tens to
    hundreds of µs on a VM); a latency-critical consumer that receives a batch every few
    milliseconds can spin that long instead, at the cost of a CPU core while it waits.
    ``delivery``: ``"in-place"`` (batches are the producer's slots), ``"mirror"`` (a copy in
    this consumer's own memory; the producer's slot is released as soon as it is made) or
    ``"auto"`` (in place on the producer's GPU, mirrored on another; host rings: in place).
    ``mirror_buffers``: the most batches a mirroring consumer holds at once (None: the ring's
    slot count); it raises Deadlock when it asks for more. ``side_signals`` (CUDA, in place):
    True waits for the producer's ``ready`` and writes ``finished`` on streams of the
    consumer's own, joined to your streams by in-process events, so your stream carries no
    cross-process signal between its kernels; False keeps both on your stream; None takes side
    streams for slots of 16 MiB and more. With them on under MPS and
    CUDA_DEVICE_MAX_CONNECTIONS unset or below 8, it warns (RuntimeWarning) saying what to set.
    ``allow_producer_uids``: user ids besides this process's own whose producers it attaches
    to (None: only its own). The producer is known by the uid listening on the socket, not by
    the socket's path, which anyone able to create a file there could have made.
    ``pin_memory`` (host rings): page-locks the memory the batches are read from with the
    CUDA driver, for as long as it is mapped, so that ``tensor.to("cuda", non_blocking=True)``
    from a batch is a DMA that returns at once, as from torch's pinned memory, with no copy
    into pinned memory first. That copy reads the slot after the call returns: keep the batch
    until it has run (its stream synchronised, or an event waited for), since the slot goes
    back to the producer once the batch's tensors are gone. The lock is made once the
    attach's handshake is over: ``timeout`` does not bound it. Where the driver refuses it,
    ``True`` raises PinError (the consumer had joined the ring and leaves it, so a batch the
    producer published meanwhile is not delivered to a later attach); ``"try"`` reads the
    ring unlocked instead, missing nothing, with ``pinned`` False and ``pin_refused`` saying
    why.

    Wrong arguments raise TypeError (a wrong type) or ValueError (a value out of range),
    naming the argument.
    """

    index: int
    """This consumer's index in the ring (0..max_consumers)."""
    mode: str
    """"broadcast" (every consumer gets every batch) or "shared" (each batch to one)."""
    backend: str
    """"host" or "cuda"."""
    socket: str
    """The socket path."""
    slots: int
    """Slots in the ring."""
    slot_bytes: int
    """Capacity of each slot in bytes."""
    held: int
    """Batches received and not yet released (by the batch or by tensors made from it)."""
    device: str
    """The device the batches are on: "cpu" or "cuda:N"."""
    enforced_read_only: bool
    """True when this consumer's batches are mapped read-only on the device, so a kernel
    that writes one faults here alone (CUDA broadcast rings on the VMM path; host rings are
    always read-only)."""
    delivery: str
    """How batches arrive: "in-place" (the producer's slot itself) or "mirror" (a copy in the
    consumer's own memory, the producer's slot released as soon as it is made)."""
    pinned: bool
    """True when this host ring's batches are page-locked for copies to a GPU
    (``pin_memory=True``, or ``"try"`` where the driver allowed it)."""
    pin_refused: Optional[str]
    """Why the batches are not page-locked although ``pin_memory="try"`` asked for it (the
    driver's refusal, or no CUDA driver here); None otherwise."""
    side_signals: bool
    """True when this CUDA consumer waits for `ready` and writes `finished` on side streams
    of its own, joined to the tensors' streams by in-process events."""
    closed: bool
    """True after close()."""
    def __init__(
        self,
        socket: Union[str, PathLike[str]],
        *,
        device: Any = None,
        timeout: float = 5.0,
        spin: Optional[float] = None,
        delivery: str = "auto",
        mirror_buffers: Optional[int] = None,
        side_signals: Optional[bool] = None,
        allow_producer_uids: Optional[Sequence[int]] = None,
        pin_memory: Union[bool, Literal["try"]] = False,
    ) -> None:
        """Attaches to the producer at `socket`: see the class docstring for the arguments."""
    def recv(self, timeout: Optional[float] = None) -> Batch:
        """Receives the next batch, waiting up to ``timeout`` seconds (None: until one comes).
        Raises Timeout (nothing was lost: call again), Closed once the producer closed the
        ring and everything published was received, ProducerDied, Detached, or Deadlock when
        the wait could never end. The GIL is released while it waits; Ctrl-C interrupts it."""
    def __iter__(self) -> Iterator[Batch]: ...
    def __next__(self) -> Batch: ...
    def close(self) -> None:
        """Detaches from the ring. Batches still held (and tensors made from them) stay
        valid; the producer is told goodbye once the last of them is released."""
    def __enter__(self) -> Consumer: ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

class Slot:
    """A slot the producer acquired: declare tensors with ``tensor()``, write them, then
    ``publish()``. Use it as a context manager: leaving the block without ``publish()`` gives
    the slot back unpublished (``abandon()``), and the next ``acquire()`` returns it again."""

    seq: int
    """The sequence number this batch will have."""
    index: int
    """The slot index."""
    capacity: int
    """Capacity in bytes."""
    names: list[str]
    """Names of the tensors declared so far."""
    def tensor(
        self,
        name: str,
        dtype: Optional[DType] = None,
        shape: Optional[Sequence[int]] = None,
        strides: Optional[Sequence[int]] = None,
    ) -> Any:
        """Declares a tensor in this slot, or returns the one declared under ``name`` before,
        and gives a writable view of it: a ``torch.Tensor`` when ``dtype`` is a torch dtype
        (made as ``torch.from_dlpack`` would, for torch's current stream), else a
        ``gpipe.Tensor``, which any DLPack library takes (``numpy.from_dlpack``,
        ``cupy.from_dlpack``).

        ``name``: the tensor's name, 1 to 32 bytes. ``dtype``: a name (``"float32"``), a NumPy
        dtype or scalar type, or a torch dtype; None to get a tensor declared before.
        ``shape``: its dimensions (None: a tensor declared before). ``strides``: in elements
        (None: row-major); a channels_last layout stays channels_last.

        Tensors are placed in declaration order, each at the previous one's end rounded up to
        256 bytes, so the same declaration in the same slot always has the same address.
        Raises ValueError if the tensor does not fit the slot."""
    def fill_pattern(self, nbytes: int) -> tuple[int, ...]:
        """Writes the test pattern of ``gpipe produce`` (batch ``seq``'s words) over the first
        ``nbytes`` bytes of a host slot and returns the header that ``gpipe consume --verify``
        checks; publish with ``publish(meta=header, nbytes=nbytes)``."""
    def publish(
        self,
        meta: Optional[Sequence[int]] = None,
        nbytes: Optional[int] = None,
        stream: Any = None,
    ) -> int:
        """Publishes the batch and returns its sequence number. Do not write the slot's
        tensors afterwards: consumers are reading them.

        ``meta``: the batch's user header, up to 8 ints from 0 to 2**64 - 1 (``batch.meta`` on
        the consumer side; missing words are 0). ``nbytes``: the batch's length in bytes when
        no tensors were declared (a raw batch, read as one uint8 tensor ``data``); None: the
        declared tensors' extent. ``stream`` (CUDA): ``ready`` is signalled after the work
        enqueued by now on this stream (a torch or CuPy stream or a handle; None: torch's
        current stream if torch has started CUDA, else the legacy default stream) and on every
        stream the slot's tensors were made for. Host rings ignore it."""
    def abandon(self) -> None:
        """Gives the slot back unpublished (the next acquire returns it again)."""
    def __enter__(self) -> Slot: ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

class Producer:
    """The producing side of a ring: it makes the ring's slots, listens on ``socket`` for
    consumers, and publishes batches. ``send()`` copies tensors into the next slot and
    publishes them; ``acquire()`` gives a slot to write in place. Use it as a context manager:
    leaving the block closes the ring (consumers get everything published, then Closed).

    ``socket``: the Unix socket path consumers attach to, made with mode 0600 (only the same
    user may attach). ``slots``: slots in the ring, 1 to 4096, or ``"auto"``: 8 with MPS
    running (and on the host); without MPS, where the GPU time-slices between processes and a
    deeper ring moves more, the deepest of 8, 16, 32 and 64 whose slots fit ``depth_budget``
    (``slots_auto`` says which and why). ``batch_bytes``: the largest batch in bytes, at most
    64 GiB; each slot holds this rounded up to 2 MiB. ``mode``: ``"broadcast"`` (every
    consumer gets every batch published after it attached) or ``"shared"`` (each batch goes
    to exactly one consumer). ``backend``: ``"auto"`` (CUDA when a GPU is usable, else host
    memory), ``"cuda"`` or ``"host"``. ``device``: the CUDA device index of the slots (CUDA
    backend). ``detach_after_ms``: detach a consumer that holds a slot the producer needs for
    longer than this many milliseconds; None: wait for it (back-pressure).
    ``max_consumers``: the most consumers attached at once, 1 to 63. ``drain_timeout``:
    seconds ``close()`` waits for consumers to release what they hold before it takes it
    back. ``sync`` (CUDA): how ``ready`` is signalled: ``"auto"`` or ``"semaphore"``
    (timeline words, which consumers release when the producer dies) or ``"events"`` (IPC
    events). ``max_lead``: write a batch only once the batch this many back was consumed by
    everyone who got it; below ``slots`` it keeps the data in flight small enough for a GPU's
    L2 cache; None: the ring's own bound (``slots``); ``"auto"``: from the GPU's L2 size and
    ``batch_bytes`` (host rings: None). ``depth_budget``: the most slot memory in bytes that
    ``slots="auto"`` may take. ``timeline_memory`` (CUDA): where the ``ready`` and
    ``finished`` words live: ``"host"``, ``"device"`` (faster; see docs/python.md for when it
    is safe) or ``"auto"``. ``keep_dumpable``: leave this process dumpable; by default the
    producer makes it not dumpable, so that other processes of the same user cannot open its
    read-write memory through ``/proc/PID/fd`` (no core dumps then, and debuggers and
    profilers such as py-spy or gdb need root; docs/security.md).

    Wrong arguments raise TypeError (a wrong type) or ValueError (a value out of range),
    naming the argument.

    This is the native class; use ``gpipe.Producer``, which adds ``send()``.
    """

    socket: str
    """The socket path consumers attach to."""
    backend: str
    """"host" or "cuda"."""
    mode: str
    """"broadcast" or "shared"."""
    slots: int
    """Slots in the ring."""
    slot_bytes: int
    """Capacity of each slot in bytes (batch_bytes rounded up to 2 MiB)."""
    device: str
    """The device: "cpu" or "cuda:N"."""
    memory: str
    """Where the slots live: "host", or the CUDA memory path ("pool", "vmm", "legacy")."""
    consumers: int
    """Consumers attached now."""
    next_seq: int
    """Sequence number of the next batch."""
    closed: bool
    """True after close()."""
    max_lead: Optional[int]
    """The producer-lead bound in batches (None: the ring's own, slots); "auto" resolved."""
    slots_auto: Optional[str]
    """With slots="auto": the depth chosen and why (None otherwise)."""
    def __init__(
        self,
        socket: Union[str, PathLike[str]],
        *,
        slots: Union[int, Literal["auto"], None] = 8,
        batch_bytes: int = 8 << 20,
        mode: str = "broadcast",
        backend: str = "auto",
        device: int = 0,
        detach_after_ms: Optional[int] = None,
        max_consumers: int = 16,
        drain_timeout: float = 5.0,
        sync: str = "auto",
        max_lead: Union[int, Literal["auto"], None] = None,
        depth_budget: int = 2 << 30,
        timeline_memory: str = "host",
        keep_dumpable: bool = False,
    ) -> None:
        """Creates the ring and listens on `socket`: see the class docstring for the
        arguments."""
    @staticmethod
    def _defaults() -> dict[str, Any]: ...
    def acquire(self, timeout: Optional[float] = None, stream: Any = None) -> Slot:
        """Takes the next slot, once every consumer that had its previous batch released it.
        One slot at a time: publish it or leave its ``with`` block before acquiring another.

        ``timeout``: seconds to wait for the slot (None: as long as it takes); raises Timeout
        when it runs out (nothing is lost: call again), Closed after close().
        ``stream`` (CUDA): the stream your writes to the slot run on, ordered after the slot's
        previous consumers before this returns (a torch or CuPy stream or a handle; None:
        torch's current stream if torch has started CUDA, else the legacy default stream).
        Host rings ignore it.

        Use it as a context manager: leaving the block without ``publish()`` gives the slot
        back unpublished."""
    def wait_for_consumers(self, n: int = 1, timeout: Optional[float] = None) -> None:
        """Waits until at least ``n`` consumers are attached, up to ``timeout`` seconds (None:
        as long as it takes; then Timeout). Ctrl-C interrupts it."""
    def flush(self, timeout: Optional[float] = None) -> None:
        """Waits until every published batch was released by every consumer that got it, up
        to ``timeout`` seconds (None: as long as it takes; then Timeout)."""
    def close(self) -> dict[str, int]:
        """Closes the ring cleanly: consumers receive everything published, then `Closed`.
        Waits up to `drain_timeout` for them to finish. Returns the run's counters."""
    def __enter__(self) -> Producer: ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

def forward(
    upstream: Union[str, PathLike[str]],
    socket: Union[str, PathLike[str]],
    *,
    device: Optional[int] = None,
    slots: int = 8,
    max_consumers: int = 16,
    wait_for_consumers: int = 0,
    chunk: Optional[int] = None,
) -> dict[str, Any]:
    """Consumes the ring at `upstream` and re-publishes every batch in a ring of its own at
    `socket` (same slot size and mode) on CUDA device `device` (default: the upstream
    producer's), so that consumers on that GPU read their own memory; forwarders chain.
    Blocks until the upstream ring closes, then closes its own ring once its consumers are
    done, and returns {"backend", "batches", "bytes", "elapsed_s", "gb_per_s", "error"}.
    `slots`: slots in the forwarder's ring, 1 to 4096. `max_consumers`: the most consumers
    attached to it at once, 1 to 63. `chunk`: copy in chunks of this many bytes, publishing
    the progress after each, so that a forwarder downstream with the same `chunk` starts on a
    chunk once it has landed (None: whole batches); consumers see only whole batches.
    `wait_for_consumers`: take no batch until that many
    consumers attached downstream. Raises
    Error if the upstream ring fails (its consumers then see the producer die);
    KeyboardInterrupt stops it."""

def fanout_plan(
    consumer_devices: Sequence[int],
    shape: str = "auto",
    batch_bytes: int = 64 << 20,
    producer_device: int = 0,
    one_at_a_time: bool = False,
) -> dict[str, Any]:
    """How `shape` ("direct", "chain", "tree" or "auto") reaches one consumer per entry of
    `consumer_devices` (its GPU) from a producer on `producer_device`, for batches of
    `batch_bytes` bytes (what "auto" weighs): {"shape", "rings": [{"device", "parent"}],
    "consumer_ring", "depth", "chunk_bytes"}. Ring 0 is the producer's; run one forward() per
    other ring, from its parent's socket, on its device, with chunk=plan["chunk_bytes"].
    "chunk_bytes": the chunk the forwarders should copy in (None: whole batches, which keep
    every link busy in a steady stream). `one_at_a_time`: batches go one at a time, each
    waited for end to end (a weight update): a chain of two forwarders or more then copies in
    chunks, so that each hop starts before the batch has crossed the one before."""


def resolve(
    *,
    slots: int | str | None = None,
    batch_bytes: int = 8 << 20,
    mode: str = "broadcast",
    backend: str = "auto",
    device: int = 0,
    sync: str = "auto",
    max_lead: int | str | None = None,
    depth_budget: int = 2 << 30,
    timeline_memory: str = "host",
    side_signals: bool | None = None,
    report: str | PathLike[str] | None = None,
) -> dict[str, Any]:
    """What `Producer(...)` would make of these arguments, without making a ring: every
    "auto" resolved by the rules the `gpipe` command line uses too (`gpipe probe --python`
    prints the same), each setting as {"value", "auto", "reason"}. `report`: a saved
    `gpipe probe --json` report to resolve against instead of this machine's driver."""
    ...
