//! The producer's half of the CUDA backend: the slots and their exports, the `ready` signal,
//! the waits on each consumer's `finished` words, and the watch on them for the lag policy.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use pipeline_core::wire::Reader;
use pipeline_core::{BackendError, BackendKind, Export, ProducerBackend, RingLayout};

use crate::driver::{self, Context, CudaError, Event, Stream, WaitCondition};
use crate::error::be;
use crate::export::ExportHeader;
use crate::memory::ProducerSlots;
use crate::memory::{HandleKind, MemoryPath};
use crate::sync::{FinishedWords, RELEASED, ReadySignal, Timelines, join_into};
use crate::sync::{SyncMode, TimelineMemory};

use super::options::{CudaOptions, check_capabilities};
use super::views::CudaSlotMut;
use crate::export::REPLY_MAGIC;

/// The producer's half.
pub struct CudaProducer {
    ctx: Arc<Context>,
    stream: Stream,
    slots: ProducerSlots,
    slot_count: u32,
    memory: MemoryPath,
    handle: HandleKind,
    ready: ReadySignal,
    export: Vec<u8>,
    slot_bytes: u64,
    pub(super) timelines: FinishedWords,
    /// Device timeline words only: the stream that zeroes and releases them (it never waits).
    release: Option<Arc<Stream>>,
    /// Consumers whose timelines the producer waits on (bit c). Locked only briefly, never
    /// across a driver call, so a departure can always release a dead consumer's words.
    live: Mutex<u64>,
    /// Held (shared) while waits are enqueued, and (exclusive) by an attach while it drains
    /// the stream before reusing a consumer index's words.
    gate: RwLock<()>,
    /// Watching our waits on consumers' `finished` words (from the first
    /// [`ProducerBackend::overdue`] call on: only a ring with the lag policy `DetachAfter`
    /// asks, and only it pays for the bookkeeping).
    watch: Watch,
    /// An ordering-only event for joining a caller's stream with ours.
    scratch: Mutex<Event>,
    /// Per slot: the generation (`seq + 1`) whose `ready` was already signalled on a caller's
    /// stream ([`CudaProducer::signal_ready_on`]); `signal_ready` then adds nothing.
    presignalled: Vec<AtomicU64>,
    /// Per slot: `prev_seq + 1` of the finished waits a look ahead already enqueued
    /// ([`ProducerBackend::signal_ready_then_wait`]); `wait_finished` for them adds nothing.
    prewaited: Vec<AtomicU64>,
}

/// What [`ProducerBackend::overdue`] needs: each wait on a `finished` word is followed on the
/// stream by a write of its number to `progress`, a host-mapped word of ours, so the host sees
/// how far the stream has got. Waits not yet passed are kept oldest first; the oldest is the
/// one holding the stream up once the stream has passed the one before it.
struct Watch {
    on: std::sync::atomic::AtomicBool,
    progress: Timelines,
    state: Mutex<WatchState>,
}

struct WatchState {
    /// Number of the last wait enqueued.
    enqueued: u64,
    /// Waits not yet seen passed: (number, consumer), oldest first.
    pending: VecDeque<(u64, u32)>,
    /// When the host first saw the stream reach the oldest pending wait.
    front_reached: Option<Instant>,
}

/// Most waits the watch remembers; past this (a stream stalled for long while the producer
/// keeps enqueuing) the newest are not recorded. Judging stays right: an entry counts as
/// reached only once the stream has passed the wait numbered just before it, recorded or not.
const MAX_WATCHED: usize = 1 << 16;

impl CudaProducer {
    /// The CUDA context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
    /// The producer's stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
    /// The memory path the slots live on.
    pub fn memory_path(&self) -> MemoryPath {
        self.memory
    }
    /// How the slots' handles are shared.
    pub fn handle_kind(&self) -> HandleKind {
        self.handle
    }
    /// Where the timeline words live.
    pub fn timeline_memory(&self) -> TimelineMemory {
        if self.release.is_some() {
            TimelineMemory::Device
        } else {
            TimelineMemory::Host
        }
    }

