//! The words a producer reads that consumers write (protocol version 4): each consumer's own
//! progress word for a slot (in its page) and, in shared mode, the slot's claim word (in the
//! claim segment, which every consumer may write). The producer decides with
//! `ring::broadcast_laggards`, `ring::shared_slot` and `ring::holders_after_mark`; consumers
//! step with `ring::try_claim`, `ring::adopt`, `ring::claim_scribbled` and `ring::release`.
//!
//! Input: a mode byte, a byte saying which of the 4 consumers are hostile, then a script of
//! one-byte operations (with 8-byte operands where needed) on one slot: the producer publishes
//! when it finds the slot free (and puts back a batch whose claim no page backs), consumers
//! join, claim, adopt, release and depart, and a hostile consumer writes any value into the
//! claim word or into its own page. A model tracks what each honest consumer holds. Whatever
//! the hostile ones write:
//! * the slot is never rewritten while an honest active consumer holds its batch;
//! * the blame for a slot that is not free falls only on consumers whose own page says they
//!   hold it;
//! * without any hostile write, a batch is delivered to one shared consumer at most, and a
//!   slot whose holders all released (or departed) is free.

#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};

use libfuzzer_sys::fuzz_target;
use pipeline_core::ring::{self, DEPARTED, NO_BATCH, SharedSlot, bit};

/// Consumers the script uses.
const CONSUMERS: u32 = 4;

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

struct Ring {
    shared: bool,
    hostile: u64,
    active: u64,
    /// The batch in the slot (None: nothing published yet).
    batch: Option<u64>,
    /// Broadcast: the consumers the batch was published to (and still attached).
    addressed: u64,
    /// Shared: the claim word (anyone writes it).
    claim: AtomicU64,
    /// The slot descriptor's `seq` (the producer's alone).
    slot_seq: AtomicU64,
    /// Each consumer's page word for the slot (a fresh page per attach).
    pages: [AtomicU64; CONSUMERS as usize],
    /// Shared: the batch + 1 whose departed claimer had released it (the producer's own table).
    consumed: u64,
    /// The honest consumers holding the current batch (the model).
    holding: u64,
    /// Shared: the honest consumers that received the current batch.
    delivered: u64,
    /// A hostile consumer wrote something since the last publish.
    scribbled: bool,
}

impl Ring {
    fn word(&self, c: u32) -> u64 {
        self.pages[c as usize].load(Ordering::Acquire)
    }

    /// Producer: is the slot free for the next batch? Puts back an unbacked claim, as the
    /// producer does while it waits.
    fn free(&mut self) -> bool {
        let Some(prev) = self.batch else {
            return true;
        };
        if !self.shared {
            let laggards = ring::broadcast_laggards(prev, self.addressed, |c| self.word(c));
            for c in 0..CONSUMERS {
                let says = self.word(c) == ring::released(prev);
                if self.addressed & bit(c) != 0 {
                    assert_eq!(laggards & bit(c) != 0, !says, "consumer {c}'s page");
                }
            }
            assert_eq!(
                laggards & !self.addressed,
                0,
                "blamed a consumer not addressed"
            );
            assert_eq!(
                laggards & self.holding,
                self.holding & self.addressed,
                "an honest holder was not waited for"
            );
            return laggards == 0;
        }
        let w = self.claim.load(Ordering::Acquire);
        let consumed = self.consumed == prev + 1;
        let state = ring::shared_slot(w, prev, self.active, consumed, |c| self.word(c));
        let pages_hold = (0..CONSUMERS)
            .filter(|&c| self.active & bit(c) != 0 && self.word(c) == ring::holding(prev))
            .fold(0, |m, c| m | bit(c));
        match state {
            SharedSlot::Held(m) => {
                assert_eq!(
                    m, pages_hold,
                    "blame on a consumer whose page does not hold"
                );
                assert_eq!(m & self.holding, self.holding);
                false
            }
            SharedSlot::Free => {
                assert_eq!(
                    self.holding, 0,
                    "free while an honest consumer holds the batch"
                );
                assert_eq!(pages_hold, 0);
                // The mark: nobody claimed anew in between (one thread here).
                assert_eq!(
                    ring::holders_after_mark(prev, self.active, |c| self.word(c)),
                    0
                );
                true
            }
            SharedSlot::Unclaimed => {
                assert_eq!(w, ring::claim_word(prev, None));
                assert_eq!(self.holding, 0);
                false
            }
            SharedSlot::Unbacked => {
                assert_eq!(self.holding, 0);
                assert!(
                    self.scribbled || consumed || w == NO_BATCH,
                    "honest claims left an unbacked word {w:#x} for batch {prev}"
                );
                // Put back (a compare-and-swap in the producer; one thread here).
                self.claim
                    .store(ring::claim_word(prev, None), Ordering::Release);
                false
            }
        }
    }

    fn publish(&mut self) {
        let next = self.batch.map_or(0, |p| p + 1);
        self.batch = Some(next);
        self.holding = 0;
        self.delivered = 0;
        self.scribbled = false;
        self.slot_seq.store(next, Ordering::Relaxed);
        if self.shared {
            self.claim
                .store(ring::claim_word(next, None), Ordering::Release);
        } else {
            self.addressed = self.active;
        }
    }

    fn honest(&self, c: u32) -> bool {
        self.hostile & bit(c) == 0 && self.active & bit(c) != 0
    }

