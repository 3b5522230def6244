//! What a consumer shares with the batches it handed out (the mapped segments, its page, the
//! backend's imports, the socket): batches are released through it from any thread, and the
//! producer is told goodbye when the last of them goes.

use std::mem::ManuallyDrop;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::time::Duration;

use crate::backend::ConsumerBackend;
use crate::error::Error;
use crate::layout::{ConsumerRecord, ControlSegment, Mode, RingLayout, producer_state};
use crate::page::{ClaimSegment, ConsumerPage};
use crate::ring;
use crate::sys;
use crate::wait;
use crate::wire::{self, Message};
use parking_lot::Mutex;

use super::verdict::record_verdict;

/// What a consumer shares with the batches it handed out: a batch is released through it,
/// from any thread, after the consumer itself may be gone. When the last of them goes, the
/// backend's imports are freed and the producer is told goodbye.
pub(super) struct Link<B: ConsumerBackend> {
    /// Our record in `seg` (see [`Link::record`]).
    pub(super) record: RecordPtr,
    /// What the producer writes (read-only to us).
    pub(super) seg: ControlSegment,
    /// The words every consumer may write: the producer's wake word, shared-mode claims.
    pub(super) claims: ClaimSegment,
    /// Our own progress, which only we and the producer map writable.
    pub(super) page: ConsumerPage,
    pub(super) backend: ManuallyDrop<B>,
    pub(super) conn: UnixStream,
    pub(super) index: u32,
    /// Our record's generation at attach (see [`Consumer::check_active`]).
    pub(super) generation: u64,
    pub(super) layout: RingLayout,
    /// Per slot: the sequence number + 1 of the batch we hold in it, 0 when none.
    pub(super) held: Box<[AtomicU64]>,
    /// Mirrored batches held (their slots are already released).
    pub(super) mirrored: AtomicUsize,
    /// An error from releasing a dropped batch, reported by the next `recv`.
    pub(super) deferred: Mutex<Option<Error>>,
    /// Broadcast: the sequence number this consumer receives next (its cursor, kept here for
    /// releases on other threads); `u64::MAX` in shared mode, where the next is claimed.
    pub(super) next_cursor: AtomicU64,
}

/// Our consumer record in the control segment (read-only to us: our counters are in our
/// page), looked up once at attach: every batch reads its state and generation, and
/// [`ControlSegment::consumer`] would check the index and work out the offset each time.
pub(super) struct RecordPtr(pub(super) std::ptr::NonNull<ConsumerRecord>);

// SAFETY: it points at a `ConsumerRecord`, whose fields are all atomics (so shared access from
// any thread is sound), in the mapping of the `ControlSegment` of the same `Link`, which
// lives (and stays mapped at the same address) as long as the pointer does.
unsafe impl Send for RecordPtr {}
// SAFETY: as for `Send` above: only shared references to atomics are made from it.
unsafe impl Sync for RecordPtr {}

impl<B: ConsumerBackend> Link<B> {
    /// Our record (`seg.consumer(index)`), without the lookup.
    #[inline]
    pub(super) fn record(&self) -> &ConsumerRecord {
        // SAFETY: `record` was made from `seg.consumer(index)` at attach; `seg` is ours and
        // keeps its mapping, at the same address, while we live.
        unsafe { self.record.0.as_ref() }
    }

    /// Our record must still say active, and still be ours: the producer marks it when it
    /// detaches us, and a consumer that attaches later may be given our index (and so our
    /// record, active again, with its generation bumped).
    pub(super) fn check_record(&self) -> Result<(), Error> {
        let rec = self.record();
        let state = rec.state.load(Ordering::Acquire);
        record_verdict(
            state,
            rec.generation.load(Ordering::Relaxed),
            self.generation,
        )
    }

    /// Releases batch `seq` in `slot` (in our page); false if it was taken from us
    /// (broadcast: the producer no longer addresses it to us, which it alone can say; in
    /// shared mode the record check before this call tells).
    pub(super) fn release_slot(&self, slot: u32, seq: u64) -> bool {
        ring::release(self.page.slot(slot), seq);
        let ok = match self.layout.mode {
            Mode::Broadcast => {
                self.seg.slot(slot).addressed.load(Ordering::Acquire) & ring::bit(self.index) != 0
            }
            Mode::Shared => true,
        };
        let h = self.seg.header();
        wait::notify(self.claims.space_wake(), &h.space_sleepers.value, false);
        ok
    }

