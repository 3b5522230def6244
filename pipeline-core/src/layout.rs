//! The control segment: a sealed memfd shared by the producer and every consumer.
//!
//! Layout (all integers little-endian, every field naturally aligned, see docs/protocol.md):
//!
//! | offset | size | what |
//! | --- | --- | --- |
//! | 0 | 768 | [`SegmentHeader`]: constants, then five 128-byte lines of counters |
//! | 768 | 256 | [`ClaimLines`] |
//! | 1024 | 256 × slots | [`SlotDesc`] per slot |
//! | 1024 + 256 × slots | 256 × consumers | [`ConsumerRecord`] per consumer |
//! | after the records | 1536 × slots | [`TensorTable`] per slot |
//!
//! Every byte of the segment lies inside an atomic, so holding a `&SegmentHeader` while
//! another process writes is sound; values read from it are validated before use.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Error, ProtocolError};
use crate::limits;
use crate::sys;
use crate::tensor::TensorTable;

/// `"GPIPESEG"` little-endian: written last by the producer, it marks the segment initialised.
pub const MAGIC: u64 = u64::from_le_bytes(*b"GPIPESEG");
/// Version of the control-segment layout and the handshake.
pub const PROTOCOL_VERSION: u32 = 3;
/// Words of user header carried by each batch descriptor (64 bytes).
pub const USER_HEADER_WORDS: usize = 8;
pub use crate::limits::{MAX_CONSUMERS, MAX_SLOT_BYTES, MAX_SLOTS, SLOT_ALIGN, round_slot_bytes};
pub use crate::ring::UNCLAIMED;
/// Largest sequence number (sequences are 48-bit so they fit next to flags if ever needed).
pub const MAX_SEQ: u64 = (1 << 48) - 1;

/// `producer_state` values.
pub mod producer_state {
    /// Publishing.
    pub const RUNNING: u32 = 1;
    /// Shut down cleanly: consumers drain what is published, then end.
    pub const CLOSED: u32 = 2;
}

/// `ConsumerRecord::state` values.
pub mod consumer_state {
    /// Never used.
    pub const FREE: u32 = 0;
    /// Handshake in progress.
    pub const ATTACHING: u32 = 1;
    /// Receiving batches.
    pub const ACTIVE: u32 = 2;
    /// Left cleanly.
    pub const LEFT: u32 = 3;
    /// Died (its socket closed without a goodbye); its claims were taken back.
    pub const DEAD: u32 = 4;
    /// Detached by the producer (lag policy or a protocol violation).
    pub const DETACHED: u32 = 5;

    /// A name for display.
    pub fn name(s: u32) -> &'static str {
        match s {
            FREE => "free",
            ATTACHING => "attaching",
            ACTIVE => "active",
            LEFT => "left",
            DEAD => "dead",
            DETACHED => "detached",
            _ => "invalid",
        }
    }
}

/// Delivery mode of a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every attached consumer gets every batch published after it joined.
    Broadcast,
    /// Each batch goes to exactly one consumer (a work queue).
    Shared,
}

impl Mode {
    /// Wire value.
    pub fn to_u32(self) -> u32 {
        match self {
            Mode::Broadcast => 1,
            Mode::Shared => 2,
        }
    }
    /// From the wire value.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Mode::Broadcast),
            2 => Some(Mode::Shared),
            _ => None,
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Broadcast => "broadcast",
            Mode::Shared => "shared",
        })
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "broadcast" => Ok(Mode::Broadcast),
            "shared" => Ok(Mode::Shared),
            _ => Err(format!("unknown mode {s:?}: use broadcast or shared")),
        }
    }
}

/// The constants of a ring, as the producer chose them and as every peer checks them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RingLayout {
    /// Number of slots (N).
    pub slot_count: u32,
    /// Capacity of each slot in bytes (a multiple of 2 MiB).
    pub slot_bytes: u64,
    /// Most consumers at once.
    pub consumer_capacity: u32,
    /// Delivery mode.
    pub mode: Mode,
}

