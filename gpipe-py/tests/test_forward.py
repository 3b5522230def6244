"""gpipe.forward: a ring re-published as another ring (issue #20's building block), and
gpipe.fanout_plan. Host rings here; tests/test_gpu.py forwards a GPU ring to another GPU."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gpipe


def attach_when_up(path, tries):
    """A consumer of the ring at `path`, once its producer (a forwarder starting in a thread)
    listens: `tries` attempts 20 ms apart."""
    for _ in range(tries):
        try:
            return gpipe.Consumer(path, timeout=5)
        except gpipe.AttachError:
            threading.Event().wait(0.02)
    return None


def test_forward_republishes_every_batch_with_its_tensors(sock):
    down = sock.replace(".sock", "-b.sock")
    p = gpipe.Producer(sock, slots=4, batch_bytes=1 << 20, backend="host")
    result = {}

    def run():
        try:
            result["report"] = gpipe.forward(sock, down, slots=4, wait_for_consumers=1)
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    p.wait_for_consumers(1, timeout=10)
    # The forwarder binds its ring, then waits for our consumer there.
    c = attach_when_up(down, 200)
    assert c is not None, "the forwarded ring never came up"
    n = 50
    got = []

    def consume():
        with c:
            for b in c:
                with b:
                    got.append((b.seq, np.from_dlpack(b["x"]).copy(), b.meta))

    ct = threading.Thread(target=consume)
    ct.start()
    for i in range(n):
        p.send({"x": np.full((4, 8), i, dtype=np.float32)}, meta=[i, 7], timeout=10)
    p.close()
    t.join(30)
    ct.join(30)
    assert not t.is_alive() and not ct.is_alive()
    assert "error" not in result, result
    assert result["report"]["batches"] == n
    assert [s for s, _, _ in got] == list(range(n))
    for i, (_, x, h) in enumerate(got):
        assert x.shape == (4, 8) and (x == i).all()
        assert h[:2] == (i, 7)


def test_forward_from_nothing_raises_a_clear_error(sock):
    with pytest.raises(gpipe.Error, match="connect|No such file|not found|attach"):
        gpipe.forward(sock, sock.replace(".sock", "-b.sock"))


def test_fanout_plan_shapes():
    p = gpipe.fanout_plan([0, 1, 2, 3], shape="chain")
    assert p["shape"] == "chain"
    assert [(r["device"], r["parent"]) for r in p["rings"]] == [(0, None), (1, 0), (2, 1), (3, 2)]
    assert p["consumer_ring"] == [0, 1, 2, 3] and p["depth"] == 3
    t = gpipe.fanout_plan(list(range(8)), shape="tree")
    assert max(sum(r["parent"] == i for r in t["rings"]) for i in range(8)) == 2
    assert gpipe.fanout_plan([0, 1], shape="auto")["shape"] == "direct"
    # Two or more other GPUs: a chain of whole-batch forwarders at every size (measured fastest).
    for size in (2 << 20, 64 << 20, 256 << 20):
        p = gpipe.fanout_plan([1, 2, 3], shape="auto", batch_bytes=size)
        assert p["shape"] == "chain" and p["chunk_bytes"] is None, (size, p)
    with pytest.raises(ValueError, match="direct, chain"):
        gpipe.fanout_plan([1], shape="ring")


def test_fanout_plan_chunks_one_large_batch_at_a_time_across_a_chain():
    gb = 3 << 30  # a weight update
    p = gpipe.fanout_plan([1, 2, 3], batch_bytes=gb, one_at_a_time=True)
    assert p["shape"] == "chain" and p["chunk_bytes"] == 64 << 20
    assert gpipe.fanout_plan([1, 2, 3], batch_bytes=gb)["chunk_bytes"] is None  # a stream
    # One forwarder copies a batch once either way; a batch of one chunk is not cut.
    assert gpipe.fanout_plan([1], shape="chain", batch_bytes=gb, one_at_a_time=True)["chunk_bytes"] is None
    assert gpipe.fanout_plan([1, 2, 3], batch_bytes=64 << 20, one_at_a_time=True)["chunk_bytes"] is None


def test_forward_whose_upstream_dies_raises_and_its_consumers_see_the_producer_die(sock, child):
    """In-process: when the upstream producer is SIGKILLed, gpipe.forward raises and leaves
    its ring as a dead producer would, so its consumers get ProducerDied at once (not a clean
    end), though the forwarding process goes on."""
    down = sock.replace(".sock", "-b.sock")
    up = child(
        """
