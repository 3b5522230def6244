"""The package on the GPU: torch, CuPy and JAX tensors over a CUDA ring's slots, streams,
killed peers and the write rule. Skipped without torch and a CUDA device (CI); run on the
GPU machine (`. .gpu/env.sh && python3 -m pytest gpipe-py/tests`)."""

from __future__ import annotations

import json
import signal
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import gpipe  # noqa: E402

N = 1 << 18  # int32 words per batch (1 MiB)

# A consumer child. Every batch is checked on the GPU against its sequence number with no
# host synchronisation per batch; the mismatch count is read once at the end.
# argv: socket, how ("default" | "side" | "record" | "fast" | "hold"), delay_s, and optionally
# side_signals ("on" | "off" | "auto")
CONSUMER = r"""
import json, sys, time, torch, gpipe, gpipe.torch
sock, how, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
signals = {"on": True, "off": False, "auto": None}[sys.argv[4] if len(sys.argv) > 4 else "auto"]
c = gpipe.Consumer(sock, side_signals=signals)
print("attached", flush=True)
bad = torch.zeros((), dtype=torch.int64, device="cuda")
side = torch.cuda.Stream()
other = torch.cuda.Stream()
seqs = []
end = "closed"
try:
    for b in c:
        with b:
            if how == "side":
                with torch.cuda.stream(side):
                    x = torch.from_dlpack(b["x"])
                    y = (x.float() @ torch.ones(x.shape[1], 64, device="cuda")).sum()
                    bad += ((x != b.seq).sum() > 0).long()
            elif how == "record":
                x = torch.from_dlpack(b["x"])       # made for the default stream
                b.record_stream(other)               # ... used on another
                with torch.cuda.stream(other):
                    torch.cuda._sleep(20000)
                    bad += ((x != b.seq).sum() > 0).long()
            elif how == "fast":
                with torch.cuda.stream(side):        # as_tensor orders the current stream
                    x = gpipe.torch.as_tensor(b["x"])
                    torch.cuda._sleep(20000)
                    bad += ((x != b.seq).sum() > 0).long()
            else:
                x = torch.from_dlpack(b["x"])
                torch.cuda._sleep(20000)             # slow reader: a refill too early shows
                bad += ((x != b.seq).sum() > 0).long()
            if "labels" in b:
                img = torch.from_dlpack(b["images"])
                if not img.is_contiguous(memory_format=torch.channels_last):
                    bad += 1000
                bad += ((img != (b.seq % 251)).sum() > 0).long()
                bad += ((torch.from_dlpack(b["labels"]) != b.seq).sum() > 0).long()
            seqs.append(b.seq)
            del x
        if delay:
            time.sleep(delay)
except gpipe.Error as e:
    end = type(e).__name__ + ": " + str(e)
torch.cuda.synchronize()
print(json.dumps({"seqs": seqs, "bad": int(bad.item()), "end": end,
                  "side_signals": c.side_signals}), flush=True)
"""


