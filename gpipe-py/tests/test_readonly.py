"""A Python consumer's batch memory is read-only for good: the consumer cannot make its mapping
writable with mprotect, nor write the slot memory through any file it can reach (the slot
memfd reopened through /proc/self/map_files, as root can). docs/security.md, "Batch data is
read-only to consumers"."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np

import gpipe

BATCH = 1 << 20

PRODUCER = """
import sys
import gpipe
p = gpipe.Producer(sys.argv[1], slots=2, batch_bytes=%d, backend="host")
p.wait_for_consumers(1, timeout=30)
for _ in range(2):
    with p.acquire(timeout=10) as s:
        meta = s.fill_pattern(%d)
        s.publish(meta=meta, nbytes=%d)
print("published", flush=True)
sys.stdin.readline()
p.close()
""" % (BATCH, BATCH, BATCH)

EVIL = b"EVILEVIL"


def attach(sock: str) -> gpipe.Consumer:
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        assert time.monotonic() < deadline, "the producer never made its socket"
        time.sleep(0.05)
    return gpipe.Consumer(sock)


def slot_mappings() -> list[tuple[int, int]]:
    """(start, end) of every mapping of gpipe's slot memory in this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:gpipe-slots" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((start, end))
    return out


def try_to_write_file(path: str, length: int) -> list[str]:
    """Opens `path` read-write and tries write() and a writable shared mapping; returns what
    the kernel allowed."""
    allowed = []
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return allowed
    try:
        try:
            os.pwrite(fd, EVIL, 4096)
            allowed.append(f"pwrite through {path}")
        except OSError:
            pass
        try:
            m = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            allowed.append(f"mmap(PROT_WRITE) of {path}")
            m[4096 : 4096 + len(EVIL)] = EVIL
            m.close()
        except OSError:
            pass
    finally:
        os.close(fd)
    return allowed


def test_a_python_consumer_cannot_make_its_batches_writable(sock, child):
    producer = child(PRODUCER, sock)
    c = attach(sock)
    assert producer.readline() == "published"
    batches = [c.recv(timeout=10) for _ in range(2)]
    assert all(b.verify_pattern() for b in batches)
    arrays = [np.from_dlpack(b) for b in batches]
    assert not any(a.flags.writeable for a in arrays)

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mprotect.restype = ctypes.c_int
    allowed = []
    for a in arrays:
        # A slot starts on a page boundary (slots are multiples of 2 MiB).
        addr = a.__array_interface__["data"][0]
        length = -(-a.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        if libc.mprotect(addr, length, mmap.PROT_READ | mmap.PROT_WRITE) == 0:
            allowed.append(f"mprotect(PROT_WRITE) of the batch at {addr:#x}")
            ctypes.memmove(addr + 4096, EVIL, len(EVIL))
            libc.mprotect(addr, length, mmap.PROT_READ)

    # The consumer keeps no fd of the slot memory, but the mapping names the file: as root,
    # /proc/self/map_files reopens it.
    maps = slot_mappings()
    assert maps, "the consumer maps the slot memory"
    for start, end in maps:
        allowed += try_to_write_file(f"/proc/self/map_files/{start:x}-{end:x}", end - start)

    intact = [b.verify_pattern() for b in batches]
    del arrays
    for b in batches:
        b.release()
    producer.release_stdin()
    c.close()
    rc, _, err = producer.wait()
    assert rc == 0, err
    assert not allowed and all(intact), (
        f"a consumer could write its batch data: the kernel allowed {allowed}; "
        f"batches intact: {intact}"
    )
