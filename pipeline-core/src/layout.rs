//! The control segment: a memfd that only the producer writes. It maps its own writable view,
//! then seals the memfd against every later write (`F_SEAL_FUTURE_WRITE`) before any peer
//! gets it, so consumers map it read-only and nothing a consumer does can change what another
//! reads here (docs/protocol.md, version 4). What consumers write lives elsewhere: each one's
//! own [`crate::page::ConsumerPage`], and the shared [`crate::page::ClaimSegment`] whose words
//! the producer never trusts.
//!
//! Layout (all integers little-endian, every field naturally aligned, see docs/protocol.md):
//!
//! | offset | size | what |
//! | --- | --- | --- |
//! | 0 | 1024 | [`SegmentHeader`]: constants, then seven 128-byte lines of counters |
//! | 1024 | 256 × slots | [`SlotDesc`] per slot |
//! | 1024 + 256 × slots | 256 × consumers | [`ConsumerRecord`] per consumer |
//! | after the records | 1536 × slots | [`TensorTable`] per slot |
//!
//! Every byte of the segment lies inside an atomic, so holding a `&SegmentHeader` while
//! the producer writes is sound; values read from it are validated before use.

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
pub const PROTOCOL_VERSION: u32 = 4;
/// Words of user header carried by each batch descriptor (64 bytes).
pub const USER_HEADER_WORDS: usize = 8;
pub use crate::limits::{MAX_CONSUMERS, MAX_SLOT_BYTES, MAX_SLOTS, SLOT_ALIGN, round_slot_bytes};
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

/// Segment header: constants, then counters on separate cache lines. The producer writes
/// every word of it.
#[repr(C)]
pub struct SegmentHeader {
    /// Offset 0.
    pub constants: HeaderConstants,
    /// Offset 128: number of batches published (= next sequence number).
    pub head: Line64,
    /// Offset 256: bumped after a publish (or requeue) when a consumer sleeps.
    pub data_wake: Line32,
    /// Offset 384 (shared mode): bumped whenever the producer puts batches back as
    /// unclaimed; a consumer that sees it change scans the whole live window again.
    pub requeued: Line64,
    /// Offset 512: non-zero while the producer sleeps on the claim segment's `space_wake`.
    pub space_sleepers: Line32,
    _reserved: [Line64; 3],
}

/// One slot's batch descriptor, written by the producer only.
#[repr(C, align(128))]
pub struct SlotDesc {
    /// Sequence number of the batch last published into this slot (`u64::MAX`: none, or
    /// the slot is being written again).
    pub seq: AtomicU64,
    /// Length of that batch in bytes.
    pub len: AtomicU64,
    /// User header of that batch.
    pub header: [AtomicU64; USER_HEADER_WORDS],
    _pad0: [AtomicU64; 6],
    /// Broadcast: bit c set if the batch was published to consumer c and c is still
    /// attached (the producer clears it when c goes). Shared: 0.
    pub addressed: AtomicU64,
    _pad1: [AtomicU64; 15],
}

/// One consumer's record, as the producer sees it: written by the producer only (the
/// counters are copied from the consumer's own page by the producer's supervisor, every tick).
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
    /// Copied from the consumer's page: next sequence number it reads (broadcast) or last
    /// claimed + 1 (shared).
    pub cursor: AtomicU64,
    /// Copied from the consumer's page: batches received.
    pub received: AtomicU64,
    /// Copied from the consumer's page: batches released.
    pub released: AtomicU64,
    /// Copied from the consumer's page: where it uses its batches
    /// ([`crate::delivery::Placement::encode`]; 0 until written).
    pub placement: AtomicU32,
    _pad_placement: AtomicU32,
    _pad1: [AtomicU64; 12],
}

/// Offset of the first slot descriptor.
pub const SLOTS_OFFSET: usize = size_of::<SegmentHeader>();

