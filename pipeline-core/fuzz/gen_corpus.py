#!/usr/bin/env python3
"""Writes the seed corpus under corpus/<target>/ (committed; rerun after a protocol change).

The encodings are written from docs/protocol.md independently of the Rust code, so a seed that
the targets do not accept as expected points at a disagreement between the two.
Usage: python3 pipeline-core/fuzz/gen_corpus.py
"""

import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")

U64_MAX = (1 << 64) - 1
UNCLAIMED = 1 << 63
SLOT_ALIGN = 2 << 20


def u16(v):
    return struct.pack("<H", v)


def u32(v):
    return struct.pack("<I", v)


def u64(v):
    return struct.pack("<Q", v)


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- handshake frames -------------------------------------------------------------------------


def frame(kind, body):
    return b"GPW1" + u16(kind) + u16(0) + u32(len(body)) + body


def hello(version, role, backend):
    return u32(version) + u32(role) + u32(backend)


def welcome(index, mode, slots, cap, backend, fds, blob):
    return (
        u32(1)
        + u64(layout_hash())
        + u32(index)
        + u32(mode)
        + u32(slots)
        + u64(SLOT_ALIGN)
        + u32(cap)
        + u32(backend)
        + u32(fds)
        + u32(len(blob))
        + blob
    )


def blob(b):
    return u32(len(b)) + b


def bodies():
    return {
        "hello_consumer": (1, hello(1, 1, 0)),
        "hello_observer_host": (1, hello(1, 2, 1)),
        "welcome_host": (2, welcome(0, 1, 4, 2, 1, 2, b"")),
        "welcome_observer": (2, welcome(0xFFFFFFFF, 2, 8, 4, 1, 1, b"")),
        # CUDA-like export: magic, version, uuid, slot_count, slot_bytes, one slot's 128 bytes.
        "welcome_cuda": (
            2,
            welcome(
                1,
                2,
                1,
                2,
                2,
                2,
                b"GCU1" + u32(1) + bytes(range(16)) + u32(1) + u64(SLOT_ALIGN) + bytes(128),
            ),
        ),
        "ready_host": (3, u32(0) + blob(b"")),
        "ready_cuda": (3, u32(0) + blob(b"GCF1" + u32(4))),
        "joined": (4, u64(77)),
        "reject": (5, blob(b"unsupported backend 2: this producer uses host")),
        "reject_utf8": (5, blob("d\u00e9j\u00e0 vu \u2713".encode())),
        # The longest reason accepted (MAX_REASON bytes).
        "reject_max": (5, blob(b"slow consumer; " * 68 + b"done")),
        "goodbye": (6, b""),
    }


def handshake():
    for name, (kind, body) in bodies().items():
        write("handshake", "frame_" + name, frame(kind, body))
        # The same body for decode_body: the first two bytes are the kind.
        write("handshake", "body_" + name, u16(kind) + body)


# --- control segment ------------------------------------------------------------------------


def layout_hash():
    parts = [1, 768, 256, 256, 256, 128, 256, 512, 8, 16, 128, 136, 8, 128, 8, UNCLAIMED]
    h = 0xCBF29CE484222325
    for p in parts:
        for b in u64(p):
            h ^= b
            h = (h * 0x100000001B3) & U64_MAX
    return h


def segment_bytes(slots, cap):
    raw = 1024 + 256 * slots + 256 * cap
    return (raw + 4095) // 4096 * 4096


def segment(slots, cap, mode, head, slot_words, consumers, hint=0, requeued=0):
    """A segment image: 1024 + 256 * slots + 256 * cap bytes (the memfd's rest stays zero)."""
    img = bytearray(1024 + 256 * slots + 256 * cap)

    def put(off, b):
        img[off : off + len(b)] = b

    put(8, u32(1) + u32(mode) + u64(layout_hash()) + u32(slots) + u32(cap))
    put(32, u64(SLOT_ALIGN) + u64(segment_bytes(slots, cap)))
    put(48, u32(4242) + u32(1) + u32(1) + u32(0) + u64(1_790_000_000_000))
    put(128, u64(head))
    put(768, u64(hint))
    put(896, u64(requeued))
    for k, (seq, length, pending, claimer) in enumerate(slot_words):
        d = 1024 + 256 * k
        put(d, u64(seq) + u64(length) + u64(seq * 10 if seq != U64_MAX else 0))
        put(d + 128, u64(pending) + u64(claimer))
    for c, (state, pid, join, cursor) in enumerate(consumers):
        r = 1024 + 256 * slots + 256 * c
        put(r, u32(state) + u32(pid) + u64(join) + u64(1))
        put(r + 128, u64(cursor) + u64(cursor - join) + u64(cursor - join))
    put(0, b"GPIPESEG")
    return bytes(img)


def setup(slots, cap, mode, not_write_sealed=False, me=0):
    flags = (mode - 1) | (2 if not_write_sealed else 0)
    return bytes([slots - 1, cap - 1, flags, me])


