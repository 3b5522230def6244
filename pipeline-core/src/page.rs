//! What consumers write, kept apart from what they read (docs/protocol.md, version 4):
//!
//! * [`ConsumerPage`]: one memfd per attach, made by the producer and sent to that consumer
//!   alone; only the two of them map it writable. It holds the consumer's progress: per slot
//!   the batch it holds or released last ([`crate::ring::holding`], [`crate::ring::released`]),
//!   whether it sleeps waiting for data, and counters for `gpipe inspect`. A consumer can
//!   write only its own page, so whatever it writes there speaks for itself alone.
//! * [`ClaimSegment`]: one memfd that every consumer maps writable, holding only words whose
//!   every value is harmless to others: the futex word consumers bump to wake the producer (a
//!   poke only makes it re-check), and in shared mode one claim word per slot, which decides
//!   between honest consumers racing for a batch but which the producer never trusts: it
//!   believes a claim only when the claimer's own page records it.
//!
//! Layouts (all integers little-endian):
//!
//! | page offset | size | field | writer |
//! | --- | --- | --- | --- |
//! | 0 | 4 | sleeping: consumer threads asleep on the control segment's `data_wake` | consumer |
//! | 128 | 8 | cursor (informational) | consumer |
//! | 136 | 8 | received (informational) | consumer |
//! | 144 | 8 | released (informational) | consumer |
//! | 152 | 4 | placement ([`crate::delivery::Placement::encode`]) | consumer |
//! | 256 | 8 × slots | progress word per slot | consumer |
//!
//! | claim offset | size | field | writer |
//! | --- | --- | --- | --- |
//! | 0 | 4 | space_wake: futex word the producer sleeps on | consumers |
//! | 128 + 128 × k | 8 | claim word of slot k (shared mode) | producer, consumers |

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Error, ProtocolError};
use crate::layout::{Line32, RingLayout};
use crate::sys;

// The sizes and offsets of pages and claim words are part of the layout (its hash covers
// them), so they live with it.
pub use crate::layout::{CLAIM_STRIDE, CLAIMS_OFFSET, PAGE_HEADER_BYTES};

/// The head of a consumer's page.
#[repr(C)]
pub struct PageHeader {
    /// Offset 0: consumer threads asleep on `data_wake` (the producer wakes them only if
    /// some page says so).
    pub sleeping: Line32,
    /// Offset 128: next sequence number it reads (broadcast) or last claimed + 1 (shared).
    pub cursor: AtomicU64,
    /// Offset 136: batches received.
    pub received: AtomicU64,
    /// Offset 144: batches released.
    pub released: AtomicU64,
    /// Offset 152: where it uses its batches (0 until written).
    pub placement: AtomicU32,
    _pad: [AtomicU32; 25],
}

const _: () = {
    assert!(size_of::<PageHeader>() == PAGE_HEADER_BYTES);
    assert!(std::mem::offset_of!(PageHeader, cursor) == 128);
    assert!(std::mem::offset_of!(PageHeader, placement) == 152);
};

fn page_bytes(layout: &RingLayout) -> u64 {
    (PAGE_HEADER_BYTES as u64 + 8 * layout.slot_count as u64).div_ceil(4096) * 4096
}

fn claim_bytes(layout: &RingLayout) -> u64 {
    (CLAIMS_OFFSET as u64 + CLAIM_STRIDE as u64 * layout.slot_count as u64).div_ceil(4096) * 4096
}

/// A sealed memfd mapped writable, for a ring of `slots` slots: what a consumer page and the
/// claim segment are each made of.
struct SharedWords {
    map: MmapRaw,
    fd: OwnedFd,
    slots: u32,
}

impl SharedWords {
    /// Producer: a fresh sealed memfd of `bytes` (all zero), mapped.
    fn create(name: &str, bytes: u64, what: &str, layout: &RingLayout) -> Result<Self, Error> {
        let fd = sys::sealed_memfd(name, bytes).map_err(Error::os("memfd_create"))?;
        Self::open(fd, bytes, what, layout)
    }

