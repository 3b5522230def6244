"""Weight updates over a gpipe ring: a trainer publishes a model's state dict after each
optimizer step, inference processes load it into their own parameters or read it in place.

One update is ONE batch of two gpipe tensors, whatever the state dict holds:

* ``weights``: a flat ``uint8`` region. Each tensor of the state dict sits at an offset
  aligned to 256 bytes, row-major; after the last one, a 32-byte *seal* (four int64 words:
  magic, version, layout hash, publisher nonce) that the publisher writes last, on the same
  stream as the tensors' copies.
* ``layout``: the layout as JSON bytes (names, dtypes, shapes, offsets), read by a receiver
  once, the first time it sees the layout's hash.

The batch's 8-word header carries ``[MAGIC, version, layout hash, weights bytes, layout
bytes, nonce, user word, user word]``. A receiver checks the magic, that the version grew,
the layout against its model, and the seal against the header before it copies anything:
a seal that does not say this version means the region was not completely written (a
trainer killed while its copies were in flight), and the update is refused with the model
untouched. The per-slot limit of 8 tensors of a gpipe batch is therefore never the user's
problem: a state dict of any number of tensors is two gpipe tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union

import torch

from . import Consumer, Error, ProducerDied, Timeout
from ._producer import Producer

MAGIC = 0x6770_6970_7774_7331  # "gpipwts1": the first header word of every update
SEAL_MAGIC = 0x5345_414C_7774_7331  # "SEALwts1": the seal's first word
ALIGN = 256  # every tensor's offset in the region, as gpipe's own tensor offsets
SEAL_BYTES = 32
LAYOUT_FORMAT = 1
_MASK63 = (1 << 63) - 1  # header values that also live in int64 seal words
# Where a tensor of an update goes: (destination, as bytes), or None (not loaded).
_Dest = Optional[tuple[torch.Tensor, bool]]


class WeightError(Error):
    """A weight update that must not be loaded: another program on the socket, a version
    that did not grow, a layout that does not match the model, or a region that was not
    completely written. The message names both sides; the model is left untouched."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightError(f"the trainer's layout names dtype {name!r}, which this torch lacks")
    return dt


def _state_dict_of(obj: Any) -> dict[str, torch.Tensor]:
    """The named tensors of a module (its state dict) or of a mapping of tensors."""
    if isinstance(obj, torch.nn.Module):
        sd = obj.state_dict()
    elif isinstance(obj, Mapping):
        sd = dict(obj)
    else:
        raise TypeError(
            f"expected a torch.nn.Module or a dict of tensors by name; got {type(obj).__name__}"
        )
    for name, t in sd.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(
                f"state dict entry {name!r} is a {type(t).__name__}; every entry must be a "
                "torch.Tensor named by a str"
            )
    if not sd:
        raise ValueError("the state dict is empty: there is nothing to publish")
    return sd


