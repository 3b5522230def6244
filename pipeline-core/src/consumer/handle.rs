//! The consumer: receiving batches in place (broadcast: the next in sequence; shared: the
//! oldest unclaimed), the checks on what it reads, and waiting for the producer.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::backend::ConsumerBackend;
use crate::error::{Error, ProtocolError};
use crate::layout::{ControlSegment, Mode, RingLayout, USER_HEADER_WORDS, producer_state};
use crate::page::{ClaimSegment, ConsumerPage};
use crate::ring;
use crate::sys;
use crate::wait;

use super::batch::Batch;
use super::config::ConsumerConfig;
use super::link::Link;
use super::verdict::explain_violation;

/// The consuming side of a ring. One thread receives; the [`Batch`]es it returns are owned
/// values that may be held several at a time, sent to other threads and released in any
/// order.
pub struct Consumer<B: ConsumerBackend> {
    pub(super) link: Arc<Link<B>>,
    pub(super) index: u32,
    pub(super) layout: RingLayout,
    pub(super) cursor: u64,
    /// Shared mode: every batch below this was claimed when we last looked (our own hint:
    /// a peer cannot move it).
    pub(super) hint: u64,
    /// Shared mode: the producer's `requeued` count when we last scanned the whole window.
    pub(super) seen_requeued: u64,
    pub(super) last_head: u64,
    pub(super) config: ConsumerConfig,
    pub(super) ended: bool,
}