def produce(p, n, start=0, images=False, conv=torch.from_dlpack):
    for s in range(start, start + n):
        with p.acquire(timeout=30) as slot:
            x = conv(slot.tensor("x", torch.int32, (N // 64, 64)))
            x.zero_()
            torch.cuda._sleep(20000)  # a slow writer: a consumer reading too early shows
            x.add_(s)
            if images:
                img = torch.from_dlpack(
                    slot.tensor("images", torch.uint8, (4, 3, 32, 32), (3072, 1, 96, 3))
                )
                img.fill_(s % 251)
                lab = torch.from_dlpack(slot.tensor("labels", torch.int64, (4,)))
                lab.fill_(s)
            slot.publish(meta=[s])


def result(ch, timeout=120):
    rc, out, err = ch.wait(timeout=timeout)
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def feed_one(child, p, script, *args, n=200):
    """Starts the consumer child `script` (argv: the producer's socket, then `args`), waits
    for it to attach, publishes `n` batches, closes the ring and returns the child's result."""
    k = child(script, p.socket, *args)
    assert k.readline(timeout=60) == "attached"
    p.wait_for_consumers(1, timeout=30)
    produce(p, n)
    p.close()
    return result(k)


def start_consumers(child, sock, n, how="default", delay="0", signals="auto"):
    kids = [child(CONSUMER, sock, how, delay, signals) for _ in range(n)]
    for k in kids:
        assert k.readline(timeout=60) == "attached"
    return kids


@pytest.mark.parametrize("how", ["default", "side", "record", "fast"])
def test_side_signals_keep_every_batch_in_order(sock, child, how):
    # The consumers wait for `ready` and write `finished` on side streams of their own
    # (side_signals=True), joined to the tensors' streams by events: a slow writer and slow
    # readers still never see a batch early or have it refilled under them.
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, backend="cuda")
    kids = start_consumers(child, sock, 2, how=how, signals="on")
    p.wait_for_consumers(2, timeout=30)
    produce(p, 300)
    p.close()
    for r in (result(k) for k in kids):
        assert r["bad"] == 0 and r["end"] == "closed", r
        assert r["side_signals"] is True and r["seqs"] == list(range(300)), r


@pytest.mark.parametrize("mib, expected", [(2, False), (16, True)])
def test_side_signals_by_default_from_16_mib_slots(sock, child, mib, expected):
    p = gpipe.Producer(sock, slots=2, batch_bytes=mib << 20, backend="cuda")
    (k,) = start_consumers(child, sock, 1)
    p.wait_for_consumers(1, timeout=30)
    produce(p, 20)
    p.close()
    r = result(k)
    assert r["bad"] == 0 and r["seqs"] == list(range(20)), r
    assert r["side_signals"] is expected, r


@pytest.mark.parametrize("mode", ["broadcast", "shared"])
@pytest.mark.parametrize("consumers", [1, 4])
def test_torch_producer_torch_consumers(sock, child, mode, consumers):
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, mode=mode, backend="cuda")
    assert p.backend == "cuda" and p.device == "cuda:0"
    if mode == "broadcast":
        assert p.memory in ("vmm", "pool")
    kids = start_consumers(child, sock, consumers)
    p.wait_for_consumers(consumers, timeout=30)
    produce(p, 300)
    p.close()
    results = [result(k) for k in kids]
    for r in results:
        assert r["bad"] == 0 and r["end"] == "closed", r
    if mode == "broadcast":
        for r in results:
            assert r["seqs"] == list(range(300))
    else:
        assert sorted(s for r in results for s in r["seqs"]) == list(range(300))


def test_as_tensor_keeps_the_stream_rules(sock, child):
    import gpipe.torch

    p = gpipe.Producer(sock, slots=2, batch_bytes=2 << 20, backend="cuda")
    (k,) = start_consumers(child, sock, 1, how="fast")
    p.wait_for_consumers(1, timeout=30)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        produce(p, 200, conv=gpipe.torch.as_tensor)
    p.close()
    r = result(k)
    assert r["bad"] == 0 and r["seqs"] == list(range(200)), r


def test_a_torch_dtype_gives_a_cuda_tensor_with_the_stream_rules(sock, child):
    # slot.tensor(name, torch_dtype, shape) is a torch tensor on the ring's GPU, made for the
    # current stream: a slow writer on a side stream is still published after its writes.
    p = gpipe.Producer(sock, slots=2, batch_bytes=2 << 20, backend="cuda")
    (k,) = start_consumers(child, sock, 1)
    p.wait_for_consumers(1, timeout=30)
    with p.acquire(timeout=30) as slot:
        x = slot.tensor("x", torch.int32, (N // 64, 64))
        assert isinstance(x, torch.Tensor) and x.device == torch.device(p.device)
        assert x.data_ptr() == slot.tensor("x").data_ptr
        del x
        slot.abandon()

    def unwrapped(t):
        assert isinstance(t, torch.Tensor)
        return t

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        produce(p, 200, conv=unwrapped)
    p.close()
    r = result(k)
    assert r["bad"] == 0 and r["seqs"] == list(range(200)), r


@pytest.mark.parametrize("how", ["side", "record"])
def test_work_on_a_side_stream_and_moved_with_record_stream(sock, child, how):
    p = gpipe.Producer(sock, slots=2, batch_bytes=2 << 20, backend="cuda")
    (k,) = start_consumers(child, sock, 1, how=how)
    p.wait_for_consumers(1, timeout=30)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the producer writes on a side stream of its own
        produce(p, 200)
    p.close()
    r = result(k)
    assert r["bad"] == 0 and r["seqs"] == list(range(200)), r


def test_multi_tensor_batches_channels_last_and_labels(sock, child):
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, backend="cuda")
    (k,) = start_consumers(child, sock, 1)
    p.wait_for_consumers(1, timeout=30)
    produce(p, 100, images=True)
    p.close()
    r = result(k)
    assert r["bad"] == 0 and len(r["seqs"]) == 100, r


def test_send_keeps_layouts_and_refuses_a_wrong_device(sock, child):
    p = gpipe.Producer(sock, slots=2, batch_bytes=2 << 20, backend="cuda")
    c = gpipe.Consumer(sock)
    p.wait_for_consumers(1, timeout=30)
    img = torch.randn(8, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    p.send({"img": img, "cpu_labels": torch.arange(8)})
    with c.recv(timeout=10) as b:
        got = torch.from_dlpack(b["img"])
        assert got.device == torch.device("cuda:0")
        assert got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got, img)
        assert torch.equal(torch.from_dlpack(b["cpu_labels"]).cpu(), torch.arange(8))
        assert b["img"].__dlpack_device__() == (2, 0)
    with pytest.raises(gpipe.AttachError, match="device 17 was asked for"):
        gpipe.Consumer(sock, device=17)
    with pytest.raises(ValueError, match="CUDA memory"):
        gpipe.Consumer(sock, device="cpu")
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="cuda:0"):
            p.send(torch.zeros(4, device="cuda:1"))
    c.close()
    p.close()


# A consumer on GPU 1 of a producer on GPU 0: the slots are read in place by peer access, or
# copied into the consumer's own memory on GPU 1 first (mirror).
PEER_CONSUMER = r"""
import json, sys, torch, gpipe
torch.cuda.set_device(1)
c = gpipe.Consumer(sys.argv[1], device=1, delivery=sys.argv[2])
print("attached", flush=True)
bad = torch.zeros((), dtype=torch.int64, device="cuda:1")
seqs, devices = [], set()
for b in c:
    with b:
        x = torch.from_dlpack(b["x"])
        devices.add(str(x.device))
        bad += ((x != b.seq).sum() > 0).long()
        seqs.append(b.seq)
        del x
torch.cuda.synchronize(1)
print(json.dumps({"seqs": seqs, "bad": int(bad.item()), "devices": sorted(devices),
                  "device": c.device, "delivery": c.delivery}), flush=True)
"""


@pytest.mark.parametrize("delivery", ["in-place", "mirror", "auto"])
@pytest.mark.parametrize("mode", ["broadcast", "shared"])
def test_a_consumer_on_another_gpu_reads_every_batch(sock, child, mode, delivery):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, mode=mode, backend="cuda", device=0)
    r = feed_one(child, p, PEER_CONSUMER, delivery)
    assert r["bad"] == 0 and r["seqs"] == list(range(200)), r
    assert r["devices"] == ["cuda:1"] and r["device"] == "cuda:1", r
    # auto mirrors on another GPU.
    assert r["delivery"] == ("mirror" if delivery == "auto" else delivery), r