impl RingLayout {
    /// Checks the constants are within gpipe's limits ([`crate::limits`]).
    pub fn validate(&self) -> Result<(), ProtocolError> {
        limits::check_slots(self.slot_count)
            .and_then(|()| limits::check_slot_bytes(self.slot_bytes))
            .and_then(|()| limits::check_max_consumers(self.consumer_capacity))
            .map_err(|e| ProtocolError::Layout(e.to_string()))
    }

    /// Bytes of the control segment for this layout (page-rounded).
    pub fn segment_bytes(&self) -> u64 {
        let raw = SLOTS_OFFSET as u64
            + self.slot_count as u64 * size_of::<SlotDesc>() as u64
            + self.consumer_capacity as u64 * size_of::<ConsumerRecord>() as u64
            + self.slot_count as u64 * size_of::<TensorTable>() as u64;
        raw.div_ceil(4096) * 4096
    }

    fn consumers_offset(&self) -> usize {
        SLOTS_OFFSET + self.slot_count as usize * size_of::<SlotDesc>()
    }

    fn tables_offset(&self) -> usize {
        self.consumers_offset() + self.consumer_capacity as usize * size_of::<ConsumerRecord>()
    }
}

/// Constants: written once by the producer before `magic`.
#[repr(C, align(128))]
pub struct HeaderConstants {
    /// [`MAGIC`], stored last (Release) when the segment is initialised.
    pub magic: AtomicU64,
    /// [`PROTOCOL_VERSION`].
    pub version: AtomicU32,
    /// [`Mode::to_u32`].
    pub mode: AtomicU32,
    /// [`LAYOUT_HASH`].
    pub layout_hash: AtomicU64,
    /// Number of slots.
    pub slot_count: AtomicU32,
    /// Consumer capacity.
    pub consumer_capacity: AtomicU32,
    /// Slot capacity in bytes.
    pub slot_bytes: AtomicU64,
    /// Segment size in bytes.
    pub segment_bytes: AtomicU64,
    /// Producer's pid (informational).
    pub producer_pid: AtomicU32,
    /// [`producer_state`].
    pub producer_state: AtomicU32,
    /// Backend kind ([`crate::BackendKind`]).
    pub backend: AtomicU32,
    /// Reserved, zero.
    pub reserved0: AtomicU32,
    /// Creation time, milliseconds since the Unix epoch (informational).
    pub created_unix_ms: AtomicU64,
    _pad: [AtomicU64; 7],
}

/// A 128-byte line holding one counter written by one side.
#[repr(C, align(128))]
pub struct Line64 {
    /// The counter.
    pub value: AtomicU64,
    _pad: [AtomicU64; 15],
}

/// A 128-byte line holding one futex word.
#[repr(C, align(128))]
pub struct Line32 {
    /// The word.
    pub value: AtomicU32,
    _pad: [AtomicU32; 31],
}

/// Segment header: constants, then counters on separate cache lines by writer.
#[repr(C)]
pub struct SegmentHeader {
    /// Offset 0.
    pub constants: HeaderConstants,
    /// Offset 128, producer writes: number of batches published (= next sequence number).
    pub head: Line64,
    /// Offset 256, producer writes: bumped after a publish (or requeue) when consumers sleep.
    pub data_wake: Line32,
    /// Offset 384, consumers write: how many consumers sleep on `data_wake`.
    pub data_sleepers: Line32,
    /// Offset 512, consumers write: bumped after a release when the producer sleeps.
    pub space_wake: Line32,
    /// Offset 640, producer writes: non-zero while the producer sleeps on `space_wake`.
    pub space_sleepers: Line32,
}

