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
rank, so the ranks keep the same number of workers.
"""

from __future__ import annotations

import itertools
import json
from typing import NamedTuple, Optional

# A rank whose peers' k-th window has not come this many batches after its own gives up on
# them and decides alone (a Loader made on some ranks only, or in another order).
LATE = 8 * 16

_SEQ = itertools.count()  # the Loaders of this process that exchange windows, in order made


class Window(NamedTuple):
    """One rank's last window: its trainer's time waiting for batches and the time they took
    (seconds), the batches its workers publish a second (None: not known yet), and how many
    batches the window has."""

    wait: float
    span: float
    rate: Optional[float]
    batches: int


def view(windows: list[Window]) -> Window:
    """The job's window from every rank's (in rank order): the wait and span of the rank that
    waited the largest share, and the slowest rank's workers' rate."""
    worst = max(windows, key=lambda w: w.wait / w.span if w.span > 0 else 1.0)
    rates = [w.rate for w in windows]
    rate = None if any(r is None for r in rates) else min(rates)
    return Window(worst.wait, worst.span, rate, worst.batches)


class Peers:
    """This rank's exchange of windows with the other ranks of its job."""

    def __init__(self, store, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._store = store
        self._prefix = f"gpipe-loader/{next(_SEQ)}"
        self._k = 0  # the next window this rank publishes
        self.pending: Optional[int] = None  # the batch count at which it published one
        # whose peers waits for theirs

    @classmethod
    def of_job(cls, rank: int, world: int) -> Optional[Peers]:
        """The exchange for this rank, or None where there is no job to exchange with: one
        rank, or ``torch.distributed`` not initialised (rank and world_size given by hand)."""
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
        return cls(store, rank, world)

    def _key(self, k: int, rank: int) -> str:
        return f"{self._prefix}/{k}/{rank}"

    def publish(self, mine: Window, taken: int) -> None:
        """Publishes this rank's window; :meth:`gathered` then says when every rank's is in."""
        self._store.set(self._key(self._k, self.rank), json.dumps(mine._asdict()))
        if self._k >= 8:  # every peer read it long ago, or this rank gave up on them
            try:
                self._store.delete_key(self._key(self._k - 8, self.rank))
            except (AttributeError, RuntimeError):
                pass
        self.pending = taken

    def gathered(self) -> Optional[list[Window]]:
        """Every rank's window of the one this rank published last, in rank order, once all
        are in (then the next may be published); None before."""
        keys = [self._key(self._k, r) for r in range(self.world)]
        if not self._store.check(keys):
            return None
        windows = [Window(**json.loads(self._store.get(k))) for k in keys]
        self._k += 1
        self.pending = None
        return windows
