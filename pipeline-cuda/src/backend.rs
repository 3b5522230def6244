//! The CUDA backend of the ring: slots in GPU memory shared on one of three memory paths
//! ([`MemoryPath`]: an exportable stream-ordered pool, VMM allocations, or legacy IPC), one
//! `ready` IPC event per slot (the producer's), and one `finished` timeline word per slot per
//! consumer.
//!
//! The producer picks the path and the handle kind ([`CudaOptions::memory`],
//! [`CudaOptions::handle`]); the export blob names them and consumers follow it. A consumer's
//! attach cost per step is in [`CudaConsumer::import_timings`] (and
//! [`last_import_timings`]).
//!
//! Ordering (docs/protocol.md): the producer's stream waits until the `finished[c][k]` words of
//! the consumers that had slot k's previous batch reach that batch's generation, runs the fill,
//! records `ready[k]`, and only then is the descriptor published. A consumer's stream waits
//! `ready[k]`, runs its kernels and writes `finished[c][k] = seq + 1` (cuStreamWriteValue64),
//! and only then is the slot released. No host synchronisation happens per batch.
//!
//! Why `finished` is a timeline word and not an IPC event: measured on an H100 (driver
//! 580.159.04, 2026-11-21), when a consumer is SIGKILLed after recording `finished` but before
//! its GPU work ran, a producer stream that waits that event never proceeds, and the producer
//! stalls for good. An event record cannot be completed by anyone else; a timeline word can:
//! on a consumer's death the producer stores a far-future value into its words, which releases
//! every wait on them. The words live in a sealed memfd both processes map and register with
//! the driver (stream memory operations reject memory from IPC-capable pools).
//!
//! ```no_run
//! use pipeline_core::{Consumer, Producer, ProducerConfig};
//! use pipeline_cuda::backend::{CudaConsumer, CudaOptions, CudaProducer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Process A: produce into GPU memory.
//! let mut producer: Producer<CudaProducer> =
//!     Producer::bind("/tmp/gpu.sock", ProducerConfig::default(), CudaOptions::default())?;
//! let mut slot = producer.acquire()?;      // the stream already waits for the consumers
//! let mem = slot.memory();                  // device pointer, capacity, the stream to use
//! // enqueue your fill kernel on mem.stream.raw() writing to mem.ptr ...
//! let _ = (mem.ptr, mem.capacity);
//! slot.publish(1 << 20)?;                   // records `ready`, then publishes
//!
//! // Process B: consume in place.
//! let mut consumer: Consumer<CudaConsumer> = Consumer::attach("/tmp/gpu.sock", CudaOptions::default())?;
//! while let Some(batch) = consumer.recv()? {
//!     let view = batch.data();              // its stream already waits `ready`
//!     // enqueue kernels on view.stream.raw() reading view.ptr .. view.ptr + view.len ...
//!     let _ = (view.ptr, view.len);
//! }                                          // dropping records `finished`, then releases
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use pipeline_core::wire::Reader;
use pipeline_core::{
    BackendError, BackendKind, ConsumerBackend, Delivery, Export, Placement, ProducerBackend,
    RingLayout,
};

use crate::driver::{self, CUdeviceptr, Context, CudaError, Event, Stream, WaitCondition};
use crate::export::ExportHeader;
use crate::memory::{ConsumerSlots, ProducerSlots, SlotExport, micros};
pub use crate::memory::{HandleKind, ImportTimings, MAX_VMM_FD_SLOTS, MemoryPath};
use crate::mirror::Mirror;
use crate::probe::Capabilities;
use crate::sync::{FinishedWords, RELEASED, ReadySignal, SideSignals, Timelines, join_into};
pub use crate::sync::{SyncMode, TimelineMemory};

const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"GCF1");
const HANDLE: usize = 64;

/// Options of the CUDA backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaOptions {
    /// Device ordinal. A consumer uses the device whose UUID matches the producer's when
    /// `None`; set it to use another device (peer access).
    pub device: Option<usize>,
    /// Producer: where the slots live and how they are shared (default: [`MemoryPath::Pool`]).
    /// Consumers ignore it and follow the path the producer's export names.
    pub memory: MemoryPath,
    /// Producer: how the pool and VMM paths share their handles (default:
    /// [`HandleKind::PosixFd`]; the legacy path refuses [`HandleKind::Fabric`]). Consumers
    /// ignore it and follow the export.
    pub handle: HandleKind,
    /// Producer: how `ready` is signalled (default [`SyncMode::Events`]). Consumers ignore it
    /// and follow the export.
    pub sync: SyncMode,
    /// Consumer of a broadcast ring on the VMM path: map the slots writable. By default such a
    /// consumer maps them read-only, so a kernel of its that writes a batch faults in that
    /// consumer alone and the batch other consumers read stays intact. The pool and legacy
    /// paths cannot map read-only (the driver refuses `PROT_READ` on an imported pool): there
    /// a consumer's writes reach everyone. Shared-mode consumers own their batches and map
    /// read-write.
    pub writable: bool,
    /// Consumer: do not make the consumer's own stream wait for `ready` on each batch; the
    /// caller makes the streams it uses wait, with
    /// [`ReleaseAfter::order_reads_on`](crate::ordering::ReleaseAfter::order_reads_on), and
    /// releases after them with
    /// [`ReleaseAfter::release_after`](crate::ordering::ReleaseAfter::release_after) (the
    /// Python package does this for the streams DLPack names). Without a wait, nothing may
    /// read the batch.
    pub defer_ready: bool,
    /// Consumer: read the producer's slots in place, or mirror each batch into buffers of its
    /// own on its GPU (see [`crate::mirror`]). Default [`Delivery::Auto`]: in place on the
    /// producer's GPU, mirrored on another (measured faster there from 2 to 256 MiB over
    /// NVLink; PCIe unmeasured).
    pub delivery: Delivery,
    /// Consumer, mirror delivery: how many batches it may hold at once (buffers of
    /// `slot_bytes` each on its GPU); default: the ring's slot count.
    pub mirror_buffers: Option<u32>,
    /// Consumer: create its stream with the device's highest priority, so that the blocks of
    /// its kernels start ahead of other streams' waiting ones. The NCCL relay's sender uses it
    /// for its sends (which run as SM kernels beside the producer's work) when asked to
    /// (`RelayOptions::high_priority`, off by default).
    pub high_priority: bool,
    /// Producer: where the timeline words (`finished`, and `ready` under semaphore sync) live
    /// (default [`TimelineMemory::Host`]). Consumers ignore it and follow the export.
    pub timeline_memory: TimelineMemory,
    /// Consumer, in place: wait for `ready` and write `finished` on streams of its own, joined
    /// to the stream that uses the batch by in-process events, instead of on that stream
    /// (see `SideSignals` in the sync module). Saves that stream a few µs of GPU time per
    /// batch between its kernels and costs the host a few more driver calls. `None` (the
    /// default): on for slots of [`crate::policy::signals::SIDE_SIGNALS_AUTO_BYTES`] and more,
    /// where that was measured faster. Mirror delivery ignores it.
    pub side_signals: Option<bool>,
}