/// One slot's batch descriptor: a line written by the producer, a line written by consumers.
#[repr(C, align(128))]
pub struct SlotDesc {
    /// Sequence number of the batch last published into this slot (`u64::MAX`: never).
    pub seq: AtomicU64,
    /// Length of that batch in bytes.
    pub len: AtomicU64,
    /// User header of that batch.
    pub header: [AtomicU64; USER_HEADER_WORDS],
    _pad0: [AtomicU64; 6],
    /// Consumers' line. Broadcast: bit c set while consumer c still holds the batch.
    /// Shared: [`UNCLAIMED`], or bit c while consumer c holds it, or 0 when free.
    pub pending: AtomicU64,
    /// Shared mode: claim token ([`crate::ring::claim_token`]) of the consumer that claimed the
    /// batch, for the backend's waits; `u64::MAX` when published.
    pub claimer: AtomicU64,
    _pad1: [AtomicU64; 14],
}

/// One consumer's record.
#[repr(C, align(128))]
pub struct ConsumerRecord {
    /// Producer writes: [`consumer_state`].
    pub state: AtomicU32,
    /// Producer writes: pid from `SO_PEERCRED`.
    pub pid: AtomicU32,
    /// Producer writes: first sequence number this consumer receives (broadcast).
    pub join_seq: AtomicU64,
    /// Producer writes: bumped on every attach to this record.
    pub generation: AtomicU64,
    _pad0: [AtomicU64; 13],
    /// Consumer writes: next sequence number it reads (broadcast) or last claimed + 1 (shared).
    pub cursor: AtomicU64,
    /// Consumer writes: batches received.
    pub received: AtomicU64,
    /// Consumer writes: batches released.
    pub released: AtomicU64,
    /// Consumer writes, at attach: where it uses its batches
    /// ([`crate::delivery::Placement::encode`]; 0 until written).
    pub placement: AtomicU32,
    _pad_placement: AtomicU32,
    _pad1: [AtomicU64; 12],
}

/// Shared-mode claim hint and requeue count, at offset 768, each on a line of its own
/// because consumers write them.
#[repr(C)]
pub struct ClaimLines {
    /// Consumers write (shared mode): lowest sequence number that may still be unclaimed.
    pub claim_hint: Line64,
    /// Producer and consumers write (shared mode): batches put back after a consumer died.
    pub requeued: Line64,
}

/// Offset of the claim lines.
pub const CLAIM_OFFSET: usize = size_of::<SegmentHeader>();
/// Offset of the first slot descriptor.
pub const SLOTS_OFFSET: usize = CLAIM_OFFSET + size_of::<ClaimLines>();

const _: () = {
    assert!(size_of::<HeaderConstants>() == 128);
    assert!(size_of::<Line64>() == 128 && size_of::<Line32>() == 128);
    assert!(size_of::<SegmentHeader>() == 768);
    assert!(std::mem::offset_of!(SegmentHeader, head) == 128);
    assert!(std::mem::offset_of!(SegmentHeader, data_wake) == 256);
    assert!(std::mem::offset_of!(SegmentHeader, data_sleepers) == 384);
    assert!(std::mem::offset_of!(SegmentHeader, space_wake) == 512);
    assert!(std::mem::offset_of!(SegmentHeader, space_sleepers) == 640);
    assert!(std::mem::offset_of!(HeaderConstants, version) == 8);
    assert!(std::mem::offset_of!(HeaderConstants, layout_hash) == 16);
    assert!(std::mem::offset_of!(HeaderConstants, slot_count) == 24);
    assert!(std::mem::offset_of!(HeaderConstants, slot_bytes) == 32);
    assert!(std::mem::offset_of!(HeaderConstants, producer_pid) == 48);
    assert!(std::mem::offset_of!(HeaderConstants, created_unix_ms) == 64);
    assert!(size_of::<ClaimLines>() == 256);
    assert!(SLOTS_OFFSET == 1024);
    assert!(size_of::<SlotDesc>() == 256);
    assert!(std::mem::offset_of!(SlotDesc, header) == 16);
    assert!(std::mem::offset_of!(SlotDesc, pending) == 128);
    assert!(std::mem::offset_of!(SlotDesc, claimer) == 136);
    assert!(size_of::<ConsumerRecord>() == 256);
    assert!(std::mem::offset_of!(ConsumerRecord, cursor) == 128);
};

