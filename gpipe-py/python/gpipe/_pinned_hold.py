"""The Loader's hold on page-locked batches (``pin_memory=True``): a copy from a batch to a GPU
made with ``non_blocking=True`` reads the slot after the call returns, so a batch the caller
dropped at once (``x = x.to("cuda", non_blocking=True)``) must not go back to its worker, which
would refill the slot, until the GPU has run past that copy."""

from __future__ import annotations

import collections
from typing import Any, Optional

import torch

# The most batches kept at once besides the one handed out last: the loader waits for the
# oldest beyond these (a ring has at least two slots).
KEPT = 2


class PinnedHold:
    """Keeps each batch handed out until the GPU work queued on the current stream when the
    next batch is taken (or the loader closes) has run. A batch's tensors are its last
    references to its slot: dropping them gives the slot back."""

    def __init__(self) -> None:
        self._last: Optional[list] = None  # the tensors handed out last
        self._kept: collections.deque = collections.deque()  # (event, tensors), oldest first

    def handed_out(self, tensors: list) -> None:
        self._last = tensors

    def holds(self) -> bool:
        """Whether it keeps batches whose copies may still be queued."""
        return bool(self._kept)

    def before_take(self) -> None:
        """Keeps the batch handed out last behind the work queued so far, and lets go of the
        kept batches whose copies have run (waiting for the oldest beyond KEPT)."""
        self._keep_last()
        while self._kept and (len(self._kept) > KEPT or self._kept[0][0].query()):
            self._let_go_oldest()

    def let_go_all(self) -> None:
        """Waits for every kept batch's copies and lets them go."""
        while self._kept:
            self._let_go_oldest()

    def close(self) -> None:
        """Waits for the copies of every batch it keeps, the last one handed out among them,
        and lets them go; on a CUDA error in that wait (a dead context runs no copies) it lets
        them go all the same, then raises."""
        try:
            self._keep_last()
            self.let_go_all()
        finally:
            self._kept.clear()
            self._last = None

    def _keep_last(self) -> None:
        if self._last is not None:
            done: Any = torch.cuda.Event()
            done.record(torch.cuda.current_stream())
            self._kept.append((done, self._last))
            self._last = None

    def _let_go_oldest(self) -> None:
        # The tensors stay referenced until the wait is over: the last reference to them gives
        # the slot back, and a worker may refill it at once.
        done, tensors = self._kept[0]
        done.synchronize()
        self._kept.popleft()
        del tensors
