"""`gpipe.torch.Loader`: a data loader whose decode processes publish batches into gpipe rings
on the trainer's GPU, and whose trainer reads them in place.

The trainer process makes the loader; the loader starts decode processes (workers), each with
a ring of its own. A worker claims the next batch number from a counter they share, reads the
batch's samples from the dataset, calls the user's ``decode(samples, device)`` and publishes
what it returns (tensors on the trainer's GPU, or host tensors) into its ring. The trainer
takes the batches in batch-number order, whichever ring holds the next one, so every rank
sees the same batches in the same order on every run with the same seed.

How many workers: a fixed number, or ``"auto"``: one to start; while the trainer waits for
data, more, as many as its pace needs but at most twice as many at a time, each step kept only
if the trainer then takes batches faster (on a GPU without MPS, decode processes time-slice
with the trainer and more of them can make it slower); up to a limit set by the CPUs per
trainer of the node. The ranks of a DDP job (whose pace is the slowest rank's) decide
together, from every rank's figures (`_loader_peers`). Workers are processes (``spawn``), so
the dataset and the decode function must be picklable, as for a torch DataLoader with workers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import multiprocessing
import operator
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, Union

import torch

from ._gpipe import TENSOR_ALIGN, Closed, Deadlock, Error, ProducerDied, Timeout
from ._loader_peers import Peers, Window, view
from ._pinned_hold import PinnedHold

# The header of a batch: a magic word, the batch number, what decode returned, when it was
# published (CLOCK_MONOTONIC, ns: the same clock in every process of the machine).
_MAGIC = 0x6770_6C6F_6164  # "gpload"
_DICT, _TUPLE, _ONE = 0, 1, 2
# auto: add workers when the trainer waited more than this share of the last WINDOW batches
# (the time between its asking for a batch and having it, over the time between batches).
WAIT_SHARE = 0.03
WINDOW = 16
# A step is kept if the rate rose by at least a quarter of the gain it was predicted to bring
# (and by MIN_GAIN at least), or if the trainer no longer waits and takes batches at least
# MIN_GAIN faster, or (one rank of several that decides alone) no longer waits
# (a step that brings nothing, or slows the trainer, is retired). Workers that
# share a limit bring a few percent; Pillow decoders on a 64-core node brought 1.44x for 2x
# the workers (each slower than one alone), which half the predicted gain (1.5x) retired.
MIN_GAIN = 0.01
# auto also adds workers when, without waiting, the trainer took batches this much faster than
# the workers made them: it lives on their rings' backlog, and will wait once that is gone.
BEHIND = 0.1
# After a retired step auto adds no workers for this many batches, then acts again as before
# (a step that failed on noise, or a load that changed, is not final); doubled each time.
RETRY_AFTER = 8 * WINDOW
# Workers run this much nicer than the trainer (a nice increment), so that where decode takes
# every CPU the trainer's own threads come first. On 4 H100s of a 64-core node 56 Pillow
# workers left the trainers their batches on time but slowed their steps; nice 10 against 0
# gave 0.946x against 0.85x the ceiling in one command, 0.67x against 0.78x in another (not
# settled: docs/python.md).
WORKER_NICE = 10
# How long an ending worker waits for the trainer to take its last batches.
_DRAIN_S = 24 * 3600.0
# How long close() waits for stopped workers to reach their ring's close before it kills
# those stuck in decode (one in its close ends on its own, once its batches are dropped).
_STOP_S = 10.0


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


class _Plan:
    """Which samples batch number ``g`` holds: epoch ``g // per_epoch``, shuffled with the
    seed and the epoch, this rank's part of it (every ``world``-th sample from ``rank``, as
    torch's DistributedSampler takes them), whole batches only."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int, shuffle: bool, seed: int):
        self.n, self.batch_size, self.rank, self.world = n, batch_size, rank, world
        self.shuffle, self.seed = shuffle, seed
        self.per_epoch = (n // world) // batch_size
        self._epoch = -1
        self._order: Optional[torch.Tensor] = None

    def indices(self, g: int) -> list[int]:
        epoch, b = divmod(g, self.per_epoch)
        if epoch != self._epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.n, generator=gen)
            else:
                order = torch.arange(self.n)
            self._order = order[self.rank : (self.n // self.world) * self.world : self.world]
            self._epoch = epoch
        assert self._order is not None
        return self._order[b * self.batch_size : (b + 1) * self.batch_size].tolist()


def _named(out: Any) -> tuple[dict[str, torch.Tensor], int]:
    """What decode returned, as named tensors, and its kind (dict, tuple or one tensor)."""
    if isinstance(out, torch.Tensor):
        return {"0": out}, _ONE
    if isinstance(out, dict):
        items = list(out.items())
        kind = _DICT
    elif isinstance(out, (tuple, list)):
        items = [(str(i), t) for i, t in enumerate(out)]
        kind = _TUPLE
    else:
        raise TypeError(
            f"decode must return a torch tensor, a tuple or list of them, or a dict of them by "
            f"name; it returned {type(out).__name__}"
        )
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"decode returned {type(t).__name__} for {name!r}: give torch tensors")
    return dict(items), kind


def _slot_bytes(tensors: dict[str, torch.Tensor]) -> int:
    a = TENSOR_ALIGN
    return sum((t.numel() * t.element_size() + a - 1) // a * a for t in tensors.values())


def _each_thread(apply: Callable[[int], None]) -> None:
    """Calls `apply(tid)` for every thread of this process (none where there is no
    /proc/self/task, as off Linux); a thread that has ended since is passed over."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tids:
        try:
            apply(int(tid))
        except OSError:
            pass


def _run_nicer(increment: int) -> None:
    """Lowers this process's CPU priority by `increment`: every thread it has (Linux's nice is a
    thread's: importing torch has started numpy's BLAS pool already), and so every thread
    started after."""
    if not increment:
        return
    now = os.nice(increment)  # the calling thread's new value (off Linux, the process's)
    _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, now))


def _run_on(cpus: Optional[list[int]]) -> None:
    """Keeps this process on `cpus` (None: as it is): every thread it has (an affinity is a
    thread's, as nice is), and so every thread started after."""
    if cpus is None:
        return
    os.sched_setaffinity(0, cpus)
    _each_thread(lambda tid: os.sched_setaffinity(tid, cpus))


class _Flags:
    """What one worker and the trainer tell each other about its ring (shared objects of the
    spawn context, handed to the worker when it starts)."""

    def __init__(self, ctx: Any) -> None:
        self.retire = ctx.Event()  # set by the trainer: publish what it claimed, then end
        self.closing = ctx.Event()  # set by the worker: it is closing its ring
        # set by the worker before it makes its ring: the ring is on a GPU
        self.on_gpu = ctx.Value("b", False)


def _worker(k: int, sock: str, dataset: Any, decode: Callable, cfg: dict, claim: Any,
            stop: Any, flags: _Flags, errors: Any) -> None:
    """One decode process: claims batch numbers until stopped (or the epochs are done) and
    publishes each decoded batch into its ring at `sock`. The next batch's samples are read on
    a thread while this one decodes (file reads release the GIL). Retired, it claims no more
    and ends once the batches it claimed are published. It ends too once the trainer is gone
    (killed: it stopped no one), which its ring cannot tell it: a broadcast ring with no
    consumer takes every batch at once."""
    import gpipe

    trainer = multiprocessing.parent_process()

    def stopping() -> bool:
        return stop.is_set() or (trainer is not None and not trainer.is_alive())

    # first: threads started from here on inherit both
    _run_on(cfg["cpus"])
    _run_nicer(cfg["nice"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    if _is_cuda(device):
        torch.cuda.set_device(device)
    plan = _Plan(*cfg["plan"])
    limit = cfg["epochs"] * plan.per_epoch if cfg["epochs"] is not None else None
    reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpipe-loader-read")

    def read(g: int) -> list:
        return [dataset[i] for i in plan.indices(g)]

    def claim_next() -> Optional[tuple[int, concurrent.futures.Future]]:
        with claim.get_lock():
            g = claim.value
            claim.value += 1
        if limit is not None and g >= limit:
            return None
        return g, reader.submit(read, g)

    producer = None
    g = -1
    try:
        pending = claim_next()
        while pending is not None and not stopping():
            g = pending[0]
            samples = pending[1].result()  # a read that failed raises here, named with g
            # its reads run while this batch decodes; a retired worker claims no more
            pending = None if flags.retire.is_set() else claim_next()
            tensors, kind = _named(decode(samples, device))
            if stopping():  # closed while it decoded: no ring to make, nothing to send
                break
            need = _slot_bytes(tensors)
            if producer is None:
                # The ring is where decode made the batch: on its GPU, or in host memory (a
                # decode may choose per worker); the trainer learns which before it attaches.
                gpu = next((t.device for t in tensors.values() if t.is_cuda), None)
                flags.on_gpu.value = gpu is not None
                # A worker that ends (retired, or its epochs done) waits in close() until the
                # trainer has taken what it published and let go of its ring, however long
                # the trainer's steps take; a dead trainer is let go at once.
                producer = gpipe.Producer(
                    sock, batch_bytes=cfg["slot_bytes"] or need, slots=cfg["slots"], drain_timeout=_DRAIN_S,
                    backend="cuda" if gpu is not None else "host",
                    **({"device": gpu.index or 0} if gpu is not None else {}),
                )
                # Broadcast rings give a consumer what is published after it attached: the
                # first batch waits for the trainer's attach (which stands once joined: a
                # refused page-lock reads the ring unlocked, pin_memory="try").
                while not stopping():
                    try:
                        producer.wait_for_consumers(1, timeout=0.2)
                        break
                    except Timeout:
                        continue
                if stopping():
                    break
            if need > producer.slot_bytes:
                sized = "slot_bytes" if cfg["slot_bytes"] else "this worker's first batch"
                raise ValueError(f"batch {g} takes {need} bytes, more than the {producer.slot_bytes} "
                                 f"of a slot (sized by {sized}): give Loader slot_bytes= the "
                                 "largest batch's size")
            while not stopping():
                try:
                    producer.send(tensors, meta=[_MAGIC, g, kind, time.monotonic_ns()], timeout=0.2)
                    break
                except Timeout:  # the trainer holds every slot: wait, unless stopped
                    continue
    except BaseException as e:  # noqa: BLE001 - every failure goes to the trainer, named
        try:
            errors.put((k, g, f"{type(e).__name__}: {e}", traceback.format_exc()))
            errors.close()
            errors.join_thread()  # the report is in the pipe before the process ends
        finally:
            os._exit(1)
    finally:
        reader.shutdown(wait=False, cancel_futures=True)
        flags.closing.set()  # what follows waits only for the trainer (see Loader._shut_down)
        if producer is not None:
            producer.close()


class _Trial(NamedTuple):
    """auto's step on trial: the workers before it, their batches a second, the workers with
    it, the gain it should bring, whether the trainer waited (else the workers were behind),
    and whether the workers before it were all of one kind."""

    before: int
    was: float
    tried: int
    predicted: float
    for_waiting: bool
    one_kind: bool


class _Ring:
    """The trainer's side of one worker: its process, its ring, the batch held from it."""

    def __init__(self, k: int, sock: str, proc: Any, flags: _Flags) -> None:
        self.k, self.sock, self.proc, self.flags = k, sock, proc, flags
        self.consumer: Any = None
        self.held: Optional[int] = None  # the batch number received from it and not yet taken
        self.first_at: Optional[int] = None  # the batch count when its first batch came
        self.done = False
        # when its latest batches were published (auto's rates), those of the current window
        self.stamps: collections.deque = collections.deque(maxlen=WINDOW)


class Loader:
    """Batches for one trainer (one rank), decoded by worker processes into gpipe rings and
    read in place.

    ``dataset``: a map-style dataset (``len()`` and ``dataset[i]``), e.g. encoded images and
    their labels. ``decode(samples, device)``: makes one batch from a list of ``batch_size``
    samples, on ``device`` (the trainer's GPU, or the CPU): a tensor, a tuple or list of
    tensors, or a dict of them by name, each batch of the same shapes and dtypes. It runs in
    the workers. ``device``: where batches are made and read (default: the current CUDA
    device, else the CPU). ``rank``, ``world_size``: this trainer's part of each epoch (default:
    from ``torch.distributed`` if it is initialised, else 0 and 1); every rank gets
    ``len(dataset) // world_size // batch_size`` batches an epoch. ``shuffle``, ``seed``: a new
    order each epoch from ``seed + epoch``. ``workers``: decode processes, a number or
    ``"auto"`` (see :attr:`why`); ``max_workers``: the most ``auto`` starts (default: the CPUs
    per trainer of the node less one; at most 8 where the workers decode on a GPU). ``slots``:
    batches each worker's ring holds; ``slot_bytes``: the room a slot has for one batch
    (default: what the worker's first batch takes, rounded up to 2 MiB; give the largest
    batch's size where batches vary). ``epochs``: the workers stop after this many (None:
    when the loader closes).
    ``worker_threads``: torch threads per worker. ``worker_nice``: how much lower the workers'
    CPU priority is than this process's (a nice increment, 0 to 19; the kernel stops at nice
    19): where decode takes every CPU, the trainer's own threads (its launches, DDP's
    all-reduce) still come first. ``worker_cpus``: the CPU numbers the workers run on (None:
    any this process may use; they must be CPUs this process may use, on Linux). The trainer
    is not restricted, so the CPUs left out are free for it. ``max_workers``' default still
    counts every CPU of this process: give it as well.
    ``timeout``: seconds a batch may take to
    come before :class:`gpipe.Timeout` (None: no limit; a dead worker is noticed anyway).
    ``pin_memory`` (``device="cpu"``, as torch's DataLoader's): the rings' slots are
    page-locked in this process for as long as they are mapped, so ``.to("cuda",
    non_blocking=True)`` from a batch is a DMA that returns at once, with no copy. The loader
    keeps each batch until the GPU work queued on the current stream when the next one is
    taken has run, so a batch dropped right after such a copy on the current stream is safe;
    for a copy on another stream, keep the batch until that copy has run. Where torch sees no
    CUDA GPU, ``pin_memory`` warns and is off, as torch's DataLoader's; where the driver cannot
    page-lock a ring, the loader warns and reads it, and the rings after it, unlocked.
    ``in_order``: True hands the batches out in their order, so the trainer waits for the
    worker of the next one however many others are ready. False hands out whichever batch came
    first: each iteration still gives ``len(loader)`` batches, and each batch of each epoch
    goes out once, but a batch that comes late goes out in a later iteration than its epoch's
    (unlike torch's DataLoader's ``in_order=False``, whose epochs wait for their last batch).
    Workers of different speeds (``MixedDecode`` in ``apps/loader``: one decoding on the GPU,
    the rest on the CPU) need ``in_order=False``: in order, the fast ones fill their rings
    and wait for the slow one's batch; with a wait at each epoch's end, a DDP job waits for
    every rank's.

    Iterating gives one epoch: what ``decode`` returned, as tensors over the ring's slot (no
    copy). They are read-only, and the slot goes back to its worker once they are gone, so
    let go of a batch's tensors by the next step. ``close()`` (or leaving a ``with`` block)
    stops the workers.
    """

    def __init__(
        self,
        dataset: Any,
        decode: Callable[[list, torch.device], Any],
        *,
        batch_size: int,
        device: Any = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        workers: Union[int, str] = "auto",
        max_workers: Optional[int] = None,
        slots: int = 4,
        slot_bytes: Optional[int] = None,
        epochs: Optional[int] = None,
        worker_threads: int = 1,
        worker_nice: int = WORKER_NICE,
        worker_cpus: Optional[Iterable[int]] = None,
        timeout: Optional[float] = None,
        pin_memory: bool = False,
        in_order: bool = True,
    ) -> None:
        if not callable(decode):
            raise TypeError(f"decode must be a function decode(samples, device); got {type(decode).__name__}")
        for name, value in (("shuffle", shuffle), ("pin_memory", pin_memory), ("in_order", in_order)):
            if not isinstance(value, bool):
                # a Consumer's pin_memory also takes "try": the Loader always reads a ring it
                # cannot page-lock unlocked (with a warning), so True is that here
                raise TypeError(f"{name} must be True or False; got {value!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int of 1 or more; got {batch_size!r}")
        if workers != "auto" and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be 'auto' or an int of 1 or more; got {workers!r}")
        if isinstance(worker_nice, bool) or not isinstance(worker_nice, int) or not 0 <= worker_nice <= 19:
            raise ValueError(f"worker_nice must be an int in 0..19 (how much lower the workers' "
                             f"CPU priority is than the trainer's); got {worker_nice!r}")
        worker_cpus = _cpus(worker_cpus)
        if not isinstance(slots, int) or slots < 2:
            raise ValueError(f"slots must be an int of 2 or more (a worker fills one while the "
                             f"trainer reads another); got {slots!r}")
        if slot_bytes is not None and (isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int)
                                       or slot_bytes < 1):
            raise ValueError(f"slot_bytes must be an int of 1 or more (the room a slot has for one "
                             f"batch), or None to size slots by each worker's first batch; got {slot_bytes!r}")
        if rank is None or world_size is None:
            dist = torch.distributed
            on = dist.is_available() and dist.is_initialized()
            rank = rank if rank is not None else (dist.get_rank() if on else 0)
            world_size = world_size if world_size is not None else (dist.get_world_size() if on else 1)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world_size {world_size})")
        n = len(dataset)
        plan = (n, batch_size, rank, world_size, shuffle, int(seed))
        self.batches_per_epoch = _Plan(*plan).per_epoch
        self._world = world_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"the dataset's {n} samples make no whole batch of {batch_size} for each of "
                f"{world_size} rank(s): use a smaller batch_size or more samples"
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        if _is_cuda(self.device) and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if pin_memory and _is_cuda(self.device):
            raise ValueError(f"pin_memory=True page-locks batches made on the CPU; these are made "
                             f"on {self.device} already: leave pin_memory out")
        if pin_memory and not torch.cuda.is_available():
            # as torch's DataLoader does: the same script runs on a machine without a GPU
            warnings.warn("pin_memory=True page-locks batches for copies to a GPU, but torch sees "
                          "no CUDA GPU here: the batches stay in pageable memory", stacklevel=2)
            pin_memory = False
        self.pin_memory = pin_memory
        if self.pin_memory:
            # torch's is_pinned() answers False for every pointer until torch has initialised
            # CUDA in this process (its own pinned tensors do that when they are made)
            torch.cuda.init()
        self.dataset, self.decode = dataset, decode
        self.auto = workers == "auto"
        self.max_workers = (max_workers if max_workers is not None else
                            _default_max_workers(_is_cuda(self.device), world_size)) \
            if self.auto else int(workers)
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be 1 or more; got {self.max_workers}")
        self.timeout = timeout
        self.in_order = in_order
        self.why = (f"{workers} worker(s), as asked" if not self.auto else
                    f"auto: 1 worker to start, up to {self.max_workers}")
        self._cfg = {"device": str(self.device), "plan": plan, "epochs": epochs,
                     "slots": slots, "slot_bytes": slot_bytes, "threads": worker_threads,
                     "nice": worker_nice, "cpus": worker_cpus}
        self._ctx = multiprocessing.get_context("spawn")
        self._claim = self._ctx.Value("q", 0)
        self._stop = self._ctx.Event()
        self._errors = self._ctx.Queue()
        self._dir = tempfile.mkdtemp(prefix="gpipe-loader-")
        self._rings: list[_Ring] = []
        self._held: dict[int, tuple[_Ring, Any]] = {}
        # batches handed out (in order, also the number of the next one)
        self._next = 0
        self._taken = 0  # batches handed out
        self._waits: collections.deque = collections.deque(maxlen=WINDOW)
        self._window_ns = 0  # when the current window began (CLOCK_MONOTONIC ns)
        self._pinned = PinnedHold() if self.pin_memory else None
        # the refusal of a ring's page-lock, if one came: the later rings are not tried
        self._pin_failed: Optional[str] = None
        self._last_t: Optional[float] = None
        self._trial: Optional[_Trial] = None  # auto's step on trial
        # under DDP: the exchange of windows with the other ranks, and the job's last window
        self._peers = Peers.of_job(rank, world_size, f"{n}-{batch_size}-{int(seed)}") \
            if self.auto else None
        self._exchange = self._peers  # kept once decided alone: close() clears it from the store
        self._view: Optional[Window] = None
        self._fed_views = 0  # the job's last windows in a row that were fed, with nothing to do
        # why, and from which batch, a rank of a DDP job gave up on the others' figures
        self._alone: Optional[str] = None
        self._frozen = False  # auto found that more workers do not help, for now
        self._frozen_at = 0  # the batch count when it did
        self._retry_in = RETRY_AFTER  # batches from then until auto acts again
        self._armed = False  # the last window of waiting called for a step
        self._closed = False
        for _ in range(1 if self.auto else self.max_workers):
            self._start_worker()

    # -- workers -------------------------------------------------------------------------

    @property
    def workers(self) -> int:
        """Decode processes making batches now (started and not retired)."""
        return len(self._active())

    def _active(self) -> list[_Ring]:
        """The workers' rings that are not retired."""
        return [r for r in self._rings if not r.flags.retire.is_set()]

    def _start_worker(self) -> None:
        k = len(self._rings)
        sock = os.path.join(self._dir, f"w{k}.sock")
        flags = _Flags(self._ctx)
        p = self._ctx.Process(
            target=_worker, name=f"gpipe-loader-worker-{k}", daemon=True,
            args=(k, sock, self.dataset, self.decode, self._cfg, self._claim, self._stop,
                  flags, self._errors),
        )
        try:
            p.start()  # pickles its arguments: no process is started if that fails
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise TypeError(
                f"{_unsendable(self.dataset, self.decode)} cannot be sent to the loader's workers, "
                f"which are separate processes given it by pickle ({type(e).__name__}: {e}); "
                "define it at the top level of a module the workers can import, not as a "
                "lambda or a nested function, and holding no open files or locks"
            ) from None
        self._rings.append(_Ring(k, sock, p, flags))

    def _failed(self, ring: _Ring) -> Error:
        """The error of a worker that ended: its own exception if it sent one."""
        reports = {}
        while True:
            try:
                k, g, what, tb = self._errors.get(timeout=0.5 if not reports else 0.0)
            except Exception:  # queue.Empty
                break
            reports[k] = (g, what, tb)
        if ring.k in reports:
            g, what, tb = reports[ring.k]
            return Error(f"decode worker {ring.k} failed on batch {g} (epoch "
                         f"{g // self.batches_per_epoch}): {what}\n\nin the worker:\n{tb}")
        ring.proc.join(timeout=1.0)
        code = ring.proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with {code}"
        # one that ended while it started (before it ran a decode) could not say why: its
        # stderr does; the usual causes are a script that makes its Loader unguarded, and a
        # decode or dataset from a __main__ the worker cannot import (python -c, a notebook)
        starting = (ring.consumer is None and not os.path.exists(ring.sock) and code is not None
                    and code > 0)
        hint = (" It ended while it started, before it could say why (its stderr does). "
                "Each worker imports the main script: a script must make its Loader under `if "
                "__name__ == \"__main__\":`, and a decode or dataset defined in `python -c` "
                "or a notebook cannot be found there (define them in a module file)"
                ) if starting else ""
        return Error(f"decode worker {ring.k} (pid {ring.proc.pid}) {how} before publishing "
                     f"{self._wanted()}; the batches it had claimed are lost, so this epoch "
                     f"cannot be completed.{hint}")

    def _maybe_scale(self, waited: float) -> None:
        """auto: more workers when the trainer waited too long over the last batches, and a
        step kept only if the trainer then takes batches faster, or (one rank of several that
        decides alone) no longer waits (see :attr:`why`). The ranks of a DDP job decide
        together, from every rank's window (`_loader_peers`)."""
        now = time.monotonic()
        if self._last_t is not None:
            self._waits.append((waited, now - self._last_t))
        self._last_t = now
        if not self.auto:
            return
        if self._peers is not None and self._peers.pending is not None:
            try:
                windows = self._peers.gathered()
            except RuntimeError as e:  # the store is gone (rank 0's process group ended)
                self._decide_alone(f"the process group's store failed ({e})")
                return
            if windows is not None:
                self._view = view(windows)
                self._decide(self._view)
                self._new_window()  # the next exchange is over the next WINDOW batches
                fed = self._trial is None and not self._armed and _fed(self._view)
                self._fed_views = self._fed_views + 1 if fed else 0
            elif self._peers.late(self._taken):
                self._decide_alone(self._peers.late_why)
            return
        if self._frozen:
            if self._taken - self._frozen_at < self._retry_in:
                return
            self._frozen = False  # try again, from a fresh window; the next pause is longer
            self._retry_in *= 2
            self._new_window()
            return
        if self._starting():
            self._new_window()  # a window counts only once every worker delivers
            return
        rate = self._rate()
        if len(self._waits) < WINDOW or rate is None:
            return
        mine = self._mine(rate)
        if self._peers is None:
            self._decide(mine)
            return
        try:
            self._peers.publish(mine, self._taken)
        except RuntimeError as e:
            self._decide_alone(f"the process group's store failed ({e})")

    def _decide_alone(self, why: str) -> None:
        """Gives up on the other ranks' figures for good: from now on this rank decides
        alone, as a rank of several without ``torch.distributed`` does."""
        self._peers, self._fed_views = None, 0
        self._alone = f"{why}, so this rank decides alone from batch {self._taken}"
        self.why += f"; {self._alone}"
        self._new_window()

    def _mine(self, rate: Optional[float]) -> Window:
        """This trainer's current window, with its workers' `rate`."""
        return Window(*self._window(), rate, len(self._waits), self.max_workers, self._each())

    def _each(self) -> Optional[float]:
        """Where the workers are of two kinds (a decode that makes some workers' batches on a
        GPU and the others' on the CPU, as ``MixedDecode`` in apps/loader does), the batches a
        second each worker of the newest one's kind makes: the workers auto adds are like it.
        None where they are all of one kind, or before each has published a few."""
        active = self._active()
        kinds = {r.flags.on_gpu.value for r in active}
        if len(kinds) < 2 or not _rated(active):
            return None
        like = [r for r in active if r.flags.on_gpu.value == active[-1].flags.on_gpu.value]
        return sum(_own_rate(r) for r in like) / len(like)

    def _decide(self, w: Window) -> None:
        """auto's step from a full window's figures: this trainer's, or the job's (DDP)."""
        wait, span, rate = w.wait, w.span, w.rate
        assert rate is not None
        # one rank of several that decides alone: its pace is the slowest rank's
        alone = self._world > 1 and self._peers is None
        # w.most: this rank's limit, or the job's lowest (the ranks step together)
        share = wait / span if span > 0 else 1.0
        taken = w.batches / span if span > 0 else 0.0  # the trainer's own take rate
        if self._trial is not None:
            before, was, tried, predicted, for_waiting, one_kind = self._trial
            self._trial = None
            if one_kind and w.each is not None:
                # The step added workers of another kind than those before it, whose rate it
                # could not know (a GPU worker's 28 batches/s predicted the first CPU worker's,
                # about 3; ResNet-18, 4 H200s): what they make, now measured, is its gain.
                predicted = (was + (tried - before) * w.each) / was
            want = 1 + max(MIN_GAIN, (predicted - 1) / 4)
            # The step paid if the rate rose by a quarter of its predicted gain, or if the trainer
            # no longer waits and takes batches faster than before: the prediction cannot know the
            # trainer's GPU-bound pace (its host time per batch, all it sees while waiting, is
            # only the launches). Fed, the trainer's own take rate is the measure: the workers'
            # publish rate still runs ahead of it while their rings fill.
            # One rank of several (DDP) that decides alone takes batches at the slowest rank's
            # pace, whatever its own workers do: a starved peer makes its rate fall, and its
            # take rate comes in bursts as the peers catch up (4 H100s: "2.71 made, 14.89
            # taken" over a window).
            # There a step taken because the trainer waited is kept once it no longer waits:
            # retiring it would starve every rank (two 4-GPU runs that did so made 0.12x and
            # 0.28x the ceiling). A step taken because the workers were behind (which such
            # bursts can also show) is judged as for one trainer: retiring it leaves the rank
            # fed, as it was. The cost: a step that slows the rank's own GPU, as decode workers
            # without MPS can, is not undone there.
            peers = alone and for_waiting
            faster = min(rate, taken) >= was * (1 + MIN_GAIN)
            fed = share <= WAIT_SHARE and (faster or peers)
            paid = rate >= was * want  # want is 1 + MIN_GAIN at least
            if not (paid or fed):
                also = f"or no waiting (one rank of {self._world})" if peers else \
                    f"or {1 + MIN_GAIN:.2f}x and no waiting"
                for r in self._active()[before:]:
                    r.flags.retire.set()
                self._frozen, self._frozen_at = True, self._taken
                self.why = (f"auto: {before} worker(s): {tried} made the trainer take "
                            f"{min(rate, taken):.2f} batches/s against {was:.2f} with {before}, "
                            f"waiting {share:.0%} (it needed {want:.2f}x, {also}), so the added "
                            f"ones were retired at batch {self._taken} and auto stopped there "
                            f"({self._shared_by}); it acts "
                            f"again after {self._retry_in} batches")
                self._new_window()
                return
            if paid:
                self.why += (f"; kept: {rate:.2f} batches/s against {was:.2f} with {before} (it "
                             f"needed {want:.2f}x)")
            elif not faster:
                self.why += (f"; kept: the trainer no longer waits ({share:.0%}; {rate:.2f} "
                             f"batches/s made, {taken:.2f} taken, against {was:.2f} with "
                             f"{before}): a rank of {self._world} takes batches at the slowest "
                             f"rank's pace")
            else:
                self.why += (f"; kept: the trainer no longer waits ({share:.0%}) and takes "
                             f"{taken:.2f} batches/s against {was:.2f} with {before}")
        behind = _behind(rate, taken)
        if self.workers >= w.most or span <= 0 or (share <= WAIT_SHARE and not behind):
            self._armed = False
            return
        if not self._armed:
            # The first window of waiting may straddle a change in the trainer's own pace, and
            # its rate is then not the workers': act on a second window, all of it waiting.
            self._armed = True
            self._new_window()
            return
        self._armed = False
        # While the trainer waits, the workers set the pace: a batch every span/WINDOW. The
        # trainer's own time per batch is what is left; the workers should keep up with that,
        # with a tenth to spare; at most twice as many at a time, each step on trial. While it
        # lives on their backlog, its take rate over theirs says how far they fall short.
        # One rank of several (DDP) cannot tell its own time from its wait in the all-reduce
        # for a slower rank: both are time not waiting for data, so its prediction falls short
        # (4 H100s: "needed one every 153.5 ms" against 160.5 gave 4 -> 5 workers, and the ranks
        # were still climbing after 600 steps). The ranks decide together where they can, from
        # the most starved rank's window, whose time not waiting is the step's own; a rank that
        # decides alone and waits for data doubles them.
        own = max(span - wait, 1e-6)
        short = max(span / own, taken / rate)
        first = self.workers
        peers = alone and share > WAIT_SHARE
        each = w.each
        if each is None:  # workers of one kind: each makes the workers' rate over their count
            grow = 2 * first if peers else max(first + 1, math.ceil(first * short * 1.1))
            need = min(w.most, 2 * first, grow)
            gain = need / first
        else:
            # Workers of two kinds: the added ones are like the newest, each making `each`
            # batches a second. The same rule, counted in such workers: at most as many as
            # the workers' rate is worth (twice the rate), as many as the trainer's pace needs.
            worth = max(1, math.floor(rate / each))
            add = worth if peers else max(1, math.ceil(rate / each * (short * 1.1 - 1)))
            need = min(w.most, first + min(worth, add))
            gain = (rate + (need - first) * each) / rate
        for _ in range(need - first):
            self._start_worker()
        # what the step should bring: the trainer's own pace, or the added workers' share of it
        self._trial = _Trial(first, rate, need, gain if peers else min(short, gain),
                             share > WAIT_SHARE, each is None)
        started = f"worker {len(self._rings) - 1}" if need - first == 1 else \
            f"workers {len(self._rings) - (need - first)}-{len(self._rings) - 1}"
        if peers:
            how = "doubles them" if need == 2 * first else f"adds up to its limit of {w.most}"
            because = (f"the trainer having waited {share:.0%} of the last {WINDOW} batches (more "
                       f"than {WAIT_SHARE:.0%}), one rank of {self._world}: its time not waiting "
                       f"includes the all-reduce's wait for slower ranks, so it {how}"
                       f"{'' if self._alone is None else f' ({self._alone})'}")
        elif share > WAIT_SHARE:
            who = "the trainer" if self._peers is None else \
                f"the trainer of the most starved of {self._world} ranks (they decide together)"
            because = (f"{who} having waited {share:.0%} of the last {w.batches} batches (more "
                       f"than {WAIT_SHARE:.0%}): a batch came every {span / w.batches * 1e3:.1f} "
                       f"ms and it needed one every {own / w.batches * 1e3:.1f} ms")
        else:
            because = (f"the workers being behind: they made {rate:.2f} batches/s and the "
                       f"trainer took {taken:.2f} from their rings' backlog, so it would soon wait")
        self.why = (f"auto: {need} workers: {started} started at batch {self._taken}, {because}; "
                    f"at most {w.most}")
        self._new_window()

    @property
    def _shared_by(self) -> str:
        if _is_cuda(self.device):
            return ("the workers share the trainer's GPU: without MPS their kernels and the "
                    "trainer's take turns on it, with MPS they share its SMs")
        return "the workers share what limits them: the CPUs, the disk, a lock in decode"

    def _window(self) -> tuple[float, float]:
        """Over the window: the trainer's time waiting for batches, and the time they took."""
        return sum(w for w, _ in self._waits), sum(s for _, s in self._waits)

    def _new_window(self) -> None:
        self._waits.clear()
        # Batches published before now are not the window's, however late they are taken:
        # after a pause (a validation, a checkpoint) a ring's backlog was made before it.
        self._window_ns = time.monotonic_ns()
        for r in self._rings:
            r.stamps.clear()

    def _rate(self) -> Optional[float]:
        """Batches a second the workers publish, each at its own pace over the window (the
        trainer's rate in steady state: workers wait for free slots when it is the slower),
        once each has published a few; None before. Each worker's own series is free of the
        bursts the trainer sees when it takes batches in order from several rings."""
        active = self._active()
        if not _rated(active):
            return None
        return sum(_own_rate(r) for r in active)

    def _starting(self) -> bool:
        """A worker has not delivered yet, or only its first few batches: while a new worker
        starts, the trainer waits for its first batch and the others fill their rings, so the
        pace is the workers' own only once that backlog is gone too."""
        active = self._active()
        settle = WINDOW + self._cfg["slots"] * len(active)
        return any(r.first_at is None or self._taken - r.first_at < settle for r in active)

    @property
    def settled(self) -> bool:
        """Whether ``auto`` is done for now: every worker delivers, no step is on trial, and
        over the last batches the trainer waited no more than its threshold while the workers
        kept up with it, or auto may not add more (always true for a fixed number of workers).
        A benchmark times its steps once this holds. Under DDP, where the ranks decide
        together, "the last batches" are the job's last two windows, each of 16 batches, one
        window being too few: a window just after a step can be fed from the rings' backlog
        (2 H200s, ResNet-18: settled on one such window, then waited 12%)."""
        if not self.auto:
            return True
        if self._starting() or self._trial is not None:
            return False
        if self._peers is not None:
            if self._armed:
                return False
            most = self.max_workers if self._view is None else self._view.most
            return self._frozen or self.workers >= most or self._fed_views >= 2
        if len(self._waits) < WINDOW:
            return False
        return (self._frozen or self.workers >= self.max_workers or
                _fed(self._mine(self._rate())))

    # -- batches -------------------------------------------------------------------------

    def _attach(self, ring: _Ring) -> bool:
        if ring.consumer is None:
            if not os.path.exists(ring.sock):
                if ring.proc.exitcode == 0:  # it ended with nothing to make (epochs done)
                    ring.done = True
                elif ring.proc.exitcode is not None:
                    raise self._failed(ring)
                return False
            from . import Consumer

            # A CPU loader's worker whose decode made its batches on a GPU has its ring there,
            # read on that GPU (device None); only host rings are page-locked.
            device = self.device if _is_cuda(self.device) else None
            pin = self.pin_memory and self._pin_failed is None and not ring.flags.on_gpu.value
            # "try": where the driver refuses the lock, the attach stands and reads the ring
            # unlocked (copies from pageable memory work, through the driver's staging)
            ring.consumer = Consumer(ring.sock, device=device, timeout=30.0,
                                     pin_memory="try" if pin else False)
            refused = ring.consumer.pin_refused
            if refused is not None:
                self._pin_failed = refused
                warnings.warn(f"pin_memory: the ring of decode worker {ring.k} could not be "
                              f"page-locked, so it and the rings after it stay in pageable memory, "
                              f"and copies from them to a GPU wait for the CPU ({refused})",
                              stacklevel=4)
        return True

    def _poll(self, ring: _Ring, timeout: float) -> bool:
        """Receives the next batch of `ring` if one came within `timeout`; True if one did."""
        try:
            b = ring.consumer.recv(timeout=timeout)
        except Timeout:
            if not ring.proc.is_alive() and ring.proc.exitcode != 0:
                raise self._failed(ring) from None
            return False
        except Closed:  # every batch it published was received: let its worker end now
            ring.done = True
            ring.consumer.close()
            return False
        except ProducerDied:
            raise self._failed(ring) from None
        except Deadlock as e:
            if self._pinned is not None and self._pinned.holds():
                self._pinned.let_go_all()  # our own hold for copies: let go, try again
                return False
            raise Deadlock(
                f"decode worker {ring.k} cannot publish its next batch: this process still "
                f"holds tensors of an earlier batch of its ring, in the slot it must refill (a "
                f"variable of an earlier loop, say); drop them (del) before taking more, keep "
                f"a copy (.clone()) of what must outlive its step, or make the Loader with more "
                f"slots (now {self._cfg['slots']}). ({e})"
            ) from None
        meta = b.meta
        if meta[0] != _MAGIC:
            b.release()
            raise Error(f"the ring of decode worker {ring.k} at {ring.sock} carries a batch that "
                        f"is not a loader's (header {meta[0]:#x})")
        ring.held = meta[1]
        if meta[3] >= self._window_ns:
            ring.stamps.append(meta[3])
        if ring.first_at is None:
            ring.first_at = self._taken
        self._held[meta[1]] = (ring, b)
        return True

    def _take(self) -> Any:
        """The next batch (see _pick), as what decode returned."""
        from .torch import as_tensor

        if self._closed:  # an iterator made before close(): its workers are stopped
            raise Error("this Loader is closed: make a new one for more batches")
        t0 = time.monotonic()
        if self._pinned is not None:
            self._pinned.before_take()
        deadline = None if self.timeout is None else t0 + self.timeout
        while (g := self._pick()) is None:
            waiting = [r for r in self._rings if r.held is None and not r.done]
            if not waiting:
                raise Error(f"{self._wanted()} will never come: every decode worker has finished "
                            f"(epochs={self._cfg['epochs']} ends at batch "
                            f"{(self._cfg['epochs'] or 0) * self.batches_per_epoch})")
            got = False
            for r in waiting:
                if self._attach(r):
                    got |= self._poll(r, 0.0)
            if not got and self._pick() is None:
                ready = [r for r in waiting if r.consumer is not None and not r.done]
                if ready:  # sleep on one ring briefly: a batch may come on any of them
                    self._poll(ready[int(time.monotonic() * 1e4) % len(ready)], 0.0005)
                else:
                    time.sleep(0.001)
            if deadline is not None and time.monotonic() > deadline:
                raise Timeout(f"{self._wanted()} did not come within {self.timeout} s from "
                              f"{self.workers} decode worker(s)")
        ring, b = self._held.pop(g)
        ring.held = None
        with b:
            names, kind = b.names, b.meta[2]
            tensors = [as_tensor(b[n]) for n in names]
        if self._pinned is not None:
            self._pinned.handed_out(tensors)
        self._next += 1
        self._taken += 1
        self._maybe_scale(time.monotonic() - t0)
        if kind == _ONE:
            return tensors[0]
        if kind == _TUPLE:
            return tuple(tensors)
        return dict(zip(names, tensors))

    def _pick(self) -> Optional[int]:
        """The number of the received batch to hand out next, or None while none may go: in
        order, batch self._next; else the lowest received one, of whichever epoch (a late
        batch goes out as soon as it comes)."""
        if self.in_order:
            return self._next if self._next in self._held else None
        return min(self._held) if self._held else None

    def _wanted(self) -> str:
        """What the trainer is waiting for, for its errors."""
        epoch, k = divmod(self._next, self.batches_per_epoch)
        if self.in_order:
            return f"batch {self._next} (epoch {epoch})"
        return f"batch {k + 1} of iteration {epoch} (any of the batches not yet handed out)"

    def __iter__(self) -> Iterator[Any]:
        """One epoch's batches. An epoch left unfinished (a ``break``) is skipped: the next
        iteration starts the next epoch."""
        if self._closed:
            raise Error("this Loader is closed")
        # The epoch after the last batch taken, or the one it began: an epoch begins with the
        # taking of its first batch, so a call that raised before that began none.
        per = self.batches_per_epoch
        start = -(-self._next // per) * per
        while self._next < start:  # what is left of an epoch the caller broke out of
            self._take()
        end = start + per
        while self._next < end:
            yield self._take()

    def __len__(self) -> int:
        return self.batches_per_epoch

    def close(self) -> None:
        """Stops the workers and detaches from their rings, without waiting for batches still
        held: their tensors stay valid, and each worker ends once they are dropped."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pinned is not None:  # no worker may refill a slot a queued copy still reads
                self._pinned.close()
        finally:  # stop the workers even if that wait failed
            self._shut_down()
            if self._exchange is not None:
                self._exchange.close()

    def _shut_down(self) -> None:
        """Stops the workers, gives back what is held and detaches from the rings."""
        self._stop.set()
        for _, b in self._held.values():
            try:
                b.release()
            except Error:  # its worker is gone and took the slot back: nothing to give
                pass
        self._held.clear()
        for r in self._rings:
            if r.consumer is not None:
                r.consumer.close()
                r.consumer = None
        # A worker in its ring's close waits for the consumer to be gone, which tensors of
        # batches this process still holds keep alive (their memory is the ring's): it ends
        # once they are dropped, or with this process (a daemon). One that has not reached its
        # close by the deadline is stuck (a decode that does not return): killed.
        deadline = time.monotonic() + _STOP_S
        while time.monotonic() < deadline and any(
                r.proc.is_alive() and not r.flags.closing.is_set() for r in self._rings):
            time.sleep(0.01)
        for r in self._rings:
            if r.proc.is_alive() and not r.flags.closing.is_set():
                r.proc.kill()
                r.proc.join(timeout=5.0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"Loader({self.batches_per_epoch} batches an epoch on {self.device}, "
                f"{self.workers} worker(s); {self.why})")


def _unsendable(dataset: Any, decode: Callable) -> str:
    """Which of the workers' arguments cannot be pickled. Outside a process's start, pickling
    refuses multiprocessing's shared objects (RuntimeError), which a start sends fine."""
    bad = []
    for what, obj in (("the dataset", dataset), ("decode", decode)):
        try:
            pickle.dumps(obj)
        except RuntimeError:
            pass
        except Exception:  # noqa: BLE001 - whatever pickling raises
            bad.append(what)
    return " and ".join(bad) or "the dataset or decode"


def _rated(rings: list[_Ring]) -> bool:
    """Whether every one of `rings`' workers has published enough batches in the window (5)
    for its own rate to mean something."""
    return all(len(r.stamps) >= 5 for r in rings)


def _own_rate(ring: _Ring) -> float:
    """The batches a second `ring`'s worker published over the window (its stamps)."""
    return (len(ring.stamps) - 1) * 1e9 / max(ring.stamps[-1] - ring.stamps[0], 1)


def _fed(w: Window) -> bool:
    """Whether over window `w` the trainer waited no more than its threshold while the
    workers kept up with it."""
    return w.span <= 0 or (w.wait / w.span <= WAIT_SHARE and
                           (w.rate is None or not _behind(w.rate, w.batches / w.span)))


def _behind(made: float, taken: float) -> bool:
    """Whether the workers make batches (`made` a second) more slowly than the trainer takes
    them (`taken`): then it lives on their rings' backlog."""
    return made < taken * (1 - BEHIND)


def _default_max_workers(on_gpu: bool, world: int) -> int:
    """auto's limit: the CPUs this process may use, shared among the trainers of this node
    (torchrun's LOCAL_WORLD_SIZE; else the ranks, at most one a GPU; one for a single
    trainer), one left for each trainer; at least 1. Workers that decode on the GPU share it
    too: at most 8 of them (auto kept 1 or 2 a GPU on H100s with MPS). Workers that decode on
    the CPU are bound by the CPUs alone (ResNet-50 on one H100 took 14 Pillow workers)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    share = max(1, cpus // _trainers_here(world) - 1)
    return min(8, share) if on_gpu else share


def _cpus(given: Optional[Iterable[int]]) -> Optional[list[int]]:
    """``worker_cpus`` checked: CPU numbers this process may run on, at least one."""
    if given is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("worker_cpus places the workers with sched_setaffinity, which this "
                         "system does not have (Linux does): leave worker_cpus out")
    try:
        cpus = sorted({operator.index(c) for c in given})
    except TypeError:
        raise TypeError(f"worker_cpus must be CPU numbers (ints), e.g. range(2, 16); got "
                        f"{given!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not set(cpus) <= allowed:
        outside = sorted(set(cpus) - allowed)
        raise ValueError(f"worker_cpus must be CPUs this process may run on "
                         f"({_ranges(sorted(allowed))}); "
                         + (f"{_ranges(outside)} are not" if outside else "none given"))
    return cpus


def _ranges(cpus: list[int]) -> str:
    """Sorted CPU numbers as taskset writes them: "0-3,8"."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _trainers_here(world: int) -> int:
    """How many trainers share this node's CPUs: torchrun's LOCAL_WORLD_SIZE where it is set,
    else the ranks (at most one a GPU where there are GPUs)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) >= 1:
        return int(local)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, min(world, gpus) if gpus else world)


__all__: Sequence[str] = ["Loader"]