# A mirroring consumer on the producer's GPU that lets two of every three batches go without
# making a tensor (so nothing of its own orders the buffer's reuse after their copies) and
# checks the third. argv: socket
MIRROR_SKIPPER = r"""
import json, sys, torch, gpipe
c = gpipe.Consumer(sys.argv[1], delivery="mirror", mirror_buffers=3)
print("attached", flush=True)
bad = torch.zeros((), dtype=torch.int64, device="cuda")
seqs = []
for b in c:
    with b:
        if b.seq % 3 == 2:
            x = torch.from_dlpack(b["x"])
            bad += ((x != b.seq).sum() > 0).long()
            del x
        seqs.append(b.seq)
torch.cuda.synchronize()
print(json.dumps({"seqs": seqs, "bad": int(bad.item()), "delivery": c.delivery}), flush=True)
"""


def test_a_mirror_whose_buffers_change_copy_streams_never_mixes_batches(sock, child):
    # 5 slots and 3 mirror buffers: a buffer's consecutive copies run on different copy
    # streams (slot k copies on stream k mod 2), and a slow producer keeps copies queued.
    p = gpipe.Producer(sock, slots=5, batch_bytes=2 << 20, backend="cuda")
    r = feed_one(child, p, MIRROR_SKIPPER, n=300)
    assert r["bad"] == 0 and r["seqs"] == list(range(300)), r
    assert r["delivery"] == "mirror", r


FORWARDER = r"""
import json, sys, gpipe
r = gpipe.forward(sys.argv[1], sys.argv[2], device=1, slots=4, wait_for_consumers=1)
print(json.dumps(r), flush=True)
"""


def test_forward_to_another_gpu_feeds_a_consumer_there(sock, child):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    down = sock.replace(".sock", "-b.sock")
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, backend="cuda", device=0)
    f = child(FORWARDER, sock, down)
    p.wait_for_consumers(1, timeout=60)
    for _ in range(600):
        if __import__("os").path.exists(down):
            break
        time.sleep(0.05)
    k = child(PEER_CONSUMER, down, "auto")
    assert k.readline(timeout=60) == "attached"
    produce(p, 200)
    p.close()
    r = result(k)
    assert r["bad"] == 0 and r["seqs"] == list(range(200)), r
    # The forwarded ring lives on GPU 1: the consumer there reads it in place, locally.
    assert r["devices"] == ["cuda:1"] and r["delivery"] == "in-place", r
    fr = result(f)
    assert fr["batches"] == 200 and fr["backend"] == "cuda", fr


