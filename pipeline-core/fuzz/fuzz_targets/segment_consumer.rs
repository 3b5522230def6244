//! The control segment as a consumer (or `gpipe inspect`) sees it: every byte of it may have
//! been written by a hostile or broken producer.
//!
//! Input: 4 bytes of set-up, then the segment's image.
//! * byte 0: slot_count = 1 + b % 16; byte 1: consumer_capacity = 1 + b % 8;
//! * byte 2: bit 0 mode (broadcast/shared), bit 1 hand over a memfd sealed against resizing
//!   but not against writes, bit 2 hand over an unsealed memfd, bit 3 hand over a sealed memfd
//!   that is too short;
//! * byte 3: the consumer's own index (modulo the capacity).
//!
//! (a) The image is written over the start of a memfd of `segment_bytes()` (the rest stays
//! zero), which is then sealed against writes as a producer does, `ControlSegment::open`
//! (always read-only since protocol version 4) validates it, and when it accepts it, `Snapshot::read` and its
//! Display and JSON forms must work on whatever the words hold. The consumer's run-time checks
//! are then fed the words it would read from that segment.
//! (b) Independently, the image's bytes are read as u64s and fed to the same checks
//! (`ring::check_*`, `ring::scan_start`), and what each promises when it returns Ok is asserted.

#![no_main]

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use libfuzzer_sys::fuzz_target;
use pipeline_core::inspect::Snapshot;
use pipeline_core::layout::{ControlSegment, Mode, RingLayout, SLOT_ALIGN};
use pipeline_core::ring::{self, Violation};
use pipeline_core::sys;

/// What a consumer read from shared memory, plus its own local state.
#[derive(Debug)]
struct Seen {
    /// Head the consumer saw before (local).
    last: u64,
    /// Head read now.
    head: u64,
    /// Its cursor (local).
    cursor: u64,
    /// Slots (local, from the handshake).
    n: u32,
    /// Slot `cursor mod n`'s seq, addressed mask and len.
    seq: u64,
    addressed: u64,
    len: u64,
    /// Slot capacity (local).
    capacity: u64,
    /// Its index (local, < 63).
    me: u32,
    /// Shared mode: its own scan hint (local), and whether `requeued` changed since its last
    /// whole scan.
    hint: u64,
    rescan: bool,
}

fn show(v: Violation) {
    let s = v.to_string();
    assert!(!s.is_empty());
}

/// Runs every consumer check on `s` and asserts what each one promises.
fn checks(s: &Seen) {
    let n = s.n;
    assert!(n >= 1 && s.me < 63);

    match ring::check_head(s.last, s.head) {
        Ok(()) => assert!(s.head >= s.last),
        Err(v) => {
            assert!(s.head < s.last);
            show(v);
        }
    }

    match ring::check_window(s.head, s.cursor, n) {
        // Accepted: no batch the consumer has not released can have been overwritten.
        Ok(()) => assert!(u128::from(s.head) <= u128::from(s.cursor) + u128::from(n)),
        Err(v) => {
            assert!(u128::from(s.head) > u128::from(s.cursor) + u128::from(n));
            show(v);
        }
    }

    let k = ring::slot_of(s.cursor, n);
    assert!(k < n);
    match ring::check_slot(k, s.seq, s.cursor, s.addressed, s.me) {
        Ok(()) => {
            assert_eq!(s.seq, s.cursor);
            assert_ne!(s.addressed & ring::bit(s.me), 0);
        }
        Err(v) => {
            assert!(s.seq != s.cursor || s.addressed & ring::bit(s.me) == 0);
            show(v);
        }
    }

    match ring::check_len(s.seq, k, s.len, s.capacity) {
        Ok(()) => assert!(s.len <= s.capacity),
        Err(v) => {
            assert!(s.len > s.capacity);
            show(v);
        }
    }

    // Shared: a claimed slot's seq read after the claim.
    let window = ring::live_window(s.head, n);
    assert!(window.start <= window.end && window.end - window.start <= u64::from(n));
    let kc = ring::slot_of(s.seq, n);
    for slot in [k, kc] {
        match ring::check_claimed(slot, s.seq, s.head, n) {
            Ok(()) => {
                // The batch can be in that slot and is within the live window, or is the
                // one being published (the head moves after the batch becomes claimable).
                assert_eq!(ring::slot_of(s.seq, n), slot);
                assert!(
                    window.contains(&s.seq) || s.seq == s.head,
                    "{s:?}: seq outside {window:?}"
                );
            }
            Err(v) => show(v),
        }
    }

    // Where the shared consumer starts scanning: inside the live window, always.
    let st = ring::scan_start(s.head, s.hint, s.rescan, n);
    assert!(
        st >= window.start && st <= window.end,
        "{s:?}: scan start {st} outside {window:?}"
    );
    if s.rescan {
        assert_eq!(st, window.start);
    } else if window.contains(&s.hint) {
        assert_eq!(st, s.hint);
    }
    // The scan visits each slot at most once.
    let mut seen = 0u32;
    for q in st..window.end {
        let b = ring::slot_of(q, n);
        if b < 32 {
            assert_eq!(seen & (1 << b), 0, "{s:?}: slot {b} scanned twice");
            seen |= 1 << b;
        }
    }
}

/// Reads little-endian u64s from bytes, zero past the end.
struct Words<'a>(&'a [u8]);

impl Words<'_> {
    fn next(&mut self) -> u64 {
        let take = self.0.len().min(8);
        let mut b = [0u8; 8];
        b[..take].copy_from_slice(&self.0[..take]);
        self.0 = &self.0[take..];
        u64::from_le_bytes(b)
    }
}

