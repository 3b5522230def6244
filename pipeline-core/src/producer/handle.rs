//! The producer's handle: binding the ring to its socket, taking slots (in order or ahead),
//! waiting for consumers, flushing and closing.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::backend::ProducerBackend;
use crate::error::Error;
use crate::layout::{ControlSegment, RingLayout, producer_state};
use crate::page::ClaimSegment;
use crate::ring;
use crate::socket_file;
use crate::sys;

use super::config::{HeldBack, Holder, ProducerConfig, ProducerStats};
use super::slot::{Slot, SlotLoan};
use super::state::{Counters, Departure, Members, PageCache, Producer, Shared, SlotWait};

impl<B: ProducerBackend> Producer<B> {
    /// Creates the ring and its backend and listens on `socket_path` (mode 0600). A stale
    /// socket file left by a dead producer is replaced; a live producer's is not.
    ///
    /// It also makes the whole process not dumpable (no core dumps; no `/proc/<pid>/fd`,
    /// `/proc/<pid>/mem` or debugger access by other processes of its uid), unless
    /// [`ProducerConfig::keep_dumpable`] is set: see docs/security.md.
    pub fn bind(
        socket_path: impl AsRef<Path>,
        config: ProducerConfig,
        options: B::Options,
    ) -> Result<Self, Error> {
        crate::limits::check_shape(config.slots, config.batch_bytes, config.max_consumers)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let layout = config.layout();
        layout.validate()?;
        if config.max_lead == Some(0) {
            return Err(Error::InvalidArgument(
                "max_lead must be at least 1 batch (leave it out for the ring's own bound)".into(),
            ));
        }
        let socket_path = socket_path.as_ref().to_path_buf();
        // Before any fd of the ring exists: a process of our uid must not be able to open our
        // read-write fds through /proc/<pid>/fd (docs/security.md).
        if !config.keep_dumpable {
            sys::make_not_dumpable().map_err(Error::os("prctl(PR_SET_DUMPABLE, 0)"))?;
        }
        let seg = ControlSegment::create(layout, B::KIND.to_u32())?;
        let claims = ClaimSegment::create(&layout)?;
        // A ring too large for its memory is a wrong argument, not a failing backend.
        let backend = B::create(&layout, options).map_err(|e| {
            match e.downcast::<crate::limits::DoesNotFit>() {
                Ok(too_large) => Error::InvalidArgument(too_large.to_string()),
                Err(e) => Error::Backend(e),
            }
        })?;
        // Other users may attach: the socket must let them connect (the uid check on every
        // connection, not the file mode, then says who gets in).
        let open_to_others = !config.allowed_uids.is_empty() || !config.allowed_gids.is_empty();
        let (listener, socket_file) =
            socket_file::listen(&socket_path, if open_to_others { 0o666 } else { 0o600 })?;
        if open_to_others {
            socket_file::warn_if_unreachable(&socket_path);
        }
        let shared = Arc::new(Shared {
            seg,
            claims,
            pages: Mutex::new((0..layout.consumer_capacity).map(|_| None).collect()),
            pages_epoch: AtomicU64::new(0),
            consumed: (0..layout.slot_count).map(|_| AtomicU64::new(0)).collect(),
            backend,
            layout,
            config,
            members: Mutex::new(Members {
                conns: (0..layout.consumer_capacity).map(|_| None).collect(),
                handshaking: (0..layout.consumer_capacity).map(|_| None).collect(),
                reserved: 0,
                active: 0,
                head: 0,
            }),
            active: AtomicU64::new(0),
            joined_at: (0..layout.consumer_capacity)
                .map(|_| AtomicU64::new(0))
                .collect(),
            claim_tokens: (0..layout.consumer_capacity)
                .map(|_| AtomicU64::new(u64::MAX))
                .collect(),
            holders_gate: RwLock::new(()),
            closing: AtomicBool::new(false),
            stop_supervisor: AtomicBool::new(false),
            waker: sys::Waker::new().map_err(Error::os("pipe"))?,
            counters: Counters::default(),
        });
        let s2 = shared.clone();
        let supervisor = std::thread::Builder::new()
            .name("gpipe-supervisor".into())
            .spawn(move || s2.supervise(listener))
            .map_err(Error::os("spawn supervisor thread"))?;
        tracing::info!(
            socket = %socket_path.display(),
            slots = layout.slot_count,
            slot_bytes = layout.slot_bytes,
            mode = %layout.mode,
            backend = %B::KIND,
            "producer listening"
        );
        Ok(Self {
            shared,
            head: 0,
            holders: vec![0; layout.slot_count as usize],
            pages: std::cell::RefCell::new(PageCache {
                epoch: 0,
                pages: (0..layout.consumer_capacity).map(|_| None).collect(),
            }),
            pages_seen: std::cell::Cell::new(0),
            supervisor: Some(supervisor),
            socket_path,
            socket_file,
            closed: false,
            stalled_since: None,
            held_since: std::cell::RefCell::new((
                None,
                vec![None; layout.consumer_capacity as usize],
            )),
            reserved: 0,
            loan_epoch: 0,
        })
    }

