#!/usr/bin/env python3
"""Writes the seed corpus under corpus/<target>/ (committed; rerun after a protocol change).

The encodings are written from docs/protocol.md (protocol version 4) independently of the Rust
code, so a seed that the targets do not accept as expected points at a disagreement between
the two. Each run empties corpus/<target>/ first, so a seed dropped here disappears there too.

Names say what a seed is meant to be, and pipeline-core/tests/fuzz_seeds.rs (run by
`cargo test`) holds every committed seed to it:

* handshake: `frame_<what>` is a whole frame for `wire::decode`, `body_<what>` the same
  message as the target's second reading (a u16 kind, then the body for `wire::decode_body`).
  Such a seed must decode, re-encode to the same bytes, and pass the checks a peer makes on
  that message (version 4, the layout hash, known mode and backend, the layout within limits,
  the fd count a Welcome or Ready carries).
* segment_consumer: 4 set-up bytes (see fuzz_targets/segment_consumer.rs), then a control
  segment image. A seed without a prefix must be accepted by `ControlSegment::open` in the
  memfd the target makes from it, and `inspect::Snapshot::read` must read it; its published
  slots must carry valid tensor tables.
* `bad_` prefix (either target above): meant to be refused, by the decoder, a peer's check
  or `ControlSegment::open`; the test names the reason each one must be refused for (its
  table `REFUSALS`: add a line there when you add a bad seed here).
* segment_producer: every seed is a script the target runs (no seed is refused); the test
  checks that it is well formed: a mode byte, a hostile mask, a u64, then whole operations.

Segment images stop after their last non-zero byte (the target's memfd is zero beyond the
image), so that each one stays within the 8192 bytes .ci/fuzz passes as -max_len.
Usage: python3 pipeline-core/fuzz/gen_corpus.py
"""

import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
TARGETS = ("handshake", "segment_consumer", "segment_producer")

PROTOCOL_VERSION = 4
U64_MAX = (1 << 64) - 1
MAX_SEQ = (1 << 48) - 1
SLOT_ALIGN = 2 << 20
MAX_LEN = 8192  # .ci/fuzz's -max_len for segment_consumer
MAX_REASON = 1024

# Section 1: message kinds, roles, backends, modes.
HELLO, WELCOME, READY, JOINED, REJECT, GOODBYE = 1, 2, 3, 4, 5, 6
CONSUMER, OBSERVER = 1, 2
ANY, HOST, CUDA = 0, 1, 2
BROADCAST, SHARED = 1, 2
OBSERVER_INDEX = 0xFFFFFFFF

# Section 2.1: sizes and offsets.
HEADER_BYTES = 1024
DESC_BYTES = 256
RECORD_BYTES = 256
TABLE_BYTES = 1536
ENTRY_BYTES = 176
TABLE_ENTRIES_OFFSET = 16
RUNNING, CLOSED = 1, 2
FREE, ATTACHING, ACTIVE, LEFT, DEAD, DETACHED = 0, 1, 2, 3, 4, 5


def u16(v):
    return struct.pack("<H", v)


def u32(v):
    return struct.pack("<I", v)


def u64(v):
    return struct.pack("<Q", v)


def fnv1a(parts):
    h = 0xCBF29CE484222325
    for p in parts:
        for b in u64(p):
            h ^= b
            h = (h * 0x100000001B3) & U64_MAX
    return h


# The 23 numbers of section 2.1, in the order given there.
LAYOUT_HASH = fnv1a(
    [
        PROTOCOL_VERSION,
        HEADER_BYTES,
        256,  # page header
        DESC_BYTES,
        RECORD_BYTES,
        128, 256, 384, 512,  # head, data_wake, requeued, space_sleepers
        8, 16, 128,  # descriptor: len, user header, addressed
        128, 128,  # claim stride, first claim word
        8, 128,  # record: join_seq, cursor
        8,  # user header words
        TABLE_BYTES,
        ENTRY_BYTES,
        TABLE_ENTRIES_OFFSET,
        48,  # entry offset of shape
        8, 8,  # most tensors, most dimensions
    ]
)
# What version 1 (the corpus before this one) hashed; kept for seeds that must be refused.
V1_LAYOUT_HASH = fnv1a([1, 768, 256, 256, 256, 128, 256, 512, 8, 16, 128, 136, 8, 128, 8, 1 << 63])