impl CudaOptions {
    /// These options with `memory` as the memory path.
    pub fn with_memory(mut self, memory: MemoryPath) -> Self {
        self.memory = memory;
        self
    }

    /// These options with `sync` as the ready signal.
    pub fn with_sync(mut self, sync: SyncMode) -> Self {
        self.sync = sync;
        self
    }

    /// These options with the timeline words in `memory`.
    pub fn with_timeline_memory(mut self, memory: TimelineMemory) -> Self {
        self.timeline_memory = memory;
        self
    }

    /// These options with `handle` as the handle kind.
    pub fn with_handle(mut self, handle: HandleKind) -> Self {
        self.handle = handle;
        self
    }

    /// These options with `delivery` as the consumer's delivery.
    pub fn with_delivery(mut self, delivery: Delivery) -> Self {
        self.delivery = delivery;
        self
    }

    /// These options with `device` as the consumer's (or producer's) device.
    pub fn on_device(mut self, device: usize) -> Self {
        self.device = Some(device);
        self
    }
}

static LAST_IMPORT: std::sync::Mutex<Option<ImportTimings>> = std::sync::Mutex::new(None);

/// The attach cost of the most recent successful CUDA import in this process (per step, in
/// microseconds), or `None` before the first. The same as [`CudaConsumer::import_timings`] of
/// the consumer that attached last.
pub fn last_import_timings() -> Option<ImportTimings> {
    LAST_IMPORT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// A slot as the producer writes it: device memory and the stream to order work on.
pub struct CudaSlotMut<'a> {
    /// Device pointer of the slot (2 MiB aligned).
    pub ptr: CUdeviceptr,
    /// Capacity in bytes.
    pub capacity: u64,
    /// The producer's stream: it already waits for the slot's previous consumers. Enqueue the
    /// fill here (or make your own stream wait an event recorded here, and this stream wait
    /// yours before publish).
    pub stream: &'a Stream,
}

/// A batch as a consumer sees it.
pub struct CudaBatchRef<'a> {
    /// Device pointer of the batch.
    pub ptr: CUdeviceptr,
    /// Length in bytes.
    pub len: u64,
    /// The consumer's stream, already ordered after the producer's `ready`. Enqueue your work
    /// here; the release records `finished` on it.
    pub stream: &'a Stream,
}

pub(crate) use crate::error::be;

fn check_capabilities(
    ctx: &Arc<Context>,
    memory: MemoryPath,
    handle: HandleKind,
) -> Result<(), BackendError> {
    let caps = Capabilities::of(ctx.device()).map_err(be)?;
    caps.check_path(memory, handle).map_err(be)?;
    Ok(())
}

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
    timelines: FinishedWords,
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

/// The consumer's half.
pub struct CudaConsumer {
    ctx: Arc<Context>,
    stream: Stream,
    // The imports and the words are dropped by hand (Drop), after the work that uses them,
    // or never when the producer died (see there).
    slots: ManuallyDrop<ConsumerSlots>,
    ready: ManuallyDrop<ReadySignal>,
    timelines: ManuallyDrop<Timelines>,
    /// The producer died: waits on its `ready` signals may never complete.
    abandoned: AtomicBool,
    slot_bytes: u64,
    timings: ImportTimings,
    /// The slots are mapped read-only.
    read_only: bool,
    /// [`CudaOptions::defer_ready`].
    defer_ready: bool,
    /// Per slot: the generation whose `finished` was already written on a caller's stream
    /// ([`CudaConsumer::signal_finished_on`]); `signal_finished` then adds nothing.
    presignalled: Vec<AtomicU64>,
    /// An ordering-only event for joining a caller's stream with ours.
    scratch: Mutex<Event>,
    /// Mirror delivery: our own buffers (`None`: in place).
    mirror: Option<Mirror>,
    /// True when the consumer runs on the producer's GPU.
    on_producer_gpu: bool,
    /// [`CudaOptions::side_signals`], resolved at attach: the streams that wait for `ready`
    /// and write `finished` (None: the stream that uses the batch does both).
    side: Option<Mutex<SideSignals>>,
    /// `seq + 1` of the batch whose `ready` our stream already waits for: a look ahead
    /// ([`ConsumerBackend::signal_finished_then_wait`]) enqueued it; 0 when none.
    prewaited: AtomicU64,
}

