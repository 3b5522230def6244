"""PyTorch on the host backend: tensors over the slot, send() of torch tensors, and the
IterableDataset. Skipped where torch is not installed (CI); run on the GPU machine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gpipe  # noqa: E402
import gpipe.torch  # noqa: E402


def test_torch_round_trip_keeps_dtype_shape_and_channels_last(make_ring):
    p, c = make_ring()
    img = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    half = torch.randn(5, 7, dtype=torch.bfloat16)
    labels = torch.arange(4)
    p.send({"images": img, "half": half, "labels": labels}, meta=[42])
    with c.recv(timeout=5) as b:
        got = torch.from_dlpack(b["images"])
        assert got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got, img)
        assert torch.equal(torch.from_dlpack(b["half"]), half)
        assert torch.equal(torch.from_dlpack(b["labels"]), labels)
        assert b.meta[0] == 42


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pin", [True, "try"])
@pytest.mark.parametrize("delivery", ["in-place", "mirror"])
def test_pin_memory_page_locks_batches_where_they_lie(make_ring, delivery, pin):
    torch.cuda.init()  # until it has, torch's is_pinned() says False for any pointer
    p, c = make_ring(consumer={"pin_memory": pin, "delivery": delivery})
    assert c.pinned and c.pin_refused is None
    x = torch.arange(1 << 18, dtype=torch.float32)
    p.send({"x": x})
    dev = torch.device("cuda", 0)
    with c.recv(timeout=5) as b:
        t = torch.from_dlpack(b["x"])
        assert t.is_pinned(), "torch does not see the batch as page-locked"
        on_gpu = t.to(dev, non_blocking=True)
        torch.cuda.current_stream(dev).synchronize()  # the copy has run before the batch goes
    assert torch.equal(on_gpu.cpu(), x)


OTHER_GPU_PIN = r"""
import ctypes, sys, tempfile, os, torch, gpipe
last = torch.cuda.device_count() - 1
torch.cuda.set_device(last)
torch.zeros(1, device="cuda")  # the rank's own context, as DDP's set_device and first op make
cu = ctypes.CDLL("libcuda.so.1")
def gpu0_context():
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return active.value
before = gpu0_context()
sock = os.path.join(tempfile.mkdtemp(), "ring.sock")
p = gpipe.Producer(sock, slots=2, batch_bytes=1 << 20, backend="host")
c = gpipe.Consumer(sock, pin_memory=True)
p.wait_for_consumers(1, timeout=5)
p.send({"x": torch.arange(1024, dtype=torch.float32)})
with c.recv(timeout=5) as b:
    t = torch.from_dlpack(b["x"])
    ok = t.is_pinned() and torch.equal(t.to("cuda", non_blocking=True).cpu(), torch.arange(1024.0))
print("current", torch.cuda.current_device(), "of", last, "gpu0_context", before, gpu0_context(),
      "copied", ok)
c.close(); p.close()
"""


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
def test_pin_memory_on_another_gpu_keeps_the_rank_on_its_own_device():
    """A DDP rank on the last GPU that pins its ring: the lock is made in that GPU's context,
    torch's current device stays the rank's, and the pin makes no context on GPU 0 (in a
    fresh process, so that no earlier test has made one)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", OTHER_GPU_PIN], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    last = torch.cuda.device_count() - 1
    words = out.stdout.split()
    assert words[:4] == ["current", str(last), "of", str(last)], out.stdout
    assert words[5] == words[6], f"pinning made a context on GPU 0: {out.stdout}"
    assert words[7:] == ["copied", "True"], out.stdout


def test_slot_tensors_are_writable_torch_tensors(make_ring):
    p, c = make_ring()
    with p.acquire() as s:
        x = torch.from_dlpack(s.tensor("x", torch.float32, (16,)))
        x.copy_(torch.arange(16.0))
        s.publish()
    with c.recv(timeout=5) as b:
        assert torch.from_dlpack(b).sum().item() == 120


def test_as_tensor_is_from_dlpack_for_batches_slots_and_tensors(make_ring):
    p, c = make_ring()
    with p.acquire() as s:
        x = gpipe.torch.as_tensor(s.tensor("x", torch.int16, (3, 5)))
        x.copy_(torch.arange(15, dtype=torch.int16).reshape(3, 5))
        s.publish()
    with c.recv(timeout=5) as b:
        whole, named = gpipe.torch.as_tensor(b), gpipe.torch.as_tensor(b["x"])
        assert whole.dtype == torch.int16 and whole.shape == (3, 5)
        assert torch.equal(whole, torch.from_dlpack(b)) and torch.equal(named, whole)
        assert whole.data_ptr() == named.data_ptr()  # both over the slot itself


def test_a_cuda_tensor_sent_to_a_host_ring_is_refused(make_ring):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    p, _ = make_ring()
    with pytest.raises(ValueError, match="host memory"):
        p.send(torch.zeros(4, device="cuda"))


def test_the_dataset_in_a_dataloader(sock, child):
    p = gpipe.Producer(sock, backend="host", slots=4, batch_bytes=1 << 20)
    ch = child(
        """
        import sys, torch, gpipe.torch
        from torch.utils.data import DataLoader
        ds = gpipe.torch.BatchDataset(sys.argv[1], with_meta=True)
        total = 0
        for n, ((x, y), meta) in enumerate(
            ((d["x"], d["y"]), m) for d, m in DataLoader(ds, batch_size=None, num_workers=0)
        ):
            assert x.shape == (8, 3) and int(meta[0]) == n
            total += int(y.sum())
        print(total, flush=True)
        """,
        sock,
    )
    p.wait_for_consumers(1, timeout=20)
    for i in range(10):
        p.send({"x": torch.zeros(8, 3), "y": torch.full((2,), i)}, meta=[i])
    p.close()
    rc, out, err = ch.wait()
    assert rc == 0, err
    assert int(out.strip()) == 2 * sum(range(10))


def test_the_dataset_refuses_broadcast_with_several_workers(sock, child):
    p = gpipe.Producer(sock, backend="host", slots=4, batch_bytes=1 << 20)
    ch = child(
        """
        import sys, torch, gpipe.torch
        from torch.utils.data import DataLoader
        ds = gpipe.torch.BatchDataset(sys.argv[1])
        n = 0
        try:
            for _ in DataLoader(ds, batch_size=None, num_workers=2):
                n += 1
            print("no error after", n, "items", flush=True)
        except Exception as e:
            print("refused" if "broadcast" in str(e) else repr(e), flush=True)
        """,
        sock,
    )
    rc, out, err = ch.wait(timeout=90)
    assert rc == 0, err
    assert out.strip() == "refused", (out, err[-3000:])
    p.close()