    /// Maps `fd` writable after checking it is sealed against resizing and large enough.
    fn open(fd: OwnedFd, bytes: u64, what: &str, layout: &RingLayout) -> Result<Self, Error> {
        sys::check_sealed_memfd(fd.as_fd(), bytes)
            .map_err(|m| ProtocolError::Segment(format!("{what}: {m}")))?;
        let map = MmapOptions::new()
            .len(bytes as usize)
            .map_raw(&fd)
            .map_err(|e| Error::Os {
                what: "mmap a consumer page or the claim segment",
                source: e,
            })?;
        Ok(Self {
            map,
            fd,
            slots: layout.slot_count,
        })
    }
}

/// One consumer's own page (see the module's documentation).
pub struct ConsumerPage(SharedWords);

impl ConsumerPage {
    /// Producer: a fresh page for one attach, all zero.
    pub fn create(layout: &RingLayout) -> Result<Self, Error> {
        SharedWords::create(
            "gpipe-consumer-page",
            page_bytes(layout),
            "consumer page",
            layout,
        )
        .map(Self)
    }

    /// Consumer: maps the page the producer sent us.
    pub fn open(fd: OwnedFd, layout: &RingLayout) -> Result<Self, Error> {
        SharedWords::open(fd, page_bytes(layout), "consumer page", layout).map(Self)
    }

    /// The memfd, to send to its consumer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.fd.as_fd()
    }

    /// The page's head.
    #[inline]
    pub fn header(&self) -> &PageHeader {
        // SAFETY: the mapping is at least PAGE_HEADER_BYTES long (page_bytes, checked at
        // map time), page-aligned, lives as long as `self`, and PageHeader is made of atomics
        // only, so the other process's concurrent stores are no data race on plain memory.
        unsafe { &*(self.0.map.as_ptr() as *const PageHeader) }
    }

    /// Slot `k`'s progress word. Panics if `k` is out of range (indices come from local
    /// state, never from shared memory).
    #[inline]
    pub fn slot(&self, k: u32) -> &AtomicU64 {
        assert!(k < self.0.slots, "slot index {k} out of range");
        let off = PAGE_HEADER_BYTES + 8 * k as usize;
        // SAFETY: k < slot_count, so [off, off + 8) lies within page_bytes(); off is a
        // multiple of 8 from a page-aligned base; the word is only accessed atomically.
        unsafe { &*(self.0.map.as_ptr().add(off) as *const AtomicU64) }
    }
}

/// The claim segment every consumer of a ring maps writable (see the module's documentation).
pub struct ClaimSegment(SharedWords);

impl ClaimSegment {
    /// Producer: creates it; every claim word starts as "nothing published" (`u64::MAX`).
    pub fn create(layout: &RingLayout) -> Result<Self, Error> {
        let seg = Self(SharedWords::create(
            "gpipe-claims",
            claim_bytes(layout),
            "claim segment",
            layout,
        )?);
        for k in 0..layout.slot_count {
            seg.claim(k)
                .store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(seg)
    }

    /// Consumer: maps the segment the producer sent.
    pub fn open(fd: OwnedFd, layout: &RingLayout) -> Result<Self, Error> {
        SharedWords::open(fd, claim_bytes(layout), "claim segment", layout).map(Self)
    }

    /// The memfd, to send to consumers.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.fd.as_fd()
    }

    /// The futex word consumers bump to wake a sleeping producer.
    #[inline]
    pub fn space_wake(&self) -> &AtomicU32 {
        // SAFETY: offset 0 of a mapping of at least 4096 bytes, page-aligned, lives as long as
        // `self`; the word is only accessed atomically.
        unsafe { &(*(self.0.map.as_ptr() as *const Line32)).value }
    }

    /// Slot `k`'s claim word. Panics if `k` is out of range (indices come from local state).
    #[inline]
    pub fn claim(&self, k: u32) -> &AtomicU64 {
        assert!(k < self.0.slots, "slot index {k} out of range");
        let off = CLAIMS_OFFSET + CLAIM_STRIDE * k as usize;
        // SAFETY: k < slot_count, so [off, off + 8) lies within claim_bytes(); off is a
        // multiple of 128 from a page-aligned base; the word is only accessed atomically.
        unsafe { &*(self.0.map.as_ptr().add(off) as *const AtomicU64) }
    }
}