def segments():
    # Zeroed: no magic.
    write("segment_consumer", "zeroed", setup(4, 2, 1) + bytes(1024))
    # Broadcast, 4 slots, 2 consumers: head 6, slots hold 2..5, consumer 0 lags at 3.
    slots = [(4, 100, 0, U64_MAX), (5, 4096, 0b11, U64_MAX), (2, 0, 0, U64_MAX), (3, 1, 0b01, U64_MAX)]
    cons = [(2, 1000, 0, 3), (2, 1001, 2, 6)]
    img = segment(4, 2, 1, 6, slots, cons)
    write("segment_consumer", "broadcast_4x2", setup(4, 2, 1) + img)
    write("segment_consumer", "broadcast_4x2_observer", setup(4, 2, 1, me=1) + img)
    # Header only (slots and records zero): valid magic, nothing published.
    write("segment_consumer", "broadcast_header_only", setup(4, 2, 1) + img[:1024])
    # Shared, 8 slots, 4 consumers: head 10, two unclaimed, one claimed, one requeued.
    slots = [(8, 64, UNCLAIMED, U64_MAX), (9, 64, UNCLAIMED, U64_MAX)]
    slots += [(s, 64, 0, 0) for s in range(2, 6)]
    slots += [(6, 64, 1 << 2, 2), (7, 64, 0, 1)]
    cons = [(2, 2000, 0, 8), (4, 2001, 0, 7), (2, 2002, 0, 7), (5, 2003, 0, 0)]
    img = segment(8, 4, 2, 10, slots, cons, hint=8, requeued=1)
    write("segment_consumer", "shared_8x4", setup(8, 4, 2, me=2) + img)


# --- producer-side words -------------------------------------------------------------------


def producer():
    # mode byte, hostile mask (4 consumers), a u64 for the claim-word codec, then the script.
    # Ops: low 3 bits 0 publish if free, 1 join, 2 depart, 3 take (claim/adopt/receive),
    # 4 release, 5 hostile writes the claim word (+selector byte), 6 hostile writes its own
    # page (+selector byte), 7 look; high 4 bits the consumer. Selector: low 3 bits the kind
    # (0 unclaimed, 1 claimed by consumer sel>>4, 2 departed, 3 holding, 4 released, 5 none,
    # 6 zero, 7 raw u64 follows), high 4 bits the batch offset + 2.
    def op(code, c=0):
        return bytes([code | (c << 4)])

    bc = bytes([0, 0b1000]) + u64(0x1234)
    bc += op(1, 0) + op(1, 1) + op(1, 3) + op(0) + op(3, 0) + op(3, 1) + op(4, 0) + op(7)
    bc += op(6, 3) + bytes([4 | (2 << 4)]) + op(0) + op(4, 1) + op(0) + op(2, 3) + op(0)
    write("segment_producer", "broadcast", bc)

    sh = bytes([1, 0b1000]) + u64(U64_MAX)
    sh += op(1, 0) + op(1, 1) + op(1, 3) + op(0) + op(3, 0) + op(5, 3) + bytes([0 | (2 << 4)])
    sh += op(3, 1) + op(0) + op(4, 0) + op(4, 1) + op(0) + op(5, 3) + bytes([1 | (2 << 4)])
    sh += op(3, 0) + op(6, 3) + bytes([3 | (2 << 4)]) + op(7) + op(2, 3) + op(0) + op(2, 0) + op(0)
    write("segment_producer", "shared", sh)


# --- regressions: inputs that crashed a target (replayed by .ci/fuzz) -----------------------


def regressions():
    d = os.path.join(HERE, "regressions", "handshake")
    os.makedirs(d, exist_ok=True)
    # A Reject whose reason is MAX_REASON bytes, one of them not UTF-8: decode's lossy
    # conversion yields 1026 bytes, more than encode sends (it truncates to MAX_REASON).
    reason = bytearray(b"slow consumer; " * 68 + b"done")
    reason[100] = 0xFF
    with open(os.path.join(d, "reject_lossy_over_max"), "wb") as f:
        f.write(frame(5, blob(bytes(reason))))

    d = os.path.join(HERE, "regressions", "segment_consumer")
    os.makedirs(d, exist_ok=True)
    # A consumer record whose pid does not fit an i32 (the producer writes it; `gpipe inspect`
    # reads it): Snapshot::read -> sys::pid_exists -> rustix Pid::from_raw(negative).
    slots = [(4, 100, 0, U64_MAX), (5, 4096, 0b11, U64_MAX), (2, 0, 0, U64_MAX), (3, 1, 0b01, U64_MAX)]
    cons = [(2, 0xFFFFFFFF, 0, 3), (2, 0x80000000, 2, 6)]
    img = segment(4, 2, 1, 6, slots, cons)
    with open(os.path.join(d, "pid_not_i32"), "wb") as f:
        f.write(setup(4, 2, 1) + img)


if __name__ == "__main__":
    handshake()
    segments()
    producer()
    regressions()