const fn fnv1a(mut h: u64, v: u64) -> u64 {
    let b = v.to_le_bytes();
    let mut i = 0;
    while i < 8 {
        h ^= b[i] as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
        i += 1;
    }
    h
}

/// A hash of every size and offset in the layout: peers built from another revision of the
/// layout refuse each other instead of misreading.
pub const LAYOUT_HASH: u64 = {
    let parts: [u64; 22] = [
        PROTOCOL_VERSION as u64,
        size_of::<SegmentHeader>() as u64,
        size_of::<ClaimLines>() as u64,
        size_of::<SlotDesc>() as u64,
        size_of::<ConsumerRecord>() as u64,
        std::mem::offset_of!(SegmentHeader, head) as u64,
        std::mem::offset_of!(SegmentHeader, data_wake) as u64,
        std::mem::offset_of!(SegmentHeader, space_wake) as u64,
        std::mem::offset_of!(SlotDesc, len) as u64,
        std::mem::offset_of!(SlotDesc, header) as u64,
        std::mem::offset_of!(SlotDesc, pending) as u64,
        std::mem::offset_of!(SlotDesc, claimer) as u64,
        std::mem::offset_of!(ConsumerRecord, join_seq) as u64,
        std::mem::offset_of!(ConsumerRecord, cursor) as u64,
        USER_HEADER_WORDS as u64,
        UNCLAIMED,
        size_of::<TensorTable>() as u64,
        size_of::<crate::tensor::TensorEntry>() as u64,
        std::mem::offset_of!(TensorTable, entries) as u64,
        std::mem::offset_of!(crate::tensor::TensorEntry, shape) as u64,
        crate::tensor::MAX_TENSORS as u64,
        crate::tensor::MAX_DIMS as u64,
    ];
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut i = 0;
    while i < parts.len() {
        h = fnv1a(h, parts[i]);
        i += 1;
    }
    h
};

/// A mapped control segment. Accessors hand out references to atomics only.
pub struct ControlSegment {
    map: MmapRaw,
    fd: OwnedFd,
    layout: RingLayout,
}