class Layout:
    """Where each tensor of a state dict lives in an update's flat region."""

    def __init__(self, entries: Sequence[tuple[str, str, tuple[int, ...], int, int]]) -> None:
        self.entries = [(n, d, tuple(s), o, b) for n, d, s, o, b in entries]
        end = max((o + b for _, _, _, o, b in self.entries), default=0)
        self.seal_offset = _align(end)
        self.nbytes = self.seal_offset + SEAL_BYTES
        self.json = json.dumps(
            {"format": LAYOUT_FORMAT, "tensors": [list(e) for e in self.entries]},
            separators=(",", ":"),
        ).encode()
        digest = hashlib.blake2b(self.json, digest_size=8).digest()
        self.hash = int.from_bytes(digest, "little") & _MASK63
        self.by_name = {e[0]: e for e in self.entries}

    @classmethod
    def of(cls, sd: Mapping[str, torch.Tensor]) -> Layout:
        entries = []
        offset = 0
        for name, t in sd.items():
            nbytes = t.numel() * t.element_size()
            entries.append((name, _dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
            offset = _align(offset + nbytes)
        return cls(entries)

    @classmethod
    def from_json(cls, raw: bytes) -> Layout:
        doc = json.loads(raw.decode())
        if doc.get("format") != LAYOUT_FORMAT:
            raise WeightError(
                f"the trainer's layout has format {doc.get('format')!r}, this receiver reads "
                f"format {LAYOUT_FORMAT}: run the same gpipe version on both sides"
            )
        return cls([(n, d, tuple(s), o, b) for n, d, s, o, b in doc["tensors"]])

    def describe(self) -> str:
        total = sum(b for *_, b in self.entries)
        return f"{len(self.entries)} tensors, {total} bytes, layout {self.hash:#x}"

    def mismatches(self, sd: Mapping[str, torch.Tensor], limit: int = 5) -> list[str]:
        """What differs between this layout (the trainer's) and `sd` (here), first `limit`."""
        out = []
        for name, dtype, shape, _, _ in self.entries:
            t = sd.get(name)
            if t is None:
                out.append(f"{name!r} ({dtype} {list(shape)}) is missing here")
            elif _dtype_name(t.dtype) != dtype or tuple(t.shape) != shape:
                out.append(
                    f"{name!r} is {dtype} {list(shape)} at the trainer and "
                    f"{_dtype_name(t.dtype)} {list(t.shape)} here"
                )
        for name, t in sd.items():
            if name not in self.by_name:
                out.append(f"{name!r} ({_dtype_name(t.dtype)} {list(t.shape)}) is not published")
        return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def _bytes_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """`t` as a flat uint8 view of its bytes, or None when it is not contiguous."""
    if not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def _region_view(flat: torch.Tensor, entry: tuple, as_bytes: bool) -> torch.Tensor:
    name, dtype, shape, offset, nbytes = entry
    piece = flat[offset : offset + nbytes]
    if as_bytes:
        return piece
    return piece.view(_dtype_of(dtype)).view(shape)


class WeightPublisher:
    """The trainer's side: publishes a state dict as one gpipe batch per update.

    ``WeightPublisher(socket, model_or_state_dict, slots=2)`` makes a broadcast ring whose
    slots hold the whole state dict once (plus its layout), on the GPU the tensors are on
    (host memory for CPU tensors). ``publish()`` after each optimizer step copies every tensor
    into the next free slot on the current stream (no host synchronisation) and publishes it
    with the next version number; it waits only when both slots are still held by receivers.
    The tensors are those of the state dict taken here: parameters updated in place (as
    optimizers and ``load_state_dict`` do) are published as they are at each ``publish()``;
    pass ``publish(state_dict)`` when the tensors themselves were replaced (same names, dtypes
    and shapes).

    ``copy``: how the copies are issued: ``"each"`` (one ``copy_`` per tensor, a memcpy for
    contiguous tensors), ``"foreach"`` (``torch._foreach_copy_`` on typed views, fewer launches
    for many small tensors) or ``"auto"`` (``"foreach"`` when tensors average under 1 MiB).
    The other arguments go to :class:`gpipe.Producer` (``max_receivers`` is its
    ``max_consumers``); a receiver that dies is let go at once.

    ``in_slot=True``: no copy at all. The ring has one slot and the model's tensors are moved
    into it (each parameter's and buffer's ``.data`` becomes a view of the slot), so
    ``publish()`` only seals and publishes, then waits until every receiver released the
    update before it returns, because the next optimizer step writes the same memory (your
    stream is also ordered after the receivers' work on the GPU). Receivers see the same
    updates as in the copying mode. Tied tensors (two names, one memory) are refused. Pass
    the module (or the very tensor objects your code updates): the tensors of a
    ``model.state_dict()`` are other objects, and moving them would leave the model behind.
    """

    def __init__(
        self,
        socket: Union[str, os.PathLike[str]],
        model_or_state_dict: Any,
        *,
        slots: int = 2,
        copy: str = "auto",
        in_slot: bool = False,
        max_receivers: int = 16,
        drain_timeout: float = 5.0,
        detach_after_ms: Optional[int] = None,
        **producer_args: Any,
    ) -> None:
        if copy not in ("auto", "each", "foreach"):
            raise ValueError(f"copy must be 'auto', 'each' or 'foreach', not {copy!r}")
        sd = _state_dict_of(model_or_state_dict)
        devices = {t.device for t in sd.values()}
        if len(devices) != 1:
            raise ValueError(
                f"the state dict's tensors are on several devices ({sorted(map(str, devices))}); "
                "a publisher takes the tensors of one device: move them first"
            )
        (dev,) = devices
        if dev.type == "cuda":
            backend, index = "cuda", dev.index if dev.index is not None else 0
        elif dev.type == "cpu":
            backend, index = "host", 0
        else:
            raise ValueError(f"tensors on {dev} cannot be published: use CUDA or CPU tensors")
        self.layout = Layout.of(sd)
        self.device = dev
        avg = sum(e[4] for e in self.layout.entries) / len(self.layout.entries)
        self.copy = copy if copy != "auto" else ("foreach" if avg < (1 << 20) else "each")
        self._src = self._sources(sd)
        self._layout_cpu = torch.frombuffer(bytearray(self.layout.json), dtype=torch.uint8)
        if backend == "cuda":
            self._layout_cpu = self._layout_cpu.pin_memory()
        self._layout_dev = self._layout_cpu.to(dev)
        self.nonce = int.from_bytes(os.urandom(8), "little") & _MASK63
        self._seal_base = torch.tensor(
            [SEAL_MAGIC, 0, self.layout.hash, self.nonce], dtype=torch.int64, device=dev
        )
        self._seal_step = torch.tensor([0, 1, 0, 0], dtype=torch.int64, device=dev)
        self._views: dict[int, list[torch.Tensor]] = {}  # region address -> slot views
        self.version = 0
        self.in_slot = in_slot
        if in_slot and slots != 2 and slots != 1:
            raise ValueError(f"in_slot=True uses one slot (the model's own memory); slots={slots}")
        self.producer = Producer(
            socket,
            slots=1 if in_slot else slots,
            batch_bytes=self.layout.nbytes + _align(len(self.layout.json)) + ALIGN,
            mode="broadcast",
            backend=backend,
            device=index,
            max_consumers=max_receivers,
            drain_timeout=drain_timeout,
            detach_after_ms=detach_after_ms,
            **producer_args,
        )
        self._slot: Any = None  # in_slot: the slot the model lives in, while this side holds it
        self._flat_ptr = 0
        if in_slot:
            try:
                self._move_into_slot(model_or_state_dict, sd)
            except BaseException:
                self.producer.close()
                raise

    def _sources(self, sd: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, bool]]:
        """What publish() copies from, in layout order: (tensor, True) for a byte view of a
        contiguous tensor (copy="each": one memcpy, a single view of the slot), (tensor,
        False) for one copied by its own dtype and shape (non-contiguous, or copy="foreach",
        whose kernels work on typed tensors)."""
        out = []
        for name, *_ in self.layout.entries:
            t = sd[name].detach()
            b = _bytes_view(t) if self.copy == "each" else None
            out.append((b, True) if b is not None else (t, False))
        return out

    def _slot_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The destination of every tensor in a slot's region, then the seal's words. The
        same slot always has the same address, so they are made once per slot."""
        key = flat.data_ptr()
        views = self._views.get(key)
        if views is None:
            views = [_region_view(flat, e, as_bytes) for e, (_, as_bytes)
                     in zip(self.layout.entries, self._src)]
            views.append(flat[self.layout.seal_offset : self.layout.nbytes].view(torch.int64))
            self._views[key] = views
        return views

    def _move_into_slot(self, obj: Any, sd: Mapping[str, torch.Tensor]) -> None:
        """in_slot: copies every tensor into the slot once and points the model at it."""
        ptrs: dict[int, str] = {}
        for name, t in sd.items():
            if t.numel() and t.data_ptr() in ptrs:
                raise ValueError(
                    f"in_slot=True: {name!r} and {ptrs[t.data_ptr()]!r} share their memory (tied "
                    "weights); publish with the copying mode (in_slot=False)"
                )
            ptrs[t.data_ptr()] = name
        if isinstance(obj, torch.nn.Module):
            holders: dict[str, torch.Tensor] = dict(obj.named_parameters(remove_duplicate=False))
            holders.update(obj.named_buffers(remove_duplicate=False))
        else:
            holders = dict(obj)
        missing = [n for n in sd if n not in holders]
        if missing:
            raise ValueError(
                f"in_slot=True: the state dict's {missing[:3]} are neither parameters nor "
                "buffers of the module, so they cannot be moved into the slot; use in_slot=False"
            )
        flat = self._take_slot(None)
        with torch.no_grad():
            for e in self.layout.entries:
                view = _region_view(flat, e, False)
                view.copy_(holders[e[0]])
                holders[e[0]].data = view

    def _take_slot(self, timeout: Optional[float]) -> torch.Tensor:
        """in_slot: acquires the one slot again (once every receiver released it) and
        declares the update's tensors, which come back at the same address."""
        slot = self.producer.acquire(timeout=timeout)
        flat = slot.tensor("weights", torch.uint8, (self.layout.nbytes,))
        lay = slot.tensor("layout", torch.uint8, (len(self.layout.json),))
        if self._flat_ptr == 0:
            lay.copy_(self._layout_dev)
            self._flat_ptr = flat.data_ptr()
            self._seal_view = flat[self.layout.seal_offset : self.layout.nbytes].view(torch.int64)
        elif flat.data_ptr() != self._flat_ptr:
            slot.abandon()
            raise Error(
                f"the slot came back at {flat.data_ptr():#x}, not at {self._flat_ptr:#x} where the "
                "model's tensors live: this gpipe breaks the fixed-address rule"
            )
        self._slot = slot
        return flat

    def wait_writable(self, timeout: Optional[float] = None) -> None:
        """in_slot: waits until every receiver released the last update, so the model's
        tensors may be written again. publish() does it before it returns; call this after a
        publish() that raised gpipe.Timeout, before the next optimizer step."""
        if self.in_slot and self._slot is None:
            self._take_slot(timeout)

    def wait_for_receivers(self, n: int = 1, timeout: Optional[float] = None) -> None:
        """Waits until `n` receivers (or forwarders) are attached. A receiver gets the
        updates published after it attached."""
        self.producer.wait_for_consumers(n, timeout=timeout)

    @property
    def receivers(self) -> int:
        """Receivers attached now."""
        return self.producer.consumers

    def publish(
        self,
        state_dict: Any = None,
        *,
        user: Sequence[int] = (),
        timeout: Optional[float] = None,
    ) -> int:
        """Copies the state dict into the next slot and publishes it; returns its version
        (1, 2, ...). Waits (up to `timeout` seconds, then gpipe.Timeout) only while every slot
        is held by a receiver. `state_dict`: other tensors than those given at construction,
        with the same names, dtypes and shapes. `user`: up to 2 words (0 to 2**64 - 1) that
        receivers read as `update.user`."""
        if len(user) > 2:
            raise ValueError(f"user takes at most 2 words; got {len(user)}")
        src = self._src
        if state_dict is not None:  # (the slot's cached views follow self._src's layouts)
            sd = _state_dict_of(state_dict)
            bad = self.layout.mismatches(sd)
            if bad:
                raise WeightError(
                    "publish(state_dict): it does not match the layout this publisher was made "
                    f"with ({self.layout.describe()}): " + "; ".join(bad)
                )
            src = self._sources(sd)
        version = self.version + 1
        if self.in_slot:
            return self._publish_in_slot(state_dict, user, timeout, version)
        with self.producer.acquire(timeout=timeout) as slot:
            flat = slot.tensor("weights", torch.uint8, (self.layout.nbytes,))
            lay = slot.tensor("layout", torch.uint8, (len(self.layout.json),))
            lay.copy_(self._layout_dev)
            views = self._slot_views(flat)
            if src is not self._src:
                views = [v if mine[1] == theirs[1] else _region_view(flat, e, theirs[1])
                         for v, mine, theirs, e in zip(views, self._src, src, self.layout.entries)
                         ] + views[-1:]
            if self.copy == "foreach":
                torch._foreach_copy_(views[:-1], [t for t, _ in src])
            else:
                for d, (t, _) in zip(views, src):
                    d.copy_(t)
            # The seal last, on the same stream: when it reads `version`, every copy before
            # it is complete.
            torch.add(self._seal_base, self._seal_step, alpha=version, out=views[-1])
            meta = [MAGIC, version, self.layout.hash, self.layout.nbytes,
                    len(self.layout.json), self.nonce, *user]
            slot.publish(meta=meta)
        self.version = version
        return version

    def _publish_in_slot(self, state_dict: Any, user: Sequence[int], timeout: Optional[float],
                         version: int) -> int:
        if state_dict is not None:
            raise ValueError("in_slot=True publishes the model's own tensors: call publish()")
        self.wait_writable(timeout)
        torch.add(self._seal_base, self._seal_step, alpha=version, out=self._seal_view)
        meta = [MAGIC, version, self.layout.hash, self.layout.nbytes, len(self.layout.json),
                self.nonce, *user]
        self._slot.publish(meta=meta)
        self._slot = None
        self.version = version
        try:
            self._take_slot(timeout)
        except Timeout as e:
            raise Timeout(
                f"version {version} was published, but receivers still hold it after {timeout} s: "
                "do not write the model's tensors before wait_writable() returns"
            ) from e
        return version

    def close(self) -> dict[str, int]:
        """Closes the ring: receivers get every update published, then gpipe.Closed. With
        in_slot=True the model's tensors stay valid (they keep the slot's memory alive)."""
        self._views.clear()
        if self._slot is not None:
            self._slot.abandon()
            self._slot = None
        return self.producer.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        return (f"WeightPublisher({self.producer.socket!r}, {self.layout.describe()}, "
                f"version {self.version}, {self.producer.consumers} receivers)")


class WeightUpdate:
    """One update read in place: ``state_dict`` maps each name to a read-only tensor over the
    trainer's slot (do not write them: torch has no read-only tensors, and a write kills this
    process). Release it (``release()``, or leave its ``with`` block) as soon as you are done:
    the trainer reuses the slot once every receiver released it."""

    def __init__(self, batch: Any, version: int, user: tuple[int, ...],
                 state_dict: dict[str, torch.Tensor]) -> None:
        self.batch = batch
        self.version = version
        self.user = user
        self.state_dict = state_dict

    def release(self) -> None:
        """Hands the slot back (once the tensors of ``state_dict`` taken from it are gone)."""
        self.state_dict = {}
        self.batch.release()

    def __enter__(self) -> WeightUpdate:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.release()
        return False

    def __repr__(self) -> str:
        return f"WeightUpdate(version {self.version}, {len(self.state_dict)} tensors)"


class WeightReceiver:
    """An inference process's side: receives the updates of a :class:`WeightPublisher`.

    ``rx.load_into(model)`` waits for the next update and copies it into the model's own
    tensors (its state dict, taken the first time; in place); ``rx.recv()`` gives the update
    in place as a :class:`WeightUpdate`. Before anything is copied or returned, the update's
    version must exceed the last one received, its layout must match (load_into: the model's
    names, dtypes and shapes), and its seal must say its version; otherwise
    :class:`WeightError`, naming both sides, and the model is untouched. A trainer that dies
    gives ``gpipe.ProducerDied`` (saying which version was the last received); a closed one
    ``gpipe.Closed``.

    ``device``: where to receive (None: the trainer's device; ``"cuda:N"`` another GPU).
    ``delivery``: on another GPU, ``"in-place"`` (default: load_into reads the trainer's slot
    over NVLink/PCIe once, straight into the model) or ``"mirror"`` (a copy on this GPU
    first, for reading an update in place many times). To feed several GPUs, forward the
    trainer's ring to each (``gpipe.forward`` / ``gpipe.fanout_plan``) and attach there.
    """

    def __init__(
        self,
        socket: Union[str, os.PathLike[str]],
        *,
        device: Any = None,
        timeout: float = 5.0,
        delivery: str = "in-place",
        spin: Optional[float] = None,
    ) -> None:
        self.consumer = Consumer(
            socket, device=device, timeout=timeout, delivery=delivery, spin=spin,
            mirror_buffers=1 if delivery == "mirror" else None,
        )
        self.socket = str(socket)
        self.device = torch.device(self.consumer.device)
        self.version = 0  # the last version received
        self.layout: Optional[Layout] = None
        self._nonce: Optional[int] = None
        # module -> (layout hash, where each tensor goes): a module's state dict is read once
        self._targets: weakref.WeakKeyDictionary[Any, tuple[int, list[_Dest]]] = (
            weakref.WeakKeyDictionary()
        )
        # the last dict of tensors loaded into: (its id, (name, weak tensor) of each entry,
        # layout hash, where each tensor goes)
        self._dict_plan: Optional[tuple[int, list, int, list[_Dest]]] = None

    # -- receiving -------------------------------------------------------------------------

    def _next(self, timeout: Optional[float], latest: bool) -> Any:
        batch = self.consumer.recv(timeout=timeout)
        while latest:
            try:
                newer = self.consumer.recv(timeout=0.0)
            except Timeout:
                break
            batch.release()
            batch = newer
        return batch

    def _died(self, e: ProducerDied) -> ProducerDied:
        """The trainer's death, said with what this receiver holds."""
        return ProducerDied(
            f"the trainer publishing weights at {self.socket} (or a forwarder between it and "
            f"this receiver) died; the last update received here is version {self.version}, "
            f"and nothing of a later one was loaded ({e})"
        )

    def _check(self, batch: Any) -> tuple[int, Layout, torch.Tensor]:
        """The update's header checked (magic, nonce, version, layout): its version, layout and
        bytes. Nothing here waits for the trainer's copies; :meth:`_check_seal` does."""
        meta = batch.meta
        if meta[0] != MAGIC or "weights" not in batch or "layout" not in batch:
            raise WeightError(
                f"the producer at {self.socket} does not publish weight updates (header "
                f"{[hex(w) for w in meta[:2]]}, tensors {batch.names}): attach to a "
                "WeightPublisher's socket"
            )
        version, lhash, nbytes, lbytes, nonce = meta[1], meta[2], meta[3], meta[4], meta[5]
        if self._nonce is not None and nonce != self._nonce:
            raise WeightError(
                f"update version {version} comes from another publisher (nonce {nonce:#x}) than "
                f"the updates received before (nonce {self._nonce:#x}): attach a new receiver"
            )
        if version <= self.version:
            raise WeightError(
                f"update version {version} is not newer than version {self.version} received "
                "before: versions must grow"
            )
        if self.layout is None or self.layout.hash != lhash:
            raw = bytes(_as_tensor(batch["layout"]).cpu().tolist())
            if len(raw) != lbytes:
                raise WeightError(f"update version {version}: its layout is {len(raw)} bytes, "
                                  f"its header says {lbytes}")
            layout = Layout.from_json(raw)
            if layout.hash != lhash or layout.nbytes != nbytes:
                raise WeightError(
                    f"update version {version}: its layout hashes to {layout.hash:#x} over "
                    f"{layout.nbytes} bytes, its header says {lhash:#x} over {nbytes}"
                )
            self.layout = layout
        return version, self.layout, _as_tensor(batch["weights"])

    def _check_seal(self, batch: Any, flat: torch.Tensor) -> None:
        """Waits for the update's bytes (the seal is written last, on the trainer's stream)
        and checks that its seal says its version. The callers make their views of the slot
        before, so that the host builds them while the copies are still in flight."""
        version, lhash, nonce = batch.meta[1], batch.meta[2], batch.meta[5]
        assert self.layout is not None
        seal = flat[self.layout.seal_offset : self.layout.nbytes].view(torch.int64).tolist()
        want = [SEAL_MAGIC, version, lhash, nonce]
        if seal != want:
            raise WeightError(
                f"update version {version} is not completely written: its seal says version "
                f"{seal[1]} (words {seal}, expected {want}); the trainer died or was stopped "
                f"while writing it. Nothing was loaded; this receiver keeps version {self.version}"
            )
        self._nonce = nonce

    def recv(self, timeout: Optional[float] = None, *, latest: bool = False) -> WeightUpdate:
        """The next update, in place (see :class:`WeightUpdate`). `latest`: skip to the
        newest update already published, releasing older ones. Raises gpipe.Timeout after
        `timeout` seconds (None: waits)."""
        try:
            batch = self._next(timeout, latest)
            try:
                version, layout, flat = self._check(batch)
                sd = {e[0]: _region_view(flat, e, False) for e in layout.entries}
                self._check_seal(batch, flat)
            except BaseException:
                sd = flat = None  # a traceback kept by the caller must not hold the slot
                batch.release()
                raise
        except ProducerDied as e:
            raise self._died(e) from e
        self.version = version
        return WeightUpdate(batch, version, tuple(batch.meta[6:8]), sd)

    def _plan(self, target: Any, layout: Layout, strict: bool) -> list[_Dest]:
        """Where each tensor of `layout` goes in `target` (None: nowhere, strict=False).
        Kept for the next update: per module, and for the last dict of tensors while it holds
        the same tensors under the same names (checking that costs far less than planning
        again, about 1 ms for 200 tensors)."""
        is_module = isinstance(target, torch.nn.Module)
        cached = self._targets.get(target) if is_module else self._dict_plan_for(target, layout)
        if cached is not None and cached[0] == layout.hash:
            return cached[1]
        sd = _state_dict_of(target)
        bad = layout.mismatches(sd)
        if strict and bad:
            raise WeightError(
                f"the trainer's state dict ({layout.describe()}) does not match this one "
                f"({len(sd)} tensors): " + "; ".join(bad)
                + " (load_into(..., strict=False) loads the tensors that match)"
            )
        dsts: list[_Dest] = []
        for name, dtype, shape, _, _ in layout.entries:
            t = sd.get(name)
            if t is None or _dtype_name(t.dtype) != dtype or tuple(t.shape) != shape:
                dsts.append(None)
                continue
            if t.device != self.device:
                raise WeightError(
                    f"{name!r} is on {t.device}, but this receiver receives on {self.device}: "
                    f"make the receiver with device={str(t.device)!r} or move the model"
                )
            b = _bytes_view(t)
            dsts.append((b, True) if b is not None else (t.detach(), False))
        if is_module:
            self._targets[target] = (layout.hash, dsts)
        else:  # no strong reference: the dict by id, its tensors by weak reference
            self._dict_plan = (id(target), [(k, weakref.ref(t)) for k, t in sd.items()],
                               layout.hash, dsts)
        return dsts

    def _dict_plan_for(self, target: Any, layout: Layout) -> Optional[tuple[int, list[_Dest]]]:
        """The plan made for `target`, a dict, if it still holds the same tensors by the same
        names."""
        c = self._dict_plan
        if c is None or c[0] != id(target) or c[2] != layout.hash or len(target) != len(c[1]):
            return None
        for (key, ref), (k, t) in zip(c[1], target.items()):
            if ref() is not t or key != k:
                return None
        return c[2], c[3]

    def load_into(
        self,
        target: Any,
        timeout: Optional[float] = None,
        *,
        latest: bool = False,
        strict: bool = True,
    ) -> int:
        """Waits for the next update (up to `timeout` seconds; None: waits) and copies it into
        `target`, a module (its state dict, taken the first time) or a dict of tensors, on the
        current stream; returns its version. `latest`: skip to the newest update already
        published. `strict=False` loads the tensors whose name, dtype and shape match and
        leaves the others. Nothing is copied unless the whole update checks out."""
        try:
            with self._next(timeout, latest) as batch:
                version, layout, flat = self._check(batch)
                try:
                    dsts = self._plan(target, layout, strict)
                    pairs = [(d[0], _region_view(flat, e, d[1]))
                             for d, e in zip(dsts, layout.entries) if d is not None]
                    self._check_seal(batch, flat)
                    for dst, src in pairs:
                        dst.copy_(src)
                finally:
                    # the slot goes back now, even when a kept traceback lives on
                    pairs = flat = None  # noqa: F841
        except ProducerDied as e:
            raise self._died(e) from e
        self.version = version
        return version

    def close(self) -> None:
        """Detaches from the trainer's ring."""
        self.consumer.close()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        return (f"WeightReceiver({self.socket!r}, on {self.device}, version {self.version}, "
                f"{self.layout.describe() if self.layout else 'no update yet'})")


def _as_tensor(obj: Any) -> torch.Tensor:
    """A torch tensor over a batch's tensor, for the current stream (two per update)."""
    return torch.from_dlpack(obj)