def clear(target):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(d):
        os.remove(os.path.join(d, name))


def write(target, name, data):
    if target == "segment_consumer":
        assert len(data) <= MAX_LEN, f"{name}: {len(data)} bytes > -max_len {MAX_LEN}"
    with open(os.path.join(CORPUS, target, name), "wb") as f:
        f.write(data)


# --- handshake frames (section 1) --------------------------------------------------------------


def frame(kind, body, reserved=0, magic=b"GPW1", length=None):
    n = len(body) if length is None else length
    return magic + u16(kind) + u16(reserved) + u32(n) + body


def hello(version=PROTOCOL_VERSION, role=CONSUMER, backend=ANY):
    return u32(version) + u32(role) + u32(backend)


def welcome(
    index,
    mode,
    slots,
    cap,
    backend,
    fds,
    blob=b"",
    version=PROTOCOL_VERSION,
    layout_hash=LAYOUT_HASH,
    slot_bytes=SLOT_ALIGN,
):
    return (
        u32(version)
        + u64(layout_hash)
        + u32(index)
        + u32(mode)
        + u32(slots)
        + u64(slot_bytes)
        + u32(cap)
        + u32(backend)
        + u32(fds)
        + u32(len(blob))
        + blob
    )


def ready(fds, blob):
    return u32(fds) + u32(len(blob)) + blob


def joined(start_seq, index, serial):
    # ring::claim_token: the index in the low 6 bits, the attach's serial above.
    return u64(start_seq) + u64((serial << 6) | index)


def reject(reason):
    return u32(len(reason)) + reason


# Section 7: the CUDA export blob. Paths 1 pool, 2 vmm, 3 legacy; handles 1 POSIX fd,
# 2 fabric; sync 1 events, 2 semaphore; timeline memory 1 host, 2 device.
def cuda_export(path, handle, sync, slots, words=1, word_bytes=0, alloc_bytes=SLOT_ALIGN):
    blob = b"GCU1" + u32(5) + u32(path) + u32(handle) + u32(sync) + bytes(range(16))
    blob += u32(slots) + u64(SLOT_ALIGN) + u32(words) + u64(word_bytes)
    assert len(blob) == 60
    if path == 1:  # pool: the fabric handle (if any), then N pointer exports
        blob += bytes([0xAB] * 64) if handle == 2 else b""
        blob += b"".join(bytes([0x10 + k] * 64) for k in range(slots))
    elif path == 2:  # vmm: alloc_bytes, then N fabric handles (if fabric)
        blob += u64(alloc_bytes)
        blob += b"".join(bytes([0x20 + k] * 64) for k in range(slots)) if handle == 2 else b""
    else:  # legacy: N IPC memory handles
        blob += b"".join(bytes([0x30 + k] * 64) for k in range(slots))
    if sync == 1:  # events: N ready event handles
        blob += b"".join(bytes([0x40 + k] * 64) for k in range(slots))
    return blob