CUPY_CONSUMER = r"""
import sys, cupy, gpipe
c = gpipe.Consumer(sys.argv[1])
print("attached", flush=True)
bad = 0; n = 0
for b in c:
    with b:
        x = cupy.from_dlpack(b["x"])
        bad += int((x != b.seq).any())
        n += 1
        del x
print(n, bad, flush=True)
"""

JAX_CONSUMER = r"""
import os, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp, gpipe
c = gpipe.Consumer(sys.argv[1])
print("attached", flush=True)
bad = 0; n = 0
for b in c:
    with b:
        x = jax.dlpack.from_dlpack(b["x"])
        bad += int(jnp.any(x != b.seq))
        n += 1
        del x
print(n, bad, flush=True)
"""


@pytest.mark.parametrize("lib", ["cupy", "jax"])
def test_cupy_and_jax_consumers(sock, child, lib):
    pytest.importorskip(lib)
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, backend="cuda")
    k = child(CUPY_CONSUMER if lib == "cupy" else JAX_CONSUMER, sock)
    assert k.readline(timeout=90) == "attached"
    p.wait_for_consumers(1, timeout=30)
    produce(p, 50)
    p.close()
    rc, out, err = k.wait(timeout=120)
    assert rc == 0, err
    assert out.split()[-2:] == ["50", "0"], (out, err[-2000:])


@pytest.mark.parametrize("mode", ["broadcast", "shared"])
def test_a_sigkilled_consumer_costs_the_others_nothing(sock, child, mode):
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, mode=mode, backend="cuda")
    victim = child(CONSUMER, sock, "default", "0.01")
    assert victim.readline(timeout=60) == "attached"
    others = start_consumers(child, sock, 2)
    p.wait_for_consumers(3, timeout=30)
    produce(p, 60)
    victim.kill()
    produce(p, 240, start=60)
    p.close()
    results = [result(k) for k in others]
    for r in results:
        assert r["bad"] == 0 and r["end"] == "closed", r
    if mode == "broadcast":
        for r in results:
            assert r["seqs"] == list(range(300))
    else:
        got = [s for r in results for s in r["seqs"]]
        assert len(got) == len(set(got)) and set(range(60, 300)) <= set(got)


WRITER = r"""
import sys, torch, gpipe
c = gpipe.Consumer(sys.argv[1])
print("attached", c.enforced_read_only, flush=True)
try:
    for b in c:
        with b:
            x = torch.from_dlpack(b["x"])
            x.add_(1000)          # a broadcast consumer writing its batch in place
            torch.cuda.synchronize()
            del x
    print("wrote", flush=True)
except Exception as e:
    print("failed", type(e).__name__, str(e)[:200], flush=True)
    sys.exit(3)
"""


def test_a_broadcast_consumer_that_writes_fails_alone(sock, child):
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, mode="broadcast", backend="cuda")
    if p.memory != "vmm":
        pytest.skip(f"the device has no VMM path ({p.memory}): writes cannot be refused there")
    w = child(WRITER, sock)
    assert w.readline(timeout=60) == "attached True"
    readers = start_consumers(child, sock, 2)
    p.wait_for_consumers(3, timeout=30)
    produce(p, 100)
    p.close()
    rc, out, err = w.wait(timeout=120)
    assert rc == 3 and "failed" in out, (rc, out, err[-2000:])
    for r in (result(k) for k in readers):
        assert r["bad"] == 0 and r["seqs"] == list(range(100)) and r["end"] == "closed", r


