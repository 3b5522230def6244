//! The words a producer reads that consumers write: a slot's `pending` handover word (and,
//! through it, what a scribbling consumer can make the producer believe). The other such word,
//! the shared-mode `claimer`, is used only when it equals a token the producer issued itself
//! (`Producer::holders_of`), so no value of it reaches an index.
//!
//! Input: a mode byte, an initial active mask, then a script of one-byte operations (with
//! 8-byte operands where needed) run on one slot's `pending` word, an `AtomicU64`:
//! producer publishes, consumers join, claim, release and depart, and a consumer scribbles an
//! arbitrary value. A model tracks who holds the slot; every `ring` step must agree with it,
//! and `slot_free` must say "free" exactly when the documented rules say so.

#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};

use libfuzzer_sys::fuzz_target;
use pipeline_core::ring::{self, UNCLAIMED, bit};

/// Consumers the script uses (indices 0..63 are all valid).
const CONSUMERS: u32 = 63;
/// Every consumer bit (bit 63 is not a consumer's).
const ALL: u64 = !UNCLAIMED;

/// Reads bytes and little-endian u64s, zero past the end.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn word(&mut self) -> u64 {
        let take = self.0.len().min(8);
        let mut b = [0u8; 8];
        b[..take].copy_from_slice(&self.0[..take]);
        self.0 = &self.0[take..];
        u64::from_le_bytes(b)
    }
}

/// Who holds the slot's current batch, as the protocol defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// Broadcast: consumers that were addressed and have not released (nor been reclaimed).
    Broadcast(u64),
    /// Shared: published, nobody claimed it yet.
    Unclaimed,
    /// Shared: claimed by one consumer.
    Claimed(u32),
    /// Shared: released, or never published.
    Free,
    /// A consumer stored an arbitrary value: only the point checks apply until the next publish.
    Scribbled,
}

/// Assertions that hold for any value a consumer can store in `pending`.
fn point_checks(p: u64, active: u64, c: u32) {
    let a = AtomicU64::new(p);
    // Broadcast: free exactly when no active consumer's bit is set; stray bits never block.
    assert_eq!(
        ring::slot_free(&a, active, false),
        p & active == 0,
        "{p:#x} {active:#x}"
    );
    // Shared.
    let free = ring::slot_free(&a, active, true);
    if p == 0 {
        assert!(free);
    }
    if p == UNCLAIMED {
        assert!(!free, "an unclaimed shared batch was seen as free");
    }
    if p & UNCLAIMED == 0 {
        // Only consumer bits: free exactly when none of them is active.
        assert_eq!(free, p & active == 0, "{p:#x} {active:#x}");
    }
    if p & active != 0 {
        assert!(!free, "a batch held by an active consumer was seen as free");
    }
    assert_eq!(a.load(Ordering::Relaxed), p, "slot_free stored");

    // Each consumer step, from any value.
    let a = AtomicU64::new(p);
    assert_eq!(ring::release_broadcast(&a, c), p & bit(c) != 0);
    assert_eq!(a.load(Ordering::Relaxed), p & !bit(c));

    let a = AtomicU64::new(p);
    assert_eq!(ring::release_shared(&a, c), p == bit(c));
    assert_eq!(a.load(Ordering::Relaxed), if p == bit(c) { 0 } else { p });

    let a = AtomicU64::new(p);
    assert_eq!(ring::try_claim(&a, c), p == UNCLAIMED);
    assert_eq!(
        a.load(Ordering::Relaxed),
        if p == UNCLAIMED { bit(c) } else { p }
    );

    // The producer taking back what consumer c holds.
    let a = AtomicU64::new(p);
    assert!(!ring::reclaim(&a, c, false));
    assert_eq!(a.load(Ordering::Relaxed), p & !bit(c));
    // After c is gone, its bit can no longer block the slot.
    assert_eq!(
        ring::slot_free(&a, active & !bit(c), false),
        p & active & !bit(c) == 0
    );

    let a = AtomicU64::new(p);
    assert_eq!(ring::reclaim(&a, c, true), p == bit(c));
    let after = a.load(Ordering::Relaxed);
    assert_eq!(after, if p == bit(c) { UNCLAIMED } else { p });
    if p == bit(c) {
        // Requeued: not free, and claimable by anyone else.
        assert!(!ring::slot_free(&a, active, true));
        assert!(
            !ring::release_shared(&a, c),
            "the old claimer released a requeued batch"
        );
        let other = (c + 1) % CONSUMERS;
        assert!(ring::try_claim(&a, other));
        assert_eq!(a.load(Ordering::Relaxed), bit(other));
    }
}