    /// Makes a caller's `stream` wait for everything enqueued on the producer's stream so far
    /// (after `acquire`: the waits for the slot's previous consumers). gpipe's own waits stay
    /// on its stream, where the lag watch counts them; the caller's stream waits one event.
    ///
    /// # Safety
    /// `stream` must be a live stream handle of this context, or `CU_STREAM_LEGACY` (1) /
    /// `CU_STREAM_PER_THREAD` (2).
    pub(crate) unsafe fn order_after(&self, stream: driver::CUstream) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        let ev = self.scratch.lock();
        ev.record(&self.stream)?;
        // SAFETY: the caller guarantees `stream`; the event is ours and live.
        unsafe { Stream::raw_wait_event(stream, &ev) }
    }

    /// Signals `ready` for batch `seq` in `slot` on a caller's `stream`, after the work
    /// enqueued on it so far (instead of joining that stream into ours and signalling there):
    /// the publish that follows adds no signal of its own. The caller's stream must already
    /// contain, or wait for, every write of the batch.
    ///
    /// # Safety
    /// As for [`CudaProducer::order_after`].
    pub(crate) unsafe fn signal_ready_on(
        &self,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        // SAFETY: the caller guarantees `stream`.
        unsafe { self.ready.signal(stream, slot, seq) }?;
        self.presignalled[slot as usize].store(seq + 1, Ordering::Release);
        Ok(())
    }

    /// Forgets a [`CudaProducer::signal_ready_on`] for `slot` whose publish did not happen:
    /// the next publish of the slot signals again.
    pub(crate) fn forget_presignal(&self, slot: u32) {
        self.presignalled[slot as usize].store(0, Ordering::Release);
    }

    /// Blocks until all work in the producer's CUDA context is done, the application's streams
    /// included (teardown, when the slots' writers used other streams than ours).
    pub fn synchronize_all(&self) -> Result<(), CudaError> {
        self.ctx.synchronize()
    }

    /// Makes the producer's stream wait for everything enqueued on a caller's `stream` so
    /// far (before `publish`: `ready` is then recorded after the caller's writes).
    ///
    /// # Safety
    /// As for [`CudaProducer::order_after`].
    pub(crate) unsafe fn join(&self, stream: driver::CUstream) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees `stream`.
        unsafe { join_into(&self.ctx, &self.scratch, &self.stream, stream) }
    }
}

impl Watch {
    fn new(ctx: &Arc<Context>) -> Result<Self, BackendError> {
        Ok(Self {
            on: std::sync::atomic::AtomicBool::new(false),
            progress: Timelines::create(ctx, 1, 1, "gpipe-progress")?,
            state: Mutex::new(WatchState {
                enqueued: 0,
                pending: VecDeque::new(),
                front_reached: None,
            }),
        })
    }

    /// Drops the waits the stream has passed; notes when it reached the oldest left.
    fn update(&self, st: &mut WatchState) {
        // Progress words are host words (Watch::new).
        let passed = self
            .progress
            .host(0, 0)
            .map_or(0, |w| w.load(Ordering::Acquire));
        while st.pending.front().is_some_and(|&(n, _)| n <= passed) {
            st.pending.pop_front();
            st.front_reached = None;
        }
        if let Some(&(n, _)) = st.pending.front() {
            // Reached once the wait before it passed (the work between two waits is ours:
            // a fill and a `ready` record).
            if n <= passed + 1 && st.front_reached.is_none() {
                st.front_reached = Some(Instant::now());
                tracing::trace!(
                    wait = n,
                    passed,
                    "the stream reached the oldest watched wait"
                );
            }
        }
    }
}

impl ProducerBackend for CudaProducer {
    type Options = CudaOptions;
    type SlotMut<'a> = CudaSlotMut<'a>;
    const KIND: BackendKind = BackendKind::Cuda;

