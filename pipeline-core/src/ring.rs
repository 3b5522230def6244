//! The ring's protocol steps on shared words, free of I/O so that proptest and loom can check
//! them. The producer and consumers call exactly these functions on the control segment.
//!
//! Per slot the producer owns `seq` and the descriptor; `pending` is the handover word:
//! * broadcast: the producer stores the mask of active consumers at publish; each consumer
//!   clears its bit when it releases; the slot is free when no active consumer's bit is set;
//! * shared: the producer stores [`UNCLAIMED`]; one consumer swaps it for its own bit; it
//!   swaps its bit for 0 when it releases.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

/// Marks a published batch that no consumer has claimed yet (shared mode).
pub const UNCLAIMED: u64 = 1 << 63;

/// Slot of sequence number `seq` in a ring of `n` slots.
#[inline]
pub fn slot_of(seq: u64, n: u32) -> u32 {
    (seq % n as u64) as u32
}

/// The sequence number that occupied `seq`'s slot before it, if any.
#[inline]
pub fn previous_in_slot(seq: u64, n: u32) -> Option<u64> {
    seq.checked_sub(n as u64)
}

/// Bit of consumer `c`.
#[inline]
pub fn bit(c: u32) -> u64 {
    debug_assert!(c < 63);
    1u64 << c
}

/// Shared mode: the word a consumer stores in a slot's `claimer` after claiming it: its index
/// in the low 6 bits and, above them, a number the producer gave this attach only (sent in
/// Joined). An index alone is not enough: a consumer may claim a batch published before it
/// joined, and an index may be reused by a later consumer that never had the batch.
#[inline]
pub fn claim_token(index: u32, attach_serial: u64) -> u64 {
    debug_assert!(index < 63);
    ((attach_serial & ((1 << 56) - 1)) << 6) | index as u64
}

/// The consumer index a claim token names (63 for the producer's "nobody" value).
#[inline]
pub fn token_index(token: u64) -> u32 {
    (token & 63) as u32
}

/// Shared mode: what the producer stores in a slot's `claimer` when it publishes batch `seq`.
/// Never a claim token (bit 63 is set; tokens stay below 2^62).
#[inline]
pub fn claim_marker(seq: u64) -> u64 {
    UNCLAIMED | seq
}

/// Shared consumer, after claiming batch `seq` and checking it: records `token` in the slot's
/// `claimer`, only over the batch's own marker. Returns false if another value was there: a
/// consumer detached between its claim and this step wrote late, or we are that consumer.
/// Either way the producer will not wait for our work on this batch, so the caller must
/// complete it before releasing ([`crate::ConsumerBackend::complete_now`]). Because a write
/// succeeds only over the marker, a late writer can never overwrite a recorded token.
#[inline]
pub fn record_claim(claimer: &AtomicU64, seq: u64, token: u64) -> bool {
    claimer
        .compare_exchange(
            claim_marker(seq),
            token,
            Ordering::AcqRel,
            Ordering::Relaxed,
        )
        .is_ok()
}

/// Sequence numbers a consumer may find published given the head it read: the last `n`.
#[inline]
pub fn live_window(head: u64, n: u32) -> std::ops::Range<u64> {
    head.saturating_sub(n as u64)..head
}

/// Producer: hand the filled slot over. The descriptor fields (`len`, header, `seq`) must be
/// stored before; `head` is the publication point (Release), consumers Acquire it.
#[inline]
pub fn publish(pending: &AtomicU64, head: &AtomicU64, seq: u64, mask: u64) {
    pending.store(mask, Ordering::Release);
    head.store(seq + 1, Ordering::Release);
}

/// Producer: may the slot be written again? `active` masks out bits of consumers that are
/// gone (or garbage bits a scribbler set). Acquire pairs with the consumers' releases, so
/// their reads of the slot happen before the producer's next writes.
#[inline]
pub fn slot_free(pending: &AtomicU64, active: u64, shared: bool) -> bool {
    let p = pending.load(Ordering::Acquire);
    if shared {
        p == 0 || (p & UNCLAIMED == 0 && p & active == 0)
    } else {
        p & active == 0
    }
}