    /// Gives back a batch we will not use, so the producer is not stalled by our refusal. We
    /// did no work on it: say so first, or the producer's next write of the slot would wait
    /// for a `finished` signal that never comes.
    pub(super) fn refuse(&self, slot: u32, seq: u64) {
        let _ = self.backend.signal_finished(slot, seq);
        self.release_slot(slot, seq);
    }

    /// Broadcast: the batch this consumer receives next, `(slot, seq)`, when the producer
    /// has already published it to us (so its ready signal is enqueued), for
    /// [`ConsumerBackend::signal_finished_then_wait`]. Read from the segment, and only used
    /// as a hint: the receive that follows checks the batch as always.
    pub(super) fn next_published(&self) -> Option<(u32, u64)> {
        let c = self.next_cursor.load(Ordering::Relaxed);
        if c == u64::MAX {
            return None;
        }
        let n = self.layout.slot_count;
        let head = self.seg.header().head.value.load(Ordering::Acquire);
        if head <= c || ring::check_window(head, c, n).is_err() {
            return None;
        }
        let k = ring::slot_of(c, n);
        let desc = self.seg.slot(k);
        let seq = desc.seq.load(Ordering::Acquire);
        let addressed = desc.addressed.load(Ordering::Acquire);
        ring::check_slot(k, seq, c, addressed, self.index)
            .is_ok()
            .then_some((k, c))
    }

    /// The backend's finished signal, then the ring's release. A mirrored batch's slot was
    /// released when it was copied: only the consumer's own buffer is given back.
    #[inline]
    pub(super) fn release_batch(
        &self,
        seq: u64,
        slot: u32,
        claim_unrecorded: bool,
        mirrored: bool,
    ) -> Result<(), Error> {
        if mirrored {
            let r = self.backend.signal_finished(slot, seq);
            self.mirrored.fetch_sub(1, Ordering::AcqRel);
            return r.map_err(Error::Backend);
        }
        let next = if self.backend.looks_ahead() {
            self.next_published()
        } else {
            None
        };
        let mut finished = self.backend.signal_finished_then_wait(slot, seq, next);
        if claim_unrecorded {
            finished = finished.and_then(|()| self.backend.complete_now());
        }
        crate::fault::point("consumer.before_release");
        self.held[slot as usize].store(0, Ordering::Release);
        // Detached, and our index perhaps given to a later consumer: the slot's bit for our
        // index, and the record's counters, are no longer ours to touch.
        let ours = self.check_record().is_ok();
        let ok = ours && self.release_slot(slot, seq);
        crate::fault::point("consumer.after_release");
        if ours {
            self.page.header().released.fetch_add(1, Ordering::Relaxed);
        }
        finished.map_err(Error::Backend)?;
        if !ok {
            return Err(Error::Detached(format!(
                "batch {seq} was taken back before we released it"
            )));
        }
        Ok(())
    }
}

impl<B: ConsumerBackend> Drop for Link<B> {
    fn drop(&mut self) {
        // A producer that died unnoticed (we did not wait since): its signals may never come.
        let closed = self
            .seg
            .header()
            .constants
            .producer_state
            .load(Ordering::Acquire)
            == producer_state::CLOSED;
        if !closed && sys::peer_gone(&self.conn) {
            self.backend.abandon();
        }
        // Importers free first: drop the backend (unmapping/freeing imports) before saying
        // goodbye, so the producer frees its memory only after ours is gone.
        // SAFETY: the backend is never used again: this is the link's drop, and every batch
        // (each holds the link) is gone.
        unsafe { ManuallyDrop::drop(&mut self.backend) };
        let _ = self.conn.set_nonblocking(false);
        let _ = self
            .conn
            .set_write_timeout(Some(Duration::from_millis(200)));
        let _ = wire::send(&self.conn, &Message::Goodbye, &[]);
    }
}
