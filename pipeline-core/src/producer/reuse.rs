//! When a slot may be written again: who still holds the batch it carries (broadcast: the
//! consumers it was addressed to, by their pages; shared: the pages alone, with the claim word
//! telling an unclaimed batch from one to put back), and the producer's wait for it under the
//! lag policy.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::backend::ProducerBackend;
use crate::error::Error;
use crate::layout::MAX_SEQ;
use crate::ring;
use crate::wait;

use super::config::LagPolicy;
use super::state::{Departure, PageCache, Producer, SlotWait};

impl<B: ProducerBackend> Producer<B> {
    /// Waits until the slot of batch `s` may be written: its previous batch released by every
    /// holder (and, through the backend, their work done), and under `max_lead` the batch
    /// that far back done with too.
    pub(super) fn wait_for_slot(&mut self, s: u64, deadline: Option<Instant>) -> Result<(), Error> {
        if s > MAX_SEQ {
            return Err(Error::InvalidArgument(
                "sequence numbers exhausted (2^48 batches)".into(),
            ));
        }
        let n = self.shared.layout.slot_count;
        let k = ring::slot_of(s, n);
        // Under a lead bound, the batch `max_lead` back must be done with too (it still sits
        // in its slot: the lead is below the ring's size).
        let early = self.lead_bound(s).map(|e| (ring::slot_of(e, n), e));
        let prev = ring::previous_in_slot(s, n);
        if early.is_none() && prev.is_none() {
            return Ok(());
        }
        let started = match self.stalled_since {
            Some((seq, t)) if seq == s => t,
            _ => self.stalled_since.insert((s, Instant::now())).1,
        };
        if let Some((k_early, e)) = early {
            self.wait_slot_free(k_early, e, started, deadline)?;
        }
        if let Some(p) = prev {
            self.wait_slot_free(k, p, started, deadline)?;
        }
        self.stalled_since = None;
        // Both released: the backend orders after both in one call (one stream operation).
        let _gate = self.shared.holders_gate.read();
        let mut waits = [(0, 0, 0); 2];
        let mut len = 0;
        for (slot, seq) in early.into_iter().chain(prev.map(|p| (k, p))) {
            waits[len] = (slot, seq, self.holders_of(slot, seq));
            len += 1;
        }
        self.shared
            .backend
            .wait_finished_all(&waits[..len])
            .map_err(Error::Backend)
    }

    /// While publishing batch `seq`: when the next batch will be acquired next and its
    /// slot's previous batch is already released by every holder, what `wait_for_slot` will
    /// hand [`ProducerBackend::wait_finished`] for it, `(slot, prev_seq, holders)`, for
    /// [`ProducerBackend::signal_ready_then_wait`]. Not under a lead bound below the ring
    /// (which waits for a second batch), nor with one slot (the next batch's previous one is
    /// `seq` itself), nor when a later batch was already taken ahead. The caller holds
    /// `holders_gate`.
    pub(super) fn free_next(&self, seq: u64) -> Option<(u32, u64, u64)> {
        let sh = &*self.shared;
        let n = sh.layout.slot_count;
        let next = seq + 1;
        if n < 2 || next > MAX_SEQ || self.reserved > next || self.lead_bound(next).is_some() {
            return None;
        }
        let prev = ring::previous_in_slot(next, n)?;
        let k = ring::slot_of(next, n);
        (self.slot_wait(k, prev) == SlotWait::Free).then(|| (k, prev, self.holders_of(k, prev)))
    }