impl ControlSegment {
    /// Creates and initialises a segment for `layout` (producer side). `magic` is written last.
    pub fn create(layout: RingLayout, backend: u32) -> Result<Self, Error> {
        layout.validate()?;
        let bytes = layout.segment_bytes();
        let fd = sys::sealed_memfd("gpipe-control", bytes).map_err(Error::os("memfd_create"))?;
        let map = MmapOptions::new()
            .len(bytes as usize)
            .map_raw(&fd)
            .map_err(Error::os("mmap control segment"))?;
        let seg = Self { map, fd, layout };
        let c = &seg.header().constants;
        c.version.store(PROTOCOL_VERSION, Ordering::Relaxed);
        c.mode.store(layout.mode.to_u32(), Ordering::Relaxed);
        c.layout_hash.store(LAYOUT_HASH, Ordering::Relaxed);
        c.slot_count.store(layout.slot_count, Ordering::Relaxed);
        c.consumer_capacity
            .store(layout.consumer_capacity, Ordering::Relaxed);
        c.slot_bytes.store(layout.slot_bytes, Ordering::Relaxed);
        c.segment_bytes.store(bytes, Ordering::Relaxed);
        c.producer_pid.store(std::process::id(), Ordering::Relaxed);
        c.producer_state
            .store(producer_state::RUNNING, Ordering::Relaxed);
        c.backend.store(backend, Ordering::Relaxed);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        c.created_unix_ms.store(now, Ordering::Relaxed);
        for k in 0..layout.slot_count {
            seg.slot(k).seq.store(u64::MAX, Ordering::Relaxed);
        }
        c.magic.store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Maps a segment received from a producer and checks it against the layout announced in
    /// the handshake. Nothing is trusted: magic, version, hash, sizes and seals are checked.
    pub fn open(fd: OwnedFd, expected: RingLayout, writable: bool) -> Result<Self, Error> {
        expected.validate()?;
        let bytes = expected.segment_bytes();
        sys::check_sealed_memfd(fd.as_fd(), bytes)
            .map_err(|m| ProtocolError::Segment(format!("control segment: {m}")))?;
        let mut opts = MmapOptions::new();
        opts.len(bytes as usize);
        let map = if writable {
            opts.map_raw(&fd)
        } else {
            // Read-only observers (gpipe inspect) still need atomics; loads on a read-only
            // mapping are fine, and they never store.
            opts.map_raw_read_only(&fd)
        }
        .map_err(Error::os("mmap control segment"))?;
        let seg = Self {
            map,
            fd,
            layout: expected,
        };
        let c = &seg.header().constants;
        let magic = c.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(ProtocolError::Segment(format!(
                "bad magic {magic:#018x} (expected {MAGIC:#018x}): not a gpipe control segment"
            ))
            .into());
        }
        let version = c.version.load(Ordering::Relaxed);
        if version != PROTOCOL_VERSION {
            return Err(ProtocolError::Version {
                ours: PROTOCOL_VERSION,
                theirs: version,
            }
            .into());
        }
        let hash = c.layout_hash.load(Ordering::Relaxed);
        if hash != LAYOUT_HASH {
            return Err(ProtocolError::Segment(format!(
                "layout hash {hash:#x} differs from ours {LAYOUT_HASH:#x}: peer built from another revision"
            ))
            .into());
        }
        let found = RingLayout {
            slot_count: c.slot_count.load(Ordering::Relaxed),
            slot_bytes: c.slot_bytes.load(Ordering::Relaxed),
            consumer_capacity: c.consumer_capacity.load(Ordering::Relaxed),
            mode: Mode::from_u32(c.mode.load(Ordering::Relaxed)).ok_or_else(|| {
                ProtocolError::Segment("control segment names an unknown mode".into())
            })?,
        };
        if found != expected {
            return Err(ProtocolError::Segment(format!(
                "control segment layout {found:?} differs from the handshake's {expected:?}"
            ))
            .into());
        }
        Ok(seg)
    }

    /// The layout (local copy, checked at open; never re-read from shared memory).
    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    /// The memfd, to pass to consumers.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The header.
    #[inline]
    pub fn header(&self) -> &SegmentHeader {
        // SAFETY: the mapping (checked at create/open) is >= size_of::<SegmentHeader>(),
        // page-aligned and lives as long as `self`; every byte of SegmentHeader is inside an
        // atomic, so other processes' concurrent writes are no data race on plain memory.
        unsafe { &*(self.map.as_ptr() as *const SegmentHeader) }
    }

    /// The shared-mode claim lines.
    #[inline]
    pub fn claim(&self) -> &ClaimLines {
        // SAFETY: as for `header`: CLAIM_OFFSET + size_of::<ClaimLines>() == SLOTS_OFFSET is
        // within the mapping, 128-aligned, and all atomics.
        unsafe { &*(self.map.as_ptr().add(CLAIM_OFFSET) as *const ClaimLines) }
    }

    /// Slot `k`'s descriptor. Panics if `k` is out of range: callers pass indices they
    /// computed from the local layout, never values read from shared memory.
    #[inline]
    pub fn slot(&self, k: u32) -> &SlotDesc {
        assert!(k < self.layout.slot_count, "slot index {k} out of range");
        let off = SLOTS_OFFSET + k as usize * size_of::<SlotDesc>();
        // SAFETY: k < slot_count, so [off, off + 256) lies within segment_bytes(); the offset
        // is a multiple of 128 from a page-aligned base; all fields are atomics.
        unsafe { &*(self.map.as_ptr().add(off) as *const SlotDesc) }
    }