const _: () = {
    assert!(size_of::<HeaderConstants>() == 128);
    assert!(size_of::<Line64>() == 128 && size_of::<Line32>() == 128);
    assert!(size_of::<SegmentHeader>() == 1024);
    assert!(std::mem::offset_of!(SegmentHeader, head) == 128);
    assert!(std::mem::offset_of!(SegmentHeader, data_wake) == 256);
    assert!(std::mem::offset_of!(SegmentHeader, requeued) == 384);
    assert!(std::mem::offset_of!(SegmentHeader, space_sleepers) == 512);
    assert!(std::mem::offset_of!(HeaderConstants, version) == 8);
    assert!(std::mem::offset_of!(HeaderConstants, layout_hash) == 16);
    assert!(std::mem::offset_of!(HeaderConstants, slot_count) == 24);
    assert!(std::mem::offset_of!(HeaderConstants, slot_bytes) == 32);
    assert!(std::mem::offset_of!(HeaderConstants, producer_pid) == 48);
    assert!(std::mem::offset_of!(HeaderConstants, created_unix_ms) == 64);
    assert!(SLOTS_OFFSET == 1024);
    assert!(size_of::<SlotDesc>() == 256);
    assert!(std::mem::offset_of!(SlotDesc, header) == 16);
    assert!(std::mem::offset_of!(SlotDesc, addressed) == 128);
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

/// Bytes of a consumer's page before its per-slot progress words (see `page.rs`).
pub const PAGE_HEADER_BYTES: usize = 256;
/// Offset of the first claim word in the claim segment (see `page.rs`).
pub const CLAIMS_OFFSET: usize = 128;
/// Distance between two claim words (each on a line of its own: consumers write them).
pub const CLAIM_STRIDE: usize = 128;

/// A hash of every size and offset in the layout: peers built from another revision of the
/// layout refuse each other instead of misreading.
pub const LAYOUT_HASH: u64 = {
    let parts: [u64; 23] = [
        PROTOCOL_VERSION as u64,
        size_of::<SegmentHeader>() as u64,
        PAGE_HEADER_BYTES as u64,
        size_of::<SlotDesc>() as u64,
        size_of::<ConsumerRecord>() as u64,
        std::mem::offset_of!(SegmentHeader, head) as u64,
        std::mem::offset_of!(SegmentHeader, data_wake) as u64,
        std::mem::offset_of!(SegmentHeader, requeued) as u64,
        std::mem::offset_of!(SegmentHeader, space_sleepers) as u64,
        std::mem::offset_of!(SlotDesc, len) as u64,
        std::mem::offset_of!(SlotDesc, header) as u64,
        std::mem::offset_of!(SlotDesc, addressed) as u64,
        CLAIM_STRIDE as u64,
        CLAIMS_OFFSET as u64,
        std::mem::offset_of!(ConsumerRecord, join_seq) as u64,
        std::mem::offset_of!(ConsumerRecord, cursor) as u64,
        USER_HEADER_WORDS as u64,
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
    /// The producer's writable view is mapped first, then the memfd is sealed against every
    /// later write (`F_SEAL_FUTURE_WRITE`): the fd it hands out can only be mapped read-only.
    pub fn create(layout: RingLayout, backend: u32) -> Result<Self, Error> {
        layout.validate()?;
        let bytes = layout.segment_bytes();
        let unshared = sys::UnsharedMemfd::create("gpipe-control", bytes)
            .map_err(Error::os("memfd_create"))?;
        let map = MmapOptions::new()
            .len(bytes as usize)
            .map_raw(&unshared.fd())
            .map_err(Error::os("mmap control segment"))?;
        let fd = unshared
            .seal_writes()
            .map_err(Error::os("seal the control segment"))?;
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

    /// Maps a segment received from a producer, read-only, and checks it against the layout
    /// announced in the handshake. Nothing is trusted: magic, version, hash, sizes and seals
    /// (it must be sealed against writes, so that no other peer can change it) are checked.
    pub fn open(fd: OwnedFd, expected: RingLayout) -> Result<Self, Error> {
        expected.validate()?;
        let bytes = expected.segment_bytes();
        sys::check_write_sealed_memfd(fd.as_fd(), bytes)
            .map_err(|m| ProtocolError::Segment(format!("control segment: {m}")))?;
        // Peers only load from it (atomics on a read-only mapping are fine for loads) and
        // wait on its futex word, which the kernel allows on a read-only mapping.
        let map = MmapOptions::new()
            .len(bytes as usize)
            .map_raw_read_only(&fd)
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

    /// Raw base pointer and length (for tests that try to scribble on the segment: a
    /// consumer's mapping is read-only, so a store through it faults).
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
        let other = ControlSegment::open(fd, layout()).unwrap();
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
        assert!(ControlSegment::open(fd, l2).is_err());
        seg.header().constants.magic.store(0, Ordering::Relaxed);
        let fd = seg.fd().try_clone_to_owned().unwrap();
        let e = ControlSegment::open(fd, layout()).err().unwrap();
        assert!(e.to_string().contains("bad magic"), "{e}");
    }

    #[test]
    fn the_shared_fd_cannot_be_written() {
        let seg = ControlSegment::create(layout(), 1).unwrap();
        let e = MmapOptions::new()
            .len(4096)
            .map_raw(&seg.fd())
            .expect_err("a writable mapping of the control segment must be refused");
        assert_eq!(e.raw_os_error(), Some(libc_eperm()), "{e}");
        let e = rustix::io::write(seg.fd(), b"x").unwrap_err();
        assert_eq!(e, rustix::io::Errno::PERM);
    }

    fn libc_eperm() -> i32 {
        rustix::io::Errno::PERM.raw_os_error()
    }

    #[test]
    fn open_refuses_unsealed_memfd() {
        let fd = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, layout().segment_bytes()).unwrap();
        let e = ControlSegment::open(fd, layout()).err().unwrap();
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
