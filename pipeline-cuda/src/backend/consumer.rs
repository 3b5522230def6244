//! The consumer's half of the CUDA backend: picking its device, importing the slots and the
//! signals, waiting `ready`, writing `finished`, mirroring, and the attach cost per step.

use std::mem::ManuallyDrop;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use pipeline_core::wire::Reader;
use pipeline_core::{
    BackendError, BackendKind, ConsumerBackend, Delivery, Export, Placement, RingLayout,
};

use crate::driver::{self, Context, CudaError, Event, Stream, WaitCondition};
use crate::error::be;
use crate::export::ExportHeader;
use crate::memory::{ConsumerSlots, SlotExport, micros};
use crate::memory::{HandleKind, ImportTimings, MemoryPath};
use crate::mirror::Mirror;
use crate::sync::{ReadySignal, SideSignals, Timelines, join_into};
use crate::sync::{SyncMode, TimelineMemory};

use super::options::{CudaOptions, check_capabilities};
use super::views::CudaBatchRef;
use crate::export::{HANDLE, REPLY_MAGIC};

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
