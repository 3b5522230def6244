"""The write rule: a consumer's batch is read-only, so no consumer can change what another
reads. Private copies are writable."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

import gpipe

READER = """
import json, sys, numpy as np, gpipe
c = gpipe.Consumer(sys.argv[1])
print("attached", flush=True)
sums = []
for b in c:
    with b:
        sums.append(int(np.from_dlpack(b).sum()))
print(json.dumps(sums), flush=True)
"""


@pytest.mark.parametrize("mode", ["broadcast", "shared"])
def test_numpy_arrays_of_a_batch_are_read_only(make_ring, mode):
    p, c = make_ring(slots=2, mode=mode)
    p.send(np.arange(8))
    with c.recv(timeout=5) as b:
        x = np.from_dlpack(b)
        assert not x.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            x[0] = 1
        with pytest.raises(ValueError):
            x.setflags(write=True)
        # A private copy is writable and leaves the batch alone.
        y = np.from_dlpack(b.copy())
        z = np.from_dlpack(b, copy=True)
        y[0] = 100
        z[1] = 200
        assert y.flags.writeable and z.flags.writeable
        assert x[0] == 0 and x[1] == 1


def test_a_consumer_that_writes_through_a_raw_pointer_dies_alone(sock, child):
    p = gpipe.Producer(sock, backend="host", slots=4, batch_bytes=1 << 20, mode="broadcast")
    writer = child(
        """
        import ctypes, sys, gpipe
        c = gpipe.Consumer(sys.argv[1])
        print("attached", flush=True)
        b = c.recv()
        ptr = b["data"].data_ptr
        print("writing", flush=True)
        ctypes.memset(ptr, 0xff, 64)   # the slot is mapped read-only: SIGSEGV
        print("wrote", flush=True)
        """,
        sock,
    )
    readers = [child(READER, sock) for _ in range(2)]
    for k in [writer, *readers]:
        assert k.readline() == "attached"
    p.wait_for_consumers(3, timeout=10)
    for i in range(20):
        p.send(np.full(512, i, dtype=np.int64), timeout=10)
    assert writer.readline() == "writing"
    rc, out, _ = writer.wait()
    assert rc == -signal.SIGSEGV, (rc, out)
    assert "wrote" not in out
    p.close()
    for r in readers:
        rc, out, err = r.wait()
        assert rc == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == [512 * i for i in range(20)]


def test_torch_tensors_of_a_batch(make_ring):
    torch = pytest.importorskip("torch")
    p, c = make_ring(slots=2)
    p.send(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    with c.recv(timeout=5) as b:
        t = torch.from_dlpack(b)
        assert t.dtype == torch.float32 and t.shape == (2, 3)
        assert t.sum().item() == 15
        mine = torch.from_dlpack(b.copy())
        mine += 1  # a private copy: writable
        assert mine.sum().item() == 21 and t.sum().item() == 15
