"""gpipe.torch.Loader on the host backend: decode workers in processes of their own, every
batch of an epoch once and in order, ranks that split an epoch, `auto` adding workers when
the trainer waits, and a worker that fails or dies ending the trainer's loop with its error."""

from __future__ import annotations

import ctypes
import gc
import os
import queue
import signal
import threading
import warnings
import time
from typing import Any, Callable

import pytest
import torch

import gpipe
from gpipe.torch import Loader


class Numbers:
    """Sample i is (i, i % 7): a batch says which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return (i, i % 7)


def decode(samples, device):
    idx = torch.tensor([s[0] for s in samples], dtype=torch.int64, device=device)
    return {
        "index": idx,
        "label": torch.tensor([s[1] for s in samples], dtype=torch.int64, device=device),
        "image": idx.to(torch.float32).repeat_interleave(12).reshape(-1, 3, 2, 2),
    }


def decode_tuple(samples, device):
    d = decode(samples, device)
    return d["image"], d["label"]


def decode_slow(samples, device):
    time.sleep(0.03)
    return decode(samples, device)


def decode_failing(samples, device):
    if any(s[0] == 13 for s in samples):
        raise ValueError("sample 13 is not a JPEG")
    return decode(samples, device)


def decode_wrong(samples, device):
    return "not tensors"


def order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def test_every_batch_of_each_epoch_once_in_order():
    n, b = 200, 8
    with Loader(Numbers(n), decode, batch_size=b, device="cpu", workers=3, seed=5) as loader:
        assert len(loader) == n // b and loader.workers == 3
        for epoch in range(2):
            seen = []
            for batch in loader:
                assert set(batch) == {"index", "label", "image"}
                assert batch["image"].shape == (b, 3, 2, 2) and batch["image"].dtype == torch.float32
                assert torch.equal(batch["label"], batch["index"] % 7)
                assert torch.equal(batch["image"][:, 0, 0, 0], batch["index"].float())
                seen += batch["index"].tolist()
            assert seen == order(n, 5, epoch)  # the whole epoch, once, in the shuffled order


class HeldBack:
    """decode whose batch of sample 0 waits (at most 60 s) until `marker` exists: the trainer
    makes it once it has taken another batch."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, samples, device):
        deadline = time.monotonic() + 60
        while samples[0][0] == 0 and not os.path.exists(self.marker):
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer took no other batch before batch 0 in 60 s")
            time.sleep(0.01)
        return decode(samples, device)