    /// Consumer c takes the batch (shared: claims it or adopts it; broadcast: receives it).
    fn take(&mut self, c: u32) {
        let Some(s) = self.batch else { return };
        if self.holding & bit(c) != 0 || !self.honest(c) {
            return;
        }
        let mine = &self.pages[c as usize];
        if !self.shared {
            if self.addressed & bit(c) != 0 && self.delivered & bit(c) == 0 {
                self.holding |= bit(c);
                self.delivered |= bit(c);
            }
            return;
        }
        let got = ring::try_claim(&self.claim, mine, s, c)
            .or_else(|| ring::adopt(&self.claim, mine, s, c))
            .or_else(|| ring::claim_scribbled(&self.claim, &self.slot_seq, mine, s, c))
            .is_some();
        if got {
            assert_eq!(mine.load(Ordering::Relaxed), ring::holding(s));
            assert_eq!(
                self.delivered & bit(c),
                0,
                "consumer {c} took batch {s} twice (a reopened claim word)"
            );
            if !self.scribbled {
                assert_eq!(
                    self.delivered, 0,
                    "batch {s} delivered twice without a scribble"
                );
            }
            self.holding |= bit(c);
            self.delivered |= bit(c);
        } else {
            assert_ne!(
                mine.load(Ordering::Relaxed),
                ring::holding(s),
                "a failed claim held"
            );
        }
    }

    fn release(&mut self, c: u32) {
        if self.holding & bit(c) == 0 {
            return;
        }
        let s = self.batch.expect("holding a batch");
        ring::release(&self.pages[c as usize], s);
        self.holding &= !bit(c);
    }

    /// Consumer c goes; the producer takes back its claim as `Shared::depart_if` does.
    fn depart(&mut self, c: u32) {
        if self.active & bit(c) == 0 {
            return;
        }
        if self.shared {
            let w = self.claim.load(Ordering::Acquire);
            if ring::claim_owner(w) == Some(c) && w != NO_BATCH {
                let s = ring::claim_seq(w);
                if self.word(c) == ring::released(s) {
                    self.consumed = s + 1;
                    self.claim
                        .store(ring::claim_word(s, Some(DEPARTED)), Ordering::Release);
                } else {
                    self.claim
                        .store(ring::claim_word(s, None), Ordering::Release);
                }
            }
        }
        self.active &= !bit(c);
        self.addressed &= !bit(c);
        if self.shared && self.holding & bit(c) != 0 {
            // Taken back unreleased and put back: the next claimer gets it again.
            self.delivered &= !bit(c);
        }
        self.holding &= !bit(c);
    }

    fn join(&mut self, c: u32) {
        if self.active & bit(c) != 0 {
            return;
        }
        // A fresh page per attach: a new consumer at the index never had the batch (one a
        // peer reopened may reach it, as it may any other consumer).
        self.pages[c as usize].store(0, Ordering::Relaxed);
        self.delivered &= !bit(c);
        self.active |= bit(c);
    }

    /// A value a hostile consumer writes: near the current batch, or raw.
    fn forged(&self, input: &mut Input<'_>, sel: u8) -> u64 {
        let s = self.batch.unwrap_or(0);
        // Sequence numbers stay below 2^48 (consumers and the producer only ever name batches
        // of the live window); the raw word below covers any other value.
        let near = (s + u64::from(sel >> 4)).saturating_sub(2);
        match sel & 7 {
            0 => ring::claim_word(near, None),
            1 => ring::claim_word(near, Some(u32::from(sel >> 4) % CONSUMERS)),
            2 => ring::claim_word(near, Some(DEPARTED)),
            3 => ring::holding(near),
            4 => ring::released(near),
            5 => NO_BATCH,
            6 => 0,
            _ => input.word(),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let (Some(mode), Some(hostile)) = (input.byte(), input.byte()) else {
        return;
    };
    let mut r = Ring {
        shared: mode & 1 == 1,
        hostile: u64::from(hostile) & 0b1111,
        active: 0,
        batch: None,
        addressed: 0,
        claim: AtomicU64::new(NO_BATCH),
        slot_seq: AtomicU64::new(NO_BATCH),
        pages: Default::default(),
        consumed: 0,
        holding: 0,
        delivered: 0,
        scribbled: false,
    };
    // The claim word's codec, on any value.
    let w = input.word();
    if w != NO_BATCH {
        let owner = ring::claim_owner(w);
        assert_eq!(
            ring::claim_word(ring::claim_seq(w), owner) & !0xff,
            w & !0xff
        );
    }

    while let Some(op) = input.byte() {
        let c = u32::from(op >> 4) % CONSUMERS;
        match op & 7 {
            0 => {
                if r.free() {
                    r.publish();
                }
            }
            1 => r.join(c),
            2 => r.depart(c),
            3 => r.take(c),
            4 => r.release(c),
            // A hostile consumer writes the claim word.
            5 if r.hostile & bit(c) != 0 => {
                let sel = input.byte().unwrap_or(0);
                let v = r.forged(&mut input, sel);
                r.claim.store(v, Ordering::Relaxed);
                r.scribbled = true;
            }
            // A hostile consumer writes its own page.
            6 if r.hostile & bit(c) != 0 => {
                let sel = input.byte().unwrap_or(0);
                let v = r.forged(&mut input, sel);
                r.pages[c as usize].store(v, Ordering::Relaxed);
                r.scribbled = true;
            }
            // The producer only looks (as it does while it waits).
            _ => {
                let _ = r.free();
            }
        }
        // A shared consumer's hold is in its page.
        for h in ring::members(if r.shared { r.holding } else { 0 }) {
            assert_eq!(r.word(h), ring::holding(r.batch.unwrap()));
        }
    }
});