impl CudaConsumer {
    /// The CUDA context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
    /// The consumer's stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
    /// True when `ready` is waited for and `finished` written on side streams of ours
    /// ([`CudaOptions::side_signals`], as resolved at attach).
    pub fn side_signals(&self) -> bool {
        self.side.is_some()
    }
    /// The memory path the producer's slots live on (taken from its export).
    pub fn memory_path(&self) -> MemoryPath {
        self.timings.memory
    }
    /// How the producer shares its handles (taken from its export).
    pub fn handle_kind(&self) -> HandleKind {
        self.timings.handle
    }
    /// Where the producer keeps the timeline words (taken from its export).
    pub fn timeline_memory(&self) -> TimelineMemory {
        self.timelines.memory()
    }
    /// How long this consumer's import (its attach) took, per step.
    pub fn import_timings(&self) -> &ImportTimings {
        &self.timings
    }

    /// True when the slots are mapped read-only (a broadcast ring on the VMM path, unless
    /// [`CudaOptions::writable`]): a kernel that writes one faults in this process alone.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The device ordinal the slots are used on.
    pub fn device_ordinal(&self) -> usize {
        self.ctx.device().ordinal()
    }

    /// How batches reach this consumer, as resolved at attach: [`Delivery::InPlace`] or
    /// [`Delivery::Mirror`].
    pub fn delivery(&self) -> Delivery {
        if self.mirror.is_some() {
            Delivery::Mirror
        } else {
            Delivery::InPlace
        }
    }

    /// True when this consumer runs on the producer's GPU.
    pub fn on_producer_gpu(&self) -> bool {
        self.on_producer_gpu
    }

    /// Mirror delivery: the number of buffers of its own (0 in place).
    pub fn mirror_buffers(&self) -> usize {
        self.mirror.as_ref().map_or(0, Mirror::len)
    }

    /// Makes a caller's `stream` wait until batch `seq` in `slot` is ready (the producer's
    /// writes are done), as [`ConsumerBackend::wait_ready`] does for the consumer's stream.
    /// Valid while the batch is held: the producer signals `ready[slot]` again only after the
    /// slot is released.
    ///
    /// # Safety
    /// `stream` must be a live stream handle of this context, or `CU_STREAM_LEGACY` (1) /
    /// `CU_STREAM_PER_THREAD` (2).
    pub unsafe fn wait_ready_on(
        &self,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        if let Some((m, j)) = self
            .mirror
            .as_ref()
            .and_then(|m| m.find(seq).map(|j| (m, j)))
        {
            // The batch is our copy: wait for the copy, which waited for `ready`.
            // SAFETY: the caller guarantees `stream`.
            return unsafe { Stream::raw_wait_event(stream, m.copied(j)) };
        }
        // SAFETY: the caller guarantees `stream`.
        unsafe { self.wait_ready_raw(stream, slot, seq) }
    }

    /// The device address of the producer's `slot` as this consumer mapped it (by peer
    /// access from another GPU): what a forwarder that chunks copies from, by the progress
    /// its upstream writer publishes, before the batch in it is published (see
    /// `pipeline_relay::chunks`). Reading it is right only once something orders the read
    /// after the producer's writes; the address stays valid while the consumer lives.
    ///
    /// # Panics
    /// If `slot` is not a slot of the ring.
    pub fn slot_ptr(&self, slot: u32) -> driver::CUdeviceptr {
        self.slots.ptr(slot as usize)
    }

    /// Makes the consumer's own stream wait for batch `seq` in `slot` to be ready.
    fn own_wait_ready(&self, slot: u32, seq: u64) -> Result<(), BackendError> {
        if self
            .prewaited
            .compare_exchange(seq + 1, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // A look ahead enqueued this wait on our stream already.
            return Ok(());
        }
        // SAFETY: our stream is live (a created stream: no context need be current).
        unsafe { self.wait_ready_raw(self.stream.raw(), slot, seq) }.map_err(be)
    }

    /// Makes `stream` wait for batch `seq` in `slot` to be ready: directly, or through our
    /// side streams.
    ///
    /// # Safety
    /// As for [`CudaConsumer::wait_ready_on`].
    unsafe fn wait_ready_raw(
        &self,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        match &self.side {
            // SAFETY: the caller guarantees `stream`.
            Some(side) => unsafe { side.lock().wait_ready(&self.ready, stream, slot, seq) },
            // SAFETY: the caller guarantees `stream`.
            None => unsafe { self.ready.wait(stream, slot, seq) },
        }
    }

    /// Writes `finished` for batch `seq` in `slot` after the work enqueued on `stream`: on
    /// it, or through our side streams.
    ///
    /// # Safety
    /// As for [`CudaConsumer::wait_ready_on`].
    unsafe fn write_finished_raw(
        &self,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        // The word is in our timelines (registered host or mapped device words), mapped for as
        // long as any stream of ours may write it: Drop synchronizes the context before it
        // unmaps them, and a dead producer's are never unmapped.
        let word = self.timelines.device(0, slot);
        match &self.side {
            // SAFETY: the word as said above; the caller guarantees `stream`.
            Some(side) => unsafe { side.lock().write_after(stream, word, seq + 1) },
            // SAFETY: the word as above; the caller guarantees `stream`.
            None => unsafe { driver::stream_write_value64_raw(stream, word, seq + 1) },
        }
    }