/// Producer, shared mode: what to put in a slot's pending word that holds a value no
/// correct consumer writes (a scribble), so the slot cannot stay blocked for good. Valid
/// values are 0, [`UNCLAIMED`] and one active consumer's bit; bits of absent consumers alone
/// already count as free. Anything else — unclaimed plus other bits, or several bits with an
/// active one — is put back as unclaimed (its batch may then be delivered again).
pub fn repair_shared(p: u64, active: u64) -> Option<u64> {
    let valid = if p & UNCLAIMED != 0 {
        p == UNCLAIMED
    } else {
        p & active == 0 || p.count_ones() == 1
    };
    (!valid).then_some(UNCLAIMED)
}

/// Broadcast consumer: release; returns false if our bit was not set (we were detached).
#[inline]
pub fn release_broadcast(pending: &AtomicU64, me: u32) -> bool {
    pending.fetch_and(!bit(me), Ordering::AcqRel) & bit(me) != 0
}

/// Shared consumer: try to claim an unclaimed batch.
#[inline]
pub fn try_claim(pending: &AtomicU64, me: u32) -> bool {
    pending.load(Ordering::Relaxed) == UNCLAIMED
        && pending
            .compare_exchange(UNCLAIMED, bit(me), Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
}

/// Shared consumer: release a claimed batch; false if it was taken back from us.
#[inline]
pub fn release_shared(pending: &AtomicU64, me: u32) -> bool {
    pending
        .compare_exchange(bit(me), 0, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

/// Producer: take back what consumer `c` holds in this slot. Broadcast clears its bit;
/// shared puts its claimed batch back as unclaimed. Returns true if a shared batch was
/// requeued.
#[inline]
pub fn reclaim(pending: &AtomicU64, c: u32, shared: bool) -> bool {
    if shared {
        pending
            .compare_exchange(bit(c), UNCLAIMED, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    } else {
        pending.fetch_and(!bit(c), Ordering::AcqRel);
        false
    }
}

/// A value read from shared memory that cannot be right: the checks every consumer applies
/// before using what it read. Pure functions, so they can be fuzzed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// The head decreased.
    HeadBackwards {
        /// Head seen before.
        from: u64,
        /// Head seen now.
        to: u64,
    },
    /// The head is more than a ring past a broadcast consumer's cursor.
    Overrun {
        /// Head.
        head: u64,
        /// Cursor.
        cursor: u64,
        /// Slots.
        n: u32,
    },
    /// A slot holds another sequence number than the one expected there.
    WrongSeq {
        /// Slot.
        slot: u32,
        /// Found.
        found: u64,
        /// Expected.
        expected: u64,
    },
    /// The batch was not addressed to this consumer (it was dropped from the ring).
    NotAddressed {
        /// Sequence number.
        seq: u64,
    },
    /// A batch claims more bytes than a slot holds.
    TooLong {
        /// Sequence number.
        seq: u64,
        /// Slot.
        slot: u32,
        /// Claimed length.
        len: u64,
        /// Slot capacity.
        capacity: u64,
    },
    /// A claimed slot holds a sequence number outside the live window.
    ImpossibleClaim {
        /// Slot.
        slot: u32,
        /// Sequence number found.
        seq: u64,
        /// Head.
        head: u64,
    },
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::HeadBackwards { from, to } => {
                write!(f, "head went backwards from {from} to {to}")
            }
            Violation::Overrun { head, cursor, n } => write!(
                f,
                "head {head} is more than {n} batches past our cursor {cursor}: the producer overwrote batches we had not released"
            ),
            Violation::WrongSeq {
                slot,
                found,
                expected,
            } => write!(f, "slot {slot} holds sequence {found}, expected {expected}"),
            Violation::NotAddressed { seq } => write!(
                f,
                "batch {seq} was not addressed to us (we were dropped from the ring)"
            ),
            Violation::TooLong {
                seq,
                slot,
                len,
                capacity,
            } => write!(
                f,
                "batch {seq} in slot {slot} claims {len} bytes; slots hold {capacity}"
            ),
            Violation::ImpossibleClaim { slot, seq, head } => write!(
                f,
                "slot {slot} holds sequence {seq}, impossible with head {head}"
            ),
        }
    }
}

/// The head must never decrease.
pub fn check_head(last: u64, head: u64) -> Result<(), Violation> {
    if head < last {
        return Err(Violation::HeadBackwards {
            from: last,
            to: head,
        });
    }
    Ok(())
}

/// Broadcast: the producer cannot be more than a ring ahead of a consumer it waits for.
pub fn check_window(head: u64, cursor: u64, n: u32) -> Result<(), Violation> {
    if head > cursor.saturating_add(n as u64) {
        return Err(Violation::Overrun { head, cursor, n });
    }
    Ok(())
}

/// Broadcast: the slot of `expected` holds it, and is addressed to consumer `me`.
pub fn check_slot(k: u32, seq: u64, expected: u64, pending: u64, me: u32) -> Result<(), Violation> {
    if seq != expected {
        return Err(Violation::WrongSeq {
            slot: k,
            found: seq,
            expected,
        });
    }
    if pending & bit(me) == 0 {
        return Err(Violation::NotAddressed { seq });
    }
    Ok(())
}

/// A batch's length fits its slot.
pub fn check_len(seq: u64, k: u32, len: u64, capacity: u64) -> Result<(), Violation> {
    if len > capacity {
        return Err(Violation::TooLong {
            seq,
            slot: k,
            len,
            capacity,
        });
    }
    Ok(())
}

/// Shared: a batch just claimed in slot `k` must be one the head says can be there. The
/// head may lag the claim by one: the producer marks a batch claimable before it advances
/// the head (two stores to different lines), so `seq == head` is a batch being published.
pub fn check_claimed(k: u32, seq: u64, head: u64, n: u32) -> Result<(), Violation> {
    if slot_of(seq, n) != k || seq > head || seq.saturating_add(n as u64) < head {
        return Err(Violation::ImpossibleClaim { slot: k, seq, head });
    }
    Ok(())
}

/// Shared: where to start looking for unclaimed batches: the whole live window when batches
/// were requeued, else from the (untrusted, so clamped) claim hint.
pub fn scan_start(head: u64, hint: u64, requeued: u64, n: u32) -> u64 {
    let w = live_window(head, n);
    if requeued > 0 {
        w.start
    } else {
        hint.clamp(w.start, w.end)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn slot_arithmetic(seq in 0u64..(1 << 48), n in 1u32..=4096) {
            let k = slot_of(seq, n);
            prop_assert!(k < n);
            if let Some(p) = previous_in_slot(seq, n) {
                prop_assert_eq!(slot_of(p, n), k);
                prop_assert_eq!(seq - p, n as u64);
            } else {
                prop_assert!(seq < n as u64);
            }
            // The live window holds each slot at most once, and always `seq`'s slot if
            // seq is in it.
            let w = live_window(seq + 1, n);
            prop_assert!(w.end - w.start <= n as u64);
            prop_assert!(w.contains(&seq));
        }

        #[test]
        fn wraparound_visits_every_slot_once_per_lap(n in 1u32..=64, laps in 1u64..5, start in 0u64..1000) {
            let mut seen = vec![0u64; n as usize];
            for s in start..start + laps * n as u64 {
                seen[slot_of(s, n) as usize] += 1;
            }
            prop_assert!(seen.iter().all(|&c| c == laps));
        }

        #[test]
        fn broadcast_free_only_after_every_active_release(mask in 0u64..(1 << 20), order in proptest::collection::vec(0u32..20, 0..40)) {
            let p = AtomicU64::new(0);
            let head = AtomicU64::new(0);
            publish(&p, &head, 0, mask);
            let mut left = mask;
            for c in order {
                prop_assert_eq!(slot_free(&p, mask, false), left == 0);
                let had = release_broadcast(&p, c);
                prop_assert_eq!(had, left & bit(c) != 0);
                left &= !bit(c);
            }
        }
    }

    proptest! {
        #[test]
        fn checks_never_panic_and_bound_what_they_accept(
            head in any::<u64>(), last in any::<u64>(), cursor in any::<u64>(), n in 1u32..=4096,
            seq in any::<u64>(), pending in any::<u64>(), me in 0u32..63, len in any::<u64>(),
            hint in any::<u64>(), requeued in any::<u64>(),
        ) {
            let _ = check_head(last, head);
            if check_window(head, cursor, n).is_ok() {
                prop_assert!(head <= cursor.saturating_add(n as u64));
            }
            let k = slot_of(cursor, n);
            if check_slot(k, seq, cursor, pending, me).is_ok() {
                prop_assert_eq!(seq, cursor);
            }
            if check_len(seq, k, len, 2 << 20).is_ok() {
                prop_assert!(len <= 2 << 20);
            }
            if check_claimed(k, seq, head, n).is_ok() {
                prop_assert!(live_window(head, n).contains(&seq) || seq == head);
            }
            let st = scan_start(head, hint, requeued, n);
            let w = live_window(head, n);
            prop_assert!(st >= w.start && st <= w.end);
        }
    }

    proptest! {
        #[test]
        fn a_shared_slot_is_never_blocked_by_garbage(p in any::<u64>(), active in 0u64..(1 << 62)) {
            let word = AtomicU64::new(p);
            if slot_free(&word, active, true) {
                return Ok(());
            }
            match repair_shared(p, active) {
                // Blocked legitimately: unclaimed, or held by exactly one active consumer.
                None => prop_assert!(p == UNCLAIMED || ((p & active).count_ones() == 1 && p & !active == 0)),
                Some(v) => prop_assert_eq!(v, UNCLAIMED),
            }
        }
    }

    #[test]
    fn a_late_claim_record_never_overwrites_a_recorded_one() {
        let claimer = AtomicU64::new(claim_marker(7));
        let (a, b) = (claim_token(0, 1), claim_token(1, 2));
        // B claimed batch 7 after A's claim was taken back; A writes late: refused.
        assert!(record_claim(&claimer, 7, b));
        assert!(!record_claim(&claimer, 7, a));
        assert_eq!(claimer.load(Ordering::Relaxed), b);
        // A's late write lands first: B's is refused, and B must complete before releasing.
        let claimer = AtomicU64::new(claim_marker(7));
        assert!(record_claim(&claimer, 7, a));
        assert!(!record_claim(&claimer, 7, b));
        // A late write for an older batch of the slot never lands on a newer one's marker.
        let claimer = AtomicU64::new(claim_marker(7 + 4));
        assert!(!record_claim(&claimer, 7, a));
        // Markers and tokens never collide.
        assert_ne!(
            claim_marker(0) & UNCLAIMED,
            claim_token(62, u64::MAX) & UNCLAIMED
        );
    }

    #[test]
    fn shared_claim_is_exclusive_and_reclaim_requeues() {
        let p = AtomicU64::new(0);
        let head = AtomicU64::new(0);
        publish(&p, &head, 0, UNCLAIMED);
        assert!(!slot_free(&p, 0b11, true));
        assert!(try_claim(&p, 1));
        assert!(!try_claim(&p, 0));
        assert!(!slot_free(&p, 0b11, true));
        assert!(reclaim(&p, 1, true));
        assert_eq!(p.load(Ordering::Relaxed), UNCLAIMED);
        assert!(
            !release_shared(&p, 1),
            "a reclaimed batch cannot be released by its old claimer"
        );
        assert!(try_claim(&p, 0));
        assert!(release_shared(&p, 0));
        assert!(slot_free(&p, 0b11, true));
        // A claim bit of a consumer that is no longer active does not block the producer.
        p.store(bit(5), Ordering::Relaxed);
        assert!(slot_free(&p, 0b11, true));
    }
}

/// Loom models of the handover: every interleaving (and every weak-memory outcome loom can
/// produce) of a producer and two consumers on one slot, including the slot's reuse for the
/// next batch. Slot contents are loom `UnsafeCell`s, so a producer write that could overlap a
/// consumer read is reported as a data race. The threads never spin: each step is tried once,
/// which keeps the state space small enough to explore exhaustively.
/// Run with `RUSTFLAGS="--cfg loom" cargo test -p pipeline-core --release --lib loom`.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::thread;

    struct Ring {
        head: AtomicU64,
        seq: AtomicU64,
        pending: AtomicU64,
        data: UnsafeCell<u64>,
    }

    impl Ring {
        fn new() -> Self {
            Ring {
                head: AtomicU64::new(0),
                seq: AtomicU64::new(u64::MAX),
                pending: AtomicU64::new(0),
                data: UnsafeCell::new(u64::MAX),
            }
        }

        /// Producer step: write batch `s` into the one slot and publish it.
        fn put(&self, s: u64, mask: u64) {
            // SAFETY: loom checks that no read of the cell overlaps this write.
            self.data.with_mut(|d| unsafe { *d = s * 10 });
            self.seq.store(s, Ordering::Relaxed);
            publish(&self.pending, &self.head, s, mask);
        }

        /// Producer: publish 0, then 1 into the same slot if (and only if) it is free.
        fn produce(&self, active: u64, shared: bool) -> bool {
            let mask = if shared { UNCLAIMED } else { active };
            self.put(0, mask);
            if slot_free(&self.pending, active, shared) {
                self.put(1, mask);
                true
            } else {
                false
            }
        }
    }

    #[test]
    fn loom_broadcast_publish_release() {
        loom::model(|| {
            let ring = Arc::new(Ring::new());
            let consumers: Vec<_> = (0..2u32)
                .map(|me| {
                    let ring = ring.clone();
                    thread::spawn(move || {
                        // Read batch 0 if it is published; release it.
                        if ring.head.load(Ordering::Acquire) >= 1 {
                            assert_eq!(ring.seq.load(Ordering::Relaxed), 0);
                            // SAFETY: loom checks that no write of the cell overlaps this read.
                            let v = ring.data.with(|d| unsafe { *d });
                            assert_eq!(v, 0, "consumer {me} read batch 0 after it was overwritten");
                            assert!(release_broadcast(&ring.pending, me));
                            true
                        } else {
                            false
                        }
                    })
                })
                .collect();
            let reused = ring.produce(0b11, false);
            let read: Vec<bool> = consumers.into_iter().map(|c| c.join().unwrap()).collect();
            if reused {
                assert!(
                    read.iter().all(|&r| r),
                    "slot reused before every consumer released it"
                );
            }
        });
    }

    #[test]
    fn loom_shared_claims_are_exclusive() {
        loom::model(|| {
            let ring = Arc::new(Ring::new());
            let consumers: Vec<_> = (0..2u32)
                .map(|me| {
                    let ring = ring.clone();
                    thread::spawn(move || {
                        let mut got = Vec::new();
                        for _ in 0..2 {
                            if ring.head.load(Ordering::Acquire) >= 1
                                && try_claim(&ring.pending, me)
                            {
                                // Read seq after the claim: the claim may be of a newer batch.
                                let seq = ring.seq.load(Ordering::Acquire);
                                // The head may not have caught up with it yet; the check
                                // consumers make must accept every such claim.
                                let now = ring.head.load(Ordering::Acquire);
                                assert!(
                                    check_claimed(0, seq, now, 1).is_ok(),
                                    "a valid claim of batch {seq} rejected with head {now}"
                                );
                                // SAFETY: loom checks that no write overlaps this read.
                                let v = ring.data.with(|d| unsafe { *d });
                                assert_eq!(v, seq * 10, "claimed batch {seq} but read other data");
                                got.push(seq);
                                assert!(release_shared(&ring.pending, me));
                            }
                        }
                        got
                    })
                })
                .collect();
            let reused = ring.produce(0b11, true);
            let mut all: Vec<u64> = consumers
                .into_iter()
                .flat_map(|c| c.join().unwrap())
                .collect();
            all.sort_unstable();
            let n = all.len();
            all.dedup();
            assert_eq!(all.len(), n, "a batch was claimed twice");
            if reused {
                assert!(all.contains(&0), "slot reused before batch 0 was consumed");
            }
        });
    }

    /// Consumer A claimed batch 0 and is about to record its token when the producer takes
    /// the batch back (A was detached); consumer B may claim it meanwhile. A recorded token is
    /// never overwritten, and a claimer whose record fails knows it (so it completes its work
    /// itself): at most one record lands, and the word ends as the token of the one that did.
    #[test]
    fn loom_late_claim_record_never_overwrites() {
        loom::model(|| {
            let (ta, tb) = (claim_token(0, 1), claim_token(1, 2));
            let pending = Arc::new(AtomicU64::new(bit(0)));
            let claimer = Arc::new(AtomicU64::new(claim_marker(0)));
            let a = {
                let claimer = claimer.clone();
                thread::spawn(move || record_claim(&claimer, 0, ta))
            };
            let b = {
                let (pending, claimer) = (pending.clone(), claimer.clone());
                thread::spawn(move || try_claim(&pending, 1).then(|| record_claim(&claimer, 0, tb)))
            };
            assert!(reclaim(&pending, 0, true));
            let ra = a.join().unwrap();
            let rb = b.join().unwrap();
            let word = claimer.load(Ordering::Acquire);
            match rb {
                Some(true) => {
                    assert!(!ra, "both records landed");
                    assert_eq!(word, tb, "B's recorded token was overwritten");
                }
                Some(false) => assert!(ra && word == ta, "B's record failed but A's did not land"),
                None => assert_eq!(word, if ra { ta } else { claim_marker(0) }),
            }
        });
    }
}