def test_out_of_order_hands_out_what_came_first_and_every_batch_once(tmp_path):
    """in_order=False: the first batch is held back in its worker until the trainer has taken
    another, so others go first, and it goes out once it comes, in that iteration or a later
    one. Each iteration gives len(loader) batches; over the run, every batch of every epoch
    goes out once."""
    marker = tmp_path / "taken"
    n, b, epochs = 64, 8, 3
    seen = []
    with Loader(Numbers(n), HeldBack(str(marker)), batch_size=b, device="cpu", workers=2,
                shuffle=False, in_order=False, epochs=epochs, timeout=90) as loader:
        for _ in range(epochs):
            got = 0
            for batch in loader:
                first = batch["index"][0].item()
                assert batch["index"].tolist() == list(range(first, first + b))  # a whole batch
                seen.append(first // b)
                got += 1
                marker.touch()
                del batch
            assert got == len(loader)
    assert seen[0] != 0, seen  # batch 0 could come only after another was taken
    # shuffle=False: every epoch's batches are the same eight; each went out once an epoch
    assert sorted(seen) == sorted(list(range(n // b)) * epochs), seen


def test_ranks_split_each_epoch_between_them_without_overlap():
    n, b = 203, 10
    got = []
    for rank in range(2):
        with Loader(Numbers(n), decode_tuple, batch_size=b, device="cpu", rank=rank,
                    world_size=2, workers=1, seed=0) as loader:
            assert len(loader) == (n // 2) // b
            seen = []
            for images, labels in loader:  # decode returned a tuple: so does the loader
                seen += images[:, 0, 0, 0].to(torch.int64).tolist()
                assert torch.equal(labels, images[:, 0, 0, 0].to(torch.int64) % 7)
            got.append(seen)
    assert len(got[0]) == len(got[1]) == 100 and not set(got[0]) & set(got[1])
    perm = order(n, 0, 0)
    assert got[0] == perm[0:202:2][:100] and got[1] == perm[1:202:2][:100]


def epochs_until_settled(loader, seconds=120.0):
    """Whole epochs until auto has settled (a watchdog of `seconds`); each epoch's indices."""
    deadline = time.monotonic() + seconds
    epochs = []
    while not epochs or not loader.settled:
        assert time.monotonic() < deadline, f"auto did not settle in {seconds} s: {loader.why}"
        epochs.append([i for batch in loader for i in batch["index"].tolist()])
    return epochs


def test_auto_adds_a_worker_when_the_trainer_waits_for_data():
    with Loader(Numbers(1200), decode_slow, batch_size=4, device="cpu", max_workers=3, seed=4) as loader:
        assert loader.workers == 1 and "auto" in loader.why and not loader.settled
        # the trainer takes batches as fast as they come
        epochs = epochs_until_settled(loader)
        assert loader.workers == 3, loader.why
        # each step (1 -> 2 -> 3 here: at most twice the workers at a time) is kept only if
        # the workers then publish faster
        assert "waited" in loader.why and "worker 2 started" in loader.why, loader.why
        assert "kept" in loader.why, loader.why
        assert all(seen == order(1200, 4, e) for e, seen in enumerate(epochs))


class Serialised:
    """A decode that holds one lock across every worker: more workers make no more batches,
    as decode processes time-slicing one GPU without MPS can."""

    def __init__(self) -> None:
        import multiprocessing

        self.lock = multiprocessing.get_context("spawn").Lock()

    def __call__(self, samples, device):
        # 50 ms in the lock against a few ms of a worker's own outside it: a second worker
        # can bring at most about 1.1x, below a quarter of the 2x a step predicts (with 10 ms,
        # 2 workers brought 1.59x on a 2-core machine)
        with self.lock:
            time.sleep(0.05)
            return decode(samples, device)


def test_auto_retires_workers_that_do_not_make_the_trainer_faster_and_loses_no_batch():
    n, b = 600, 4
    with Loader(Numbers(n), Serialised(), batch_size=b, device="cpu", max_workers=4, seed=2) as loader:
        epochs = epochs_until_settled(loader)
        # a step that gained less than a quarter of what it should was retired and auto stopped: at
        # 1 worker (a second one overlaps only the work outside the lock)
        assert loader.workers == 1, loader.why
        assert "retired" in loader.why and "auto stopped" in loader.why, loader.why
        # every epoch whole and in order: the retired workers published every batch they claimed
        assert all(seen == order(n, 2, e) for e, seen in enumerate(epochs))


def test_a_rank_of_several_that_still_waits_retires_a_step_that_does_not_pay():
    # As the test above, on rank 0 of 2: the trainer still waits after the step, so the step
    # is judged on its workers' rate, as for one trainer, and retired.
    n, b = 1200, 4
    with Loader(Numbers(n), Serialised(), batch_size=b, device="cpu", max_workers=4, seed=2,
                rank=0, world_size=2) as loader:
        epochs = epochs_until_settled(loader)
        assert loader.workers == 1, loader.why
        assert "retired" in loader.why and "or no waiting (one rank of 2)" in loader.why, loader.why
        mine = len(loader) * b
        assert all(seen == order(n, 2, e)[0:n:2][:mine] for e, seen in enumerate(epochs))


class SerialisedUntil(Serialised):
    """Serialised while a shared flag is set; then every worker decodes on its own."""

    def __init__(self) -> None:
        import multiprocessing

        super().__init__()
        self.on = multiprocessing.get_context("spawn").Event()
        self.on.set()

    def __call__(self, samples, device):
        if self.on.is_set():
            return super().__call__(samples, device)
        time.sleep(0.05)
        return decode(samples, device)


def test_auto_tries_again_after_a_retired_step_and_keeps_a_step_that_now_pays():
    n, b = 40000, 4
    shared = SerialisedUntil()
    with Loader(Numbers(n), shared, batch_size=b, device="cpu", max_workers=2, seed=7) as loader:
        it = iter(loader)
        deadline = time.monotonic() + 100
        while "retired" not in loader.why:  # the lock: a second worker brings nothing
            assert time.monotonic() < deadline, loader.why
            batch = next(it)
            del batch
        assert loader.workers == 1 and "acts again after 128 batches" in loader.why, loader.why
        shared.on.clear()  # the load changes: workers no longer share a limit
        while not (loader.workers == 2 and "kept" in loader.why):
            assert time.monotonic() < deadline, loader.why
            batch = next(it)
            del batch


def test_a_step_is_judged_against_the_recent_rate_not_a_slow_start():
    n, b = 40000, 4
    with Loader(Numbers(n), Serialised(), batch_size=b, device="cpu", max_workers=2, seed=1) as loader:
        it = iter(loader)
        for _ in range(120):  # a slow start: the trainer, not the data, sets the pace
            batch = next(it)
            del batch
            time.sleep(0.08)
        deadline = time.monotonic() + 120
        while not (loader.settled and ("retired" in loader.why or "kept" in loader.why)):
            assert time.monotonic() < deadline, loader.why
            batch = next(it)
            del batch
        # the second worker cannot beat the lock: against the slow start it looked like a 4x
        # gain; against the rate just before the step it is none
        assert loader.workers == 1 and "retired" in loader.why, loader.why


class Device:
    """A trainer's GPU as its host sees it: `submit()` returns at once unless the last job is
    still running (then it waits for that one), so while the trainer waits for data its own
    time per batch is only the launch, as a CUDA trainer's is."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy_until = 0.0

    def submit(self) -> None:
        now = time.monotonic()
        if self.busy_until > now:
            time.sleep(self.busy_until - now)
            now = self.busy_until
        self.busy_until = now + self.seconds


def decode_50ms(samples, device):
    time.sleep(0.05)
    return decode(samples, device)


def train_until_settled(loader: Loader, device_seconds: Callable[[int], float], n: int, seed: int,
                        rank: int = 0, world: int = 1, host_seconds: float = 0.0) -> None:
    """Epochs until `auto` settles, each batch followed by a device job of
    `device_seconds(loader.workers)` and `host_seconds` the host sees pass (a DDP rank's wait
    in the all-reduce, say); every epoch must be whole, in order, and this rank's."""
    dev = Device(device_seconds(1))
    deadline = time.monotonic() + 120
    epochs = []
    while not epochs or not loader.settled:
        assert time.monotonic() < deadline, f"auto did not settle: {loader.why}"
        seen = []
        for batch in loader:
            seen.extend(batch["index"].tolist())
            del batch
            dev.seconds = device_seconds(loader.workers)
            dev.submit()
            time.sleep(host_seconds)
        epochs.append(seen)
    mine = len(loader) * loader._cfg["plan"][1]
    assert all(seen == order(n, seed, e)[rank:(n // world) * world:world][:mine]
               for e, seen in enumerate(epochs))


def test_a_step_that_lets_the_trainer_keep_its_own_pace_is_kept():
    # One worker makes a batch every 50 ms; the trainer's device needs 45 ms a batch, which its
    # host does not see while it waits for data. `auto` predicts 2x from the host's times; a
    # second worker brings 1.11x (the device's pace), and the trainer no longer waits: kept.
    n, b = 1200, 4
    with Loader(Numbers(n), decode_50ms, batch_size=b, device="cpu", max_workers=2, seed=3) as loader:
        train_until_settled(loader, lambda workers: 0.045, n, 3)
        assert loader.workers == 2, loader.why
        assert "kept: the trainer no longer waits" in loader.why, loader.why


def test_a_step_that_stops_the_waiting_but_slows_the_trainer_is_retired():
    # As a decode process without MPS can: with a second worker the trainer's device needs
    # 100 ms a batch instead of 30, slower than one worker fed it (50 ms). The trainer no
    # longer waits, but takes fewer batches a second: retired.
    n, b = 1200, 4
    with Loader(Numbers(n), decode_50ms, batch_size=b, device="cpu", max_workers=2, seed=5) as loader:
        train_until_settled(loader, lambda workers: 0.030 if workers <= 1 else 0.100, n, 5)
        assert loader.workers == 1 and "retired" in loader.why, loader.why


def test_a_rank_of_several_keeps_a_step_that_feeds_it_though_a_slower_peer_sets_the_pace():
    # The trace of the test above (with 58 ms a batch), on rank 0 of 2 (DDP): there the
    # trainer's pace after the step is also what a starved peer rank imposes, through the
    # gradients' all-reduce, and retiring the step would starve this rank next. A rank keeps a
    # step that leaves it fed.
    n, b = 2400, 4
    with Loader(Numbers(n), decode_50ms, batch_size=b, device="cpu", max_workers=2, seed=5,
                rank=0, world_size=2) as loader:
        train_until_settled(loader, lambda workers: 0.030 if workers <= 1 else 0.058, n, 5,
                            rank=0, world=2)
        # kept (on a loaded machine it may be on the rate's own rise instead), never retired
        assert loader.workers == 2 and "kept" in loader.why and "retired" not in loader.why, loader.why


def test_a_rank_of_several_that_waits_doubles_its_workers():
    # Each worker makes a batch every 50 ms; the rank's time between batches is 20 ms, which to
    # its host may be its own work or its wait in the all-reduce for a slower rank: it cannot
    # tell them apart. One trainer takes 2 workers to 3 (2 x 25/20, a tenth over); a rank of
    # several doubles them, 2 -> 4, as a prediction from that time falls short under DDP.
    n, b = 2400, 4
    with Loader(Numbers(n), decode_50ms, batch_size=b, device="cpu", max_workers=4, seed=8,
                rank=0, world_size=2) as loader:
        train_until_settled(loader, lambda workers: 0.0, n, 8, rank=0, world=2,
                            host_seconds=0.020)  # seen by the host, as the all-reduce's wait is
        assert loader.workers == 4, loader.why
        assert "workers 2-3 started" in loader.why and "so it doubles them" in loader.why, loader.why
        assert "kept" in loader.why, loader.why



def judge_a_step(world: int, for_waiting: bool) -> Loader:
    """auto's verdict on a step from 1 worker to 2 that leaves the trainer fed while its take
    rate bursts, as a DDP rank's does when its peers catch up ("2.71 made, 14.89 taken" on 4
    H100s): the workers publish 2.7 batches/s, against 4.3 before the step, and the last 16
    batches were taken within 64 ms, without waiting. The loader's state is set to that point."""
    loader = Loader(Numbers(64), decode, batch_size=4, device="cpu", workers="auto",
                    max_workers=2, rank=0, world_size=world)
    loader._start_worker()  # the step's worker
    now = time.monotonic_ns()
    for r in loader._rings:  # each delivering for a while, at 1.35 batches/s
        r.first_at = 0
        r.stamps.extend(now - int(k * 1e9 / 1.35) for k in range(WINDOW_STAMPS, -1, -1))
    loader._taken = 500
    loader._trial = (1, 4.3, 2, 2.0, for_waiting, True)
    loader._waits.extend([(0.0, 0.004)] * 15)
    loader._last_t = time.monotonic() - 0.004
    loader._maybe_scale(0.0)
    return loader


WINDOW_STAMPS = 8


def test_a_ddp_rank_keeps_a_step_it_took_for_waiting_once_fed_however_its_take_rate_bursts():
    with judge_a_step(world=2, for_waiting=True) as loader:
        assert loader.workers == 2 and "kept: the trainer no longer waits" in loader.why, loader.why
    # a step taken because the workers were behind is judged as for one trainer: retired (the
    # rank was fed before it, and is after)
    with judge_a_step(world=2, for_waiting=False) as loader:
        assert loader.workers == 1 and "retired" in loader.why, loader.why
    # one trainer retires either: it takes fewer batches a second than before
    with judge_a_step(world=1, for_waiting=True) as loader:
        assert loader.workers == 1 and "retired" in loader.why, loader.why


def test_workers_of_two_kinds_are_sized_by_the_newest_kind_and_a_blind_step_by_what_it_adds():
    """MixedDecode's case (figures made up, of its order): a first worker decoding on the GPU
    makes 28 batches/s, a CPU worker 2.5. auto's first step (1 -> 2) predicted the second worker from the first: 2x. Judged by
    that, the 9% it brought is a failure; judged by what the CPU worker makes, now measured, it
    paid. The next step is sized in CPU workers: the trainer needs 1.5x the rate."""
    from gpipe._loader_peers import Window

    with Loader(Numbers(64), decode, batch_size=4, device="cpu", workers="auto",
                max_workers=6, rank=0, world_size=1) as loader:
        loader._start_worker()  # the step's worker
        loader._taken = 500
        loader._trial = (1, 28.0, 2, 2.0, True, True)  # taken while the workers were of one kind
        # waiting half the time (so only the rate can say it paid): 30.5 batches/s
        loader._decide(Window(0.5, 1.0, 30.5, 16, 6, each=2.5))
        assert loader.workers == 2 and "kept: 30.50 batches/s against 28.00" in loader.why, loader.why
        assert loader._trial is None and loader._armed  # the next window of waiting steps
        loader._decide(Window(0.5, 1.0, 30.5, 16, 6, each=2.5))
        # short 2x (half the time waiting): the rate is 12.2 CPU workers' worth, and 1.2x more
        # of it (a tenth to spare) is 15 more; at most 12 at a time (twice the rate), and 6
        # workers in all: 4 more, not the 1 that counting the workers alike would add
        assert loader.workers == 6, loader.why
        assert loader._trial[:3] == (2, 30.5, 6) and loader._trial[5] is False
        assert loader._trial[3] == pytest.approx((30.5 + 4 * 2.5) / 30.5)
    with Loader(Numbers(64), decode, batch_size=4, device="cpu", workers="auto",
                max_workers=6, rank=0, world_size=1) as loader:
        loader._start_worker()
        loader._taken = 500
        loader._trial = (1, 28.0, 2, 2.0, True, True)
        # the workers are of one kind: the prediction stands, and 9% is not a quarter of it
        loader._decide(Window(0.5, 1.0, 30.5, 16, 6))
        assert loader.workers == 1 and "retired" in loader.why, loader.why


def decode_20ms(samples, device):
    time.sleep(0.02)
    return decode(samples, device)


def test_auto_adds_a_worker_before_a_backlog_runs_out():
    # One worker makes a batch every 20 ms; the trainer takes one every 16 ms from a ring of
    # 64 that filled while it paused, so it would not wait for about 320 batches. `auto` sees
    # the workers make 0.8 of what the trainer takes and adds one before the backlog is gone
    # (after about 110: a window once the worker's first 16 + 64 are taken, and a second).
    # With 32 slots a loaded CI machine, its worker making one every 26 ms, ran out first.
    n, b = 4000, 4
    with Loader(Numbers(n), decode_20ms, batch_size=b, device="cpu", max_workers=2, slots=64,
                seed=6) as loader:
        it = iter(loader)
        next(it)
        time.sleep(3.0)  # the ring fills
        taken, waited = 1, 0.0
        while loader.workers < 2:
            t = time.monotonic()
            batch = next(it)
            waited += time.monotonic() - t
            del batch
            taken += 1
            assert taken < 400, f"no step after {taken} batches: {loader.why}"
            time.sleep(0.016)
        assert "the workers being behind" in loader.why, loader.why
        # the backlog was not used up: the trainer had not waited
        assert waited < 0.1 * taken * 0.016, f"waited {waited:.2f} s over {taken} batches: {loader.why}"


def test_a_pause_after_a_worker_ends_loses_none_of_its_batches():
    # A worker that ends (retired here; or its epochs done) waits for the trainer to take
    # what it published, however long the trainer pauses (a validation, a checkpoint).
    got = []
    with Loader(Numbers(4000), decode, batch_size=8, device="cpu", workers=2, slots=2,
                shuffle=False) as loader:
        it = iter(loader)
        for _ in range(6):
            got += next(it)["index"].tolist()
        loader._rings[1].flags.retire.set()  # what auto does to the workers of a step that failed
        time.sleep(7)  # longer than a producer's default drain_timeout (5 s)
        for _ in range(10):
            got += next(it)["index"].tolist()
        assert loader.workers == 1
    assert got == list(range(16 * 8))


def test_a_slow_trainer_gets_every_batch_of_the_last_epoch():
    got = []
    with Loader(Numbers(80), decode, batch_size=8, device="cpu", workers=2, slots=2, epochs=1,
                shuffle=False) as loader:
        for i, batch in enumerate(loader):
            got += batch["index"].tolist()
            del batch
            if i == 4:  # the workers have published their last batches and are ending
                time.sleep(6.5)
    assert got == list(range(80))


def read_until_every_worker_published(loader: Loader) -> None:
    """Reads whole epochs (10 batches each) until every worker has published one: a worker
    that started late may have published nothing in the first."""
    deadline = time.monotonic() + 60
    while any(r.first_at is None for r in loader._rings):
        assert time.monotonic() < deadline, "a worker published nothing in 60 s"
        assert sum(1 for _ in loader) == 10


def thread_nices(pid: int) -> dict[int, int]:
    """Each thread of process `pid` and its nice value (/proc/PID/task/TID/stat, field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
        except (OSError, IndexError):  # the thread ended meanwhile
            pass
    return out


def test_workers_run_nicer_than_the_trainer_so_its_own_threads_come_first():
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    if mine > 9:
        pytest.skip(f"this test runs at nice {mine}: a worker could not be 10 nicer")
    # worker_threads=2: torch starts a thread pool in set_num_threads, and importing torch
    # started numpy's before the worker's code ran; every one of them must be nicer
    for asked, want in ((None, mine + 10), (3, mine + 3), (0, mine)):
        extra = {} if asked is None else {"worker_nice": asked}
        with Loader(Numbers(40), decode, batch_size=4, device="cpu", workers=2, worker_threads=2,
                    **extra) as loader:
            read_until_every_worker_published(loader)
            for r in loader._rings:
                nices = thread_nices(r.proc.pid)
                assert len(nices) > 1 and set(nices.values()) == {want}, (asked, nices)
    with pytest.raises(ValueError, match="worker_nice must be an int in 0..19"):
        Loader(Numbers(40), decode, batch_size=4, device="cpu", worker_nice=25)
    with pytest.raises(ValueError, match="worker_nice must be an int in 0..19"):
        Loader(Numbers(40), decode, batch_size=4, device="cpu", worker_nice=True)


def thread_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of process `pid` and the CPUs it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return out


def test_workers_run_on_the_cpus_given_and_every_thread_of_theirs_too():
    mine = sorted(os.sched_getaffinity(0))
    # the last CPU of this process's: the workers' threads run there, the trainer anywhere
    with Loader(Numbers(40), decode, batch_size=4, device="cpu", workers=2, worker_threads=2,
                worker_cpus=[mine[-1]]) as loader:
        read_until_every_worker_published(loader)
        for r in loader._rings:
            cpus = thread_cpus(r.proc.pid)
            assert len(cpus) > 1 and all(c == {mine[-1]} for c in cpus.values()), cpus
    assert sorted(os.sched_getaffinity(0)) == mine  # the trainer's own are untouched
    with pytest.raises(ValueError, match=r"worker_cpus must be CPUs this process may run on "
                                         r"\(.*\); 4096-4097 are not"):
        Loader(Numbers(40), decode, batch_size=4, device="cpu", worker_cpus=[4096, 4097, mine[0]])
    with pytest.raises(ValueError, match="none given"):
        Loader(Numbers(40), decode, batch_size=4, device="cpu", worker_cpus=[])
    with pytest.raises(TypeError, match="worker_cpus must be CPU numbers"):
        Loader(Numbers(40), decode, batch_size=4, device="cpu", worker_cpus="0-3")


def test_a_fixed_worker_count_is_settled_from_the_start():
    with Loader(Numbers(64), decode, batch_size=4, device="cpu", workers=2) as loader:
        assert loader.settled and loader.why == "2 worker(s), as asked"


def test_a_failing_decode_ends_the_loop_naming_the_worker_and_its_error():
    with Loader(Numbers(64), decode_failing, batch_size=4, device="cpu", workers=2,
                shuffle=False) as loader:
        with pytest.raises(gpipe.Error, match=r"decode worker \d failed on batch 3 \(epoch 0\): "
                           r"ValueError: sample 13 is not a JPEG") as e:
            for _ in loader:
                pass
        assert "in the worker:" in str(e.value) and "decode_failing" in str(e.value)


def test_a_killed_worker_is_a_clear_error_not_a_hang():
    with Loader(Numbers(4000), decode, batch_size=4, device="cpu", workers=1) as loader:
        it = iter(loader)
        next(it)
        os.kill(loader._rings[0].proc.pid, signal.SIGKILL)
        with pytest.raises(gpipe.Error, match=r"decode worker 0 \(pid \d+\) was killed by signal 9"):
            for _ in it:
                pass


@pytest.mark.parametrize("last", [2, 6])
def test_breaking_out_of_an_epoch_starts_the_next_one(last):
    n, b = 80, 8
    # One worker, so the ring's batch order is the loader's (with two, which batch needed the
    # held slot again depended on which worker claimed what). Its 4 slots: batch `last` holds
    # slot last % 4, which batch last + 4 needs: in the skip of the epoch's rest (2 -> 6), or
    # the next epoch's first (6 -> 10).
    with Loader(Numbers(n), decode, batch_size=b, device="cpu", workers=1, seed=3) as loader:
        for i, batch in enumerate(loader):
            if i == last:
                break
        # the loop's last batch still holds its slot: the skip needs that slot again
        with pytest.raises(gpipe.Deadlock, match=r"still holds tensors of an earlier batch.*"
                                                 r"keep a copy \(\.clone\(\)\) of what must outlive"):
            next(iter(loader))
        del batch
        first = next(iter(loader))
        assert first["index"].tolist() == order(n, 3, 1)[:b]  # the refused call began no epoch


def test_epochs_end_the_workers_and_a_further_epoch_is_refused_clearly():
    with Loader(Numbers(32), decode, batch_size=8, device="cpu", workers=2, epochs=1) as loader:
        assert sum(1 for _ in loader) == 4
        with pytest.raises(gpipe.Error, match="every decode worker has finished"):
            next(iter(loader))


def test_bad_arguments_and_a_bad_decode_say_what_is_wrong():
    with pytest.raises(ValueError, match="batch_size must be"):
        Loader(Numbers(10), decode, batch_size=0, device="cpu")
    with pytest.raises(ValueError, match="make no whole batch of 8"):
        Loader(Numbers(5), decode, batch_size=8, device="cpu")
    with pytest.raises(TypeError, match="decode must be a function"):
        Loader(Numbers(10), "decode", batch_size=2, device="cpu")
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        Loader(Numbers(10), decode, batch_size=2, device="cpu", rank=2, world_size=2)
    for name, value in (("pin_memory", "try"), ("in_order", 0), ("shuffle", None)):
        with pytest.raises(TypeError, match=f"{name} must be True or False; got {value!r}"):
            Loader(Numbers(10), decode, batch_size=2, device="cpu", **{name: value})
    with Loader(Numbers(16), decode_wrong, batch_size=4, device="cpu", workers=1) as loader:
        with pytest.raises(gpipe.Error, match="decode must return a torch tensor.*returned str"):
            next(iter(loader))
    # auto's default limit: the CPUs per trainer of the node less one (a single trainer has
    # them all); at most 8 only for workers on a GPU (the arithmetic: the test below)
    cpus = len(os.sched_getaffinity(0))
    share = max(1, cpus - 1)
    with Loader(Numbers(16), decode, batch_size=4, device="cpu") as loader:
        assert loader.max_workers == share
    if torch.cuda.is_available():
        with Loader(Numbers(16), decode, batch_size=4, device="cuda:0") as loader:
            assert loader.max_workers == min(8, share)
        with pytest.raises(ValueError, match="made on cuda:0 already: leave pin_memory out"):
            Loader(Numbers(10), decode, batch_size=2, device="cuda:0", pin_memory=True)


def test_autos_limit_shares_the_cpus_among_the_trainers_of_the_node(monkeypatch):
    import gpipe._loader as impl

    # a 64-CPU node with 4 GPUs, whatever this machine has
    monkeypatch.setattr(impl.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(impl.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(impl.torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert impl._default_max_workers(False, 1) == 63  # a single trainer has every CPU
    assert impl._default_max_workers(False, 2) == 31  # one trainer a rank
    assert impl._default_max_workers(False, 8) == 15  # at most one a GPU (8 ranks: 2 nodes)
    assert impl._default_max_workers(True, 1) == 8  # decoding on a GPU: at most 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun says how many this node runs
    assert impl._default_max_workers(False, 8) == 31
    for bad in ("0", "x", ""):  # not a count: the ranks, as without torchrun
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        assert impl._default_max_workers(False, 8) == 15
    monkeypatch.setattr(impl.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert impl._default_max_workers(False, 2) == 31  # no GPU: one trainer a rank


def decode_growing(samples, device):
    """A batch whose size grows with its first sample: 1 KiB, then up to 4 MiB (past the
    2 MiB a slot sized by the first batch holds)."""
    first = samples[0][0]
    n = 256 if first < 8 else 1 << 20
    return {"index": torch.tensor([s[0] for s in samples]), "data": torch.full((n,), float(first))}


def test_batches_that_grow_fit_slots_sized_by_slot_bytes():
    with Loader(Numbers(64), decode_growing, batch_size=4, device="cpu", workers=1, shuffle=False,
                slot_bytes=(4 << 20) + 4096) as loader:
        sizes = []
        for batch in loader:
            assert torch.all(batch["data"] == batch["index"][0].float())
            sizes.append(batch["data"].numel())
        assert sizes == [256, 256] + [1 << 20] * 14


def test_a_batch_larger_than_its_slot_names_slot_bytes():
    # sized by the first batch (1 KiB, rounded up to 2 MiB), the third batch (4 MiB) does not fit
    with Loader(Numbers(64), decode_growing, batch_size=4, device="cpu", workers=1, shuffle=False,
                timeout=60) as loader:
        it = iter(loader)
        assert next(it)["data"].numel() == 256 and next(it)["data"].numel() == 256
        with pytest.raises(gpipe.Error, match=r"batch 2 takes \d+ bytes, more than the 2097152 of a "
                                              r"slot \(sized by this worker's first batch\): give "
                                              r"Loader slot_bytes="):
            next(it)
    for bad in (0, True, 2.5, "1M"):
        with pytest.raises(ValueError, match="slot_bytes must be an int of 1 or more"):
            Loader(Numbers(64), decode, batch_size=4, device="cpu", slot_bytes=bad)


def workers_end(procs: list) -> None:
    """The workers' processes end on their own (not killed) within a minute, their batches
    dropped."""
    deadline = time.monotonic() + 60
    while any(p.is_alive() for p in procs):
        assert time.monotonic() < deadline, "a worker did not end after the batches were dropped"
        time.sleep(0.05)
    assert [p.exitcode for p in procs] == [0] * len(procs)  # ended, not killed


def test_close_is_prompt_and_a_batch_kept_past_it_stays_valid():
    # A worker's ring stays mapped while tensors of its batches live; close() does not wait
    # for them (nor kill the worker): the worker ends on its own once they are dropped.
    import gpipe._loader as impl

    loader = Loader(Numbers(64), decode, batch_size=4, device="cpu", workers=2, shuffle=False)
    it = iter(loader)
    kept = next(it)
    next(it)
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < impl._STOP_S  # not held up until the kill deadline
    assert torch.equal(kept["index"], torch.arange(4)) and torch.equal(kept["image"][:, 0, 0, 0], torch.arange(4.0))
    with pytest.raises(gpipe.Error, match="this Loader is closed"):  # not a wait for stopped workers
        next(it)
    procs = [r.proc for r in loader._rings]
    del kept, it
    gc.collect()
    workers_end(procs)


def decode_stuck(samples, device):
    if samples[0][0] >= 4:
        time.sleep(3600)
    return decode(samples, device)


def test_close_kills_a_worker_stuck_in_decode(monkeypatch):
    import gpipe._loader as impl

    monkeypatch.setattr(impl, "_STOP_S", 0.5)
    loader = Loader(Numbers(64), decode_stuck, batch_size=4, device="cpu", workers=1, shuffle=False)
    assert next(iter(loader))["index"].tolist() == [0, 1, 2, 3]
    loader.close()
    assert loader._rings[0].proc.exitcode == -signal.SIGKILL

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def decode_on_gpu_late(samples, device):
    """A batch whose values come after a millisecond of GPU work on the worker's stream: a
    trainer that read the slot before its ready signal would see the previous batch."""
    torch.cuda._sleep(2_000_000)
    d = decode(samples, device)
    d["image"] = d["image"].repeat(1, 1, 32, 32).contiguous()  # 64 x 3 x 64 x 64 float
    return d


@cuda
def test_on_a_gpu_every_batch_is_read_after_its_decode_and_before_its_slot_is_refilled():
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(dev)
    n, b = 2048, 64
    sums, want = [], []
    with Loader(Numbers(n), decode_on_gpu_late, batch_size=b, device=dev, workers=2, slots=2,
                seed=9) as loader:
        for epoch in range(2):
            for batch in loader:
                image = batch["image"]
                assert image.device == dev and image.shape == (b, 3, 64, 64)
                # the trainer's stream reads the slot late: a worker that refilled it before
                # the trainer was done would change the sum
                torch.cuda._sleep(1_000_000)
                sums.append((image.double().sum(dim=(1, 2, 3)) - batch["index"].double() * 12288).abs().max())
                want.append(batch["index"].cpu())
                del batch, image
        assert torch.stack(sums).max().item() == 0.0
        assert torch.cat(want).tolist() == order(n, 9, 0) + order(n, 9, 1)


def decode_big(samples, device):
    """16 MiB a batch: sample i's index in every float, for a copy to a GPU to check."""
    idx = torch.tensor([s[0] for s in samples], dtype=torch.float32, device=device)
    return {"image": idx[:, None].expand(-1, (16 << 20) // 4 // len(samples)).contiguous()}



@cuda
def test_on_a_gpu_close_is_prompt_and_a_batch_kept_past_it_stays_valid():
    # As on the host: the workers' rings are on the GPU here, and a batch kept past close()
    # keeps its worker (and so its memory) until it is dropped.
    loader = Loader(Numbers(64), decode, batch_size=4, device="cuda:0", workers=2, shuffle=False)
    it = iter(loader)
    kept = next(it)
    next(it)
    loader.close()
    torch.cuda.synchronize()
    assert torch.equal(kept["index"].cpu(), torch.arange(4))
    assert torch.equal(kept["image"][:, 0, 0, 0].cpu(), torch.arange(4.0))
    procs = [r.proc for r in loader._rings]
    del kept, it
    gc.collect()
    workers_end(procs)

@cuda
def test_pinned_slots_copy_to_a_gpu_without_blocking_and_unlock_when_unmapped():
    """pin_memory=True: every batch is page-locked where it lies (torch sees it pinned), a
    non-blocking copy of it to the GPU is right, and each ring's lock goes with its mapping:
    a lock left behind would make the next ring mapped at that address fail to lock
    (already registered) or be read from stale pages."""
    dev = torch.device("cuda", 0)
    n, b = 64, 8
    for round_ in range(4):  # new rings each round, likely at the addresses just unmapped
        got = []
        with Loader(Numbers(n), decode_big, batch_size=b, device="cpu", workers=2, slots=2,
                    shuffle=False, epochs=1, pin_memory=True) as loader:
            for batch in loader:
                image = batch["image"]
                assert image.is_pinned(), "a batch of a pin_memory loader is not page-locked"
                on_gpu = image.to(dev, non_blocking=True)
                torch.cuda.current_stream(dev).synchronize()  # the copy has run: let it go
                got.append(on_gpu[:, :1024].mean(dim=1).cpu())
                del batch, image
        assert torch.cat(got).tolist() == [float(i) for i in range(n)], f"round {round_}"


@cuda
def test_pinned_batches_dropped_after_a_queued_copy_are_not_refilled_under_it():
    """The DataLoader idiom on pinned slots: copy with non_blocking=True behind a long GPU
    job and drop the batch at once. The loader keeps it until the GPU has run past the copy,
    so its worker cannot refill the slot under it (two slots, one worker: it would at once)."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    n, b = 48, 8
    got = []
    with Loader(Numbers(n), decode_big, batch_size=b, device="cpu", workers=1, slots=2,
                shuffle=False, epochs=1, pin_memory=True) as loader:
        for batch in loader:
            torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time queued before the copy
            image = batch["image"].to(dev, non_blocking=True)
            del batch  # what `x = x.to(...)` does
            got.append(image[:, :1024].mean(dim=1))
        torch.cuda.synchronize(dev)
    assert torch.cat(got).cpu().tolist() == [float(i) for i in range(n)]


class WithALock(Numbers):
    """A dataset that cannot be pickled: it holds a lock."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


def test_a_decode_or_dataset_the_workers_cannot_be_given_is_named():
    with pytest.raises(TypeError, match=r"^decode cannot be sent to the loader's workers.*"
                                        r"Can't pickle local object.*not as a lambda"):
        Loader(Numbers(16), lambda samples, device: decode(samples, device), batch_size=4,
               device="cpu", workers=1)
    with pytest.raises(TypeError, match=r"^the dataset cannot be sent to the loader's workers.*"
                                        r"cannot pickle '_thread.lock'"):
        Loader(WithALock(16), decode, batch_size=4, device="cpu", workers=1)


TRAINER_WITHOUT_A_MAIN_GUARD = r"""
import os, sys
sys.path.insert(0, os.environ["TESTS"])
from gpipe.torch import Loader
from test_torch_loader import Numbers, decode
loader = Loader(Numbers(64), decode, batch_size=4, device="cpu", workers=1, timeout=60)
try:
    next(iter(loader))
except Exception as e:
    print(type(e).__name__, e, flush=True)
    os._exit(0)
"""


def test_a_script_that_makes_its_loader_unguarded_is_told(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"  # each spawned worker imports it, and makes a Loader too
    script.write_text(TRAINER_WITHOUT_A_MAIN_GUARD)
    env = {**os.environ, "TESTS": os.path.dirname(os.path.abspath(__file__))}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("Error decode worker 0"), out.stdout
    assert 'under `if __name__ == "__main__":`' in out.stdout, out.stdout
    assert "bootstrapping phase" in out.stderr  # the worker's own account, on its stderr
    # a decode defined in `python -c` (as in a notebook): the worker cannot find it
    code = TRAINER_WITHOUT_A_MAIN_GUARD.replace(
        "from test_torch_loader import Numbers, decode",
        "from test_torch_loader import Numbers\n"
        "def decode(samples, device): return torch.tensor([s[0] for s in samples])\n"
        "import torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "defined in `python -c` or a notebook cannot be found there" in out.stdout, out.stdout
    assert "Can't get attribute 'decode'" in out.stderr, out.stderr[-3000:]


TRAINER_THAT_IS_KILLED = r"""
import os, sys
sys.path.insert(0, os.environ["TESTS"])
from gpipe.torch import Loader
from test_torch_loader import Numbers, decode
if __name__ == "__main__":
    loader = Loader(Numbers(4000), decode, batch_size=4, device="cpu", workers=2, shuffle=False)
    it = iter(loader)
    next(it)
    print(" ".join(str(r.proc.pid) for r in loader._rings), flush=True)
    sys.stdin.readline()  # until it is killed
"""


def running(pid: int) -> bool:
    """Whether process `pid` runs (not ended, nor a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_the_workers_of_a_killed_trainer_end(tmp_path, child):
    """A trainer killed (OOM, kill -9, a notebook's kernel restart) stops no worker: with no
    consumer left, its ring takes every batch at once, and a worker making batches for no one
    would keep its CPUs busy for good. Each must notice and end."""
    script = tmp_path / "trainer.py"  # a file: spawned workers re-import the main module
    script.write_text(TRAINER_THAT_IS_KILLED)
    trainer = child(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                    env={"TESTS": os.path.dirname(os.path.abspath(__file__))})
    pids = [int(p) for p in trainer.readline(timeout=60).split()]
    assert len(pids) == 2 and all(running(p) for p in pids)
    os.kill(trainer.proc.pid, signal.SIGKILL)  # the trainer alone, not its process group
    trainer.proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"workers {[p for p in pids if running(p)]} outlived their trainer"
        time.sleep(0.1)


LOADER_ON_ANOTHER_GPU = r"""
import ctypes, os, sys, torch
sys.path.insert(0, os.environ["TESTS"])
from gpipe.torch import Loader
from test_torch_loader import Numbers, decode_big
cu = ctypes.CDLL("libcuda.so.1")
def gpu0_context():
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return active.value
if __name__ == "__main__":
    last = torch.cuda.device_count() - 1
    before = gpu0_context()
    # made before the rank picks its GPU, as some DDP scripts do
    with Loader(Numbers(32), decode_big, batch_size=8, device="cpu", workers=1, slots=2,
                shuffle=False, epochs=1, pin_memory=True) as loader:
        torch.cuda.set_device(last)
        got = [b["image"].to("cuda", non_blocking=True)[:, 0].cpu().tolist() for b in loader]
    print("current", torch.cuda.current_device(), "of", last, "gpu0_context", before, gpu0_context(),
          "rows", sum(len(g) for g in got))
"""


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
def test_a_pin_memory_loader_made_before_set_device_pins_on_the_ranks_gpu(tmp_path):
    """A DDP rank that makes its pin_memory Loader before set_device(rank): the Loader's
    torch.cuda.init() makes no context on GPU 0, the rings are locked at the first batch, in
    the rank's device's context, and torch's current device stays the rank's."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"  # a file: spawned workers re-import the main module
    script.write_text(LOADER_ON_ANOTHER_GPU)
    env = {**os.environ, "TESTS": os.path.dirname(os.path.abspath(__file__))}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    last = torch.cuda.device_count() - 1
    words = out.stdout.split()
    assert words[:4] == ["current", str(last), "of", str(last)], out.stdout
    assert words[5:7] == ["0", "0"], f"a context on GPU 0 (before, after): {out.stdout}"
    assert words[7:] == ["rows", "32"], out.stdout


class LaggingStream:
    """A stand-in for a CUDA stream that runs each piece of its work 150 ms late, in order, on
    a thread of its own, with torch.cuda.Event's record/query/synchronize: lets a host test
    see whether the loader lets a pinned batch go before the stream has read it."""

    def __init__(self) -> None:
        self.work: "queue.Queue" = queue.Queue()
        self.ran = 0
        self.queued = 0
        self.cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            k, f = self.work.get()
            time.sleep(0.15)
            f()
            with self.cv:
                self.ran = k
                self.cv.notify_all()

    def put(self, f: Callable[[], None]) -> int:
        self.queued += 1
        self.work.put((self.queued, f))
        return self.queued

    def wait(self, k: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.ran >= k, timeout=30)
            assert self.ran >= k, "the stand-in stream stopped"

    def event(self) -> Any:
        stream = self

        class Event:
            def record(self, _stream: Any = None) -> None:
                self.k = stream.put(lambda: None)

            def query(self) -> bool:
                return stream.ran >= self.k

            def synchronize(self) -> None:
                stream.wait(self.k)

        return Event()


def cuda_on_a_stand_in_stream(monkeypatch) -> "LaggingStream":
    """torch's CUDA calls that a pin_memory Loader makes, on this host: CUDA is said to be
    there, and events are recorded on a LaggingStream, which is returned."""
    stream = LaggingStream()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", stream.event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    return stream


def test_pinned_batches_go_back_only_once_the_stream_has_read_them(monkeypatch):
    """The pin_memory hold, on the host: each batch's 'copy' is queued on a stream that runs
    150 ms late and reads the slot's memory by address only (as a DMA does, holding no
    reference), and the caller drops the batch at once. A batch let go before its event was
    waited for would be refilled under the copy (two slots, one worker); the last one, left
    in the loader at the end of the `with`, would be unmapped under it."""
    stream = cuda_on_a_stand_in_stream(monkeypatch)
    real = gpipe.Consumer
    unmapped = threading.Event()
    closed_after: list[int] = []  # how much of the stream had run when a ring was closed

    class Watched:
        """The loader's consumer, without the page-lock (no driver here; the hold is what this
        test is about), noting when it is closed."""

        def __init__(self, *a: Any, pin_memory: bool = False, **k: Any) -> None:
            self.inner = real(*a, **k)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def close(self) -> None:
            closed_after.append(stream.ran)
            unmapped.set()
            self.inner.close()

    monkeypatch.setattr(gpipe, "Consumer", Watched)

    def read(address: int) -> None:  # no read of memory the loader has unmapped
        got.append(float("nan") if unmapped.is_set() else ctypes.c_float.from_address(address).value)

    n, b = 48, 8
    got: list[float] = []
    with Loader(Numbers(n), decode_big, batch_size=b, device="cpu", workers=1, slots=2,
                shuffle=False, epochs=1, pin_memory=True) as loader:
        for batch in loader:
            # sample 0 of the batch, its first float
            last = stream.put(lambda a=batch["image"].data_ptr(): read(a))
            del batch
    assert closed_after and min(closed_after) >= last, "the ring was closed before its last copy ran"
    stream.wait(stream.queued)
    assert got == [float(i) for i in range(0, n, b)]


def test_pin_memory_without_a_cuda_gpu_warns_and_carries_on(monkeypatch):
    # as torch's DataLoader: a warning, and batches in pageable memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="sees no CUDA GPU here: the batches stay in pageable") as w:
        loader = Loader(Numbers(16), decode, batch_size=4, device="cpu", workers=1, epochs=1,
                        shuffle=False, pin_memory=True)
    assert w[0].filename == __file__  # the caller's line
    with loader:
        assert not loader.pin_memory
        got = [int(x) for batch in loader for x in batch["index"]]
    assert got == list(range(16))


class _RefusedLock:
    """A consumer attached with pin_memory="try" where the driver refused the lock: the real
    consumer, unpinned, saying why."""

    pinned = False
    pin_refused = ("pin_memory: CUDA could not page-lock the ring's 2 MiB on device 0 "
                   "(a stand-in refusal)")

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def _refuse_page_locks(monkeypatch) -> list:
    """pin_memory on this host: torch's CUDA calls stand in, and an attach that asks for the
    page-lock is refused it as the driver would refuse; returns the sockets of those
    attaches."""
    cuda_on_a_stand_in_stream(monkeypatch)
    real = gpipe.Consumer
    tried: list[str] = []

    def refusing(sock: str, *a: Any, pin_memory: Any = False, **k: Any) -> Any:
        if not pin_memory:
            return real(sock, *a, **k)
        assert pin_memory == "try", "the loader must keep its attach where the lock is refused"
        tried.append(sock)
        joined = real(sock, *a, **k)
        time.sleep(0.3)  # the page-lock's time: long enough for the worker to publish
        return _RefusedLock(joined)

    monkeypatch.setattr(gpipe, "Consumer", refusing)
    return tried


def test_a_ring_that_cannot_be_page_locked_is_read_unpinned_and_loses_no_batch(monkeypatch):
    """pin_memory where the driver refuses to page-lock a ring: the attach has joined the ring
    (the page-lock runs after the handshake) and stands, reading the ring unlocked. The loader
    warns, tries no other ring, and every batch comes, in order."""
    tried = _refuse_page_locks(monkeypatch)
    n, b = 64, 4
    with pytest.warns(UserWarning, match=r"the ring of decode worker \d could not be page-locked.*"
                                         r"a stand-in refusal") as w:
        with Loader(Numbers(n), decode, batch_size=b, device="cpu", workers=2, shuffle=False,
                    epochs=1, timeout=60, pin_memory=True) as loader:
            got = [int(i) for batch in loader for i in batch["index"]]
    assert got == list(range(n))
    assert len(tried) == 1, tried
    assert [x.filename for x in w] == [__file__]  # once, at the caller's line


def test_a_page_lock_warning_made_an_error_still_leaves_the_ring_usable(monkeypatch):
    # python -W error: the warning raises from the loop, and the worker must still publish
    # to the attach that was kept
    _refuse_page_locks(monkeypatch)
    n, b = 64, 4
    with Loader(Numbers(n), decode, batch_size=b, device="cpu", workers=1, shuffle=False,
                epochs=1, timeout=60, pin_memory=True) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="could not be page-locked"):
                next(iter(loader))
        got = [int(i) for batch in loader for i in batch["index"]]
    assert got == list(range(n))


def test_an_attach_error_that_is_not_the_page_lock_is_raised(monkeypatch):
    _refuse_page_locks(monkeypatch)
    monkeypatch.setattr(gpipe, "Consumer", lambda *a, **k: (_ for _ in ()).throw(
        # its text names pin_memory: the loader goes by the class (PinError), not the text
        gpipe.AttachError("the producer refused the attach of a pin_memory consumer: the ring is full")))
    with Loader(Numbers(16), decode, batch_size=4, device="cpu", workers=1, timeout=60,
                pin_memory=True) as loader:
        with pytest.raises(gpipe.AttachError, match="the ring is full"):
            next(iter(loader))


class Unreadable(Numbers):
    """Sample 21 cannot be read: the worker's read-ahead thread raises."""

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == 21:
            raise OSError("sample 21: input/output error")
        return super().__getitem__(i)


def test_a_sample_that_cannot_be_read_names_its_batch():
    with Loader(Unreadable(64), decode, batch_size=4, device="cpu", workers=1,
                shuffle=False) as loader:
        with pytest.raises(gpipe.Error, match=r"decode worker 0 failed on batch 5 \(epoch 0\): "
                           r"OSError: sample 21: input/output error"):
            for _ in loader:
                pass