    /// Writes `finished` for batch `seq` in `slot` on a caller's `stream`, after the work
    /// enqueued on it so far (instead of joining that stream into ours): the release that
    /// follows adds no signal of its own. The caller's stream must contain, or wait for, every
    /// use of the batch.
    ///
    /// # Safety
    /// As for [`CudaConsumer::wait_ready_on`].
    pub unsafe fn signal_finished_on(
        &self,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        if self.mirror.as_ref().is_some_and(|m| m.find(seq).is_some()) {
            // The producer's slot was signalled after the copy. What the release must order
            // is the reuse of our buffer, by a later copy: join the caller's stream.
            // SAFETY: the caller guarantees `stream`.
            return unsafe { join_into(&self.ctx, &self.scratch, &self.stream, stream) };
        }
        // SAFETY: the caller guarantees `stream`.
        unsafe { self.write_finished_raw(stream, slot, seq) }?;
        self.presignalled[slot as usize].store(seq + 1, Ordering::Release);
        Ok(())
    }

    /// Makes the consumer's stream (on which a release writes `finished`) wait for the work
    /// enqueued on a caller's `stream` so far.
    ///
    /// # Safety
    /// As for [`CudaConsumer::wait_ready_on`].
    pub(crate) unsafe fn join(&self, stream: driver::CUstream) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees `stream`.
        unsafe { join_into(&self.ctx, &self.scratch, &self.stream, stream) }
    }
}