    /// Consumer record `c`. Panics if `c` is out of range (indices come from local state).
    #[inline]
    pub fn consumer(&self, c: u32) -> &ConsumerRecord {
        assert!(
            c < self.layout.consumer_capacity,
            "consumer index {c} out of range"
        );
        let off = self.layout.consumers_offset() + c as usize * size_of::<ConsumerRecord>();
        // SAFETY: c < consumer_capacity, so the record lies within segment_bytes(); aligned to
        // 128 from a page-aligned base; all fields are atomics.
        unsafe { &*(self.map.as_ptr().add(off) as *const ConsumerRecord) }
    }

    /// Slot `k`'s tensor table. Panics if `k` is out of range (indices come from local state).
    #[inline]
    pub fn tensor_table(&self, k: u32) -> &TensorTable {
        assert!(k < self.layout.slot_count, "slot index {k} out of range");
        let off = self.layout.tables_offset() + k as usize * size_of::<TensorTable>();
        // SAFETY: k < slot_count, so the table lies within segment_bytes(); the offset is a
        // multiple of 128 (every region before it is) from a page-aligned base; all fields are
        // atomics.
        unsafe { &*(self.map.as_ptr().add(off) as *const TensorTable) }
    }

    /// Raw base pointer and length (for tests that scribble on the segment on purpose).
    pub fn as_raw(&self) -> (*mut u8, usize) {
        (self.map.as_mut_ptr(), self.map.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> RingLayout {
        RingLayout {
            slot_count: 4,
            slot_bytes: SLOT_ALIGN,
            consumer_capacity: 8,
            mode: Mode::Broadcast,
        }
    }

    #[test]
    fn rounding_is_to_2mib() {
        assert_eq!(round_slot_bytes(0), SLOT_ALIGN);
        assert_eq!(round_slot_bytes(1), SLOT_ALIGN);
        assert_eq!(round_slot_bytes(SLOT_ALIGN), SLOT_ALIGN);
        assert_eq!(round_slot_bytes(SLOT_ALIGN + 1), 2 * SLOT_ALIGN);
    }

    #[test]
    fn create_then_open_roundtrip() {
        let seg = ControlSegment::create(layout(), 1).unwrap();
        let fd = seg.fd().try_clone_to_owned().unwrap();
        let other = ControlSegment::open(fd, layout(), true).unwrap();
        seg.slot(3).len.store(77, Ordering::Relaxed);
        assert_eq!(other.slot(3).len.load(Ordering::Relaxed), 77);
        assert_eq!(other.slot(0).seq.load(Ordering::Relaxed), u64::MAX);
    }

    #[test]
    fn open_refuses_other_layout_and_bad_magic() {
        let seg = ControlSegment::create(layout(), 1).unwrap();
        let mut l2 = layout();
        l2.slot_count = 5;
        let fd = seg.fd().try_clone_to_owned().unwrap();
        assert!(ControlSegment::open(fd, l2, true).is_err());
        seg.header().constants.magic.store(0, Ordering::Relaxed);
        let fd = seg.fd().try_clone_to_owned().unwrap();
        let e = ControlSegment::open(fd, layout(), true).err().unwrap();
        assert!(e.to_string().contains("bad magic"), "{e}");
    }

    #[test]
    fn open_refuses_unsealed_memfd() {
        let fd = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, layout().segment_bytes()).unwrap();
        let e = ControlSegment::open(fd, layout(), true).err().unwrap();
        assert!(e.to_string().contains("seal"), "{e}");
    }

    #[test]
    fn layout_validation() {
        let mut l = layout();
        l.slot_count = 0;
        assert!(l.validate().is_err());
        let mut l = layout();
        l.consumer_capacity = 64;
        assert!(l.validate().is_err());
        let mut l = layout();
        l.slot_bytes = 4096;
        assert!(l.validate().is_err());
    }
}
