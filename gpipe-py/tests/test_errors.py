"""Bad arguments and misuse get clear errors, never a crash; reprs say what things are."""

from __future__ import annotations

import numpy as np
import pytest

import gpipe


@pytest.fixture
def ring(make_ring):
    return make_ring(slots=2)


def test_exception_classes_form_one_hierarchy():
    for cls in (gpipe.ProducerDied, gpipe.Closed, gpipe.AttachError, gpipe.Detached,
                gpipe.Timeout, gpipe.Deadlock, gpipe.ProtocolError, gpipe.BackendError):
        assert issubclass(cls, gpipe.Error)
    assert issubclass(gpipe.Error, Exception)


def test_attach_to_nothing(sock):
    with pytest.raises(gpipe.AttachError, match="no producer is listening"):
        gpipe.Consumer(sock)


def test_producer_arguments(sock):
    with pytest.raises(ValueError, match="unknown mode"):
        gpipe.Producer(sock, backend="host", mode="fanout")
    with pytest.raises(ValueError, match="unknown backend"):
        gpipe.Producer(sock, backend="tpu")
    with pytest.raises(ValueError, match="^slots: "):
        gpipe.Producer(sock, backend="host", slots=0)
    with pytest.raises(ValueError, match="^max_consumers: "):
        gpipe.Producer(sock, backend="host", max_consumers=64)
    with pytest.raises(ValueError, match="^slots must be"):
        gpipe.Producer(sock, backend="host", slots=-1)
    with pytest.raises(ValueError):
        gpipe.Producer(sock, backend="host", device=-1)
    with pytest.raises(ValueError, match="unknown timeline memory.*expected host or device"):
        gpipe.Producer(sock, backend="host", timeline_memory="gpu")


def test_a_second_producer_on_a_live_socket(ring, sock):
    with pytest.raises(ValueError, match="already listening"):
        gpipe.Producer(sock, backend="host")


def test_slot_tensor_arguments(ring):
    p, _ = ring
    with p.acquire() as s:
        with pytest.raises(ValueError, match="unknown dtype"):
            s.tensor("x", "float8", (2,))
        with pytest.raises(ValueError, match="unknown dtype"):
            s.tensor("x", float, (2,))
        with pytest.raises(ValueError, match="beyond the slot capacity"):
            s.tensor("x", "float32", (1024, 1024))
        with pytest.raises(ValueError, match="dimensions"):
            s.tensor("x", "uint8", (1,) * 9)
        with pytest.raises(ValueError, match="negative"):
            s.tensor("x", "uint8", (4, 4), (-4, 1))
        with pytest.raises(ValueError, match="strides"):
            s.tensor("x", "uint8", (4, 4), (1,))
        with pytest.raises(ValueError, match="name"):
            s.tensor("", "uint8", (4,))
        with pytest.raises(ValueError, match="name"):
            s.tensor("n" * 33, "uint8", (4,))
        with pytest.raises(ValueError, match="not declared"):
            s.tensor("x")
        t = s.tensor("x", np.float32, (2, 2))
        assert s.tensor("x").data_ptr == t.data_ptr
        assert s.tensor("x", "float32").data_ptr == t.data_ptr
        with pytest.raises(ValueError, match="already declared"):
            s.tensor("x", "int32", (2, 2))
        for i in range(gpipe.MAX_TENSORS - 1):
            s.tensor(f"t{i}", "uint8", (1,))
        with pytest.raises(ValueError, match="at most"):
            s.tensor("one_more", "uint8", (1,))
        with pytest.raises(ValueError, match="at most 8"):
            s.publish(meta=list(range(9)))
        with pytest.raises(ValueError, match=r"meta\[0\] must be"):
            s.publish(meta=[-1])
        with pytest.raises(ValueError, match="shorter"):
            s.publish(nbytes=1)
        assert "open" in repr(s)


def test_publish_needs_content(ring):
    p, _ = ring
    with p.acquire() as s:
        with pytest.raises(ValueError, match="nothing to publish"):
            s.publish()
        with pytest.raises(ValueError, match="exceeds the slot capacity"):
            s.publish(nbytes=(2 << 20) + 1)


def test_batch_misuse(ring):
    p, c = ring
    p.send({"a": np.zeros(3), "b": np.ones(2)})
    b = c.recv(timeout=5)
    with pytest.raises(KeyError, match='no tensor "c"'):
        b["c"]
    with pytest.raises(BufferError, match="2 tensors"):
        np.from_dlpack(b)
    with pytest.raises(BufferError, match="device"):
        b["a"].__dlpack__(dl_device=(2, 0))
    assert b["a"].__dlpack_device__() == (1, 0)
    assert "seq=0" in repr(b) and "held" in repr(b)
    assert "float64" in repr(b["a"]) and "read-only" in repr(b["a"])
    b.release()


def test_wrong_device_for_a_host_ring(ring, sock):
    with pytest.raises(ValueError, match="host memory"):
        gpipe.Consumer(sock, device=0)


def test_closed_objects(ring, sock):
    p, c = ring
    c.close()
    assert c.closed and "closed" in repr(c)
    with pytest.raises(gpipe.Closed, match="is closed"):
        c.recv(timeout=1)
    p.close()
    assert p.closed and "closed" in repr(p)
    with pytest.raises(gpipe.Closed):
        p.acquire(timeout=1)
    with pytest.raises(gpipe.Closed):
        p.send(np.zeros(1))


def test_send_of_unsupported_objects(ring):
    p, _ = ring
    with pytest.raises((TypeError, BufferError, AttributeError)):
        p.send(object())
    # The failed send gave its slot back.
    assert p.next_seq == 0
    assert p.send(np.zeros(4)) == 0


def test_spin_is_checked_and_a_spinning_consumer_receives(ring):
    p, _ = ring
    for bad in (-0.1, 2.0, float("nan")):
        with pytest.raises(ValueError, match="spin"):
            gpipe.Consumer(p.socket, spin=bad)
    with gpipe.Consumer(p.socket, spin=0.01) as c:
        p.wait_for_consumers(2, timeout=5)
        p.send(np.arange(4, dtype=np.int32))
        with c.recv(timeout=5) as b:
            assert np.from_dlpack(b).tolist() == [0, 1, 2, 3]


def test_max_lead_holds_the_producer_back_before_the_ring_is_full(make_ring):
    for bad in (0, -1, "fast"):
        with pytest.raises(ValueError, match="max_lead"):
            make_ring(max_lead=bad)
    with pytest.raises(TypeError, match="max_lead"):
        make_ring(max_lead=1.5)
    p, c = make_ring(slots=4, max_lead=1)
    assert p.max_lead == 1
    p.send(np.zeros(4, dtype=np.int32))
    b = c.recv(timeout=5)
    with pytest.raises(gpipe.Timeout):  # three slots free, but batch 0 is not consumed
        p.acquire(timeout=0.2)
    b.release()
    assert p.send(np.ones(4, dtype=np.int32)) == 1
    with c.recv(timeout=5) as b:
        assert b.seq == 1 and np.from_dlpack(b).tolist() == [1, 1, 1, 1]


def test_max_lead_auto_on_a_host_ring_is_the_rings_own_bound(make_ring):
    p, c = make_ring(slots=2, max_lead="auto")
    assert p.max_lead is None
    for i in range(2):  # both slots may be in flight
        p.send(np.full(4, i, dtype=np.int32))
    with c.recv(timeout=5) as b:
        assert b.seq == 0