def messages():
    """(kind, body) of every message a peer may send, as the current code sends them."""
    version_reason = (
        "protocol version mismatch: we speak v4, the peer v3; run the same gpipe release on "
        "both sides"
    )
    return {
        "hello_consumer": (HELLO, hello()),
        "hello_consumer_cuda": (HELLO, hello(backend=CUDA)),
        "hello_observer_host": (HELLO, hello(role=OBSERVER, backend=HOST)),
        # Host consumer: control segment, claim segment, its page, the slot memfd; no blob.
        "welcome_host": (WELCOME, welcome(0, BROADCAST, 4, 2, HOST, 4)),
        "welcome_host_limits": (WELCOME, welcome(62, SHARED, 4096, 63, HOST, 4, slot_bytes=64 << 30)),
        # Observer: the control segment only, no blob.
        "welcome_observer": (WELCOME, welcome(OBSERVER_INDEX, SHARED, 8, 4, HOST, 1)),
        # CUDA pool + POSIX fd, events, host words: 3 + the pool + the finished words.
        "welcome_cuda_pool": (WELCOME, welcome(1, SHARED, 2, 2, CUDA, 5, cuda_export(1, 1, 1, 2))),
        # CUDA vmm + POSIX fd, semaphore, device words: 3 + N slots + ready + finished words.
        "welcome_cuda_vmm": (
            WELCOME,
            welcome(0, BROADCAST, 3, 1, CUDA, 8, cuda_export(2, 1, 2, 3, words=2, word_bytes=SLOT_ALIGN)),
        ),
        # CUDA legacy, events, host words: 3 + the finished words.
        "welcome_cuda_legacy": (WELCOME, welcome(3, BROADCAST, 2, 4, CUDA, 4, cuda_export(3, 1, 1, 2))),
        "ready_host": (READY, ready(0, b"")),
        "ready_cuda": (READY, ready(0, b"GCF1" + u32(2))),
        "joined": (JOINED, joined(77, 1, 5)),
        "joined_first": (JOINED, joined(0, 0, 1)),
        "reject": (REJECT, reject(b"unsupported backend 2: this producer uses host")),
        "reject_version": (REJECT, reject(version_reason.encode())),
        "reject_utf8": (REJECT, reject("d\u00e9j\u00e0 vu \u2713".encode())),
        # The longest reason accepted (MAX_REASON bytes).
        "reject_max": (REJECT, reject(b"slow consumer; " * 68 + b"done")),
        "goodbye": (GOODBYE, b""),
    }


def bad_messages():
    """(kind, body) that decode as frames but must be refused, by the decoder or the peer."""
    not_utf8 = bytearray(b"slow consumer")
    not_utf8[4] = 0xFF
    return {
        # Version 1's messages, as the corpus before this one had them.
        "hello_v1": (HELLO, hello(version=1)),
        "welcome_v1": (WELCOME, welcome(0, BROADCAST, 4, 2, HOST, 2, version=1, layout_hash=V1_LAYOUT_HASH)),
        "joined_v1": (JOINED, u64(77)),
        "welcome_old_hash": (WELCOME, welcome(0, BROADCAST, 4, 2, HOST, 4, layout_hash=V1_LAYOUT_HASH)),
        # A consumer's Welcome needs the control segment, the claim segment and its page.
        "welcome_few_fds": (WELCOME, welcome(0, BROADCAST, 4, 2, HOST, 2)),
        "welcome_fds_over_limit": (WELCOME, welcome(0, BROADCAST, 4, 2, HOST, 254)),
        "welcome_index_over_capacity": (WELCOME, welcome(2, BROADCAST, 4, 2, HOST, 4)),
        "welcome_unknown_mode": (WELCOME, welcome(0, 3, 4, 2, HOST, 4)),
        "welcome_slot_bytes_unaligned": (WELCOME, welcome(0, BROADCAST, 4, 2, HOST, 4, slot_bytes=4096)),
        "welcome_too_many_consumers": (WELCOME, welcome(0, BROADCAST, 4, 64, HOST, 4)),
        "hello_unknown_role": (HELLO, hello(role=3)),
        "hello_unknown_backend": (HELLO, hello(backend=3)),
        "ready_host_with_fds": (READY, ready(1, b"")),
        "reject_not_utf8": (REJECT, reject(bytes(not_utf8))),
        "reject_too_long": (REJECT, reject(b"x" * (MAX_REASON + 1))),
        "goodbye_trailing": (GOODBYE, b"\0"),
        "unknown_kind": (7, b""),
    }


