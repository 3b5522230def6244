"""When a slot goes back to the producer: batches held together, tensors outliving batches,
the deadlock check, and timeouts."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import gpipe


def send(p, i):
    return p.send(np.full(16, i, dtype=np.int64), timeout=5)


def slot_is_held(p) -> bool:
    """True when the producer cannot get its next slot now."""
    try:
        with p.acquire(timeout=0.1):
            return False
    except gpipe.Timeout:
        return True


@pytest.mark.parametrize("mode", ["broadcast", "shared"])
def test_several_batches_held_and_released_out_of_order(make_ring, mode):
    p, c = make_ring(mode=mode)
    for i in range(4):
        send(p, i)
    held = [c.recv(timeout=5) for _ in range(4)]
    assert [b.seq for b in held] == [0, 1, 2, 3]
    assert c.held == 4
    assert slot_is_held(p)
    held[2].release()
    with held[0]:
        assert np.from_dlpack(held[0])[0] == 0
    assert held[0].released and c.held == 2
    # Slot 0 is free again, slot 1 is not.
    send(p, 4)
    assert slot_is_held(p)
    held[3].release()
    held[1].release()
    b = c.recv(timeout=5)
    assert b.seq == 4 and np.from_dlpack(b)[0] == 4
    b.release()


def test_a_tensor_that_outlives_its_batch_keeps_the_slot(make_ring):
    p, c = make_ring(slots=1)
    send(p, 1)
    with c.recv(timeout=5) as b:
        x = np.from_dlpack(b)
    assert b.released
    # The batch is released but x still points into slot 0: the producer must not reuse it.
    assert slot_is_held(p)
    assert x[0] == 1
    assert c.held == 1
    del x
    gc.collect()
    assert c.held == 0
    assert not slot_is_held(p)


def test_a_view_object_and_a_dropped_batch(make_ring):
    p, c = make_ring(slots=2)
    send(p, 5)
    b = c.recv(timeout=5)
    view = b["data"]
    del b
    gc.collect()
    # The gpipe.Tensor view still holds the slot; the batch object itself is gone.
    assert c.held == 1
    assert np.from_dlpack(view)[3] == 5
    del view
    gc.collect()
    assert c.held == 0


def test_a_released_batch_makes_no_new_tensors(make_ring):
    p, c = make_ring()
    send(p, 1)
    b = c.recv(timeout=5)
    b.release()
    b.release()  # twice is fine
    with pytest.raises(gpipe.Error, match="released"):
        np.from_dlpack(b)
    assert "released" in repr(b)


@pytest.mark.parametrize("mode", ["broadcast", "shared"])
def test_holding_every_slot_and_asking_for_one_more_raises_deadlock(make_ring, mode):
    p, c = make_ring(slots=2, mode=mode)
    send(p, 0)
    send(p, 1)
    a, b = c.recv(timeout=5), c.recv(timeout=5)
    t0 = time.monotonic()
    with pytest.raises(gpipe.Deadlock, match="holds batch 0"):
        c.recv()
    assert time.monotonic() - t0 < 1.0
    # Through a tensor as well.
    x = np.from_dlpack(a)
    a.release()
    with pytest.raises(gpipe.Deadlock):
        c.recv()
    del x
    gc.collect()
    with pytest.raises(gpipe.Timeout):
        c.recv(timeout=0.05)
    b.release()


def test_recv_timeout(make_ring):
    p, c = make_ring()
    for t in (0.0, 0.05, 0.3):
        t0 = time.monotonic()
        with pytest.raises(gpipe.Timeout):
            c.recv(timeout=t)
        took = time.monotonic() - t0
        assert t <= took < t + 1.0, (t, took)
    with pytest.raises(ValueError):
        c.recv(timeout=-1)
    # Nothing was lost by timing out.
    send(p, 3)
    assert c.recv(timeout=5).seq == 0


def test_iteration_ends_when_the_producer_closes(sock, child):
    p = gpipe.Producer(sock, backend="host", slots=4, batch_bytes=1 << 20)
    ch = child(
        """
        import sys, numpy as np, gpipe
        got = []
        for b in gpipe.Consumer(sys.argv[1]):
            with b:
                got.append(int(np.from_dlpack(b)[0]))
        print(got, flush=True)
        """,
        sock,
    )
    p.wait_for_consumers(1, timeout=10)
    for i in range(10):
        send(p, i)
    p.close()
    rc, out, err = ch.wait()
    assert rc == 0, err
    assert out.strip() == str(list(range(10)))


def test_acquire_is_one_slot_at_a_time_and_with_gives_back(sock):
    p = gpipe.Producer(sock, backend="host", slots=2, batch_bytes=1 << 20)
    s = p.acquire()
    with pytest.raises(gpipe.Error, match="still open"):
        p.acquire()
    s.abandon()
    with p.acquire() as s2:
        assert s2.seq == 0
    # Leaving the block without publish gives the slot back.
    with p.acquire() as s3:
        assert s3.seq == 0
        s3.tensor("x", "uint8", (4,))
        assert s3.publish() == 0
    assert p.next_seq == 1
    with pytest.raises(gpipe.Error, match="published"):
        s3.tensor("y", "uint8", (4,))
    p.close()


def test_under_detach_after_ms_a_held_tensor_gets_its_consumer_detached(make_ring):
    """detach_after_ms: instead of waiting for a consumer that keeps a slot (through a tensor),
    the producer detaches it and goes on; the consumer learns it at its next call."""
    p, c = make_ring(slots=2, detach_after_ms=200)
    send(p, 0)
    b = c.recv(timeout=5)
    x = np.from_dlpack(b)  # holds slot 0
    b.release()
    send(p, 1)
    t0 = time.monotonic()
    send(p, 2)  # needs slot 0: waits 200 ms, then detaches the consumer
    assert 0.15 < time.monotonic() - t0 < 5
    with pytest.raises(gpipe.Detached):
        c.recv(timeout=5)
    del x


@pytest.mark.parametrize("mode", ["broadcast", "shared"])
def test_a_mirroring_consumer_holds_more_batches_than_the_ring_has_slots(make_ring, mode):
    p, c = make_ring(slots=2, mode=mode, consumer={"delivery": "mirror", "mirror_buffers": 5})
    assert c.delivery == "mirror"
    held = []
    for i in range(5):
        # Each slot is released as soon as its batch is copied: the producer never waits.
        send(p, i)
        held.append(c.recv(timeout=5))
    assert c.held == 5
    assert [int(np.from_dlpack(b)[0]) for b in held] == [0, 1, 2, 3, 4]
    send(p, 5)
    with pytest.raises(gpipe.Deadlock, match="mirror buffers"):
        c.recv(timeout=5)
    # Nothing was lost: batch 5 stayed in the ring until a buffer was free.
    held.pop(0).release()
    b = c.recv(timeout=5)
    assert b.seq == 5 and np.from_dlpack(b)[0] == 5
    b.release()
    for b in held:
        b.release()


def test_delivery_is_checked_and_reported(make_ring, sock):
    p, c = make_ring()
    assert c.delivery == "in-place"
    with pytest.raises(ValueError, match="in-place, mirror or auto"):
        gpipe.Consumer(sock, delivery="copy")
    with pytest.raises(ValueError, match="mirror_buffers"):
        gpipe.Consumer(sock, delivery="mirror", mirror_buffers=0)