    /// The ring's layout.
    pub fn layout(&self) -> RingLayout {
        self.shared.layout
    }

    /// The backend (e.g. for its stream or device).
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// The socket path consumers attach to.
    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// Number of consumers attached and active now.
    pub fn consumers(&self) -> u32 {
        self.shared.active.load(Ordering::Acquire).count_ones()
    }

    /// Sequence number of the next batch.
    pub fn next_seq(&self) -> u64 {
        self.head
    }

    /// Counters so far.
    pub fn stats(&self) -> ProducerStats {
        let c = &self.shared.counters;
        ProducerStats {
            published: self.head,
            attached: c.attached.load(Ordering::Relaxed),
            left: c.left.load(Ordering::Relaxed),
            died: c.died.load(Ordering::Relaxed),
            detached: c.detached.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            requeued: c.requeued.load(Ordering::Relaxed),
        }
    }

    /// Waits until at least `n` consumers are active, or `timeout` passes.
    pub fn wait_for_consumers(&self, n: u32, timeout: Duration) -> Result<(), Error> {
        self.wait_for_consumers_or_stop(n, timeout, &|| false)
            .map(|_| ())
    }

    /// As [`Producer::wait_for_consumers`], but also ends when `stop` returns true (a Ctrl-C
    /// flag, a shutdown request), which it asks every 2 ms. Returns whether the consumers
    /// came: `Ok(false)` when `stop` ended the wait. Refuses at once a wait that could never
    /// end: more consumers than the ring takes (`max_consumers`).
    pub fn wait_for_consumers_or_stop(
        &self,
        n: u32,
        timeout: Duration,
        stop: &dyn Fn() -> bool,
    ) -> Result<bool, Error> {
        let capacity = self.shared.layout.consumer_capacity;
        if n > capacity {
            return Err(Error::InvalidArgument(format!(
                "waiting for {n} consumers would never end: this ring takes at most {capacity} \
                 at once (max_consumers); raise max_consumers or wait for fewer"
            )));
        }
        let deadline = Instant::now() + timeout;
        while self.consumers() < n {
            if stop() {
                return Ok(false);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout("consumers to attach"));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(true)
    }

    /// While the producer waits for a slot (an [`Producer::acquire`] in progress, or the last
    /// one gave up with [`Error::Timeout`] and the slot is still taken): the batch it waits to
    /// write, since when, and the consumers that still hold the slot's previous batch. `None`
    /// when it is not waiting. In shared mode a slot whose batch no consumer has claimed yet
    /// is held by nobody in particular (`holders` is empty).
    pub fn held_back(&self) -> Option<HeldBack> {
        let (seq, since) = self.stalled_since?;
        if seq < self.head {
            return None;
        }
        let sh = &*self.shared;
        let n = sh.layout.slot_count;
        let waited_on = self
            .lead_bound(seq)
            .into_iter()
            .chain(ring::previous_in_slot(seq, n));
        for prev in waited_on {
            let slot = ring::slot_of(prev, n);
            let held = match self.slot_wait(slot, prev) {
                SlotWait::Free => continue,
                SlotWait::Held(m) => m,
                SlotWait::Unclaimed | SlotWait::Unbacked(_) => 0,
            };
            let members = sh.members.lock();
            let holders = (0..sh.layout.consumer_capacity)
                .filter(|&c| held & ring::bit(c) != 0)
                .map(|index| Holder {
                    index,
                    pid: members.conns[index as usize].as_ref().and_then(|m| m.pid),
                })
                .collect();
            return Some(HeldBack {
                seq,
                slot,
                since,
                holders,
            });
        }
        None
    }

    /// Takes the next slot, waiting until every consumer that had its previous batch has
    /// released it (and, through the backend, finished with it). Blocks while consumers lag,
    /// unless the lag policy detaches them.
    pub fn acquire(&mut self) -> Result<Slot<'_, B>, Error> {
        self.acquire_until(None)
    }