/// What `slot_free` must answer in each modelled state.
fn expect_free(h: Held, active: u64) -> Option<bool> {
    match h {
        Held::Broadcast(holders) => Some(holders & active == 0),
        Held::Unclaimed => Some(false),
        Held::Claimed(c) => Some(active & bit(c) == 0),
        Held::Free => Some(true),
        Held::Scribbled => None,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let Some(mode) = input.byte() else {
        return;
    };
    let shared = mode & 1 == 1;
    let mut active = input.word() & ALL;
    point_checks(input.word(), input.word(), u32::from(mode >> 1) % CONSUMERS);

    let pending = AtomicU64::new(0);
    let head = AtomicU64::new(0);
    let mut seq = 0u64;
    let mut held = if shared {
        Held::Free
    } else {
        Held::Broadcast(0)
    };

    while let Some(op) = input.byte() {
        let c = u32::from(op >> 3) % CONSUMERS;
        match op & 7 {
            // Producer: publish the next batch if the slot is free.
            0 => {
                let free = ring::slot_free(&pending, active, shared);
                if let Some(want) = expect_free(held, active) {
                    assert_eq!(free, want, "{held:?} active {active:#x}");
                }
                if free {
                    let mask = if shared { UNCLAIMED } else { active };
                    ring::publish(&pending, &head, seq, mask);
                    seq += 1;
                    assert_eq!(head.load(Ordering::Relaxed), seq);
                    held = if shared {
                        Held::Unclaimed
                    } else {
                        Held::Broadcast(active)
                    };
                }
            }
            // A consumer joins (addressed from the next publish on).
            1 => active |= bit(c),
            // A consumer departs: the producer removes it and takes back what it holds.
            2 => {
                active &= !bit(c);
                let requeued = ring::reclaim(&pending, c, shared);
                held = match held {
                    Held::Broadcast(h) => {
                        assert!(!requeued);
                        Held::Broadcast(h & !bit(c))
                    }
                    Held::Claimed(x) if x == c => {
                        assert!(requeued, "a departed consumer's claim was not requeued");
                        Held::Unclaimed
                    }
                    Held::Scribbled => Held::Scribbled,
                    other => {
                        assert!(!requeued, "{other:?}: requeued what {c} did not hold");
                        other
                    }
                };
            }
            // Broadcast consumer c releases.
            3 if !shared => {
                let had = ring::release_broadcast(&pending, c);
                if let Held::Broadcast(h) = held {
                    assert_eq!(had, h & bit(c) != 0);
                    held = Held::Broadcast(h & !bit(c));
                }
            }
            // Shared consumer c claims.
            3 => {
                let got = ring::try_claim(&pending, c);
                match held {
                    Held::Unclaimed => {
                        assert!(got);
                        held = Held::Claimed(c);
                    }
                    Held::Scribbled => {}
                    other => assert!(!got, "{other:?}: claimed again by {c}"),
                }
            }
            // Shared consumer c releases.
            4 if shared => {
                let ok = ring::release_shared(&pending, c);
                match held {
                    Held::Claimed(x) => {
                        assert_eq!(ok, x == c);
                        if ok {
                            held = Held::Free;
                        }
                    }
                    Held::Scribbled => {}
                    other => assert!(!ok, "{other:?}: released by {c}"),
                }
            }
            // A consumer scribbles an arbitrary value over `pending`.
            5 => {
                let v = input.word();
                pending.store(v, Ordering::Relaxed);
                held = Held::Scribbled;
                point_checks(v, active, c);
            }
            // The producer only checks (as it does while it waits).
            _ => {
                let p = pending.load(Ordering::Relaxed);
                point_checks(p, active, c);
                if let Some(want) = expect_free(held, active) {
                    assert_eq!(ring::slot_free(&pending, active, shared), want);
                }
            }
        }
        // Without scribbles, the word holds exactly what the model says.
        let p = pending.load(Ordering::Relaxed);
        match held {
            Held::Broadcast(h) => assert_eq!(p, h),
            Held::Unclaimed => assert_eq!(p, UNCLAIMED),
            Held::Claimed(x) => assert_eq!(p, bit(x)),
            Held::Free => assert_eq!(p, 0),
            Held::Scribbled => {}
        }
    }
});