def handshake():
    clear("handshake")
    for name, (kind, body) in messages().items():
        write("handshake", "frame_" + name, frame(kind, body))
        # The same body for decode_body: the first two bytes are the kind.
        write("handshake", "body_" + name, u16(kind) + body)
    for name, (kind, body) in bad_messages().items():
        write("handshake", "bad_frame_" + name, frame(kind, body))
        write("handshake", "bad_body_" + name, u16(kind) + body)
    # Refused in the frame prefix (no body reading of these).
    write("handshake", "bad_frame_magic", frame(GOODBYE, b"", magic=b"GPW0"))
    write("handshake", "bad_frame_reserved", frame(GOODBYE, b"", reserved=1))
    write("handshake", "bad_frame_length", frame(JOINED, joined(77, 1, 5), length=17))
    write("handshake", "bad_frame_oversized", frame(READY, b"", length=(1 << 20) + 1))


# --- control segment (sections 2.1 and 2.2) -------------------------------------------------


def segment_bytes(slots, cap):
    raw = HEADER_BYTES + DESC_BYTES * slots + RECORD_BYTES * cap + TABLE_BYTES * slots
    return (raw + 4095) // 4096 * 4096


# DLPack codes (section 2.2): code | bits << 8 | lanes << 16.
INT, UINT, FLOAT, BFLOAT, COMPLEX, BOOL = 0, 1, 2, 4, 5, 6
DTYPES = {
    "bool": (BOOL, 8), "uint8": (UINT, 8), "int64": (INT, 64), "float16": (FLOAT, 16),
    "float32": (FLOAT, 32), "bfloat16": (BFLOAT, 16), "complex64": (COMPLEX, 64),
}