/// (b): the checks on raw words, with ring sizes up to the real maximum.
fn checks_on_words(bytes: &[u8]) {
    let mut w = Words(bytes);
    let s = Seen {
        last: w.next(),
        head: w.next(),
        cursor: w.next(),
        n: 1 + (w.next() % 4096) as u32,
        seq: w.next(),
        addressed: w.next(),
        len: w.next(),
        capacity: w.next(),
        me: (w.next() % 63) as u32,
        hint: w.next(),
        rescan: w.next() & 1 == 1,
    };
    checks(&s);
}

/// (a), after `open` accepted the segment: what the consumer reads, checked as it checks it.
fn checks_on_segment(seg: &ControlSegment, me: u32) {
    let l = seg.layout();
    let h = seg.header();
    let rec = seg.consumer(me);
    let cursor = rec.cursor.load(Ordering::Relaxed);
    let k = ring::slot_of(cursor, l.slot_count);
    let d = seg.slot(k);
    checks(&Seen {
        last: rec.join_seq.load(Ordering::Relaxed),
        head: h.head.value.load(Ordering::Acquire),
        cursor,
        n: l.slot_count,
        seq: d.seq.load(Ordering::Acquire),
        addressed: d.addressed.load(Ordering::Acquire),
        len: d.len.load(Ordering::Relaxed),
        capacity: l.slot_bytes,
        me,
        hint: cursor,
        rescan: h.requeued.value.load(Ordering::Acquire) & 1 == 1,
    });
}

fn check_snapshot(seg: &ControlSegment) {
    let l = seg.layout();
    let snap = Snapshot::read(seg, "host");
    assert_eq!(snap.slot_count, l.slot_count);
    assert_eq!(snap.slot_bytes, l.slot_bytes);
    assert_eq!(snap.mode, l.mode);
    assert_eq!(snap.slots.len(), l.slot_count as usize);
    for (i, s) in snap.slots.iter().enumerate() {
        assert_eq!(s.index as usize, i);
        assert!(s.held_by.iter().all(|&c| c < l.consumer_capacity));
        assert!(s.held_by.windows(2).all(|p| p[0] < p[1]));
        assert!(!(s.unclaimed && !s.held_by.is_empty()));
    }
    assert!(snap.consumers.len() <= l.consumer_capacity as usize);
    for c in &snap.consumers {
        assert!(c.index < l.consumer_capacity);
        assert_ne!(c.state, "free");
        if l.mode == Mode::Shared || c.state != "active" {
            assert_eq!(c.lag, 0);
        }
    }
    let text = snap.to_string();
    assert!(text.starts_with("ring: backend host"));
    let lines = text.lines().count();
    assert_eq!(
        lines,
        3 + snap.slots.len() + snap.consumers.len().max(1),
        "{text}"
    );
    let json = serde_json::to_string(&snap).expect("snapshot serialises");
    let v: serde_json::Value = serde_json::from_str(&json).expect("snapshot JSON parses");
    assert_eq!(v["slots"].as_array().map(Vec::len), Some(snap.slots.len()));
}

/// A memfd of `bytes` holding `image`: unsealed, sealed against resizing only, or sealed
/// against writes too (what a producer hands out).
fn memfd(bytes: u64, image: &[u8], sealed: bool, write_sealed: bool) -> OwnedFd {
    let write = |fd: &OwnedFd| {
        let file = File::from(fd.try_clone().expect("dup"));
        file.write_all_at(image, 0).expect("write the image");
    };
    if !sealed {
        let fd = rustix::fs::memfd_create("gpipe-fuzz-control", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd");
        rustix::fs::ftruncate(&fd, bytes).expect("ftruncate");
        write(&fd);
        return fd;
    }
    if !write_sealed {
        let fd = sys::sealed_memfd("gpipe-fuzz-control", bytes).expect("memfd");
        write(&fd);
        return fd;
    }
    let unshared = sys::UnsharedMemfd::create("gpipe-fuzz-control", bytes).expect("memfd");
    let fd = unshared.fd().try_clone_to_owned().expect("dup");
    write(&fd);
    drop(fd);
    unshared.seal_writes().expect("seal")
}

fuzz_target!(|data: &[u8]| {
    let Some((setup, image)) = data.split_first_chunk::<4>() else {
        return;
    };
    checks_on_words(image);

    let layout = RingLayout {
        slot_count: 1 + u32::from(setup[0] % 16),
        consumer_capacity: 1 + u32::from(setup[1] % 8),
        mode: if setup[2] & 1 == 0 {
            Mode::Broadcast
        } else {
            Mode::Shared
        },
        slot_bytes: SLOT_ALIGN,
    };
    let write_sealed = setup[2] & 2 == 0;
    let sealed = setup[2] & 4 == 0;
    let short = setup[2] & 8 != 0;
    let me = u32::from(setup[3]) % layout.consumer_capacity;

    let want = layout.segment_bytes();
    let bytes = if short { want / 2 } else { want };
    let image = &image[..image.len().min(bytes as usize)];
    let fd = memfd(bytes, image, sealed, write_sealed);

    match ControlSegment::open(fd, layout) {
        Ok(seg) => {
            assert!(
                sealed && write_sealed && !short,
                "open accepted a memfd that is short or not sealed against writes"
            );
            assert_eq!(seg.layout(), layout);
            check_snapshot(&seg);
            checks_on_segment(&seg, me);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
