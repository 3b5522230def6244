//! The ring's protocol steps on shared words, free of I/O so that proptest and loom can check
//! them. The producer and consumers call exactly these functions (docs/protocol.md, version 4).
//!
//! The producer alone writes the descriptors (in the read-only control segment). A consumer
//! writes its progress in its own page, one word per slot: [`holding`]`(seq)` while it holds
//! batch `seq` of that slot, [`released`]`(seq)` once it let go of it. The producer reuses a
//! slot when no consumer it published the batch to (broadcast), or no consumer at all
//! (shared), still holds it. In shared mode a claim word per slot, which every consumer may
//! write, decides which consumer takes a batch: a consumer records its hold in its page
//! *before* it swaps the word from [`claim_word`]`(seq, None)` to its own index, and the
//! producer trusts a claim only when the claimer's page backs it.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering, fence};

/// A descriptor's `seq`, and a claim word, before any batch (and a descriptor's `seq` while
/// the producer writes the slot again, in shared mode).
pub const NO_BATCH: u64 = u64::MAX;

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

/// The newest batch published into slot `k` of a ring of `n` slots before `head`, if any.
#[inline]
pub fn last_in_slot(head: u64, k: u32, n: u32) -> Option<u64> {
    let (k, n) = (u64::from(k), u64::from(n));
    (head > k).then(|| k + (head - 1 - k) / n * n)
}

/// Bit of consumer `c`.
#[inline]
pub fn bit(c: u32) -> u64 {
    debug_assert!(c < 63);
    1u64 << c
}

/// The consumers in `mask`, lowest first.
#[inline]
pub fn members(mut mask: u64) -> impl Iterator<Item = u32> {
    std::iter::from_fn(move || {
        (mask != 0).then(|| {
            let c = mask.trailing_zeros();
            mask &= mask - 1;
            c
        })
    })
}

/// A number the producer gives each attach (sent in Joined): the consumer's index in the low
/// 6 bits and, above them, a serial unique to that attach. The producer uses it to name one
/// attach of an index (a later consumer may take the same index).
#[inline]
pub fn claim_token(index: u32, attach_serial: u64) -> u64 {
    debug_assert!(index < 63);
    ((attach_serial & ((1 << 56) - 1)) << 6) | index as u64
}

/// The consumer index a claim token names.
#[inline]
pub fn token_index(token: u64) -> u32 {
    (token & 63) as u32
}

/// A page's progress word while its consumer holds batch `seq` (shared: claimed).
#[inline]
pub fn holding(seq: u64) -> u64 {
    ((seq + 1) << 1) | 1
}

/// A page's progress word once its consumer let go of batch `seq`.
#[inline]
pub fn released(seq: u64) -> u64 {
    (seq + 1) << 1
}

/// The batch a page's progress word says was released, if it says so.
#[inline]
pub fn released_seq(word: u64) -> Option<u64> {
    (word & 1 == 0)
        .then(|| (word >> 1).checked_sub(1))
        .flatten()
}

/// The owner a claim word names for a batch whose claimer released it and then departed (the
/// producer writes it then, so that a later consumer given the same index does not take the
/// batch for a claim made in its name). No consumer has this index.
pub const DEPARTED: u32 = 0xfe;

/// Shared mode: the claim word of batch `seq`, unclaimed (`None`) or claimed by a consumer.
#[inline]
pub fn claim_word(seq: u64, owner: Option<u32>) -> u64 {
    (seq << 8) | owner.map_or(0, |c| u64::from(c) + 1)
}

/// The batch a claim word speaks of.
#[inline]
pub fn claim_seq(w: u64) -> u64 {
    w >> 8
}

/// The consumer a claim word names, if any (any value: it may be a scribble).
#[inline]
pub fn claim_owner(w: u64) -> Option<u32> {
    ((w & 0xff) as u32).checked_sub(1)
}

/// Sequence numbers a consumer may find published given the head it read: the last `n`.
#[inline]
pub fn live_window(head: u64, n: u32) -> std::ops::Range<u64> {
    head.saturating_sub(n as u64)..head
}

