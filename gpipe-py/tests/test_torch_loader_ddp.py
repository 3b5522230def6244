"""gpipe.torch.Loader's `auto` under DDP (torch.distributed initialised, gloo on the host): the
ranks decide their workers together, from every rank's window, and keep the same number; a
Loader made on one rank only decides alone once its peers' figures do not come."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from gpipe import _loader_peers
from gpipe._loader_peers import Window, view
from gpipe.torch import Loader

from test_torch_loader import Numbers, decode_50ms, order

# Each worker makes a batch every 50 ms; a step takes 20 ms of the trainer's own time, then the
# all-reduce (DDP's), where a rank waits for the slower one. One trainer settles at 3 workers
# (2.5x, a tenth over: 2 then 3); a rank alone cannot tell the all-reduce's wait from its own time.
STEP_S = 0.020


def _rank(rank: int, world: int, init: str, n: int, seed: int, one_loader_only: bool, out) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        flag = torch.zeros(1)
        if one_loader_only and rank != 0:
            dist.barrier()  # rank 0 alone makes a Loader; this one waits for it to finish
            out.put((rank, None, None, None))
            return
        if one_loader_only:
            _loader_peers.LATE_S = 5.0  # its 60 s would outlast the test's watchdog
        deadline = time.monotonic() + 90
        with Loader(Numbers(n), decode_50ms, batch_size=4, device="cpu", max_workers=4,
                    seed=seed) as loader:
            epochs, settled_for = [], 0
            while settled_for < 2 * 16:  # settled over two windows in a row, on every rank
                assert time.monotonic() < deadline, f"rank {rank}: auto did not settle: {loader.why}"
                seen = []
                for batch in loader:
                    seen.extend(batch["index"].tolist())
                    del batch
                    time.sleep(STEP_S)
                    if not one_loader_only:
                        flag[0] = 0 if loader.settled else 1
                        dist.all_reduce(flag)  # lockstep, as DDP's gradients are
                        settled_for = settled_for + 1 if flag[0] == 0 else 0
                    else:
                        settled_for = settled_for + 1 if loader.settled else 0
                    if settled_for >= 2 * 16:
                        break
                epochs.append(seen)
            mine = len(loader) * 4  # the last epoch, broken out of, is whole as far as it went
            whole = all(s == order(n, seed, e)[rank:(n // world) * world:world][:mine][:len(s)]
                        and (len(s) == mine or e == len(epochs) - 1)
                        for e, s in enumerate(epochs))
            out.put((rank, loader.workers, loader.why, whole))
        if one_loader_only:
            dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, None, f"{type(e).__name__}: {e}", False))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(tmp_path, one_loader_only: bool) -> dict:
    """Two ranks in processes of their own (a process group of their own), within a watchdog
    that kills them both; each rank's (workers, why, whole epochs)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path}/pg"
    procs = [ctx.Process(target=_rank, args=(r, 2, init, 4000, 9, one_loader_only, out), daemon=False)
             for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + 110  # within conftest's 120 s watchdog
        while len(got) < 2:
            left = deadline - time.monotonic()
            assert left > 0, f"the ranks did not finish: {got}"
            try:
                rank, workers, why, whole = out.get(timeout=min(left, 5.0))
            except Exception:  # queue.Empty: a rank may have died
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"rank(s) died: {[(p.pid, p.exitcode) for p in dead]}; {got}"
                continue
            got[rank] = (workers, why, whole)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
    return got


def test_ddp_ranks_decide_their_workers_together_and_keep_the_same_number(tmp_path):
    got = run_ranks(tmp_path, one_loader_only=False)
    (w0, why0, whole0), (w1, why1, whole1) = got[0], got[1]
    assert w0 is not None and w1 is not None, got
    assert w0 == w1, f"the ranks kept different numbers of workers: {got}"
    # 3 feed a 20 ms step from 50 ms workers; a fourth only where noise called for one
    assert 3 <= w0 <= 4, got
    # the same decisions, at batches a step or two apart
    assert "they decide together" in why0, got
    assert re.sub(r"batch \d+", "batch N", why0) == re.sub(r"batch \d+", "batch N", why1), got
    assert whole0 and whole1, got


def test_a_loader_on_one_rank_only_decides_alone_once_its_peers_figures_do_not_come(tmp_path):
    got = run_ranks(tmp_path, one_loader_only=True)
    w0, why0, whole0 = got[0]
    assert w0 is not None, got
    assert "figures had not come" in why0 and "so this rank decides alone from batch" in why0, why0
    assert whole0, got


def test_the_jobs_view_is_the_most_starved_ranks_window_with_the_slowest_rate_and_lowest_limit():
    # rank 1 waited 60% of its span: its time not waiting (0.4 s) is the step's own; rank 0's
    # 0.9 s includes its wait in the all-reduce for rank 1
    ranks = [Window(0.1, 1.0, 30.0, 16, 15), Window(0.6, 1.0, 12.0, 16, 7), Window(0.0, 1.1, 20.0, 16, 9)]
    assert view(ranks) == Window(0.6, 1.0, 12.0, 16, 7)
    # a rank whose workers' rate is not known yet leaves the job's unknown
    assert view([Window(0.1, 1.0, None, 16, 4), Window(0.0, 1.0, 9.0, 16, 4)]).rate is None
    # the order of the ranks does not change the view: every rank computes the same
    assert view(ranks[::-1]) == view(ranks)
    # workers of two kinds on every rank: the slowest newest kind's rate; else one kind
    assert view([Window(0.1, 1.0, 9.0, 16, 4, 2.5), Window(0.0, 1.0, 9.0, 16, 4, 2.0)]).each == 2.0
    assert view([Window(0.1, 1.0, 9.0, 16, 4, 2.5), Window(0.0, 1.0, 9.0, 16, 4)]).each is None


@pytest.mark.parametrize("windows", [3, 20])
def test_the_last_rank_to_close_leaves_nothing_of_the_exchange_in_the_store(windows):
    # two ranks' exchanges on one store, as two DDP ranks' Loaders: each window published by
    # both and gathered by both; rank 1 published one more that rank 0 never saw
    store = dist.HashStore()
    store.set("the job's own", "kept")
    ranks = [_loader_peers.Peers(store, r, 2, "store-test") for r in range(2)]
    ranks[1]._prefix = ranks[0]._prefix  # the same Loader in two processes: here, one
    w = Window(0.0, 1.0, 10.0, 16, 4)
    for k in range(windows):
        for p in ranks:
            p.publish(w, k * 16)
        for p in ranks:
            assert p.gathered() == [w, w]
    ranks[1].publish(w, windows * 16)
    ranks[0].close()
    assert store.num_keys() > 1, "the first rank to close deleted what its peer may still read"
    ranks[1].close()
    assert store.num_keys() == 1 and store.get("the job's own") == b"kept"