def contiguous(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= max(n, 1)
    return strides


def tensors(*decls):
    """Places (name, dtype, shape[, strides]) as a TensorPlan does: each at the previous one's
    end rounded up to 256. Returns (entries, len)."""
    out, end = [], 0
    for d in decls:
        name, dtype, shape = d[:3]
        strides = d[3] if len(d) > 3 else contiguous(shape)
        offset = (end + 255) // 256 * 256
        size = DTYPES[dtype][1] // 8
        extent = 0 if 0 in shape else (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * size
        out.append((name, dtype, shape, strides, offset))
        end = offset + extent
    return out, end


def table(entries):
    t = bytearray(TABLE_BYTES)
    t[0:4] = u32(len(entries))
    for i, (name, dtype, shape, strides, offset) in enumerate(entries):
        code, bits = DTYPES[dtype]
        e = name.encode().ljust(32, b"\0")
        e += u32(code | bits << 8 | 1 << 16) + u32(len(shape)) + u64(offset)
        e += b"".join(u64(v) for v in shape + [0] * (8 - len(shape)))
        e += b"".join(u64(v) for v in strides + [0] * (8 - len(strides)))
        assert len(e) == ENTRY_BYTES
        o = TABLE_ENTRIES_OFFSET + ENTRY_BYTES * i
        t[o : o + ENTRY_BYTES] = e
    return bytes(t)


class Slot:
    """A descriptor: the batch in the slot (None: nothing yet, or being written again)."""

    def __init__(self, seq=None, length=0, addressed=0, tensors=None):
        self.seq, self.len, self.addressed, self.tensors = seq, length, addressed, tensors


class Record:
    def __init__(self, state, pid, join, cursor, generation=1, received=None, released=None, placement=0):
        self.state, self.pid, self.join, self.cursor = state, pid, join, cursor
        self.generation, self.placement = generation, placement
        self.received = cursor - join if received is None else received
        self.released = self.received if released is None else released


def segment(
    slots,
    cap,
    mode,
    head,
    descs,
    records=(),
    requeued=0,
    state=RUNNING,
    space_sleepers=0,
    version=PROTOCOL_VERSION,
    layout_hash=LAYOUT_HASH,
    header_mode=None,
):
    """A control segment image as ControlSegment::create and the producer write it, cut after
    its last non-zero byte."""
    assert len(descs) == slots and len(records) <= cap
    img = bytearray(segment_bytes(slots, cap))

    def put(off, b):
        img[off : off + len(b)] = b

    put(8, u32(version) + u32(header_mode or mode) + u64(layout_hash) + u32(slots) + u32(cap))
    put(32, u64(SLOT_ALIGN) + u64(segment_bytes(slots, cap)))
    put(48, u32(4242) + u32(state) + u32(HOST) + u32(0) + u64(1_790_000_000_000))
    put(128, u64(head))
    put(256, u32(head & 0xFFFFFFFF))  # data_wake: bumped on publishes (wraps)
    put(384, u64(requeued))
    put(512, u32(space_sleepers))
    tables = HEADER_BYTES + DESC_BYTES * slots + RECORD_BYTES * cap
    for k, s in enumerate(descs):
        d = HEADER_BYTES + DESC_BYTES * k
        if s.seq is None:
            put(d, u64(U64_MAX))
            continue
        assert s.seq % slots == k and s.seq < head
        user = [s.seq * 10 + i for i in range(8)]
        put(d, u64(s.seq) + u64(s.len) + b"".join(u64(w) for w in user))
        put(d + 128, u64(s.addressed if mode == BROADCAST else 0))
        if s.tensors:
            put(tables + TABLE_BYTES * k, table(s.tensors))
    for c, r in enumerate(records):
        o = HEADER_BYTES + DESC_BYTES * slots + RECORD_BYTES * c
        put(o, u32(r.state) + u32(r.pid) + u64(r.join) + u64(r.generation))
        put(o + 128, u64(r.cursor) + u64(r.received) + u64(r.released) + u32(r.placement))
    put(0, b"GPIPESEG")
    return bytes(img).rstrip(b"\0")


def setup(slots, cap, mode, not_write_sealed=False, unsealed=False, short=False, me=0):
    """The target's 4 set-up bytes: slot_count = 1 + b0 % 16, capacity = 1 + b1 % 8, b2 flags,
    b3 the consumer's index."""
    assert 1 <= slots <= 16 and 1 <= cap <= 8
    flags = (mode - 1) | (2 if not_write_sealed else 0) | (4 if unsealed else 0) | (8 if short else 0)
    return bytes([slots - 1, cap - 1, flags, me])


def in_place(device=None):
    # delivery::Placement::encode: bit 0 written, bit 1 mirror, bits 8.. device + 1.
    return 1 | ((device + 1) << 8 if device is not None else 0)


def mirror(device):
    return 1 | 2 | ((device + 1) << 8)


def broadcast_4x2(pids=(1000, 1001)):
    """Head 6: slots hold 4, 5, 2, 3. Consumer 0 (joined at 0) lags at 3, consumer 1 (joined
    at 2) has everything; both still hold what they were addressed."""
    image, image_len = tensors(("image", "uint8", [2, 3, 32, 32]), ("label", "int64", [2]))
    x, x_len = tensors(("x", "float32", [4, 8], [1, 4]), ("mask", "bool", [4]), ("h", "bfloat16", [0, 3]))
    descs = [
        Slot(4, image_len, 0b11, image),
        Slot(5, x_len, 0b11, x),
        Slot(2, 0, 0b11),
        Slot(3, 4096, 0b11),
    ]
    records = [
        Record(ACTIVE, pids[0], 0, 3, placement=in_place()),
        Record(ACTIVE, pids[1], 2, 6, generation=3, placement=mirror(0)),
    ]
    return segment(4, 2, BROADCAST, 6, descs, records)


def segments():
    clear("segment_consumer")
    t = "segment_consumer"
    img = broadcast_4x2()
    write(t, "broadcast_4x2", setup(4, 2, BROADCAST) + img)
    write(t, "broadcast_4x2_observer", setup(4, 2, BROADCAST, me=1) + img)

    # Just created (ControlSegment::create): every seq u64::MAX, nothing published, no records.
    fresh = segment(2, 1, BROADCAST, 0, [Slot(), Slot()])
    write(t, "broadcast_fresh_2x1", setup(2, 1, BROADCAST) + fresh)

    # The largest ring the target makes (16 slots, 8 records), near the last sequence number,
    # with a record in every state; the producer sleeps waiting for space.
    head = MAX_SEQ + 1 - 5
    last = [k + (head - 1 - k) // 16 * 16 for k in range(16)]
    descs = [Slot(s, 1 << 20, 0b101 if s >= head - 4 else 0b1) for s in last]
    records = [
        Record(ACTIVE, 3000, 0, head - 16, received=head - 16),
        Record(ATTACHING, 3001, 0, 0),
        Record(ACTIVE, 3002, head - 4, head - 2, generation=7, placement=in_place(3)),
        Record(LEFT, 3003, 10, 20),
        Record(DEAD, 0, 5, 9),  # pid 0: a peer in another pid namespace
        Record(DETACHED, 3005, 0, 100, released=90),
    ]
    big = segment(16, 8, BROADCAST, head, descs, records, space_sleepers=1)
    write(t, "broadcast_16x8_near_max_seq", setup(16, 8, BROADCAST, me=2) + big)

    # Shared, 8 slots, 4 consumers: head 10, the live window is 2..=9; slot 2 is marked for
    # batch 10 (seq u64::MAX while the producer writes it, section 3.4); requeued once.
    t8, t8_len = tensors(("tokens", "int64", [4, 128]), ("weights", "float16", [4, 128]))
    descs = [Slot(8, t8_len, tensors=t8), Slot(9, 64)]
    descs += [Slot()] + [Slot(s, 64) for s in range(3, 8)]
    records = [
        Record(ACTIVE, 2000, 0, 9, received=5, released=4),
        Record(DEAD, 2001, 0, 7, received=3, released=2),
        Record(ACTIVE, 2002, 0, 8, generation=2, received=2, released=2, placement=mirror(1)),
        Record(DETACHED, 2003, 0, 0),
    ]
    shared = segment(8, 4, SHARED, 10, descs, records, requeued=1)
    write(t, "shared_8x4", setup(8, 4, SHARED, me=2) + shared)

    # Shared, closed: the one consumer left; one slot holding the last batch.
    c64, c64_len = tensors(("z", "complex64", [16]))
    closed = segment(1, 1, SHARED, 3, [Slot(2, c64_len, tensors=c64)], [Record(LEFT, 77, 0, 3)], state=CLOSED)
    write(t, "shared_closed_1x1", setup(1, 1, SHARED) + closed)

    # Refused by ControlSegment::open.
    write(t, "bad_zeroed", setup(4, 2, BROADCAST) + bytes(HEADER_BYTES))
    write(t, "bad_not_write_sealed", setup(4, 2, BROADCAST, not_write_sealed=True) + img)
    write(t, "bad_unsealed", setup(4, 2, BROADCAST, unsealed=True) + img)
    write(t, "bad_short", setup(4, 2, BROADCAST, short=True) + img)
    old = segment(4, 2, BROADCAST, 0, [Slot()] * 4, version=3)
    write(t, "bad_version3", setup(4, 2, BROADCAST) + old)
    old_hash = segment(4, 2, BROADCAST, 0, [Slot()] * 4, layout_hash=V1_LAYOUT_HASH)
    write(t, "bad_layout_hash", setup(4, 2, BROADCAST) + old_hash)
    # The handshake said 3 consumers, the segment says 2.
    write(t, "bad_layout_differs", setup(4, 3, BROADCAST) + img)
    odd_mode = segment(4, 2, BROADCAST, 0, [Slot()] * 4, header_mode=3)
    write(t, "bad_unknown_mode", setup(4, 2, BROADCAST) + odd_mode)


# --- producer-side words -------------------------------------------------------------------


def producer():
    # mode byte, hostile mask (4 consumers), a u64 for the claim-word codec, then the script.
    # Ops: low 3 bits 0 publish if free, 1 join, 2 depart, 3 take (claim/adopt/receive),
    # 4 release, 5 hostile writes the claim word (+selector byte), 6 hostile writes its own
    # page (+selector byte), 7 look; high 4 bits the consumer. Selector: low 3 bits the kind
    # (0 unclaimed, 1 claimed by consumer sel>>4, 2 departed, 3 holding, 4 released, 5 none,
    # 6 zero, 7 raw u64 follows), high 4 bits the batch offset + 2.
    clear("segment_producer")

    def op(code, c=0):
        return bytes([code | (c << 4)])

    def sel(kind, offset=0):
        return bytes([kind | ((offset + 2) << 4)])

    bc = bytes([0, 0b1000]) + u64(0x1234)
    bc += op(1, 0) + op(1, 1) + op(1, 3) + op(0) + op(3, 0) + op(3, 1) + op(4, 0) + op(7)
    bc += op(6, 3) + sel(4) + op(0) + op(4, 1) + op(0) + op(2, 3) + op(0)
    write("segment_producer", "broadcast", bc)

    # Broadcast, consumer 2 hostile: it says it holds, then writes garbage, then departs.
    bh = bytes([0, 0b0100]) + u64(0)
    bh += op(1, 0) + op(1, 2) + op(0) + op(3, 0) + op(6, 2) + sel(3) + op(4, 0) + op(7)
    bh += op(6, 2) + sel(7) + u64(0xDEAD_BEEF) + op(0) + op(2, 2) + op(0) + op(3, 0) + op(4, 0) + op(0)
    write("segment_producer", "broadcast_hostile_holds", bh)

    sh = bytes([1, 0b1000]) + u64(U64_MAX)
    sh += op(1, 0) + op(1, 1) + op(1, 3) + op(0) + op(3, 0) + op(5, 3) + sel(0)
    sh += op(3, 1) + op(0) + op(4, 0) + op(4, 1) + op(0) + op(5, 3) + sel(1)
    sh += op(3, 0) + op(6, 3) + sel(3) + op(7) + op(2, 3) + op(0) + op(2, 0) + op(0)
    write("segment_producer", "shared", sh)

    # Shared, honest: a consumer releases and departs (the word becomes DEPARTED), another
    # joins at the same index and must not take the batch again.
    sd = bytes([1, 0]) + u64(((5 << 8) | 0xFF))
    sd += op(1, 0) + op(1, 1) + op(0) + op(3, 0) + op(4, 0) + op(2, 0) + op(1, 0) + op(3, 0)
    sd += op(7) + op(0) + op(3, 1) + op(4, 1) + op(0)
    write("segment_producer", "shared_release_then_depart", sd)

    # Shared, consumer 1 hostile: forges a claim of the current batch in consumer 2's name (a
    # claimed-by selector's high bits are both the batch offset + 2 and the owner), which 2
    # adopts; then writes a raw word, and says it released a batch it never claimed.
    sf = bytes([1, 0b0010]) + u64(0)
    sf += op(1, 0) + op(1, 1) + op(1, 2) + op(0) + op(5, 1) + sel(1) + op(3, 2) + op(3, 0) + op(7)
    sf += op(5, 1) + sel(7) + u64(U64_MAX - 1) + op(4, 2) + op(0) + op(6, 1) + sel(4) + op(0)
    sf += op(3, 0) + op(4, 0) + op(0)
    write("segment_producer", "shared_forged_claims", sf)


# --- regressions: inputs that crashed a target (replayed by .ci/fuzz) -----------------------


def regressions():
    d = os.path.join(HERE, "regressions", "handshake")
    os.makedirs(d, exist_ok=True)
    # A Reject whose reason is MAX_REASON bytes, one of them not UTF-8: decode's lossy
    # conversion (since replaced by a refusal) yielded 1026 bytes, more than encode sends.
    reason = bytearray(b"slow consumer; " * 68 + b"done")
    reason[100] = 0xFF
    with open(os.path.join(d, "reject_lossy_over_max"), "wb") as f:
        f.write(frame(REJECT, reject(bytes(reason))))

    d = os.path.join(HERE, "regressions", "segment_consumer")
    os.makedirs(d, exist_ok=True)
    # A consumer record whose pid does not fit an i32 (the producer writes it; `gpipe inspect`
    # reads it): Snapshot::read -> sys::pid_exists -> rustix Pid::from_raw(negative). The
    # segment must be one `open` accepts, or the input never reaches Snapshot::read.
    with open(os.path.join(d, "pid_not_i32"), "wb") as f:
        f.write(setup(4, 2, BROADCAST) + broadcast_4x2(pids=(0xFFFFFFFF, 0x80000000)))


if __name__ == "__main__":
    handshake()
    segments()
    producer()
    regressions()