/// Consumer: let go of batch `seq` (Release: our reads of the slot happen before the
/// producer's next writes, which it makes after an Acquire load of this word).
#[inline]
pub fn release(mine: &AtomicU64, seq: u64) {
    mine.store(released(seq), Ordering::Release);
}

/// Shared consumer: claim batch `seq` if its word says unclaimed. Records the hold in our
/// page first, so that a claim the word shows is always backed. Returns our page word's
/// value from before (to put back if the claim is not kept).
#[inline]
pub fn try_claim(claim: &AtomicU64, mine: &AtomicU64, seq: u64, me: u32) -> Option<u64> {
    let free = claim_word(seq, None);
    if claim.load(Ordering::Relaxed) != free {
        return None;
    }
    claim_from(claim, free, mine, seq, me)
}

/// Claims batch `seq` whose claim word reads `from` (unclaimed, or a scribble): unless our page
/// holds or released it already (a word reopened by a peer never hands us the same batch
/// twice), records the hold in our page first (SeqCst), then compare-and-swaps the word from
/// `from` to ours; on failure puts our page word back. Returns our page word from before.
#[inline]
fn claim_from(claim: &AtomicU64, from: u64, mine: &AtomicU64, seq: u64, me: u32) -> Option<u64> {
    let before = mine.load(Ordering::Relaxed);
    if before == released(seq) || before == holding(seq) {
        return None;
    }
    mine.store(holding(seq), Ordering::SeqCst);
    match claim.compare_exchange(
        from,
        claim_word(seq, Some(me)),
        Ordering::SeqCst,
        Ordering::Relaxed,
    ) {
        Ok(_) => Some(before),
        Err(_) => {
            mine.store(before, Ordering::Release);
            None
        }
    }
}

/// Shared consumer: the claim word of the slot that holds batch `seq` speaks of another
/// batch. Only a peer's scribble puts one there: the producer stores a batch's word before it
/// publishes the batch (and the slot descriptor's `seq` before that word), and every other
/// writer changes a word by compare-and-swap from what it read. So a word of an older batch
/// is always a scribble, and one of a newer batch is one while the slot's descriptor
/// (`slot_seq`, loaded after the word) still says `seq`. Such a word counts as unclaimed
/// (else nobody could take the batch until the producer needs the slot, and a ring closed
/// meanwhile would lose it): claim it as [`try_claim`] does, swapping from the scribble.
/// Returns our page word from before.
#[inline]
pub fn claim_scribbled(
    claim: &AtomicU64,
    slot_seq: &AtomicU64,
    mine: &AtomicU64,
    seq: u64,
    me: u32,
) -> Option<u64> {
    let w = claim.load(Ordering::Acquire);
    if !scribbled(w, seq, || slot_seq.load(Ordering::Acquire)) {
        return None;
    }
    claim_from(claim, w, mine, seq, me)
}

/// Whether claim word `w`, Acquire-loaded from the slot of batch `seq`, is a peer's scribble
/// (see [`claim_scribbled`]); `slot_seq` loads the slot descriptor's `seq` after it.
#[inline]
pub fn scribbled(w: u64, seq: u64, slot_seq: impl FnOnce() -> u64) -> bool {
    let ws = claim_seq(w);
    ws < seq || (ws > seq && slot_seq() == seq)
}

/// Shared consumer: a claim word names us for batch `seq` but our page does not back it (a
/// peer wrote it in our name): take the batch as ours. Returns our page word from before.
/// If the word changed meanwhile (the producer reset it), the batch is not ours.
#[inline]
pub fn adopt(claim: &AtomicU64, mine: &AtomicU64, seq: u64, me: u32) -> Option<u64> {
    let w = claim_word(seq, Some(me));
    if claim.load(Ordering::Relaxed) != w {
        return None;
    }
    let before = mine.load(Ordering::Relaxed);
    if before == holding(seq) || before == released(seq) {
        return None;
    }
    mine.store(holding(seq), Ordering::SeqCst);
    if claim.load(Ordering::SeqCst) == w {
        Some(before)
    } else {
        mine.store(before, Ordering::Release);
        None
    }
}