    fn create(layout: &RingLayout, options: CudaOptions) -> Result<Self, BackendError> {
        let (memory, handle) = (options.memory, options.handle);
        if !memory.supports(handle) {
            return Err(format!(
                "the {memory} memory path cannot share memory with {handle} handles (fabric \
                 handles apply to the pool and vmm paths)"
            )
            .into());
        }
        driver::init().map_err(be)?;
        let ctx = Context::new(options.device.unwrap_or(0)).map_err(be)?;
        check_capabilities(&ctx, memory, handle)?;
        // Before allocating the slots: every path allocates them in full, now.
        let (free, _total) = ctx.memory_info().map_err(be)?;
        pipeline_core::limits::check_fits(
            layout.slot_count,
            layout.slot_bytes,
            Some(free),
            pipeline_core::limits::Memory::Gpu(ctx.device().ordinal()),
        )?;
        let stream = Stream::new(&ctx).map_err(be)?;
        // Made right after ours, before any stream of the application's: consecutive streams
        // get different hardware queues, so a wait stalled on ours never holds up a release.
        let release = match options.timeline_memory {
            TimelineMemory::Host => None,
            TimelineMemory::Device => Some(Arc::new(Stream::new(&ctx).map_err(be)?)),
        };
        if release.is_some() {
            let (auto, why) = crate::policy::sync::rule_timeline_memory(
                true,
                crate::policy::signals::max_connections(),
            );
            if auto == TimelineMemory::Host {
                tracing::warn!("timeline words in device memory, but {why}");
            }
        }
        let word_bytes = match options.timeline_memory {
            TimelineMemory::Host => 0,
            TimelineMemory::Device => crate::sync::device_word_bytes(&ctx)?,
        };
        let slots = ProducerSlots::create(&ctx, &stream, layout, memory, handle).map_err(be)?;
        let mut export = Vec::new();
        ExportHeader {
            memory,
            handle,
            sync: options.sync,
            uuid: ctx.device().uuid().map_err(be)?,
            slot_count: layout.slot_count,
            slot_bytes: layout.slot_bytes,
            words: options.timeline_memory,
            word_bytes,
        }
        .write(&mut export);
        slots.write_export(&mut export);
        let ready = match options.sync {
            SyncMode::Events => {
                let mut events = Vec::with_capacity(layout.slot_count as usize);
                for _ in 0..layout.slot_count {
                    let ev = Event::new_ipc(&ctx).map_err(be)?;
                    export.extend_from_slice(&ev.ipc_handle().map_err(be)?);
                    events.push(ev);
                }
                ReadySignal::Events(events)
            }
            SyncMode::Semaphore => ReadySignal::Semaphore(Timelines::create_in(
                &ctx,
                options.timeline_memory,
                release.as_ref(),
                word_bytes,
                1,
                layout.slot_count,
                "gpipe-ready",
            )?),
        };
        let timelines = FinishedWords::new(
            &ctx,
            options.timeline_memory,
            word_bytes,
            release.as_ref(),
            layout.consumer_capacity,
            layout.slot_count,
        );
        let watch = Watch::new(&ctx)?;
        let scratch = Event::new_plain(&ctx).map_err(be)?;
        Ok(Self {
            ctx,
            stream,
            slots,
            slot_count: layout.slot_count,
            memory,
            handle,
            ready,
            export,
            slot_bytes: layout.slot_bytes,
            timelines,
            release,
            live: Mutex::new(0),
            gate: RwLock::new(()),
            watch,
            scratch: Mutex::new(scratch),
            presignalled: (0..layout.slot_count).map(|_| AtomicU64::new(0)).collect(),
            prewaited: (0..layout.slot_count).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    fn export(&self, consumer: u32) -> Result<Export, BackendError> {
        let mut fds = self.slots.export_fds()?;
        if let ReadySignal::Semaphore(words) = &self.ready {
            fds.push(words.fd.try_clone()?);
        }
        // Fresh `finished` words for this attach alone: it never holds another consumer's,
        // not even those of an earlier holder of its index.
        fds.push(self.timelines.fresh(consumer)?);
        Ok(Export {
            blob: self.export.clone(),
            fds,
        })
    }

    fn attach(&self, consumer: u32, reply: &[u8], fds: Vec<OwnedFd>) -> Result<(), BackendError> {
        if !fds.is_empty() {
            return Err("CUDA consumer reply must carry no fds".into());
        }
        let mut r = Reader::new(reply, "CUDA consumer reply");
        if r.u32()? != REPLY_MAGIC {
            return Err("CUDA consumer reply has a bad magic".into());
        }
        let n = r.u32()? as usize;
        r.finish()?;
        if n != self.slot_count as usize {
            return Err(format!("CUDA consumer imported {n} slots of {}", self.slot_count).into());
        }
        // A previous holder of this index may still have waits in our stream (released by
        // its departure): let them pass before its words are dropped for the new ones. The
        // gate keeps new waits from being enqueued meanwhile. `detach` never takes the gate,
        // so a consumer that dies while we wait here still gets its waits released, and the
        // stream drains.
        let _gate = self.gate.write();
        self.stream.synchronize().map_err(be)?;
        // Every wait enqueued so far has passed (none is enqueued while we hold the gate).
        {
            let mut st = self.watch.state.lock();
            st.pending.clear();
            st.front_reached = None;
        }
        self.timelines.install(consumer)?;
        let mut live = self.live.lock();
        *live |= 1u64 << consumer;
        Ok(())
    }

    fn detach(&self, consumer: u32, died: bool) {
        *self.live.lock() &= !(1u64 << consumer);
        // Release every wait on its words, now and later: a dead consumer's last writes may
        // never happen. (A wait enqueued meanwhile on its words passes too: the released
        // value stays.) Not under `live`: with device words this is a driver call.
        self.timelines.store_all(consumer, RELEASED);
        if died {
            tracing::debug!(
                consumer,
                "released the finished timelines of a dead consumer"
            );
        }
    }

    fn memory_in_use(&self) -> Option<u64> {
        self.slots.device_bytes(self.slot_bytes)
    }

    fn wait_finished(&self, slot: u32, prev_seq: u64, holders: u64) -> Result<(), BackendError> {
        if self.take_prewaited(slot, prev_seq) {
            return Ok(());
        }
        if self.presignalled[slot as usize].load(Ordering::Acquire) == prev_seq + 1 {
            // The previous batch's writes ran on a caller's stream, which nothing of ours has
            // waited for (with no holders, no consumer's `finished` orders after them either):
            // wait for its `ready`, so the next writes of the slot come after them.
            // SAFETY: our stream is live.
            unsafe { self.ready.wait(self.stream.raw(), slot, prev_seq) }.map_err(be)?;
        }
        if holders == 0 {
            return Ok(());
        }
        // A consumer that departs while we enqueue has had its words released: a wait on
        // them passes. Its words are reused only after an attach drains the stream, which
        // the gate holds off until we are done.
        let _gate = self.gate.read();
        if !self.watch.on.load(Ordering::Acquire) {
            // Every wait in one batched stream operation.
            let mut ops = Vec::new();
            self.finished_waits(slot, prev_seq, holders, |_, op| ops.push(op));
            // SAFETY: the words are in the consumers' finished words, which stay mapped until
            // an attach at their index has let every wait enqueued here pass (the gate is
            // held); the stream is ours.
            return unsafe { driver::stream_mem_ops_raw(self.stream.raw(), &ops) }.map_err(be);
        }
        // Watched: each wait, then a progress write the watch can see it pass by.
        let mut waits = Vec::new();
        self.finished_waits(slot, prev_seq, holders, |c, op| waits.push((c, op)));
        for (c, op) in waits {
            let n = {
                let mut st = self.watch.state.lock();
                st.enqueued += 1;
                st.enqueued
            };
            let ops = [
                op,
                driver::MemOp::Write {
                    ptr: self.watch.progress.device(0, 0),
                    value: n,
                },
            ];
            // Never hold the watch's lock across a driver call: with the stream stalled the
            // call may block, and the supervisor must still be able to look.
            // SAFETY: the finished word as above (the gate is held); the progress word is in
            // our registered progress timeline, mapped for our lifetime; the stream is ours.
            unsafe { driver::stream_mem_ops_raw(self.stream.raw(), &ops) }.map_err(be)?;
            let mut st = self.watch.state.lock();
            self.watch.update(&mut st);
            if st.pending.len() < MAX_WATCHED {
                st.pending.push_back((n, c));
            }
        }
        Ok(())
    }

    fn overdue(&self, limit: std::time::Duration) -> Option<u32> {
        self.watch.on.store(true, Ordering::Release);
        let mut st = self.watch.state.lock();
        self.watch.update(&mut st);
        let &(n, c) = st.pending.front()?;
        tracing::trace!(wait = n, consumer = c, pending = st.pending.len(), reached = ?st.front_reached, "watch");
        st.front_reached
            .is_some_and(|t| t.elapsed() > limit)
            .then_some(c)
    }

    unsafe fn slot_mut(&self, slot: u32) -> CudaSlotMut<'_> {
        CudaSlotMut {
            ptr: self.slots.ptr(slot as usize),
            capacity: self.slot_bytes,
            stream: &self.stream,
        }
    }

    fn signal_ready(&self, slot: u32, seq: u64) -> Result<(), BackendError> {
        if self.presignalled[slot as usize].load(Ordering::Acquire) == seq + 1 {
            return Ok(());
        }
        // SAFETY: our stream is live.
        unsafe { self.ready.signal(self.stream.raw(), slot, seq) }.map_err(be)
    }

    fn wait_finished_all(&self, waits: &[(u32, u64, u64)]) -> Result<(), BackendError> {
        let one_by_one = waits.len() < 2
            || self.watch.on.load(Ordering::Acquire)
            || waits.iter().any(|&(slot, prev, _)| {
                self.presignalled[slot as usize].load(Ordering::Acquire) == prev + 1
            });
        if one_by_one {
            for &(slot, prev, holders) in waits {
                self.wait_finished(slot, prev, holders)?;
            }
            return Ok(());
        }
        let mut ops = Vec::new();
        let _gate = self.gate.read();
        for &(slot, prev, holders) in waits {
            if !self.take_prewaited(slot, prev) && holders != 0 {
                self.finished_waits(slot, prev, holders, |_, op| ops.push(op));
            }
        }
        // SAFETY: the words as in `wait_finished` (the gate is held); the stream is ours.
        unsafe { driver::stream_mem_ops_raw(self.stream.raw(), &ops) }.map_err(be)
    }

    fn looks_ahead(&self) -> bool {
        matches!(self.ready, ReadySignal::Semaphore(_)) && !self.watch.on.load(Ordering::Acquire)
    }

    fn signal_ready_then_wait(
        &self,
        slot: u32,
        seq: u64,
        next: Option<(u32, u64, u64)>,
    ) -> Result<(), BackendError> {
        let (Some((k, prev, holders)), Some(word)) = (next, self.ready.word(slot)) else {
            return self.signal_ready(slot, seq);
        };
        if !self.looks_ahead()
            || self.presignalled[slot as usize].load(Ordering::Acquire) == seq + 1
            || self.presignalled[k as usize].load(Ordering::Acquire) == prev + 1
        {
            return self.signal_ready(slot, seq);
        }
        // The ready write, then the next slot's finished waits, in one stream operation: the
        // GPU runs them in order, so the ready signal is not held back by the waits.
        let mut ops = vec![driver::MemOp::Write {
            ptr: word,
            value: seq + 1,
        }];
        // An attach holds the gate while it drains our stream: never make a publish wait for
        // that; the acquire will wait as usual.
        let Some(_gate) = self.gate.try_read() else {
            return self.signal_ready(slot, seq);
        };
        self.finished_waits(k, prev, holders, |_, op| ops.push(op));
        // SAFETY: the ready word is in our timelines, mapped for our lifetime; the finished
        // words as in `wait_finished` (the gate is held); the stream is ours.
        if let Err(e) = unsafe { driver::stream_mem_ops_raw(self.stream.raw(), &ops) } {
            // Nothing was enqueued: signal alone, and let the acquire wait as usual.
            tracing::debug!("batched ready signal failed ({e}); signalling alone");
            return self.signal_ready(slot, seq);
        }
        // Only now: `wait_finished` may leave the waits out once they are enqueued.
        self.prewaited[k as usize].store(prev + 1, Ordering::Release);
        Ok(())
    }
}

impl CudaProducer {
    /// Hands `f` a wait, with its consumer, for each consumer in `holders` that is live and
    /// has not yet finished batch `prev_seq` in `slot` as far as the host can tell. The
    /// caller holds `gate` (read) until the waits are enqueued.
    fn finished_waits(
        &self,
        slot: u32,
        prev_seq: u64,
        holders: u64,
        mut f: impl FnMut(u32, driver::MemOp),
    ) {
        let mut rest = holders & *self.live.lock();
        while rest != 0 {
            let c = rest.trailing_zeros();
            rest &= rest - 1;
            // Done already (the usual case with host words when the producer is the faster
            // side): no stream wait, which would cost stream time per batch and consumer.
            if self.timelines.reached(c, slot, prev_seq + 1) {
                continue;
            }
            // A live consumer has attached, so its words are installed.
            if let Some(ptr) = self.timelines.device(c, slot) {
                let value = prev_seq + 1;
                let condition = WaitCondition::Geq;
                f(
                    c,
                    driver::MemOp::Wait {
                        ptr,
                        value,
                        condition,
                    },
                );
            }
        }
    }

    /// True (and forgotten) when a look ahead already enqueued the waits for batch
    /// `prev_seq` in `slot` ([`ProducerBackend::signal_ready_then_wait`]).
    fn take_prewaited(&self, slot: u32, prev_seq: u64) -> bool {
        self.prewaited[slot as usize]
            .compare_exchange(prev_seq + 1, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }
}

impl Drop for CudaProducer {
    fn drop(&mut self) {
        // The ring closes only after consumers detached (or its drain timeout passed), so the
        // importers have freed their imports; our stream already waits their last `finished`.
        if let Err(e) = self.stream.synchronize() {
            tracing::error!("CUDA producer teardown: stream synchronize failed: {e}");
        }
        self.slots.release(&self.stream);
        if let Err(e) = self.stream.synchronize() {
            tracing::error!("CUDA producer teardown: stream synchronize failed: {e}");
        }
        if let Some(r) = &self.release {
            if let Err(e) = r.synchronize() {
                tracing::error!("CUDA producer teardown: release stream synchronize failed: {e}");
            }
        }
    }
}
