//! How a consumer leaves the ring (it says Goodbye, its socket closes, or the producer detaches
//! it): its claims are folded or put back, the backend forgets its waits, and everyone who
//! might wait on it is woken. Also the counters folded from the consumers' pages.

use std::sync::atomic::Ordering;

use crate::backend::ProducerBackend;
use crate::layout::{Mode, consumer_state};
use crate::page::ConsumerPage;
use crate::ring;
use crate::sys;
use crate::wait;

use super::state::{Departure, Shared};

impl<B: ProducerBackend> Shared<B> {
    pub(super) fn shared_mode(&self) -> bool {
        self.layout.mode == Mode::Shared
    }

    /// Removes consumer `idx`: clears or requeues its claims, tells the backend, wakes
    /// everyone who might be waiting on it.
    pub(super) fn depart(&self, idx: u32, how: Departure, why: &str) {
        self.depart_if(idx, None, how, why);
    }

    /// As [`Shared::depart`], but only if the consumer at `idx` is still the attach whose
    /// claim token is `token` (when given): not a consumer that took the index since.
    pub(super) fn depart_if(&self, idx: u32, token: Option<u64>, how: Departure, why: &str) {
        let mut requeued = 0u64;
        let pid;
        let page = self.pages.lock()[idx as usize].clone();
        {
            let mut m = self.members.lock();
            if token.is_some_and(|t| self.claim_tokens[idx as usize].load(Ordering::Acquire) != t) {
                return;
            }
            let Some(member) = m.conns[idx as usize].take() else {
                return;
            };
            pid = member.pid;
            let state = match how {
                Departure::Left => consumer_state::LEFT,
                Departure::Died => consumer_state::DEAD,
                Departure::Detached => consumer_state::DETACHED,
            };
            // Its last counters, for `gpipe inspect`: they are final once it is gone.
            if let Some(page) = page.as_ref() {
                self.fold_counters_of(idx, page);
            }
            self.seg.consumer(idx).state.store(state, Ordering::Release);
            // Pairs with the fence a shared consumer makes between a claim and reading its
            // record: either our reclaim below sees its claim, or it sees this state.
            std::sync::atomic::fence(Ordering::SeqCst);
            for k in 0..self.layout.slot_count {
                if !self.shared_mode() {
                    // It no longer receives what it had not released: the batch is no
                    // longer addressed to it (it sees that if it comes back to it).
                    self.seg
                        .slot(k)
                        .addressed
                        .fetch_and(!ring::bit(idx), Ordering::AcqRel);
                    continue;
                }
                // What its page says it released counts as consumed from now on (its page
                // is no longer looked at), whatever the claim word says; its other claims go
                // back as unclaimed.
                let word = self.claims.claim(k);
                let progress = page
                    .as_ref()
                    .map_or(0, |p| p.slot(k).load(Ordering::Acquire));
                // The slot's batch by our own count (its descriptor's `seq` may be marked
                // as being rewritten), not by anything a consumer wrote.
                if let Some(r) = ring::released_seq(progress)
                    && Some(r) == ring::last_in_slot(m.head, k, self.layout.slot_count)
                {
                    self.consumed[k as usize].store(r + 1, Ordering::Release);
                }
                let w = word.load(Ordering::Acquire);
                if ring::claim_owner(w) != Some(idx) || w == ring::NO_BATCH {
                    continue;
                }
                let s = ring::claim_seq(w);
                if progress == ring::released(s) {
                    // Not in its index's name any more: a later consumer at the index
                    // would take it for a claim made in its name.
                    let _ = word.compare_exchange(
                        w,
                        ring::claim_word(s, Some(ring::DEPARTED)),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    );
                } else if word
                    .compare_exchange(
                        w,
                        ring::claim_word(s, None),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    requeued += 1;
                }
            }
            if requeued > 0 {
                self.seg
                    .header()
                    .requeued
                    .value
                    .fetch_add(1, Ordering::AcqRel);
            }
            // Only now leave the active set: from here on its page is not looked at.
            m.active &= !ring::bit(idx);
            self.active.store(m.active, Ordering::Release);
            // Keep the index from being handed out until the backend has let go of it.
            m.reserved |= ring::bit(idx);
        }
        self.backend.detach(idx, how == Departure::Died);
        self.members.lock().reserved &= !ring::bit(idx);
        let counter = match how {
            Departure::Left => &self.counters.left,
            Departure::Died => &self.counters.died,
            Departure::Detached => &self.counters.detached,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.counters
            .requeued
            .fetch_add(requeued, Ordering::Relaxed);
        match how {
            Departure::Left => tracing::info!(consumer = idx, pid, "consumer left"),
            _ => tracing::warn!(
                consumer = idx,
                pid,
                requeued,
                "consumer {}: {why}; its slots were taken back",
                if how == Departure::Died {
                    "died"
                } else {
                    "detached"
                }
            ),
        }
        self.wake_producer();
        if requeued > 0 {
            self.wake_consumers();
        }
        if how == Departure::Detached {
            // Close its socket so it notices at once.
            self.waker.wake();
        }
    }

    /// Wakes a producer thread asleep waiting for a slot.
    pub(super) fn wake_producer(&self) {
        wait::notify(
            self.claims.space_wake(),
            &self.seg.header().space_sleepers.value,
            true,
        );
    }

    /// Wakes every consumer asleep waiting for data (off the hot path: unconditionally).
    pub(super) fn wake_consumers(&self) {
        let w = &self.seg.header().data_wake.value;
        std::sync::atomic::fence(Ordering::SeqCst);
        w.fetch_add(1, Ordering::Release);
        sys::futex_wake(w, i32::MAX as u32);
    }

    /// Copies each active consumer's counters from its page into its record, where
    /// `gpipe inspect` reads them.
    pub(super) fn fold_counters(&self) {
        let active = self.active.load(Ordering::Acquire);
        let pages = self.pages.lock();
        for c in ring::members(active) {
            if let Some(page) = pages[c as usize].as_ref() {
                self.fold_counters_of(c, page);
            }
        }
    }

    /// Copies consumer `c`'s counters from its page into its record.
    pub(super) fn fold_counters_of(&self, c: u32, page: &ConsumerPage) {
        let (p, r) = (page.header(), self.seg.consumer(c));
        r.cursor
            .store(p.cursor.load(Ordering::Relaxed), Ordering::Relaxed);
        r.received
            .store(p.received.load(Ordering::Relaxed), Ordering::Relaxed);
        r.released
            .store(p.released.load(Ordering::Relaxed), Ordering::Relaxed);
        r.placement
            .store(p.placement.load(Ordering::Relaxed), Ordering::Release);
    }
}