/// Producer, broadcast: which of the consumers the batch `prev` was published to (and still
/// attached: `addressed`) have not released it. 0: the slot may be written again. `word(c)`
/// is an Acquire load of consumer c's progress word for the slot.
#[inline]
pub fn broadcast_laggards(prev: u64, addressed: u64, word: impl Fn(u32) -> u64) -> u64 {
    let mut laggards = 0;
    for c in members(addressed) {
        if word(c) != released(prev) {
            laggards |= bit(c);
        }
    }
    laggards
}

/// What a shared-mode slot holding batch `prev` is to the producer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedSlot {
    /// Consumed: some consumer's page says it released the batch (or a claimer that has since
    /// departed had), and no page says it holds it.
    Free,
    /// Held by these consumers (their pages say so): not free, and theirs the blame.
    Held(u64),
    /// Published and unclaimed.
    Unclaimed,
    /// Nobody's page holds or released it and the claim word does not say unclaimed (a
    /// scribble, a claim in another's name, or a departed claimer's): put the batch back.
    Unbacked,
}

/// Producer, shared mode: the state of a slot whose batch is `prev`, from its claim word `w`,
/// the active consumers and their progress words (`word(c)`, Acquire loads), and `consumed`:
/// whether a claimer that has since departed had released it.
///
/// The pages decide, never the claim word, which every consumer can write: a batch is held
/// while any page says so, and consumed once any page says it was released. The claim word
/// only tells an unclaimed batch (wait for a consumer) from one to put back. So a peer that
/// rewrites claim words can neither free a batch someone holds nor keep a consumed one from
/// being written again.
pub fn shared_slot(
    w: u64,
    prev: u64,
    active: u64,
    consumed: bool,
    word: impl Fn(u32) -> u64,
) -> SharedSlot {
    let (mut held, mut done) = (0, consumed);
    for c in members(active) {
        let v = word(c);
        if v == holding(prev) {
            held |= bit(c);
        } else if v == released(prev) {
            done = true;
        }
    }
    if held != 0 {
        SharedSlot::Held(held)
    } else if done {
        SharedSlot::Free
    } else if w == claim_word(prev, None) {
        SharedSlot::Unclaimed
    } else {
        SharedSlot::Unbacked
    }
}