import sys, numpy as np, gpipe
p = gpipe.Producer(sys.argv[1], slots=4, batch_bytes=1 << 20, backend="host")
print("ready", flush=True)
i = 0
while True:
    p.send({"x": np.full(8, i, dtype=np.int64)}, meta=[i])
    i += 1
""",
        sock,
    )
    assert up.readline(timeout=30) == "ready"
    result = {}

    def run():
        try:
            result["report"] = gpipe.forward(sock, down, slots=4, wait_for_consumers=1)
        except gpipe.Error as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    c = attach_when_up(down, 500)
    assert c is not None, "the forwarded ring never came up"
    got = []
    died = None
    with c:
        while True:
            try:
                b = c.recv(timeout=10)
            except gpipe.ProducerDied as e:
                died = e
                break
            with b:
                got.append(b.meta[0])
            if len(got) == 50:
                up.kill()
    t.join(10)
    assert not t.is_alive()
    assert died is not None
    assert "error" in result and "upstream" in str(result["error"]), result
    # What arrived came in order, every batch from the first the forwarder took.
    assert got == list(range(got[0], got[0] + len(got)))


def test_slots_auto_on_the_host_is_eight_and_says_why(sock):
    with gpipe.Producer(sock, slots="auto", batch_bytes=1 << 20, backend="host") as p:
        assert p.slots == 8
        assert p.slots_auto == "8 slots: the host backend"
    with gpipe.Producer(sock + "2", slots=4, batch_bytes=1 << 20, backend="host") as p:
        assert p.slots == 4 and p.slots_auto is None
    with pytest.raises(ValueError, match="slots must be"):
        gpipe.Producer(sock, slots="deep", backend="host")
    with pytest.raises(ValueError, match="^slots: "):
        gpipe.Producer(sock, slots=0, backend="host")


def test_a_chain_of_chunked_forwarders_hands_on_every_batch_whole(sock):
    """Two forwarders with chunk=256 KiB (8 chunks of a 2 MiB slot) one after the other: the
    second copies a batch's chunks as they land in the first's ring; the consumer at the end
    still sees every batch whole, in order."""
    mid, end = sock.replace(".sock", "-m.sock"), sock.replace(".sock", "-e.sock")
    p = gpipe.Producer(sock, slots=4, batch_bytes=1 << 20, backend="host")
    reports = {}

    def run(name, up, down):
        try:
            reports[name] = gpipe.forward(up, down, slots=4, wait_for_consumers=1, chunk=256 << 10)
        except BaseException as e:  # noqa: BLE001 - reported below
            reports[name] = e

    first = threading.Thread(target=run, args=("first", sock, mid), daemon=True)
    first.start()
    p.wait_for_consumers(1, timeout=10)
    second = threading.Thread(target=run, args=("second", mid, end), daemon=True)
    second.start()
    c = attach_when_up(end, 200)
    assert c is not None, "the second forwarded ring never came up"
    n, got = 40, []

    def consume():
        with c:
            for b in c:
                with b:
                    x = np.from_dlpack(b["x"])
                    got.append((b.seq, bool((x == b.meta[0]).all()), x.size))
                    del x  # a view keeps the batch (and so the rings) from closing

    ct = threading.Thread(target=consume)
    ct.start()
    for i in range(n):
        p.send({"x": np.full(1 << 17, i, dtype=np.int64)}, meta=[i], timeout=10)
    p.close()
    for t in (first, second, ct):
        t.join(30)
        assert not t.is_alive()
    for name in ("first", "second"):
        assert isinstance(reports[name], dict), reports[name]
        assert reports[name]["batches"] == n, reports[name]
    assert [s for s, _, _ in got] == list(range(n))
    assert all(ok and size == 1 << 17 for _, ok, size in got), got[:3]


@pytest.mark.parametrize("chunk", [0, -1, "1MiB", 1.5])
def test_forward_refuses_a_chunk_that_is_not_a_size(sock, chunk):
    with pytest.raises((ValueError, TypeError), match="chunk"):
        gpipe.forward(sock, sock.replace(".sock", "-b.sock"), chunk=chunk)