    /// The consumers' pages as of now, for the consumers in the active mask loaded first
    /// (the caller's `active` must be loaded before this call: a page is installed, and the
    /// epoch bumped, before its consumer's bit is set).
    pub(super) fn pages(&self) -> std::cell::Ref<'_, PageCache> {
        let epoch = self.shared.pages_epoch.load(Ordering::Acquire);
        if self.pages_seen.get() != epoch {
            let mut cache = self.pages.borrow_mut();
            cache.pages.clone_from(&self.shared.pages.lock());
            cache.epoch = epoch;
            self.pages_seen.set(epoch);
        }
        self.pages.borrow()
    }

    /// Where slot `k`, holding batch `prev`, stands (see [`SlotWait`]). In shared mode a slot
    /// found free is marked as being written again (its descriptor's `seq` set to
    /// [`ring::NO_BATCH`]) and its holders looked for once more: a consumer that claims the
    /// batch anew (a peer may have reopened its claim word) either sees the mark and lets
    /// go, or is seen here and waited for.
    pub(super) fn slot_wait(&self, k: u32, prev: u64) -> SlotWait {
        let sh = &*self.shared;
        let active = sh.active.load(Ordering::Acquire);
        let cache = self.pages();
        let word = |c: u32, order: Ordering| {
            cache.pages[c as usize]
                .as_ref()
                .map_or(0, |p| p.slot(k).load(order))
        };
        if !sh.shared_mode() {
            let addressed = self.addressed(k, prev, active);
            return match ring::broadcast_laggards(prev, addressed, |c| word(c, Ordering::Acquire)) {
                0 => SlotWait::Free,
                m => SlotWait::Held(m),
            };
        }
        let w = sh.claims.claim(k).load(Ordering::Acquire);
        let consumed = sh.consumed[k as usize].load(Ordering::Acquire) == prev + 1;
        match ring::shared_slot(w, prev, active, consumed, |c| word(c, Ordering::Acquire)) {
            ring::SharedSlot::Free => {
                let desc = sh.seg.slot(k);
                if desc.seq.load(Ordering::Relaxed) != ring::NO_BATCH {
                    desc.seq.store(ring::NO_BATCH, Ordering::SeqCst);
                }
                match ring::holders_after_mark(prev, active, |c| word(c, Ordering::SeqCst)) {
                    0 => SlotWait::Free,
                    m => SlotWait::Held(m),
                }
            }
            ring::SharedSlot::Held(m) => SlotWait::Held(m),
            ring::SharedSlot::Unclaimed => SlotWait::Unclaimed,
            ring::SharedSlot::Unbacked => SlotWait::Unbacked(w),
        }
    }

    /// Broadcast: the consumers batch `prev` (in slot `k`) was published to that are still
    /// attached — not a consumer that has since taken the same index (it joined after).
    pub(super) fn addressed(&self, k: u32, prev: u64, active: u64) -> u64 {
        let sh = &*self.shared;
        let mut holders = 0;
        for c in ring::members(self.holders[k as usize] & active) {
            if sh
                .joined_at
                .get(c as usize)
                .is_some_and(|j| j.load(Ordering::Acquire) <= prev)
            {
                holders |= ring::bit(c);
            }
        }
        holders
    }

    /// Shared mode: puts back as unclaimed a batch whose claim word `w` no page backs (a
    /// scribble, a claim in another's name, a departed claimer's late claim), and tells the
    /// consumers to look again.
    pub(super) fn put_back(&self, k: u32, prev: u64, w: u64) {
        let sh = &*self.shared;
        if sh
            .claims
            .claim(k)
            .compare_exchange(
                w,
                ring::claim_word(prev, None),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            tracing::debug!(
                slot = k,
                "slot {k}'s claim word held {w:#x}, which no consumer's page backs (a claim in \
                 another's name, or scribbled); put batch {prev} back as unclaimed"
            );
            self.rescan();
        }
    }

    /// Shared mode: tells consumers to scan the whole window again (a batch was put back).
    pub(super) fn rescan(&self) {
        let sh = &*self.shared;
        sh.seg
            .header()
            .requeued
            .value
            .fetch_add(1, Ordering::AcqRel);
        sh.wake_consumers();
    }

    /// The batch that must be done with before batch `s` is written, under
    /// [`ProducerConfig::max_lead`]; None when the ring's own bound applies.
    pub(super) fn lead_bound(&self, s: u64) -> Option<u64> {
        let lead = u64::from(self.shared.config.max_lead?);
        if lead >= u64::from(self.shared.layout.slot_count) {
            return None;
        }
        s.checked_sub(lead)
    }

    /// Waits until slot `k`, holding batch `prev`, is free; the lag policy counts from
    /// `started`.
    pub(super) fn wait_slot_free(
        &self,
        k: u32,
        prev: u64,
        started: Instant,
        deadline: Option<Instant>,
    ) -> Result<(), Error> {
        let sh = &*self.shared;
        let h = sh.seg.header();
        // Sleep no longer than the deadline: a caller polling with short timeouts (a pipeline
        // that publishes between them) must get control back on time.
        let mut policy = sh.config.wait;
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            policy.tick = policy.tick.min(left.max(Duration::from_micros(50)));
        }
        wait::wait_for(
            policy,
            sh.claims.space_wake(),
            &h.space_sleepers.value,
            || match self.slot_wait(k, prev) {
                SlotWait::Free => Some(()),
                SlotWait::Unbacked(w) => {
                    self.put_back(k, prev, w);
                    None
                }
                _ => None,
            },
            || {
                let laggards = match self.slot_wait(k, prev) {
                    SlotWait::Free => return Ok(Some(())),
                    SlotWait::Held(m) => m,
                    SlotWait::Unbacked(w) => {
                        self.put_back(k, prev, w);
                        0
                    }
                    SlotWait::Unclaimed => {
                        // Consumers look for work from where they last found some: make
                        // them look at the whole window, whatever put this batch back.
                        self.rescan();
                        0
                    }
                };
                if let LagPolicy::DetachAfter(limit) = sh.config.lag {
                    // Broadcast: a laggard has held the batch since the wait began at least.
                    // Shared: since its page first said so (without a break) in this stall.
                    let now = Instant::now();
                    let mut overdue = 0;
                    let mut held_since = self.held_since.borrow_mut();
                    let (stall, since) = &mut *held_since;
                    if *stall != Some(started) {
                        since.fill(None);
                        *stall = Some(started);
                    }
                    for (c, t) in since.iter_mut().enumerate() {
                        let c = c as u32;
                        if laggards & ring::bit(c) == 0 {
                            *t = None;
                            continue;
                        }
                        let from = if sh.shared_mode() {
                            *t.get_or_insert(now)
                        } else {
                            started
                        };
                        if now.saturating_duration_since(from) >= limit {
                            overdue |= ring::bit(c);
                        }
                    }
                    drop(held_since);
                    for c in ring::members(overdue) {
                        sh.depart(
                            c,
                            Departure::Detached,
                            &format!(
                                "it held slot {k} for over {limit:?} (lag policy detach-after)"
                            ),
                        );
                    }
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(Error::Timeout("a free slot"));
                }
                Ok(None)
            },
        )
    }

    /// The consumers that got batch `seq` (in slot `k`) and are still attached — not a
    /// consumer that has since taken the same index (broadcast: it joined after `seq`;
    /// shared: its fresh page never took the batch).
    pub(super) fn holders_of(&self, k: u32, seq: u64) -> u64 {
        let sh = &*self.shared;
        let active = sh.active.load(Ordering::Acquire);
        if !sh.shared_mode() {
            return self.addressed(k, seq, active);
        }
        // Every active consumer whose page says it took the batch (held or released it): not
        // filtered by join point, since a consumer may claim a batch published before it
        // joined; a later consumer at an index has a fresh page that never took it.
        let cache = self.pages();
        let mut holders = 0;
        for c in ring::members(active) {
            let w = cache.pages[c as usize]
                .as_ref()
                .map_or(0, |p| p.slot(k).load(Ordering::Acquire));
            if w == ring::holding(seq) || w == ring::released(seq) {
                holders |= ring::bit(c);
            }
        }
        holders
    }
}
