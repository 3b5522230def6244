"""The other ranks' loaders, for ``auto`` under DDP: each rank's figures over its last window
of batches, exchanged through ``torch.distributed``'s store, so that every rank decides its
workers from the same view of the job.

Why: the ranks of a DDP job step together, at the pace of the slowest, so one rank alone
cannot tell its own time per batch from its wait in the all-reduce for a slower rank, and a
step it takes alone does not change that pace. Ranks that decided alone diverged (4 H200s,
ResNet-50: 15, 12, 11 and 15 workers, 0.78x the ceiling). Here each rank publishes its k-th
window, waits (without blocking its trainer) for every rank's k-th, and decides from the view
of all: the job waited as long as its most starved rank waited, whose time not waiting is the
step's own (its data came last, so the others were in the all-reduce already), and the
workers make what the slowest rank's make. The same figures give the same decision on every
rank, so the ranks keep the same number of workers (the same job: 8 on every rank, 0.99x).
"""

from __future__ import annotations

import collections
import itertools
import json
import time
from typing import NamedTuple, Optional

# A rank whose peers' k-th window has not come this many batches and seconds after its own
# gives up on them and decides alone (a Loader made on some ranks only, or in another order).
# Both: a peer's window waits until its new workers deliver, which on busy CPUs can take
# seconds, and at 50 steps a second that is hundreds of batches.
LATE = 8 * 16
LATE_S = 60.0

# the Loaders of this process that exchange windows, by shape, in the order made
_SEQ: collections.defaultdict = collections.defaultdict(itertools.count)


class Window(NamedTuple):
    """One rank's last window: its trainer's time waiting for batches and the time they took
    (seconds), the batches its workers publish a second (None: not known yet), how many
    batches the window has, the most workers the rank may have, and, where its workers are
    of two kinds (some decode on a GPU, the rest on the CPU), the batches a second each
    worker of the newest one's kind makes (None: they are all of one kind)."""

    wait: float
    span: float
    rate: Optional[float]
    batches: int
    most: int
    each: Optional[float] = None


def view(windows: list[Window]) -> Window:
    """The job's window from every rank's (in rank order): the wait and span of the rank that
    waited the largest share, the slowest rank's workers' rate, and the lowest limit (so that
    a rank at its limit does not leave the others to step without it); the slowest rate of a
    newest worker's kind, where every rank's workers are of two kinds."""
    worst = max(windows, key=lambda w: w.wait / w.span if w.span > 0 else 1.0)
    rates = [w.rate for w in windows]
    rate = None if any(r is None for r in rates) else min(rates)
    eaches = [w.each for w in windows]
    each = None if any(e is None for e in eaches) else min(eaches)
    return Window(worst.wait, worst.span, rate, worst.batches, min(w.most for w in windows), each)


class Peers:
    """This rank's exchange of windows with the other ranks of its job."""

    def __init__(self, store, rank: int, world: int, tag: str) -> None:
        self.rank, self.world = rank, world
        self._store = store
        # the Loaders of one shape, in the order made: a Loader made on some ranks only
        # shifts the count of its own shape, not of the others
        self._prefix = f"gpipe-loader/{tag}/{next(_SEQ[tag])}"
        self._k = 0  # the next window this rank publishes
        # the batch count and time at which it published one whose peers it waits for
        self.pending: Optional[int] = None
        self.pending_since = 0.0

    @classmethod
    def of_job(cls, rank: int, world: int, tag: str) -> Optional[Peers]:
        """The exchange for this rank, or None where there is no job to exchange with: one
        rank, or ``torch.distributed`` not initialised (rank and world_size given by hand).
        `tag` names the Loader's shape (its data set's size, batch size, seed): only Loaders
        of the same shape exchange."""
        if world < 2:
            return None
        try:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d

            if not (dist.is_available() and dist.is_initialized()):
                return None
            if dist.get_world_size() != world or dist.get_rank() != rank:
                return None  # a rank and world of the caller's own, not the job's
            store = distributed_c10d._get_default_store()
        except (ImportError, AttributeError, RuntimeError, ValueError):
            return None
        return cls(store, rank, world, tag)

    def _key(self, k: int, rank: int) -> str:
        return f"{self._prefix}/{k}/{rank}"

    def publish(self, mine: Window, taken: int) -> None:
        """Publishes this rank's window; :meth:`gathered` then says when every rank's is in.
        Raises RuntimeError where the store fails (its server, on rank 0, gone)."""
        self._store.set(self._key(self._k, self.rank), json.dumps(mine._asdict()))
        self._store.add(f"{self._prefix}/{self._k}/n", 1)
        if self._k >= 8:  # every peer read it long ago, or this rank gave up on them
            self._store.delete_key(self._key(self._k - 8, self.rank))
            if self.rank == 0:
                self._store.delete_key(f"{self._prefix}/{self._k - 8}/n")
        self.pending, self.pending_since = taken, time.monotonic()

    def gathered(self) -> Optional[list[Window]]:
        """Every rank's window of the one this rank published last, in rank order, once all
        are in (then the next may be published); None before. One counter is asked on each
        call, and the windows read once they are all in. Raises RuntimeError where the store
        fails."""
        if self._store.add(f"{self._prefix}/{self._k}/n", 0) < self.world:
            return None
        keys = [self._key(self._k, r) for r in range(self.world)]
        many = getattr(self._store, "multi_get", None)  # one round trip where the store has it
        values = many(keys) if many is not None else [self._store.get(k) for k in keys]
        windows = [Window(**json.loads(v)) for v in values]
        self._k += 1
        self.pending = None
        return windows

    def close(self) -> None:
        """This rank's Loader is closed. The last rank of the job to close deletes what the
        exchange left in the store (each rank's last windows, their counters), which no rank
        reads any more: a job that makes a Loader per epoch leaves nothing behind. A store
        that fails (rank 0's process group gone) is left as it is."""
        p = self._prefix
        try:
            self._store.set(f"{p}/last/{self.rank}", str(self._k))
            if self._store.add(f"{p}/closed", 1) < self.world:
                return
            # each rank's windows up to its last (published, perhaps not gathered), less those
            # it deleted itself as it went (publish keeps 8)
            lasts = [int(self._store.get(f"{p}/last/{r}")) for r in range(self.world)]
            keys = [self._key(k, r) for r, last in enumerate(lasts)
                    for k in range(max(0, last - 9), last + 1)]
            keys += [f"{p}/{k}/n" for k in range(max(0, min(lasts) - 9), max(lasts) + 1)]
            keys += [f"{p}/last/{r}" for r in range(self.world)] + [f"{p}/closed"]
            for key in keys:
                self._store.delete_key(key)  # False where it is not there
        except (RuntimeError, ValueError):
            pass

    late_why = (f"the other ranks' figures had not come {LATE} batches and {LATE_S:.0f} s after "
                f"this rank's (a Loader made on some ranks only?)")

    def late(self, taken: int) -> bool:
        """Whether the peers' windows are so late that this rank should decide alone."""
        return (self.pending is not None and taken - self.pending > LATE
                and time.monotonic() - self.pending_since > LATE_S)