impl<B: ConsumerBackend> Consumer<B> {
    /// Our consumer index (0..capacity).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The ring's layout.
    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.link.backend
    }

    /// The control segment (mapped read-only: inspection and tests).
    pub fn segment(&self) -> &ControlSegment {
        &self.link.seg
    }

    /// The claim segment every consumer of the ring maps writable (tests).
    pub fn claims(&self) -> &ClaimSegment {
        &self.link.claims
    }

    /// This consumer's own page: its progress as the producer reads it (tests).
    pub fn page(&self) -> &ConsumerPage {
        &self.link.page
    }

    /// Starts a thread that checks the producer's socket every `tick` and, when the producer
    /// died, calls the backend's [`ConsumerBackend::abandon`] at once, without waiting for
    /// the next `recv`. On a GPU, work waiting on the producer's signals (a stream waiting on
    /// `ready`) is then released even while the user is blocked elsewhere, e.g. in a device
    /// synchronize. The thread ends when the ring closes, the producer dies, or the consumer
    /// and all its batches are gone.
    pub fn watch_producer(&self, tick: Duration) -> Result<(), Error> {
        let link = Arc::downgrade(&self.link);
        std::thread::Builder::new()
            .name("gpipe-watch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(tick);
                    let Some(link) = link.upgrade() else { return };
                    let state = link
                        .seg
                        .header()
                        .constants
                        .producer_state
                        .load(Ordering::Acquire);
                    if state == producer_state::CLOSED {
                        return;
                    }
                    if sys::peer_gone(&link.conn) {
                        tracing::warn!("the producer died: releasing waits on its signals");
                        link.backend.abandon();
                        return;
                    }
                }
            })
            .map_err(Error::os("spawn the producer watch thread"))?;
        Ok(())
    }

    /// Checks, without waiting for a batch, whether the producer is still there: `Ok(())`
    /// while it runs or after it closed the ring cleanly, [`Error::Detached`] if it detached
    /// us, [`Error::ProducerDied`] if it died (and then, as `recv` would, the backend releases
    /// the waits on its signals: on a GPU ring with timeline words, every consumer's). For a
    /// process that blocks elsewhere while holding this ring's batches, such as a forwarder
    /// waiting for room in its own ring, whose consumers' GPU work waits on ours.
    pub fn check_producer(&self) -> Result<(), Error> {
        // Detached (our socket was cut by a live producer): not a death, and nothing of the
        // ring's signals may be released.
        self.check_active()?;
        let h = self.link.seg.header();
        if h.constants.producer_state.load(Ordering::Acquire) == producer_state::CLOSED {
            return Ok(());
        }
        if sys::peer_gone(&self.link.conn)
            && h.constants.producer_state.load(Ordering::Acquire) != producer_state::CLOSED
        {
            self.link.backend.abandon();
            return Err(Error::ProducerDied);
        }
        Ok(())
    }

    /// Batches received and not yet released (by this consumer or by batches it handed out).
    pub fn held(&self) -> usize {
        self.link
            .held
            .iter()
            .filter(|h| h.load(Ordering::Acquire) != 0)
            .count()
            + self.link.mirrored.load(Ordering::Acquire)
    }

    /// Receives the next batch. `Ok(None)` means the producer closed the ring cleanly and
    /// everything published has been received. Errors: the producer died, we were detached,
    /// or the control segment holds values that cannot be right.
    pub fn recv(&mut self) -> Result<Option<Batch<B>>, Error> {
        self.recv_until(None)
    }

    /// As [`Consumer::recv`], giving up with [`Error::Timeout`] after `timeout`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Batch<B>>, Error> {
        self.recv_until(Some(Instant::now() + timeout))
    }

    /// As [`Consumer::recv`], giving up with [`Error::Timeout`] at `deadline` (`None`: never).
    pub fn recv_until(&mut self, deadline: Option<Instant>) -> Result<Option<Batch<B>>, Error> {
        if let Some(e) = self.link.deferred.lock().take() {
            return Err(e);
        }
        if self.ended {
            return Ok(None);
        }
        // A consumer that never has to wait (batches always ready) would otherwise not look
        // at its record until then, and go on receiving after the producer detached it.
        self.check_active()?;
        // Mirror delivery with every buffer of ours held: a batch taken now could not be
        // delivered, and would be lost to this consumer.
        if let Some(buffers) = self.link.backend.mirror_full() {
            return Err(Error::MirrorFull {
                buffers,
                held: self.held(),
            });
        }
        let got = match self.layout.mode {
            Mode::Broadcast => self.next_broadcast(deadline),
            Mode::Shared => self.next_shared(deadline),
        };
        let got = match got {
            Ok(g) => g,
            Err(Error::ProducerDied) => {
                self.link.backend.abandon();
                return Err(Error::ProducerDied);
            }
            Err(e) => return Err(e),
        };
        let Some((seq, slot, claim_unrecorded)) = got else {
            self.ended = true;
            return Ok(None);
        };
        let link = &*self.link;
        let desc = link.seg.slot(slot);
        let len = desc.len.load(Ordering::Relaxed);
        let mut header = [0u64; USER_HEADER_WORDS];
        for (h, w) in header.iter_mut().zip(&desc.header) {
            *h = w.load(Ordering::Relaxed);
        }
        if let Err(v) = ring::check_len(seq, slot, len, self.layout.slot_bytes) {
            link.refuse(slot, seq);
            return Err(self.violation(v));
        }
        let tensors = match link.seg.tensor_table(slot).read_tensors(len) {
            Ok(t) => t,
            Err(m) => {
                link.refuse(slot, seq);
                // Rewritten under us after a detach, or corrupt: our record tells which.
                return Err(match self.check_active() {
                    Err(detached) => detached,
                    Ok(()) => ProtocolError::Segment(format!("batch {seq}: {m}")).into(),
                });
            }
        };
        crate::fault::point("consumer.before_wait");
        if let Err(e) = link.backend.wait_ready(slot, seq) {
            link.refuse(slot, seq);
            return Err(Error::Backend(e));
        }
        crate::fault::point("consumer.after_wait");
        let mirrored = match link.backend.mirror(slot, seq, len) {
            Ok(m) => m,
            Err(e) => {
                link.refuse(slot, seq);
                return Err(Error::Backend(e));
            }
        };
        let rec = link.page.header();
        rec.received.fetch_add(1, Ordering::Relaxed);
        if mirrored {
            // The copy is ours and `finished` for the slot is signalled after it: release the
            // slot now. A claim whose token was not recorded is one the producer will not wait
            // for: the copy must be complete first.
            let done = if claim_unrecorded {
                link.backend.complete_now()
            } else {
                Ok(())
            };
            let ok = link.release_slot(slot, seq);
            rec.released.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = done {
                let _ = link.backend.signal_finished(slot, seq);
                return Err(Error::Backend(e));
            }
            if !ok {
                let _ = link.backend.signal_finished(slot, seq);
                return Err(Error::Detached(format!(
                    "batch {seq} was taken back before we released it"
                )));
            }
            link.mirrored.fetch_add(1, Ordering::AcqRel);
        } else {
            link.held[slot as usize].store(seq + 1, Ordering::Release);
        }
        Ok(Some(Batch {
            link: self.link.clone(),
            seq,
            slot,
            len,
            header,
            tensors,
            claim_unrecorded,
            mirrored,
            done: false,
        }))
    }

    /// Before a wait for the producer's next batch: if we hold the batch in the slot the
    /// producer must refill first, the wait could never end.
    pub(super) fn check_not_self_blocked(&self, head: u64) -> Result<(), Error> {
        let k = ring::slot_of(head, self.layout.slot_count);
        match self.link.held[k as usize].load(Ordering::Acquire) {
            0 => Ok(()),
            s => Err(Error::Deadlock {
                seq: s - 1,
                slot: k,
                held: self.held(),
            }),
        }
    }

    pub(super) fn load_head(&mut self) -> Result<u64, Error> {
        let head = self.link.seg.header().head.value.load(Ordering::Acquire);
        ring::check_head(self.last_head, head).map_err(|v| self.violation(v))?;
        self.last_head = head;
        Ok(head)
    }

    /// Our record must still say active, and still be ours (see [`Link::check_record`]).
    pub(super) fn check_active(&self) -> Result<(), Error> {
        self.link.check_record()
    }

    /// What a violation seen in the ring means. The producer marks our record before it
    /// takes our batches back and goes on without us, and what it publishes after that
    /// happens after the mark: a violation seen after it (the head past our cursor by more
    /// than the ring, a slot refilled under us) is the ring going on without us, which makes
    /// it a detach, not corruption. Only with our record still active and ours is the segment
    /// corrupt. Out of line: the per-batch checks that may call it stay small.
    #[cold]
    #[inline(never)]
    pub(super) fn violation(&self, v: ring::Violation) -> Error {
        if let ring::Violation::Overrun { head, cursor, n } = v
            && let Some(what) = self.page_tampered(cursor)
        {
            return ProtocolError::Segment(format!(
                "head {head} is more than {n} batches past our cursor {cursor}: batches we had \
                 not released were overwritten, because our page says {what}, which this \
                 consumer never wrote: another process wrote our page (a process of this uid \
                 can open it through /proc/<pid>/fd; run consumers that must not be reached \
                 as a user of their own)"
            ))
            .into();
        }
        explain_violation(v, self.check_active())
    }

    /// What our page says that we did not write, if anything: a batch we hold, or one we
    /// never received, shown as released. (Our page is writable by us and
    /// the producer only; a process that can reach our fds can write it too.)
    pub(super) fn page_tampered(&self, cursor: u64) -> Option<String> {
        let link = &*self.link;
        (0..self.layout.slot_count).find_map(|k| {
            let word = link.page.slot(k).load(Ordering::Acquire);
            match link.held[k as usize].load(Ordering::Acquire) {
                0 => ring::released_seq(word)
                    .filter(|&x| x >= cursor)
                    .map(|x| format!("batch {x} (slot {k}) was released before we received it")),
                h if word == ring::released(h - 1) => Some(format!(
                    "batch {} (slot {k}), which we still hold, was released",
                    h - 1
                )),
                _ => None,
            }
        })
    }

    /// Shared mode: puts batch `seq`, which we claimed in slot `k`, back as unclaimed and
    /// our page as it was (`before`). The producer makes the others look again if it waits.
    pub(super) fn unclaim(&self, k: u32, seq: u64, before: u64) {
        let link = &*self.link;
        let _ = link.claims.claim(k).compare_exchange(
            ring::claim_word(seq, Some(self.index)),
            ring::claim_word(seq, None),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        link.page.slot(k).store(before, Ordering::Release);
        wait::notify(
            link.claims.space_wake(),
            &link.seg.header().space_sleepers.value,
            false,
        );
    }

    /// Liveness check after a wake-up with nothing to do. `Ok(true)`: the ring is closed.
    pub(super) fn check_peer(&self, deadline: Option<Instant>) -> Result<bool, Error> {
        let h = self.link.seg.header();
        self.check_active()?;
        if h.constants.producer_state.load(Ordering::Acquire) == producer_state::CLOSED {
            return Ok(true);
        }
        if sys::peer_gone(&self.link.conn) {
            // A clean close may race the hang-up: re-check the state.
            if h.constants.producer_state.load(Ordering::Acquire) == producer_state::CLOSED {
                return Ok(true);
            }
            return Err(Error::ProducerDied);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Error::Timeout("a batch"));
        }
        Ok(false)
    }

    pub(super) fn next_broadcast(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(u64, u32, bool)>, Error> {
        let c = self.cursor;
        let n = self.layout.slot_count;
        let mut head = self.load_head()?;
        if head <= c {
            self.check_not_self_blocked(head)?;
            let seg = &self.link.seg;
            let h = seg.header();
            let policy = self.config.wait;
            let closed_empty = wait::wait_for(
                policy,
                &h.data_wake.value,
                &self.link.page.header().sleeping.value,
                || (h.head.value.load(Ordering::Acquire) > c).then_some(false),
                || {
                    if self.check_peer(deadline)? {
                        // Closed: anything left? Re-read head after seeing CLOSED.
                        return Ok(Some(h.head.value.load(Ordering::Acquire) <= c));
                    }
                    Ok(None)
                },
            )?;
            if closed_empty {
                return Ok(None);
            }
            head = self.load_head()?;
        }
        ring::check_window(head, c, n).map_err(|v| self.violation(v))?;
        let k = ring::slot_of(c, n);
        let desc = self.link.seg.slot(k);
        let seq = desc.seq.load(Ordering::Acquire);
        let addressed = desc.addressed.load(Ordering::Acquire);
        ring::check_slot(k, seq, c, addressed, self.index).map_err(|v| self.violation(v))?;
        self.cursor = c + 1;
        self.link
            .page
            .header()
            .cursor
            .store(self.cursor, Ordering::Relaxed);
        self.link.next_cursor.store(self.cursor, Ordering::Relaxed);
        Ok(Some((c, k, false)))
    }

    /// Shared mode: claims the oldest unclaimed batch (or one a peer claimed in our name).
    /// The flag is the old protocol's "claim not recorded", always false now: every claim
    /// is recorded in our page before it is made.
    pub(super) fn next_shared(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(u64, u32, bool)>, Error> {
        let n = self.layout.slot_count;
        let me = self.index;
        loop {
            let head = self.load_head()?;
            let link = &*self.link;
            let (seg, claims, page) = (&link.seg, &link.claims, &link.page);
            let h = seg.header();
            let requeued = h.requeued.value.load(Ordering::Acquire);
            let rescan = requeued != self.seen_requeued;
            let window = ring::live_window(head, n);
            let start = ring::scan_start(head, self.hint, rescan, n);
            for s in start..window.end {
                let k = ring::slot_of(s, n);
                let (claim, mine) = (claims.claim(k), page.slot(k));
                let Some(before) = ring::try_claim(claim, mine, s, me)
                    .or_else(|| ring::adopt(claim, mine, s, me))
                    .or_else(|| ring::claim_scribbled(claim, &seg.slot(k).seq, mine, s, me))
                else {
                    continue;
                };
                // Detached meanwhile (the producer marks our record before it takes our
                // claims back): this claim is not ours to keep. The fence pairs with the
                // producer's between marking the record and taking claims back, and with its
                // fence between marking a slot as being rewritten and looking at our page.
                std::sync::atomic::fence(Ordering::SeqCst);
                if let Err(e) = self.check_active() {
                    self.unclaim(k, s, before);
                    return Err(e);
                }
                let seq = seg.slot(k).seq.load(Ordering::SeqCst);
                if seq != s {
                    // The slot is being written again (a peer reopened a batch that was
                    // consumed) or holds a newer batch: not ours. Our page as it was, and
                    // the claim word too (unless the producer has written it since).
                    self.unclaim(k, s, before);
                    continue;
                }
                let now = h.head.value.load(Ordering::Acquire).max(head);
                if let Err(v) = ring::check_claimed(k, seq, now, n) {
                    self.unclaim(k, s, before);
                    return Err(self.violation(v));
                }
                if s >= self.hint {
                    self.hint = s + 1;
                }
                page.header().cursor.store(seq + 1, Ordering::Relaxed);
                return Ok(Some((seq, k, false)));
            }
            // Everything from `start` on was claimed when we looked.
            self.hint = self.hint.max(window.end);
            if rescan {
                self.seen_requeued = requeued;
            }
            // Nothing claimable: wait for a new batch or a requeue.
            self.check_not_self_blocked(head)?;
            let closed_empty = wait::wait_for(
                self.config.wait,
                &h.data_wake.value,
                &page.header().sleeping.value,
                || {
                    (h.head.value.load(Ordering::Acquire) != head
                        || h.requeued.value.load(Ordering::Acquire) != requeued)
                        .then_some(false)
                },
                || {
                    if self.check_peer(deadline)? {
                        // Closed: done when no batch still in its slot is unclaimed,
                        // claimed in our name (by a peer) without our page having taken it,
                        // or scribbled to another batch's word, but for batches we hold or
                        // released ourselves (a peer may reopen their words; we never take a
                        // batch twice). A slot the producer marked for rewriting held a
                        // consumed batch.
                        let head = h.head.value.load(Ordering::Acquire);
                        let left = ring::live_window(head, n).any(|s| {
                            let k = ring::slot_of(s, n);
                            let w = claims.claim(k).load(Ordering::Acquire);
                            let slot_seq = seg.slot(k).seq.load(Ordering::Acquire);
                            let mine = page.slot(k).load(Ordering::Relaxed);
                            slot_seq == s
                                && (w == ring::claim_word(s, None)
                                    || w == ring::claim_word(s, Some(me))
                                    || ring::scribbled(w, s, || slot_seq))
                                && mine != ring::released(s)
                                && mine != ring::holding(s)
                        });
                        return Ok(Some(!left));
                    }
                    Ok(None)
                },
            )?;
            if closed_empty {
                return Ok(None);
            }
            if h.constants.producer_state.load(Ordering::Acquire) == producer_state::CLOSED {
                // Closed with batches left (a peer may have forged a claim in our name after
                // our last scan passed it): look at the whole window again.
                self.hint = 0;
            }
        }
    }
}