@pytest.mark.parametrize("consumer_stream", ["default", "side"])
def test_a_sigkilled_producer_never_hangs_the_consumers_gpu(sock, child, report, consumer_stream):
    """The consumer's stream waits for a `ready` that seconds of producer GPU work precede;
    the producer is killed meanwhile. The consumer's synchronize must return soon after the
    kill (its watch releases the wait), not before it (it really waited), and recv must
    raise ProducerDied. Times are CLOCK_MONOTONIC, shared by the processes."""
    prod = child(
        r"""
        import sys, time, torch, gpipe
        p = gpipe.Producer(sys.argv[1], slots=4, batch_bytes=2 << 20, backend="cuda")
        print("bound", flush=True)
        p.wait_for_consumers(1, timeout=60)
        # Load the kernels first: with lazy module loading, a kernel's first launch waits for
        # the device, which would finish the long work below before the batch is published.
        torch.zeros(1024, dtype=torch.int32, device="cuda").fill_(7)
        torch.cuda.synchronize()
        with p.acquire() as slot:
            x = torch.from_dlpack(slot.tensor("x", torch.int32, (1024,)))
            for _ in range(10):
                torch.cuda._sleep(1_000_000_000)   # seconds of GPU time before `ready`
            x.fill_(7)
            slot.publish()
        print("published", flush=True)
        time.sleep(120)
        """,
        sock,
    )
    assert prod.readline(timeout=60) == "bound"
    cons = child(
        r"""
        import sys, time, torch, gpipe
        # CUDA up and the kernels loaded before the batch comes (a first launch waits for the
        # device, which here would wait for the producer).
        (torch.zeros(1024, dtype=torch.int32, device="cuda") + 1).sum().item()
        c = gpipe.Consumer(sys.argv[1])
        b = c.recv(timeout=30)
        s = torch.cuda.current_stream() if sys.argv[2] == "default" else torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = torch.from_dlpack(b["x"])  # this stream now waits for the producer's `ready`
            y = (x + 1).sum()
        print("enqueued", time.monotonic(), flush=True)
        torch.cuda.synchronize()           # released by the consumer's watch on the producer
        synced = time.monotonic()
        try:
            c.recv(timeout=10)
            died = None
        except gpipe.ProducerDied:
            died = time.monotonic()
        print("result", synced, died, flush=True)
        """,
        sock,
        consumer_stream,
    )
    assert prod.readline(timeout=60) == "published"
    enqueued = float(cons.readline(timeout=60).split()[1])
    time.sleep(0.5)
    killed = time.monotonic()
    prod.kill()
    line = cons.readline(timeout=30).split()
    assert line[0] == "result", line
    synced, died = float(line[1]), (None if line[2] == "None" else float(line[2]))
    report(
        f"producer SIGKILLed ({consumer_stream} stream): the consumer's read waited "
        f"{synced - enqueued:.3f} s in all and returned {synced - killed:.3f} s after the kill; "
        f"ProducerDied {died - killed if died else None} s after the kill"
    )
    assert synced >= killed - 0.05, "the consumer's stream did not wait for the producer"
    assert synced - killed < 1.0
    assert died is not None and died - killed < 1.0


def test_a_consumer_stream_waits_for_the_producers_work(sock, child, report):
    """Stream ordering end to end: the producer's fill runs after a long kernel, and the
    consumer's reduction must see the fill, on the default stream and on a side stream."""
    p = gpipe.Producer(sock, slots=4, batch_bytes=2 << 20, backend="cuda")
    k = child(
        r"""
        import sys, time, torch, gpipe
        torch.zeros(1024, dtype=torch.int32, device="cuda").sum().item()  # kernels loaded
        c = gpipe.Consumer(sys.argv[1])
        print("attached", flush=True)
        side = torch.cuda.Stream()
        for i, b in enumerate(c):
            with b:
                t0 = time.monotonic()
                if i % 2:
                    with torch.cuda.stream(side):
                        total = int(torch.from_dlpack(b["x"]).sum().item())
                else:
                    total = int(torch.from_dlpack(b["x"]).sum().item())
                print(b.seq, total, round(time.monotonic() - t0, 3), flush=True)
        """,
        sock,
    )
    assert k.readline(timeout=60) == "attached"
    p.wait_for_consumers(1, timeout=30)
    torch.zeros(4, dtype=torch.int32, device="cuda").fill_(1)  # kernels loaded (see above)
    torch.cuda.synchronize()
    for s in range(4):
        with p.acquire() as slot:
            x = torch.from_dlpack(slot.tensor("x", torch.int32, (1024,)))
            torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time
            x.fill_(s + 1)
            slot.publish()
    p.close()
    rc, out, err = k.wait(timeout=120)
    assert rc == 0, err
    lines = [l.split() for l in out.strip().splitlines()[1:]]
    report(f"consumer waited for a slow producer: {[l[2] for l in lines]} s per batch")
    assert [(int(a), int(b)) for a, b, _ in lines] == [(s, 1024 * (s + 1)) for s in range(4)]


def test_pin_memory_on_a_cuda_ring_is_refused_naming_it(sock):
    with gpipe.Producer(sock, backend="cuda", slots=2, batch_bytes=1 << 20):
        with pytest.raises(ValueError, match="is in CUDA memory .*leave pin_memory out"):
            gpipe.Consumer(sock, pin_memory=True)