/// The ordinal of the visible device with this UUID, if any.
fn device_with_uuid(uuid: &[u8; 16]) -> Result<Option<usize>, BackendError> {
    for d in 0..driver::device_count().map_err(be)? {
        if driver::Device::get(d).map_err(be)?.uuid().map_err(be)? == *uuid {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

/// `ordinal (name)` of a device, for messages.
fn describe_device(ordinal: usize) -> String {
    match driver::Device::get(ordinal).and_then(|d| d.name()) {
        Ok(name) => format!("GPU {ordinal} ({name})"),
        Err(_) => format!("GPU {ordinal}"),
    }
}

/// The device a consumer runs on: the one it asked for, else the producer's own (by UUID).
/// Another device than the producer's must be able to reach the producer's memory by peer
/// access; the refusal names both devices.
fn pick_device(uuid: &[u8; 16], options: &CudaOptions) -> Result<usize, BackendError> {
    let producer = device_with_uuid(uuid)?;
    let Some(want) = options.device else {
        return producer.ok_or_else(|| {
            "the producer's GPU is not visible to this consumer: check CUDA_VISIBLE_DEVICES".into()
        });
    };
    let count = driver::device_count().map_err(be)?;
    if want >= count {
        return Err(format!(
            "device {want} was asked for, but this process sees {count} CUDA device(s) \
             (0..{count})"
        )
        .into());
    }
    let Some(producer) = producer else {
        return Err(format!(
            "the producer's GPU is not visible to this consumer, so {} cannot reach its \
             memory: make it visible (CUDA_VISIBLE_DEVICES) alongside the device asked for",
            describe_device(want)
        )
        .into());
    };
    if want != producer {
        let mine = driver::Device::get(want).map_err(be)?;
        let theirs = driver::Device::get(producer).map_err(be)?;
        if !mine.can_access_peer(&theirs).map_err(be)? {
            return Err(format!(
                "{} cannot reach the memory of the producer's {} by peer access (no NVLink \
                 or PCIe peer path between them; `gpipe probe` shows which devices can \
                 consume from which): run this consumer on the producer's GPU or one that can",
                describe_device(want),
                describe_device(producer)
            )
            .into());
        }
        tracing::debug!(
            consumer_device = want,
            producer_device = producer,
            "consuming from another GPU by peer access"
        );
    }
    Ok(want)
}

impl ConsumerBackend for CudaConsumer {
    type Options = CudaOptions;
    type BatchRef<'a> = CudaBatchRef<'a>;
    const KIND: BackendKind = BackendKind::Cuda;

    fn import(
        layout: &RingLayout,
        _consumer: u32,
        options: CudaOptions,
        blob: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<(Self, Export), BackendError> {
        let started = Instant::now();
        let mut r = Reader::new(blob, "CUDA export");
        let header = ExportHeader::read(&mut r)?;
        let (memory, handle, n, slot_bytes) = (
            header.memory,
            header.handle,
            header.slot_count,
            header.slot_bytes,
        );
        if n != layout.slot_count || slot_bytes != layout.slot_bytes {
            return Err(format!(
                "CUDA export describes {n} slots of {slot_bytes} bytes; the ring has {} of {}",
                layout.slot_count, layout.slot_bytes
            )
            .into());
        }
        let mut fds = fds;
        let timeline_fd = fds.pop().ok_or_else(|| {
            format!("CUDA {memory} export carries no fds; it needs at least the timelines fd")
        })?;
        let ready_fd = match header.sync {
            SyncMode::Events => None,
            SyncMode::Semaphore => Some(fds.pop().ok_or_else(|| {
                format!("CUDA {memory} export with semaphore sync carries no ready-words fd")
            })?),
        };
        // Everything is parsed and counted before the driver sees any of it.
        let export = SlotExport::parse(&mut r, memory, handle, n, slot_bytes, fds)?;
        let mut ready_handles = Vec::with_capacity(n as usize);
        for _ in 0..if ready_fd.is_none() { n } else { 0 } {
            let e: [u8; HANDLE] = r.bytes(HANDLE)?.try_into()?;
            ready_handles.push(e);
        }
        r.finish()?;
        let mut timings = ImportTimings {
            memory,
            handle,
            slots: n,
            ..ImportTimings::default()
        };
        let t = Instant::now();
        driver::init().map_err(be)?;
        let ordinal = pick_device(&header.uuid, &options)?;
        let on_producer_gpu = device_with_uuid(&header.uuid)? == Some(ordinal);
        let ctx = Context::new(ordinal).map_err(be)?;
        check_capabilities(&ctx, memory, handle)?;
        let stream = if options.high_priority {
            Stream::new_high_priority(&ctx)
        } else {
            Stream::new(&ctx)
        }
        .map_err(be)?;
        // Device timeline words: a stream that only ever writes them (see the producer's).
        let release = match header.words {
            TimelineMemory::Host => None,
            TimelineMemory::Device => Some(Arc::new(Stream::new(&ctx).map_err(be)?)),
        };
        timings.setup_us = micros(t);
        let scratch = Event::new_plain(&ctx).map_err(be)?;
        let read_only = layout.mode == pipeline_core::Mode::Broadcast
            && memory == MemoryPath::Vmm
            && !options.writable;
        let slots = ConsumerSlots::import(&ctx, export, &mut timings, read_only)?;
        debug_assert_eq!(slots.len(), n as usize);
        let t = Instant::now();
        let ready = match ready_fd {
            None => {
                let mut events = Vec::with_capacity(n as usize);
                for e in &ready_handles {
                    events.push(Event::open_ipc(&ctx, e).map_err(be)?);
                }
                ReadySignal::Events(events)
            }
            Some(fd) => ReadySignal::Semaphore(Timelines::map_in(
                &ctx,
                header.words,
                release.as_ref(),
                header.word_bytes,
                1,
                n,
                fd,
            )?),
        };
        timings.event_opens_us = micros(t);
        let t = Instant::now();
        // Our own `finished` words only: one row, written at index 0.
        let timelines = Timelines::map_in(
            &ctx,
            header.words,
            release.as_ref(),
            header.word_bytes,
            1,
            layout.slot_count,
            timeline_fd,
        )?;
        timings.timelines_us = micros(t);
        let mirror = if crate::policy::delivery::mirrors(options.delivery, on_producer_gpu) {
            let count = options.mirror_buffers.unwrap_or(layout.slot_count);
            Some(Mirror::new(&ctx, count, slot_bytes)?)
        } else {
            None
        };
        let side = if mirror.is_none()
            && options
                .side_signals
                .unwrap_or(crate::policy::signals::side_signals_auto(slot_bytes))
        {
            Some(Mutex::new(SideSignals::new(&ctx)?))
        } else {
            None
        };
        let mut reply = Vec::with_capacity(8);
        reply.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
        reply.extend_from_slice(&n.to_le_bytes());
        timings.total_us = micros(started);
        *LAST_IMPORT
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(timings.clone());
        tracing::debug!(?timings, "CUDA consumer imported the producer's export");
        Ok((
            Self {
                ctx,
                stream,
                slots: ManuallyDrop::new(slots),
                ready: ManuallyDrop::new(ready),
                timelines: ManuallyDrop::new(timelines),
                abandoned: AtomicBool::new(false),
                slot_bytes,
                timings,
                read_only,
                defer_ready: options.defer_ready,
                presignalled: (0..n).map(|_| AtomicU64::new(0)).collect(),
                scratch: Mutex::new(scratch),
                mirror,
                on_producer_gpu,
                side,
                prewaited: AtomicU64::new(0),
            },
            Export {
                blob: reply,
                fds: Vec::new(),
            },
        ))
    }

    fn wait_ready(&self, slot: u32, seq: u64) -> Result<(), BackendError> {
        // A mirror's copy stream waits for `ready` itself (in `mirror`).
        if self.defer_ready || self.mirror.is_some() {
            return Ok(());
        }
        self.own_wait_ready(slot, seq)
    }

    fn mirror(&self, slot: u32, seq: u64, len: u64) -> Result<bool, BackendError> {
        let Some(m) = &self.mirror else {
            return Ok(false);
        };
        debug_assert!(len <= self.slot_bytes);
        self.ctx.make_current().map_err(be)?;
        let j = m.copy_in(
            slot,
            seq,
            self.slots.ptr(slot as usize),
            len,
            // SAFETY: the copy stream is ours and live.
            |s| unsafe { self.ready.wait(s.raw(), slot, seq) },
            // SAFETY: the word is in our timelines (registered host or mapped device words), mapped
            // for our lifetime (a dead producer's are never unmapped: Drop); the stream is ours,
            // and the copy before it on this stream is all we do with the slot.
            |s| unsafe { driver::stream_write_value64(s, self.timelines.device(0, slot), seq + 1) },
        )?;
        if !self.defer_ready {
            // Our own stream (the one `batch.data()` names) uses the copy.
            if let Err(e) = self.stream.wait_event(m.copied(j)) {
                let _ = m.give_back(seq, &self.stream);
                return Err(be(e));
            }
        }
        Ok(true)
    }

    fn mirror_full(&self) -> Option<usize> {
        self.mirror.as_ref().and_then(Mirror::full)
    }

    fn placement(&self) -> Placement {
        Placement {
            device: u32::try_from(self.device_ordinal()).ok(),
            mirror: self.mirror.is_some(),
        }
    }

    fn complete_now(&self) -> Result<(), BackendError> {
        // `finished` may have been written on a caller's stream: wait for the whole context.
        self.ctx.synchronize().map_err(be)
    }

    fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
        // Release our own stream's waits on a producer that will never signal.
        if let Err(e) = self.ready.release_all() {
            tracing::error!("could not release the ready words of a dead producer: {e}");
        }
    }

    unsafe fn batch_ref(&self, slot: u32, seq: u64, len: u64) -> CudaBatchRef<'_> {
        debug_assert!(len <= self.slot_bytes);
        let mirrored = self
            .mirror
            .as_ref()
            .and_then(|m| m.find(seq).map(|j| m.ptr(j)));
        CudaBatchRef {
            ptr: mirrored.unwrap_or_else(|| self.slots.ptr(slot as usize)),
            len,
            stream: &self.stream,
        }
    }

    fn signal_finished(&self, slot: u32, seq: u64) -> Result<(), BackendError> {
        // A mirrored batch: the slot was signalled after the copy; the buffer is free again
        // once our stream (into which its users were joined) gets here.
        if let Some(m) = &self.mirror {
            if m.give_back(seq, &self.stream).map_err(be)? {
                return Ok(());
            }
            // A batch refused before its copy: say so on the slot's copy stream, where every one of
            // this slot's `finished` words is written, in order, so the word never goes
            // backwards. No wait for `ready`: we read nothing of the batch, and one that
            // failed would leave the word unwritten and the producer waiting on it.
            // SAFETY: the copy stream is ours; the word is in our timelines, mapped for our
            // lifetime.
            return unsafe {
                driver::stream_write_value64(
                    m.stream(slot),
                    self.timelines.device(0, slot),
                    seq + 1,
                )
            }
            .map_err(be);
        }
        if self.presignalled[slot as usize].load(Ordering::Acquire) == seq + 1 {
            return Ok(());
        }
        if self.defer_ready {
            // Nothing of ours waited for `ready` (the batch was not used on a stream, or it is
            // refused): wait now, so this write lands after the producer's, and so after this
            // slot's previous `finished` written on a caller's stream. The word never goes
            // backwards.
            self.own_wait_ready(slot, seq)?;
        }
        // SAFETY: our stream is live (a created stream: no context need be current).
        unsafe { self.write_finished_raw(self.stream.raw(), slot, seq) }.map_err(be)
    }

    fn looks_ahead(&self) -> bool {
        self.side.is_none()
            && self.mirror.is_none()
            && !self.defer_ready
            && matches!(*self.ready, ReadySignal::Semaphore(_))
    }

    fn signal_finished_then_wait(
        &self,
        slot: u32,
        seq: u64,
        next: Option<(u32, u64)>,
    ) -> Result<(), BackendError> {
        let Some((k, next_seq)) = next else {
            return self.signal_finished(slot, seq);
        };
        let Some(ready) = self.ready.word(k) else {
            return self.signal_finished(slot, seq);
        };
        if !self.looks_ahead()
            || self.presignalled[slot as usize].load(Ordering::Acquire) == seq + 1
            || self.prewaited.load(Ordering::Acquire) == next_seq + 1
            || self.ready.is_ready(k, next_seq).map_err(be)?
        {
            return self.signal_finished(slot, seq);
        }
        // Our `finished` write, then the wait for the next batch's `ready`, in one stream
        // operation, as the next receive would have enqueued it. Early, but harmless: the
        // producer enqueued that batch's ready signal before publishing it, behind waits only
        // on work enqueued before (its slot was released, ours included, before it was
        // written), so the wait ends without anything of ours enqueued after it.
        let ops = [
            driver::MemOp::Write {
                ptr: self.timelines.device(0, slot),
                value: seq + 1,
            },
            driver::MemOp::Wait {
                ptr: ready,
                value: next_seq + 1,
                condition: WaitCondition::Geq,
            },
        ];
        // SAFETY: the finished word as in `write_finished_raw`, the ready word as in
        // `ReadySignal::wait_unchecked` (both mapped for as long as our stream may use them);
        // our stream is live.
        if let Err(e) = unsafe { driver::stream_mem_ops_raw(self.stream.raw(), &ops) } {
            // Nothing was enqueued: signal alone, and let the receive wait as usual.
            tracing::debug!("batched finished signal failed ({e}); signalling alone");
            return self.signal_finished(slot, seq);
        }
        // Only now: the receive may leave its wait out once this one is enqueued.
        self.prewaited.store(next_seq + 1, Ordering::Release);
        Ok(())
    }
}

/// How long a departing consumer waits for a look ahead's wait on a batch it never received
/// ([`ConsumerBackend::signal_finished_then_wait`]) before it leaves its teardown to the
/// process's exit. That batch's `ready` follows the producer's waits on the batch's slot's
/// previous holders, so a consumer whose GPU work hangs could otherwise keep a healthy one
/// from leaving.
const LOOK_AHEAD_DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

impl CudaConsumer {
    /// Waits up to [`LOOK_AHEAD_DRAIN`] for our stream to pass everything enqueued on it (the
    /// look ahead's wait among it); false when it did not.
    fn drain_look_ahead(&self) -> bool {
        let end = Instant::now() + LOOK_AHEAD_DRAIN;
        loop {
            match self.stream.query() {
                Ok(true) => return true,
                Ok(false) if Instant::now() < end => {
                    std::thread::sleep(std::time::Duration::from_millis(1))
                }
                Ok(false) => return false,
                // A broken context: the synchronize that follows reports it.
                Err(_) => return true,
            }
        }
    }
}

impl Drop for CudaConsumer {
    fn drop(&mut self) {
        // Importers free first: finish our work, drop every import (free pool pointers, unmap
        // and release VMM allocations, close legacy IPC handles), and only then (when the core
        // sends Goodbye after this drop) may the producer free its memory.
        // Our stream may be stuck, and nothing may be freed under it: then leave the imports,
        // the words and a mirror's buffers (whose free could wait for a copy stream stuck the
        // same way) to the driver's process teardown.
        let stuck = if self.abandoned.load(Ordering::Acquire) && !self.ready.host_releasable() {
            // The producer died: our stream may wait forever on a `ready` event it recorded
            // but never ran, or resume at any time once a release written to device words
            // lands.
            tracing::warn!("the producer died: skipping the CUDA consumer's teardown");
            true
        } else if self.prewaited.load(Ordering::Acquire) != 0 && !self.drain_look_ahead() {
            tracing::warn!(
                "the CUDA consumer's stream still waits for a batch the producer has not \
                 finished writing after {LOOK_AHEAD_DRAIN:?}: leaving its teardown to the \
                 process's exit"
            );
            true
        } else {
            false
        };
        if stuck {
            if let Some(m) = self.mirror.take() {
                std::mem::forget(m);
            }
            return;
        }
        // The whole context: batches may have been used on the application's streams.
        if let Err(e) = self.ctx.synchronize() {
            tracing::error!("CUDA consumer teardown: context synchronize failed: {e}");
        }
        self.slots.release(&self.stream);
        if let Err(e) = self.stream.synchronize() {
            tracing::error!("CUDA consumer teardown: stream synchronize failed: {e}");
        }
        // SAFETY: each is dropped once, here, and never used again (this is drop); every
        // stream that used them has been synchronised above.
        unsafe {
            ManuallyDrop::drop(&mut self.slots);
            ManuallyDrop::drop(&mut self.ready);
            ManuallyDrop::drop(&mut self.timelines);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeline_core::Mode;

    fn layout(slot_count: u32) -> RingLayout {
        RingLayout {
            slot_count,
            slot_bytes: 2 << 20,
            consumer_capacity: 4,
            mode: Mode::Broadcast,
        }
    }

    #[test]
    fn options_default_to_the_pool_with_posix_fds() {
        let o = CudaOptions::default();
        assert_eq!(
            (o.memory, o.handle),
            (MemoryPath::Pool, HandleKind::PosixFd)
        );
        let o = o
            .with_memory(MemoryPath::Vmm)
            .with_handle(HandleKind::Fabric);
        assert_eq!((o.memory, o.handle), (MemoryPath::Vmm, HandleKind::Fabric));
    }

    #[test]
    fn legacy_with_fabric_is_refused_before_touching_the_driver() {
        let o = CudaOptions::default()
            .with_memory(MemoryPath::Legacy)
            .with_handle(HandleKind::Fabric);
        let e = CudaProducer::create(&layout(2), o).err().unwrap();
        assert!(e.to_string().contains("legacy memory path cannot"), "{e}");
    }

    #[test]
    fn consumers_refuse_a_mismatched_export_before_touching_the_driver() {
        let mut blob = Vec::new();
        ExportHeader {
            memory: MemoryPath::Vmm,
            handle: HandleKind::PosixFd,
            sync: SyncMode::Events,
            uuid: [0; 16],
            slot_count: 2,
            slot_bytes: 2 << 20,
            words: TimelineMemory::Host,
            word_bytes: 0,
        }
        .write(&mut blob);
        blob.extend_from_slice(&(2u64 << 20).to_le_bytes());
        blob.extend_from_slice(&[0; 2 * HANDLE]);
        let memfd = || pipeline_core::sys::sealed_memfd("gpipe-test", 4096).unwrap();
        // A pool-style fd set (one memory fd) for a VMM export of two slots.
        let e = CudaConsumer::import(
            &layout(2),
            0,
            CudaOptions::default(),
            &blob,
            vec![memfd(), memfd()],
        )
        .err()
        .unwrap();
        assert!(
            e.to_string()
                .contains("vmm export with posix_fd handles must carry 2"),
            "{e}"
        );
        // A ring of another shape.
        let e = CudaConsumer::import(&layout(3), 0, CudaOptions::default(), &blob, vec![])
            .err()
            .unwrap();
        assert!(e.to_string().contains("describes 2 slots"), "{e}");
        // Trailing bytes.
        let mut long = blob.clone();
        long.push(0);
        let fds = vec![memfd(), memfd(), memfd()];
        let e = CudaConsumer::import(&layout(2), 0, CudaOptions::default(), &long, fds)
            .err()
            .unwrap();
        assert!(e.to_string().contains("trailing"), "{e}");
    }

    mod gpu {
        use super::*;
        use crate::driver::{PinnedBuffer, memcpy_dtoh_async, memset_d8_async};
        use crate::memory::imex_channel_present;

        /// Parses a producer's export the way a consumer does, without importing.
        fn parse(export: Export, memory: MemoryPath, slots: u32) {
            let mut r = Reader::new(&export.blob, "test export");
            let h = ExportHeader::read(&mut r).unwrap();
            assert_eq!((h.memory, h.handle), (memory, HandleKind::PosixFd));
            assert_eq!((h.slot_count, h.slot_bytes), (slots, 2 << 20));
            let mut fds = export.fds;
            fds.pop().unwrap();
            SlotExport::parse(&mut r, memory, h.handle, slots, 2 << 20, fds).unwrap();
            r.bytes(slots as usize * HANDLE).unwrap();
            r.finish().unwrap();
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn every_path_allocates_writable_slots_and_exports_them() {
            for (memory, memory_fds) in [
                (MemoryPath::Pool, 1),
                (MemoryPath::Vmm, 3),
                (MemoryPath::Legacy, 0),
            ] {
                let options = CudaOptions::default().with_memory(memory);
                let p = CudaProducer::create(&layout(3), options).unwrap();
                assert_eq!(p.memory_path(), memory);
                let export = p.export(0).unwrap();
                assert_eq!(export.fds.len(), memory_fds + 1, "{memory}");
                parse(export, memory, 3);
                let host = PinnedBuffer::new(p.context(), 16).unwrap();
                for k in 0..3 {
                    // SAFETY: no consumer is attached, so the producer owns every slot.
                    let slot = unsafe { p.slot_mut(k) };
                    assert_eq!(slot.ptr % (2 << 20), 0, "{memory} slot {k}");
                    // SAFETY: the slot is live device memory of `capacity` bytes used only by
                    // the producer's stream; the host reads `host` after synchronize.
                    unsafe {
                        memset_d8_async(slot.ptr, k as u8 + 1, slot.capacity as usize, slot.stream)
                            .unwrap();
                        memcpy_dtoh_async(
                            host.as_ptr(),
                            slot.ptr + slot.capacity - 16,
                            16,
                            slot.stream,
                        )
                        .unwrap();
                    }
                    p.signal_ready(k, 0).unwrap();
                    p.stream().synchronize().unwrap();
                    // SAFETY: the stream is idle.
                    assert_eq!(unsafe { host.as_slice() }, &[k as u8 + 1; 16]);
                }
                drop(p);
            }
        }

        /// The inode of an fd.
        fn inode(fd: &OwnedFd) -> u64 {
            rustix::fs::fstat(fd).unwrap().st_ino as u64
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn each_consumer_is_sent_only_its_own_finished_words() {
            for sync in SyncMode::ALL {
                let options = CudaOptions::default().with_sync(sync);
                let p = CudaProducer::create(&layout(3), options).unwrap();
                // Every export (one per attach) carries fresh words of its own, last; none
                // is ever sent twice, not even to a later holder of the same index.
                let mut seen = std::collections::HashSet::new();
                for c in [0u32, 1, 2, 3, 0, 0, 3] {
                    let export = p.export(c).unwrap();
                    let words = export.fds.last().unwrap();
                    assert!(seen.insert(inode(words)), "index {c} got words sent before");
                    // One row of 3 words (a page), not every consumer's.
                    let size = rustix::fs::fstat(words).unwrap().st_size;
                    assert_eq!(size, 4096, "{sync}");
                }
                // Nothing is waited on before an attach installs the words; after, the
                // producer reads the installed ones, and a departure releases them.
                assert_eq!(p.timelines.device(2, 1), None);
                p.timelines.install(2).unwrap();
                assert_eq!(p.timelines.load(2, 1), Some(0));
                assert!(
                    p.timelines.install(2).is_err(),
                    "installed twice from one export"
                );
                p.timelines.store_all(2, RELEASED);
                assert_eq!(p.timelines.load(2, 0), Some(RELEASED));
                assert_eq!(p.timelines.load(1, 0), None);
            }
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn a_ring_larger_than_the_gpus_free_memory_is_refused_before_allocating() {
            let ctx = Context::new(0).unwrap();
            let (free, _total) = ctx.memory_info().unwrap();
            // The fewest of the largest slots that do not fit in what is free now.
            let slot_bytes = pipeline_core::limits::MAX_SLOT_BYTES;
            let slots = u32::try_from(free / slot_bytes + 1).unwrap();
            let ring = RingLayout {
                slot_count: slots,
                slot_bytes,
                ..layout(1)
            };
            for memory in [MemoryPath::Pool, MemoryPath::Vmm, MemoryPath::Legacy] {
                let options = CudaOptions::default().with_memory(memory);
                if !memory.supports(options.handle) {
                    continue;
                }
                let e = CudaProducer::create(&ring, options).err().unwrap();
                let too_large = e
                    .downcast_ref::<pipeline_core::limits::DoesNotFit>()
                    .unwrap_or_else(|| panic!("{memory}: not refused for its size: {e}"));
                assert_eq!(too_large.memory, pipeline_core::limits::Memory::Gpu(0));
                assert!(e.to_string().contains("free memory on GPU 0"), "{e}");
            }
            let (free_after, _) = ctx.memory_info().unwrap();
            assert!(
                free_after + slot_bytes > free,
                "memory was allocated: {free} then {free_after}"
            );
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn vmm_with_posix_fds_refuses_more_than_250_slots() {
            let options = CudaOptions::default().with_memory(MemoryPath::Vmm);
            let e = CudaProducer::create(&layout(MAX_VMM_FD_SLOTS + 1), options)
                .err()
                .unwrap();
            assert!(e.to_string().contains("at most 250 slots"), "{e}");
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn fabric_without_an_imex_channel_fails_at_setup_naming_it() {
            if imex_channel_present() {
                eprintln!("an IMEX channel exists here; nothing to check");
                return;
            }
            for memory in [MemoryPath::Pool, MemoryPath::Vmm] {
                let options = CudaOptions::default()
                    .with_memory(memory)
                    .with_handle(HandleKind::Fabric);
                let e = CudaProducer::create(&layout(1), options).err().unwrap();
                let text = e.to_string();
                assert!(text.contains("/dev/nvidia-caps-imex-channels"), "{text}");
                assert!(text.contains("multi-node NVLink"), "{text}");
            }
        }
    }
}