/// Producer, shared mode, after [`shared_slot`] said free: which consumers' pages say they
/// hold `prev` after the producer marked the descriptor as being rewritten (stored
/// [`NO_BATCH`] in its `seq`, SeqCst). A consumer records its hold (SeqCst) before it reads
/// `seq` (SeqCst): either it sees the mark and lets go, or it is seen here and waited for.
#[inline]
pub fn holders_after_mark(prev: u64, active: u64, word: impl Fn(u32) -> u64) -> u64 {
    fence(Ordering::SeqCst);
    let mut held = 0;
    for c in members(active) {
        if word(c) == holding(prev) {
            held |= bit(c);
        }
    }
    held
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
pub fn check_slot(
    k: u32,
    seq: u64,
    expected: u64,
    addressed: u64,
    me: u32,
) -> Result<(), Violation> {
    if seq != expected {
        return Err(Violation::WrongSeq {
            slot: k,
            found: seq,
            expected,
        });
    }
    if addressed & bit(me) == 0 {
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
/// were put back since our last whole scan (`rescan`), else from our own hint (clamped).
pub fn scan_start(head: u64, hint: u64, rescan: bool, n: u32) -> u64 {
    let w = live_window(head, n);
    if rescan {
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
        fn broadcast_free_only_after_every_addressed_release(
            addressed in 0u64..(1 << 20),
            order in proptest::collection::vec(0u32..20, 0..40),
            seq in 0u64..(1 << 40),
        ) {
            let words: Vec<AtomicU64> = (0..20).map(|_| AtomicU64::new(0)).collect();
            let mut left = addressed;
            for c in order {
                let lag = broadcast_laggards(seq, addressed, |c| words[c as usize].load(Ordering::Acquire));
                prop_assert_eq!(lag, left);
                release(&words[c as usize], seq);
                left &= !bit(c);
            }
        }

        /// Whatever a scribbler puts in a claim word and in its own page, the producer calls a
        /// slot free only when no active page holds the batch and some page released it (or
        /// a departed claimer had), and the claim word alone never makes it free or held.
        #[test]
        fn a_shared_slot_is_free_only_when_consumed_and_unheld(
            w in any::<u64>(), prev in 0u64..(1 << 40), active in 0u64..(1 << 8),
            consumed in any::<bool>(), pages in proptest::collection::vec(0u8..4, 8),
        ) {
            let word = |c: u32| match pages[c as usize] {
                0 => 0,
                1 => holding(prev),
                2 => released(prev),
                _ => released(prev + 1),
            };
            let st = shared_slot(w, prev, active, consumed, word);
            let held: u64 = members(active).filter(|&c| pages[c as usize] == 1).map(bit).sum();
            let some_released = members(active).any(|c| pages[c as usize] == 2);
            match st {
                SharedSlot::Held(m) => prop_assert_eq!(m, held),
                SharedSlot::Free => {
                    prop_assert_eq!(held, 0);
                    prop_assert!(consumed || some_released);
                }
                SharedSlot::Unclaimed => {
                    prop_assert_eq!(w, claim_word(prev, None));
                    prop_assert!(held == 0 && !consumed && !some_released);
                }
                SharedSlot::Unbacked => prop_assert!(held == 0 && !consumed && !some_released),
            }
            // Whatever the claim word says, the pages' answer is the same.
            let other = shared_slot(w ^ 0x5a5a, prev, active, consumed, word);
            prop_assert_eq!(
                matches!(st, SharedSlot::Free | SharedSlot::Held(_)),
                matches!(other, SharedSlot::Free | SharedSlot::Held(_))
            );
        }
    }

    proptest! {
        #[test]
        fn checks_never_panic_and_bound_what_they_accept(
            head in any::<u64>(), last in any::<u64>(), cursor in any::<u64>(), n in 1u32..=4096,
            seq in any::<u64>(), addressed in any::<u64>(), me in 0u32..63, len in any::<u64>(),
            hint in any::<u64>(), rescan in any::<bool>(),
        ) {
            let _ = check_head(last, head);
            if check_window(head, cursor, n).is_ok() {
                prop_assert!(head <= cursor.saturating_add(n as u64));
            }
            let k = slot_of(cursor, n);
            if check_slot(k, seq, cursor, addressed, me).is_ok() {
                prop_assert_eq!(seq, cursor);
            }
            if check_len(seq, k, len, 2 << 20).is_ok() {
                prop_assert!(len <= 2 << 20);
            }
            if check_claimed(k, seq, head, n).is_ok() {
                prop_assert!(live_window(head, n).contains(&seq) || seq == head);
            }
            let st = scan_start(head, hint, rescan, n);
            let w = live_window(head, n);
            prop_assert!(st >= w.start && st <= w.end);
        }
    }

    #[test]
    fn claims_are_exclusive_and_backed_by_the_page() {
        let claim = AtomicU64::new(claim_word(7, None));
        let (a, b) = (AtomicU64::new(released(3)), AtomicU64::new(0));
        assert_eq!(try_claim(&claim, &a, 7, 0), Some(released(3)));
        assert_eq!(a.load(Ordering::Relaxed), holding(7));
        assert_eq!(try_claim(&claim, &b, 7, 1), None);
        assert_eq!(
            b.load(Ordering::Relaxed),
            0,
            "a lost claim leaves the page as it was"
        );
        release(&a, 7);
        let page = |c: u32| [&a, &b][c as usize].load(Ordering::Acquire);
        let w = claim.load(Ordering::Relaxed);
        assert_eq!(shared_slot(w, 7, 0b11, false, page), SharedSlot::Free);
        // A peer reopens the released batch: the consumer that had it never takes it again;
        // another may (a duplicate the peer caused), and its hold is seen and waited for.
        claim.store(claim_word(7, None), Ordering::Relaxed);
        let w = claim.load(Ordering::Relaxed);
        assert_eq!(
            shared_slot(w, 7, 0b11, false, page),
            SharedSlot::Free,
            "a reopened claim word does not make a consumed batch unclaimed"
        );
        assert_eq!(
            try_claim(&claim, &a, 7, 0),
            None,
            "at most once per consumer"
        );
        assert!(try_claim(&claim, &b, 7, 1).is_some());
        let w = claim.load(Ordering::Relaxed);
        assert_eq!(shared_slot(w, 7, 0b11, false, page), SharedSlot::Held(0b10));
        // Reopened while b holds it: b does not take it a second time, and its hold stays.
        claim.store(claim_word(7, None), Ordering::Relaxed);
        assert_eq!(try_claim(&claim, &b, 7, 1), None, "not while we hold it");
        assert_eq!(b.load(Ordering::Relaxed), holding(7));
        release(&b, 7);
        claim.store(claim_word(7, None), Ordering::Relaxed);
        assert_eq!(
            try_claim(&claim, &b, 7, 1),
            None,
            "at most once per consumer"
        );
    }

    #[test]
    fn a_claim_word_of_another_batch_is_a_scribble_and_claimable_once() {
        // Slot of batch 11 (4 slots), its word scribbled back to batch 7's.
        let claim = AtomicU64::new(claim_word(7, Some(0)));
        let slot = AtomicU64::new(11);
        let (a, b) = (AtomicU64::new(released(7)), AtomicU64::new(0));
        assert_eq!(try_claim(&claim, &a, 11, 0), None, "not an unclaimed word");
        assert_eq!(claim_scribbled(&claim, &slot, &a, 11, 0), Some(released(7)));
        assert_eq!(claim.load(Ordering::Relaxed), claim_word(11, Some(0)));
        assert_eq!(a.load(Ordering::Relaxed), holding(11));
        assert_eq!(
            claim_scribbled(&claim, &slot, &b, 11, 1),
            None,
            "a claim of this batch stands"
        );
        // Scribbled again while a holds it: a does not take it twice; b may (the scribbler's
        // duplicate), and only once.
        claim.store(claim_word(3, None), Ordering::Relaxed);
        assert_eq!(
            claim_scribbled(&claim, &slot, &a, 11, 0),
            None,
            "not while we hold it"
        );
        assert!(claim_scribbled(&claim, &slot, &b, 11, 1).is_some());
        release(&b, 11);
        claim.store(claim_word(3, None), Ordering::Relaxed);
        assert_eq!(
            claim_scribbled(&claim, &slot, &b, 11, 1),
            None,
            "at most once per consumer"
        );
        // A newer batch's word: the producer's while the slot is being written again...
        let c = AtomicU64::new(0);
        claim.store(claim_word(15, None), Ordering::Relaxed);
        slot.store(15, Ordering::Relaxed);
        assert_eq!(claim_scribbled(&claim, &slot, &c, 11, 2), None);
        slot.store(NO_BATCH, Ordering::Relaxed);
        assert_eq!(claim_scribbled(&claim, &slot, &c, 11, 2), None);
        // ...a scribble while the slot still holds batch 11.
        slot.store(11, Ordering::Relaxed);
        assert!(claim_scribbled(&claim, &slot, &c, 11, 2).is_some());
    }

    #[test]
    fn the_last_batch_of_a_slot_is_below_the_head() {
        assert_eq!(last_in_slot(0, 0, 4), None);
        assert_eq!(last_in_slot(3, 3, 4), None, "slot 3 not written yet");
        assert_eq!(last_in_slot(4, 3, 4), Some(3));
        assert_eq!(last_in_slot(9, 0, 4), Some(8));
        assert_eq!(last_in_slot(9, 1, 4), Some(5));
        for head in 1..40u64 {
            for k in 0..4u32 {
                let want = (0..head).rev().find(|s| s % 4 == u64::from(k));
                assert_eq!(last_in_slot(head, k, 4), want, "head {head} slot {k}");
            }
        }
    }

    #[test]
    fn released_seq_reads_only_released_words() {
        assert_eq!(released_seq(released(0)), Some(0));
        assert_eq!(released_seq(released(41)), Some(41));
        assert_eq!(released_seq(holding(41)), None);
        assert_eq!(released_seq(0), None, "a fresh page released nothing");
    }

    #[test]
    fn forged_claims_are_unbacked_or_adopted() {
        let (a, b) = (AtomicU64::new(0), AtomicU64::new(0));
        let page = |c: u32| [&a, &b][c as usize].load(Ordering::Acquire);
        // A peer claims batch 9 in consumer 1's name: unbacked for the producer ...
        let claim = AtomicU64::new(claim_word(9, Some(1)));
        assert_eq!(
            shared_slot(claim_word(9, Some(1)), 9, 0b11, false, page),
            SharedSlot::Unbacked
        );
        // ... until consumer 1 sees its name and takes the batch as its own.
        assert_eq!(adopt(&claim, &b, 9, 1), Some(0));
        assert_eq!(
            shared_slot(claim_word(9, Some(1)), 9, 0b11, false, page),
            SharedSlot::Held(0b10)
        );
        assert_eq!(adopt(&claim, &b, 9, 1), None, "adopted once");
        // A name of a consumer that is not active, garbage, another batch's word: unbacked.
        for w in [
            claim_word(9, Some(5)),
            claim_word(9, Some(200)),
            claim_word(8, None),
            NO_BATCH,
        ] {
            assert_eq!(
                shared_slot(w, 9, 0b01, false, page),
                SharedSlot::Unbacked,
                "{w:#x}"
            );
        }
        assert_eq!(claim_owner(claim_word(3, None)), None);
        assert_eq!(claim_owner(claim_word(3, Some(62))), Some(62));
        assert_eq!(
            claim_seq(claim_word((1 << 48) - 1, Some(62))),
            (1 << 48) - 1
        );
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

    /// One slot: the producer's descriptor (`head`, `seq`, the data), the claim word anyone
    /// may write, and each consumer's own progress word for the slot.
    struct Ring {
        head: AtomicU64,
        seq: AtomicU64,
        claim: AtomicU64,
        pages: [AtomicU64; 2],
        data: UnsafeCell<u64>,
    }

    impl Ring {
        fn new() -> Self {
            Ring {
                head: AtomicU64::new(0),
                seq: AtomicU64::new(NO_BATCH),
                claim: AtomicU64::new(NO_BATCH),
                pages: [AtomicU64::new(0), AtomicU64::new(0)],
                data: UnsafeCell::new(u64::MAX),
            }
        }

        fn word(&self, c: u32) -> u64 {
            self.pages[c as usize].load(Ordering::Acquire)
        }

        /// Producer step: write batch `s` into the one slot and publish it.
        fn put(&self, s: u64, shared: bool) {
            // SAFETY: loom checks that no read of the cell overlaps this write.
            self.data.with_mut(|d| unsafe { *d = s * 10 });
            self.seq.store(s, Ordering::Relaxed);
            if shared {
                self.claim.store(claim_word(s, None), Ordering::Release);
            }
            self.head.store(s + 1, Ordering::Release);
        }

        /// Producer: publish 0, then 1 into the same slot if (and only if) it is free.
        fn produce(&self, shared: bool) -> bool {
            self.put(0, shared);
            let free = if shared {
                let w = self.claim.load(Ordering::Acquire);
                shared_slot(w, 0, 0b11, false, |c| self.word(c)) == SharedSlot::Free && {
                    self.seq.store(NO_BATCH, Ordering::SeqCst);
                    holders_after_mark(0, 0b11, |c| self.pages[c as usize].load(Ordering::SeqCst))
                        == 0
                }
            } else {
                broadcast_laggards(0, 0b11, |c| self.word(c)) == 0
            };
            if free {
                self.put(1, shared);
            }
            free
        }

        /// Shared consumer: claim (or, named by a peer, adopt) the batch; check it; read it.
        fn consume_shared(&self, me: u32) -> Option<u64> {
            let head = self.head.load(Ordering::Acquire);
            let s = head.checked_sub(1)?;
            let mine = &self.pages[me as usize];
            let before =
                try_claim(&self.claim, mine, s, me).or_else(|| adopt(&self.claim, mine, s, me))?;
            fence(Ordering::SeqCst);
            if self.seq.load(Ordering::SeqCst) != s {
                // Being written again: not ours to read. The claim word back, as
                // `Consumer::unclaim` does, then our page.
                let _ = self.claim.compare_exchange(
                    claim_word(s, Some(me)),
                    claim_word(s, None),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
                mine.store(before, Ordering::Release);
                return None;
            }
            // SAFETY: loom checks that no write of the cell overlaps this read.
            let v = self.data.with(|d| unsafe { *d });
            assert_eq!(
                v,
                s * 10,
                "consumer {me} read batch {s} while it was rewritten"
            );
            release(mine, s);
            Some(s)
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
                        if ring.head.load(Ordering::Acquire) >= 1 {
                            assert_eq!(ring.seq.load(Ordering::Relaxed), 0);
                            // SAFETY: loom checks that no write of the cell overlaps this read.
                            let v = ring.data.with(|d| unsafe { *d });
                            assert_eq!(v, 0, "consumer {me} read batch 0 after it was overwritten");
                            release(&ring.pages[me as usize], 0);
                            true
                        } else {
                            false
                        }
                    })
                })
                .collect();
            let reused = ring.produce(false);
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
                    thread::spawn(move || ring.consume_shared(me))
                })
                .collect();
            let reused = ring.produce(true);
            let got: Vec<Option<u64>> = consumers.into_iter().map(|c| c.join().unwrap()).collect();
            assert!(
                !(got[0] == Some(0) && got[1] == Some(0)),
                "batch 0 was claimed twice"
            );
            if reused {
                assert!(
                    got.contains(&Some(0)),
                    "slot reused before batch 0 was consumed"
                );
            }
        });
    }

    /// A hostile peer reopens batch 0's claim word right after consumer 0 took it (as if it
    /// were unclaimed) while consumer 1 looks for work and the producer decides whether to
    /// reuse the slot. A duplicate delivery is what the peer may cause; a read of the slot
    /// while the producer rewrites it (a data race loom reports) never.
    #[test]
    fn loom_a_reopened_claim_never_lets_a_slot_be_rewritten_while_read() {
        loom::model(|| {
            let ring = Arc::new(Ring::new());
            ring.put(0, true);
            // Consumer 0 claimed, read and released batch 0 before the model starts.
            assert!(try_claim(&ring.claim, &ring.pages[0], 0, 0).is_some());
            release(&ring.pages[0], 0);
            let hostile = {
                let ring = ring.clone();
                thread::spawn(move || ring.claim.store(claim_word(0, None), Ordering::Relaxed))
            };
            let honest = {
                let ring = ring.clone();
                thread::spawn(move || ring.consume_shared(1))
            };
            let w = ring.claim.load(Ordering::Acquire);
            let word = |c: u32| ring.word(c);
            if shared_slot(w, 0, 0b11, false, word) == SharedSlot::Free {
                ring.seq.store(NO_BATCH, Ordering::SeqCst);
                if holders_after_mark(0, 0b11, |c| ring.pages[c as usize].load(Ordering::SeqCst))
                    == 0
                {
                    // SAFETY: loom checks that no read of the cell overlaps this write.
                    ring.data.with_mut(|d| unsafe { *d = 10 });
                }
            }
            hostile.join().unwrap();
            honest.join().unwrap();
        });
    }
}