    /// As [`Producer::acquire`], but gives up with [`Error::Timeout`] after `timeout`.
    pub fn acquire_timeout(&mut self, timeout: Duration) -> Result<Slot<'_, B>, Error> {
        self.acquire_until(Some(Instant::now() + timeout))
    }

    fn acquire_until(&mut self, deadline: Option<Instant>) -> Result<Slot<'_, B>, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        let s = self.head;
        if s < self.reserved {
            // Taken ahead already (its waits are done): the same slot again.
            return Ok(Slot {
                seq: s,
                slot: ring::slot_of(s, self.shared.layout.slot_count),
                producer: self,
            });
        }
        self.wait_for_slot(s, deadline)?;
        Ok(Slot {
            seq: s,
            slot: ring::slot_of(s, self.shared.layout.slot_count),
            producer: self,
        })
    }

    /// Takes the slot of the next batch not yet taken, while earlier ones are still being
    /// written: a pipeline (a forwarder copying, a relay receiving) can have several batches
    /// in flight and publish each once it is whole. Returns a loan; write the slot through
    /// [`Producer::loan_memory`], and publish the batches in order: [`Producer::resume`] takes
    /// a loan back when it is the next batch (`loan.seq() == next_seq()`). At most as many
    /// batches as the ring has slots (and as `max_lead`) may be taken at once.
    /// [`Producer::acquire`] hands out the oldest taken one again.
    pub fn acquire_ahead(&mut self, timeout: Duration) -> Result<SlotLoan, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        let s = self.reserved.max(self.head);
        let n = u64::from(self.shared.layout.slot_count);
        let limit = self
            .shared
            .config
            .max_lead
            .map_or(n, |l| u64::from(l).min(n));
        if s - self.head >= limit {
            return Err(Error::InvalidArgument(format!(
                "{} batches are taken ahead and unpublished: at most {limit} may be (the ring's \
                 slots{})",
                s - self.head,
                if limit < n { " and max_lead" } else { "" }
            )));
        }
        self.wait_for_slot(s, Some(Instant::now() + timeout))?;
        self.reserved = s + 1;
        Ok(SlotLoan {
            seq: s,
            slot: ring::slot_of(s, self.shared.layout.slot_count),
            epoch: self.loan_epoch,
        })
    }

    /// The memory of a slot taken with [`Producer::acquire_ahead`] and not yet published.
    pub fn loan_memory(&mut self, loan: &SlotLoan) -> Result<B::SlotMut<'_>, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        if loan.epoch != self.loan_epoch
            || loan.seq < self.head
            || loan.seq >= self.reserved
            || loan.slot != ring::slot_of(loan.seq, self.shared.layout.slot_count)
        {
            return Err(Error::InvalidArgument(format!(
                "slot loan for batch {} is not an unpublished batch taken ahead ({}..{})",
                loan.seq, self.head, self.reserved
            )));
        }
        // The slot of an unpublished batch taken ahead: its previous holders released it and
        // the backend ordered after them (acquire_ahead); nothing else hands it out until it
        // is published (acquire returns it only as the head batch, through a Slot that
        // borrows the producer mutably, as this memory does).
        // SAFETY: the slot is ours alone until published, as argued above.
        Ok(unsafe { self.shared.backend.slot_mut(loan.slot) })
    }

    /// Gives back every slot taken ahead and not published (e.g. after the pipeline filling
    /// them failed): the next batch taken is the next to publish again, and the loans taken
    /// before are void (do not publish them). Asynchronous writes into those slots (a copy or
    /// a receive on a stream) must have finished or been ended first: the slots are handed out
    /// again.
    pub fn cancel_ahead(&mut self) {
        self.reserved = self.head;
        self.loan_epoch += 1;
    }

    /// The producer-lead bound it was configured with (None: the ring's own, its slots).
    pub fn max_lead(&self) -> Option<u32> {
        self.shared.config.max_lead
    }

    /// Batches taken ahead and not yet published.
    pub fn taken_ahead(&self) -> u64 {
        self.reserved.saturating_sub(self.head)
    }

    /// Takes back a slot let go with [`Slot::into_loan`]. Refused once the producer has
    /// published past it or was closed: a loan is good for the next batch only.
    pub fn resume(&mut self, loan: SlotLoan) -> Result<Slot<'_, B>, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        if loan.epoch != self.loan_epoch {
            return Err(Error::InvalidArgument(format!(
                "slot loan for batch {} was cancelled (cancel_ahead)",
                loan.seq
            )));
        }
        if loan.seq != self.head
            || loan.slot != ring::slot_of(self.head, self.shared.layout.slot_count)
        {
            return Err(Error::InvalidArgument(format!(
                "slot loan for batch {} is stale: the next batch is {}",
                loan.seq, self.head
            )));
        }
        Ok(Slot {
            producer: self,
            seq: loan.seq,
            slot: loan.slot,
        })
    }

    /// Waits until every published batch has been released by every consumer that holds it,
    /// and orders the backend after their work (as `acquire` does for each slot): afterwards
    /// the ring is idle. Gives up with [`Error::Timeout`] after `timeout`.
    pub fn flush(&mut self, timeout: Duration) -> Result<(), Error> {
        let deadline = Some(Instant::now() + timeout);
        let n = self.shared.layout.slot_count;
        for s in self.head.saturating_sub(n as u64)..self.head {
            let k = ring::slot_of(s, n);
            self.wait_slot_free(k, s, Instant::now(), deadline)?;
            let _gate = self.shared.holders_gate.read();
            let holders = self.holders_of(k, s);
            self.shared
                .backend
                .wait_finished(k, s, holders)
                .map_err(Error::Backend)?;
        }
        Ok(())
    }

    /// Shuts the ring down cleanly: consumers get every batch already published, then end.
    /// Waits up to the configured drain timeout for them to release and detach (the CUDA
    /// backend frees memory only after importers are done).
    pub fn close(mut self) -> ProducerStats {
        self.close_inner();
        self.stats()
    }

    /// Closes the ring as [`Producer::close`] does, but keeps the slot memory until the
    /// producer is dropped: for bindings that handed out views of it.
    pub fn shutdown(&mut self) -> ProducerStats {
        self.close_inner();
        self.stats()
    }

    /// True once the ring is closed.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    fn close_inner(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let sh = &*self.shared;
        sh.closing.store(true, Ordering::Release);
        let h = sh.seg.header();
        h.constants
            .producer_state
            .store(producer_state::CLOSED, Ordering::Release);
        sh.wake_consumers();
        let deadline = Instant::now() + sh.config.drain_timeout;
        loop {
            let attached = {
                let m = sh.members.lock();
                // Reserved: an attach in progress, or a departure whose backend detach is
                // still running. Either ends soon.
                m.reserved != 0 || m.conns.iter().any(|c| c.is_some())
            };
            if !attached || Instant::now() >= deadline {
                if attached {
                    tracing::warn!(
                        "closing with consumers still attached after {:?}; detaching them",
                        sh.config.drain_timeout
                    );
                    // Detach them here, as the supervisor would: on the CUDA backend this
                    // releases their waits, which an attach in progress may be draining.
                    let idxs: Vec<u32> = {
                        let m = sh.members.lock();
                        (0..m.conns.len() as u32)
                            .filter(|&i| m.conns[i as usize].is_some())
                            .collect()
                    };
                    for i in idxs {
                        sh.depart(
                            i,
                            Departure::Detached,
                            "did not drain before the close timed out",
                        );
                    }
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        sh.stop_supervisor.store(true, Ordering::Release);
        sh.waker.wake();
        if let Some(t) = self.supervisor.take() {
            let _ = t.join();
        }
        socket_file::remove(&self.socket_path, self.socket_file);
    }

    /// Leaves the ring as a crashed producer would, for a producer whose own source failed
    /// (a forwarder whose upstream died, a relay whose sender vanished): consumers get
    /// [`Error::ProducerDied`] at once, not a clean end that would hide the batches that never
    /// came, while this process goes on. The connections are cut and the socket removed; the
    /// ring's memory (and on a GPU its streams, which may wait on work that never comes) is
    /// left to the process's exit rather than torn down here, where that could block.
    pub fn abandon(mut self) {
        self.closed = true;
        let sh = &*self.shared;
        {
            // Under the lock an attach checks `closing` with: no consumer joins after this.
            let mut m = sh.members.lock();
            sh.closing.store(true, Ordering::Release);
            for member in m.conns.iter_mut().filter_map(Option::take) {
                let _ = member.conn.shutdown(std::net::Shutdown::Both);
            }
        }
        // Consumers asleep waiting for a batch look at the producer now.
        sh.wake_consumers();
        socket_file::remove(&self.socket_path, self.socket_file);
        // The supervisor is told to stop but not joined: a handshake it waits for may be stuck
        // in the backend (a GPU stream that waits on work that never comes). It and the
        // backend stay alive to the end of the process (see above).
        sh.stop_supervisor.store(true, Ordering::Release);
        sh.waker.wake();
        drop(self.supervisor.take());
        std::mem::forget(Arc::clone(&self.shared));
    }
}

impl<B: ProducerBackend> Drop for Producer<B> {
    fn drop(&mut self) {
        self.close_inner();
    }
}
