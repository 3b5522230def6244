//! How the producer and its consumers order their GPU work across processes.
//!
//! * `ready` (producer → consumers), per slot, as the producer chooses ([`SyncMode`]): one IPC
//!   event per slot, or one timeline word per slot in host-mapped shared memory.
//! * `finished` (consumer → producer): one timeline word per slot per consumer, each consumer's
//!   words in a memfd of its own that only it and the producer hold ([`FinishedWords`]). Why it
//!   is not an event: see [`crate::backend`].
//!
//! Timeline words are written and waited on the GPU with stream memory operations
//! (`cuStreamWriteValue64` / `cuStreamWaitValue64`); a word can be released from the host, so
//! a dead peer never leaves a stream waiting for good. They live in host memory mapped for
//! the device, or in device memory ([`TimelineMemory`]), where a stream's wait polls local
//! memory and a release is a write on a stream that never waits. A caller's stream is joined into ours
//! through an ordering-only event.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::{Mutex, RwLock};
use pipeline_core::BackendError;
use serde::Serialize;

use crate::driver::{
    self, CUdeviceptr, Context, CudaError, Event, HostRegistration, Stream, WaitCondition,
};
use crate::error::be;

/// How `ready` is signalled across processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// One IPC event per slot, recorded by the producer, waited by consumers.
    #[default]
    Events,
    /// One timeline word per slot in host-mapped shared memory: the producer's stream writes
    /// the batch's generation (`cuStreamWriteValue64`), consumers' streams wait for
    /// `value >= generation` (`cuStreamWaitValue64`). No event handles; a consumer whose
    /// producer died can release its own waits.
    Semaphore,
}

crate::names::named_enum!(SyncMode, "sync mode", [
    Events = "events" (1) [],
    Semaphore = "semaphore" (2) [],
]);

/// A value past any real generation (sequences are below 2^48) that still compares as
/// "greater or equal" in the driver's wrapping comparison: it releases every wait.
pub(crate) const RELEASED: u64 = 1 << 62;

/// Where the timeline words (`finished`, and `ready` under [`SyncMode::Semaphore`]) live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TimelineMemory {
    /// Host memory (a sealed memfd) registered with the driver and mapped for the device: the
    /// GPU reads and writes it over PCIe, and the host reads it directly, so a wait already
    /// satisfied is left out and a dead peer's words are released with a plain store.
    #[default]
    Host,
    /// Device memory (a `cuMemCreate` allocation shared by fd) mapped by both processes: a
    /// stream's wait polls local memory. The host cannot read it, so every wait is enqueued,
    /// and a dead peer's words are released by a write on a stream of their own.
    Device,
}

crate::names::named_enum!(TimelineMemory, "timeline memory", [
    Host = "host" (1) [],
    Device = "device" (2) [],
]);

/// Bytes of one device-memory timeline allocation on `ctx`'s device: the VMM granularity
/// (2 MiB on the GPUs measured), which holds far more words than a ring has slots.
pub(crate) fn device_word_bytes(ctx: &Context) -> Result<u64, BackendError> {
    let g = driver::allocation_granularity(ctx.device(), driver::PoolHandleType::PosixFd)
        .map_err(be)?;
    Ok(g as u64)
}

/// The release stream device words need (a caller's mistake if it is missing).
fn release_stream(release: Option<&Arc<Stream>>) -> Result<&Arc<Stream>, BackendError> {
    release.ok_or_else(|| "device timeline words need a release stream".into())
}

/// Where a [`Timelines`]' words are.
enum Store {
    Host {
        // Field order matters: the registration must go before the mapping.
        reg: HostRegistration,
        map: MmapRaw,
    },
    Device {
        mapping: driver::VmmMapping,
        /// Writes the host asks for (releases) go on this stream, never on one that may be
        /// waiting on these words.
        release: Arc<Stream>,
    },
}

/// Timeline words: `rows × slots` u64 words, in host memory (a sealed memfd, mapped here and
/// registered with the driver) or in device memory (a VMM allocation exported as an fd).
/// Word `r * slots + k` holds a generation (`seq + 1`) for slot k: the last batch ready in it
/// (`ready` under semaphore sync, one row), or the last batch a consumer finished in it (one
/// row, in that consumer's own words: [`FinishedWords`]).
pub(crate) struct Timelines {
    store: Store,
    pub(crate) fd: OwnedFd,
    pub(crate) slots: u32,
    words: usize,
}

impl Timelines {
    fn bytes(rows: u32, slots: u32) -> u64 {
        (rows as u64 * slots as u64 * 8).div_ceil(4096) * 4096
    }

    /// `rows × slots` zeroed words in host memory (finished: a row per consumer; ready: one
    /// row).
    pub(crate) fn create(
        ctx: &Arc<Context>,
        rows: u32,
        slots: u32,
        name: &str,
    ) -> Result<Self, BackendError> {
        let fd = pipeline_core::sys::sealed_memfd(name, Self::bytes(rows, slots))?;
        Self::map(ctx, rows, slots, fd)
    }

    /// As [`Timelines::create`], in the memory `memory` names; device words (which need the
    /// `release` stream) take one allocation of `bytes` ([`device_word_bytes`], queried once
    /// by the producer and sent in its export) and are zeroed on the stream before this
    /// returns. `bytes` is ignored for host words.
    pub(crate) fn create_in(
        ctx: &Arc<Context>,
        memory: TimelineMemory,
        release: Option<&Arc<Stream>>,
        bytes: u64,
        rows: u32,
        slots: u32,
        name: &str,
    ) -> Result<Self, BackendError> {
        if memory == TimelineMemory::Host {
            return Self::create(ctx, rows, slots, name);
        }
        let release = release_stream(release)?;
        if Self::bytes(rows, slots) > bytes {
            return Err(format!("{rows} x {slots} timeline words do not fit {bytes} bytes").into());
        }
        let alloc = driver::PhysicalAllocation::create(
            ctx,
            bytes as usize,
            driver::PoolHandleType::PosixFd,
        )
        .map_err(be)?;
        let mapping = driver::VmmMapping::new(ctx, alloc, 0).map_err(be)?;
        let fd = mapping.allocation().export_fd().map_err(be)?;
        // SAFETY: the range is ours, mapped and `bytes` long; the stream is live, and it is
        // synchronised before anything else uses the words.
        unsafe { driver::memset_d8_async(mapping.ptr(), 0, bytes as usize, release) }
            .map_err(be)?;
        release.synchronize().map_err(be)?;
        Ok(Self {
            store: Store::Device {
                mapping,
                release: Arc::clone(release),
            },
            fd,
            slots,
            words: (rows * slots) as usize,
        })
    }

    pub(crate) fn map(
        ctx: &Arc<Context>,
        rows: u32,
        slots: u32,
        fd: OwnedFd,
    ) -> Result<Self, BackendError> {
        let bytes = Self::bytes(rows, slots);
        pipeline_core::sys::check_sealed_memfd(fd.as_fd(), bytes)
            .map_err(|m| format!("timeline words: {m}"))?;
        let map = MmapOptions::new().len(bytes as usize).map_raw(&fd)?;
        // SAFETY: the mapping is page-aligned, `bytes` long (a page multiple), and owned by
        // this struct, whose field order drops the registration before the mapping.
        let registered = unsafe { HostRegistration::new(ctx, map.as_mut_ptr(), bytes as usize) };
        let reg = registered.map_err(be)?;
        Ok(Self {
            store: Store::Host { reg, map },
            fd,
            slots,
            words: (rows * slots) as usize,
        })
    }

    /// Maps words another process made with [`Timelines::create_in`]: host words from a
    /// sealed memfd, device words (`bytes` long, as the export says) from a VMM fd.
    pub(crate) fn map_in(
        ctx: &Arc<Context>,
        memory: TimelineMemory,
        release: Option<&Arc<Stream>>,
        bytes: u64,
        rows: u32,
        slots: u32,
        fd: OwnedFd,
    ) -> Result<Self, BackendError> {
        if memory == TimelineMemory::Host {
            return Self::map(ctx, rows, slots, fd);
        }
        let release = release_stream(release)?;
        if bytes < Self::bytes(rows, slots) || bytes > 1 << 30 {
            return Err(format!(
                "timeline words: an allocation of {bytes} bytes cannot hold {rows} x {slots} words"
            )
            .into());
        }
        // On another GPU than the producer's this maps its memory by peer access, as the
        // slots are.
        let hint = |e: CudaError| {
            format!(
                "mapping the producer's timeline words in device memory: {e} (a producer with \
                 host timeline words, --timeline-memory host, needs no device mapping)"
            )
        };
        let alloc =
            driver::PhysicalAllocation::import_fd(ctx, fd.as_fd(), bytes as usize).map_err(hint)?;
        let mapping = driver::VmmMapping::new(ctx, alloc, 0).map_err(hint)?;
        Ok(Self {
            store: Store::Device {
                mapping,
                release: Arc::clone(release),
            },
            fd,
            slots,
            words: (rows * slots) as usize,
        })
    }

    /// Where the words are.
    pub(crate) fn memory(&self) -> TimelineMemory {
        match self.store {
            Store::Host { .. } => TimelineMemory::Host,
            Store::Device { .. } => TimelineMemory::Device,
        }
    }

    fn index(&self, consumer: u32, slot: u32) -> usize {
        let i = consumer as usize * self.slots as usize + slot as usize;
        assert!(i < self.words, "timeline index out of range");
        i
    }

    pub(crate) fn device(&self, consumer: u32, slot: u32) -> CUdeviceptr {
        let base = match &self.store {
            Store::Host { reg, .. } => reg.device_ptr(),
            Store::Device { mapping, .. } => mapping.ptr(),
        };
        base + 8 * self.index(consumer, slot) as u64
    }

    /// The word as the host sees it: host words only (`None` for device words, which the host
    /// cannot read).
    pub(crate) fn host(&self, consumer: u32, slot: u32) -> Option<&AtomicU64> {
        let i = self.index(consumer, slot);
        let Store::Host { map, .. } = &self.store else {
            return None;
        };
        // SAFETY: i < words and the mapping holds words * 8 bytes, 8-aligned (page base); the
        // word is only ever accessed atomically (here) or by the GPU's stream memory ops.
        let word = unsafe { &*(map.as_mut_ptr().add(8 * i) as *const AtomicU64) };
        Some(word)
    }

    /// Stores `value` into every word of row `consumer`: at once for host words; for device
    /// words, enqueued on the release stream (which never waits on timeline words, so the
    /// writes land even while another stream of ours waits on them).
    pub(crate) fn store_row(&self, consumer: u32, value: u64) -> Result<(), CudaError> {
        if let Store::Device { release, .. } = &self.store {
            // Called from whichever thread saw the death.
            release.context().make_current()?;
        }
        for k in 0..self.slots {
            match &self.store {
                Store::Host { .. } => {
                    if let Some(w) = self.host(consumer, k) {
                        w.store(value, Ordering::Release);
                    }
                }
                // SAFETY: the word is in our mapping, which stays mapped until this struct is
                // dropped, and its owner synchronises the release stream first (Drop); the
                // stream is live.
                Store::Device { release, .. } => unsafe {
                    driver::stream_write_value64(release, self.device(consumer, k), value)?
                },
            }
        }
        Ok(())
    }
}

impl Drop for Timelines {
    fn drop(&mut self) {
        if let Store::Device { release, .. } = &self.store {
            // A release written to these words may still be queued: let it land first.
            if let Err(e) = release.synchronize() {
                tracing::warn!("dropping device timeline words: release stream: {e}");
            }
        }
    }
}

/// The producer's view of every consumer's `finished` words: one single-row [`Timelines`]
/// per attach, in a memfd of its own. Each attach gets fresh words ([`FinishedWords::fresh`]
/// when the producer exports to it, [`FinishedWords::install`] once it has attached), so no
/// consumer ever holds the words of another, not even of a later holder of its index: raising
/// another consumer's word would let the producer refill a slot that consumer still reads,
/// and lowering it would stall the producer.
pub(crate) struct FinishedWords {
    ctx: Arc<Context>,
    slots: u32,
    memory: TimelineMemory,
    /// Bytes of each consumer's device-word allocation (the size the export names); 0 for
    /// host words.
    word_bytes: u64,
    /// Device words' releases go here (see [`Timelines::store_row`]); `None` for host words.
    release: Option<Arc<Stream>>,
    /// The words of each index's current holder (None before the index's first attach). A
    /// row is replaced only by `install`, which the producer calls with every wait on the old
    /// row passed and no new wait being enqueued.
    rows: RwLock<Vec<Option<Timelines>>>,
    /// Words made for an attach in progress, per index.
    pending: Mutex<Vec<Option<Timelines>>>,
}

impl FinishedWords {
    /// Room for `capacity` consumer indices; no words exist until an attach. Device words
    /// take `word_bytes` each (the size the export names).
    pub(crate) fn new(
        ctx: &Arc<Context>,
        memory: TimelineMemory,
        word_bytes: u64,
        release: Option<&Arc<Stream>>,
        capacity: u32,
        slots: u32,
    ) -> Self {
        let none = || (0..capacity).map(|_| None).collect::<Vec<_>>();
        Self {
            ctx: Arc::clone(ctx),
            slots,
            memory,
            word_bytes,
            release: release.cloned(),
            rows: RwLock::new(none()),
            pending: Mutex::new(none()),
        }
    }

    /// Makes zeroed words for the consumer attaching at index `consumer` and returns the fd
    /// to send it. Replaces words made for an earlier attempt at the index that never
    /// attached (nothing waits on those).
    pub(crate) fn fresh(&self, consumer: u32) -> Result<OwnedFd, BackendError> {
        let row = Timelines::create_in(
            &self.ctx,
            self.memory,
            self.release.as_ref(),
            self.word_bytes,
            1,
            self.slots,
            "gpipe-finished",
        )?;
        let fd = row.fd.try_clone()?;
        let mut pending = self.pending.lock();
        let entry = pending
            .get_mut(consumer as usize)
            .ok_or_else(|| format!("consumer index {consumer} is past the ring's capacity"))?;
        *entry = Some(row);
        Ok(fd)
    }

    /// Makes the words [`FinishedWords::fresh`] made for `consumer` the ones the producer
    /// waits on, dropping its previous holder's. The caller guarantees that every wait
    /// enqueued on the old words has passed and that none is enqueued meanwhile.
    pub(crate) fn install(&self, consumer: u32) -> Result<(), BackendError> {
        let row = self
            .pending
            .lock()
            .get_mut(consumer as usize)
            .and_then(Option::take)
            .ok_or_else(|| format!("no finished words were made for consumer {consumer}"))?;
        let old = self.rows.write()[consumer as usize].replace(row);
        // Dropped outside the lock: dropping device words waits for their release stream,
        // and a departure must still be able to release the other consumers' words.
        drop(old);
        Ok(())
    }

    /// The device address of `consumer`'s word for `slot`, if it has attached. Valid until
    /// the index's next [`FinishedWords::install`].
    pub(crate) fn device(&self, consumer: u32, slot: u32) -> Option<CUdeviceptr> {
        let rows = self.rows.read();
        rows.get(consumer as usize)?
            .as_ref()
            .map(|r| r.device(0, slot))
    }

    /// True when `consumer`'s word for `slot` has reached `target` already, as the host sees
    /// it: a stream wait for it would pass at once, and can be left out. Always false for
    /// device words, which the host cannot read (a wait on local memory is cheap).
    pub(crate) fn reached(&self, consumer: u32, slot: u32, target: u64) -> bool {
        let rows = self.rows.read();
        rows.get(consumer as usize)
            .and_then(Option::as_ref)
            .and_then(|r| r.host(0, slot))
            .is_some_and(|w| w.load(Ordering::Acquire) >= target)
    }

    /// Stores `value` into every word of `consumer` (0: none finished; RELEASED: every wait
    /// passes), if it has attached. Device words are written on the release stream.
    pub(crate) fn store_all(&self, consumer: u32, value: u64) {
        let rows = self.rows.read();
        if let Some(Some(row)) = rows.get(consumer as usize) {
            if let Err(e) = row.store_row(0, value) {
                tracing::error!(
                    consumer,
                    "could not write the finished words in device memory: {e}"
                );
            }
        }
    }

    /// The current value of `consumer`'s word for `slot`, if it has attached (host words).
    #[cfg(test)]
    pub(crate) fn load(&self, consumer: u32, slot: u32) -> Option<u64> {
        let rows = self.rows.read();
        rows.get(consumer as usize)?
            .as_ref()
            .and_then(|r| r.host(0, slot))
            .map(|w| w.load(Ordering::Acquire))
    }
}

/// Makes `into` (one of ours) wait for the work enqueued so far on a caller's `stream`,
/// through the ordering-only event `scratch`.
///
/// # Safety
/// `stream` is a live stream handle of `ctx` (or `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD`).
pub(crate) unsafe fn join_into(
    ctx: &Context,
    scratch: &Mutex<Event>,
    into: &Stream,
    stream: driver::CUstream,
) -> Result<(), CudaError> {
    ctx.make_current()?;
    let ev = scratch.lock();
    // SAFETY: the caller guarantees `stream`.
    unsafe { ev.record_raw(stream) }?;
    into.wait_event(&ev)
}

/// How the producer signals `ready`.
pub(crate) enum ReadySignal {
    /// One IPC event per slot.
    Events(Vec<Event>),
    /// One timeline word per slot (a single row).
    Semaphore(Timelines),
}

impl ReadySignal {
    /// Releases every wait on the `ready` words (the producer died): host words at once,
    /// device words by a write on their release stream. Events cannot be released.
    pub(crate) fn release_all(&self) -> Result<(), CudaError> {
        match self {
            ReadySignal::Events(_) => Ok(()),
            ReadySignal::Semaphore(words) => words.store_row(0, RELEASED),
        }
    }

    /// The timeline word of `slot` (semaphore sync), as the GPU addresses it.
    pub(crate) fn word(&self, slot: u32) -> Option<CUdeviceptr> {
        match self {
            ReadySignal::Events(_) => None,
            ReadySignal::Semaphore(words) => Some(words.device(0, slot)),
        }
    }

    /// True when a wait on `ready` that will never be signalled can be released from the
    /// host for certain: host words. (Events cannot be; device words are released by a write
    /// on another stream, which teardown does not rely on.)
    pub(crate) fn host_releasable(&self) -> bool {
        matches!(self, ReadySignal::Semaphore(w) if w.memory() == TimelineMemory::Host)
    }

    /// Signals that batch `seq` in `slot` is ready, after the work enqueued on `stream`.
    ///
    /// # Safety
    /// `stream` is a live stream handle of the signal's context (or `CU_STREAM_LEGACY` /
    /// `CU_STREAM_PER_THREAD`).
    pub(crate) unsafe fn signal(
        &self,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        match self {
            // SAFETY: the caller guarantees `stream`; the event is ours.
            ReadySignal::Events(events) => unsafe { events[slot as usize].record_raw(stream) },
            // SAFETY: the word is in our timelines (registered host or mapped device words), mapped
            // for our lifetime (a dead producer's are never unmapped: Drop); the caller guarantees
            // `stream`.
            ReadySignal::Semaphore(words) => unsafe {
                driver::stream_write_value64_raw(stream, words.device(0, slot), seq + 1)
            },
        }
    }

    /// True when batch `seq` in `slot` is ready now (the producer's writes are complete), as
    /// the host can tell without waiting: the event has completed, or the word has reached the
    /// batch (false for device words, which the host cannot read). Valid while the batch is
    /// held (the producer signals the slot again only after it is released).
    pub(crate) fn is_ready(&self, slot: u32, seq: u64) -> Result<bool, CudaError> {
        match self {
            ReadySignal::Events(events) => events[slot as usize].query(),
            ReadySignal::Semaphore(words) => Ok(words
                .host(0, slot)
                .is_some_and(|w| w.load(Ordering::Acquire) > seq)),
        }
    }

    /// Makes `stream` wait until batch `seq` in `slot` is ready. A batch already ready (the
    /// usual case when the consumer is the slower side) adds no wait to the stream: a
    /// cross-process, and for a consumer on another GPU cross-device, wait costs a few µs of
    /// stream time per batch, which small batches feel.
    ///
    /// # Safety
    /// As for [`ReadySignal::signal`].
    pub(crate) unsafe fn wait(
        &self,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        if self.is_ready(slot, seq)? {
            return Ok(());
        }
        // SAFETY: the caller guarantees `stream`.
        unsafe { self.wait_unchecked(stream, slot, seq) }
    }

    /// As [`ReadySignal::wait`], without first asking whether the batch is ready already (for
    /// a caller that just asked).
    ///
    /// # Safety
    /// As for [`ReadySignal::signal`].
    pub(crate) unsafe fn wait_unchecked(
        &self,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        match self {
            // SAFETY: the caller guarantees `stream`; the event is ours, live for our life.
            ReadySignal::Events(events) => unsafe {
                Stream::raw_wait_event(stream, &events[slot as usize])
            },
            // SAFETY: the word is in our timelines (registered host or mapped device words), mapped
            // for our lifetime (a dead producer's are never unmapped: Drop); the caller guarantees
            // `stream`.
            ReadySignal::Semaphore(words) => unsafe {
                driver::stream_wait_value64_raw(
                    stream,
                    words.device(0, slot),
                    seq + 1,
                    WaitCondition::Geq,
                )
            },
        }
    }
}

/// A consumer's cross-process signals moved off the stream that uses the batch: a stream of
/// ours waits for `ready` and records an ordering-only event that the batch's stream waits
/// for; the batch's stream records an ordering-only event after its work, which a second
/// stream of ours waits for before it writes `finished`. The batch's stream then carries only
/// in-process event records and waits between its kernels.
///
/// Each side stream runs its signals in the order they were asked for: with batches used on
/// several caller streams, a `finished` write waits behind earlier batches' writes (and a
/// `ready` wait behind earlier waits), where on the callers' own streams they would not. The
/// order is the order of receipt and release, so this delays, never deadlocks: a batch's
/// `ready` depends only on `finished` writes asked for before it was received.
pub(crate) struct SideSignals {
    /// Waits for `ready` (and may block there); nothing else runs on it.
    waits: Stream,
    /// Writes `finished`, each after the batch's stream has got past the batch's work.
    writes: Stream,
    /// Recorded on `waits` once `ready` is reached.
    ready: Event,
    /// Recorded on the batch's stream after its work.
    done: Event,
}

impl SideSignals {
    /// Two streams and two ordering-only events in `ctx`.
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<SideSignals, CudaError> {
        Ok(SideSignals {
            waits: Stream::new(ctx)?,
            writes: Stream::new(ctx)?,
            ready: Event::new_plain(ctx)?,
            done: Event::new_plain(ctx)?,
        })
    }

    /// Makes `stream` wait until batch `seq` in `slot` is ready, through `waits`. A batch the
    /// host can already tell is ready adds nothing.
    ///
    /// # Safety
    /// `stream` is a live stream handle of this context (or `CU_STREAM_LEGACY` /
    /// `CU_STREAM_PER_THREAD`).
    pub(crate) unsafe fn wait_ready(
        &self,
        signal: &ReadySignal,
        stream: driver::CUstream,
        slot: u32,
        seq: u64,
    ) -> Result<(), CudaError> {
        if signal.is_ready(slot, seq)? {
            return Ok(());
        }
        // SAFETY: `waits` is a live stream of ours (a created stream: no context need be
        // current).
        unsafe { signal.wait_unchecked(self.waits.raw(), slot, seq) }?;
        self.ready.record(&self.waits)?;
        // SAFETY: the caller guarantees `stream`; the event is ours.
        unsafe { Stream::raw_wait_event(stream, &self.ready) }
    }

    /// Writes `value` to the timeline word at `word` on `writes`, after the work enqueued on
    /// `stream` so far.
    ///
    /// # Safety
    /// As for [`SideSignals::wait_ready`]; `word` is a timeline word mapped for at least as
    /// long as `writes` may run.
    pub(crate) unsafe fn write_after(
        &self,
        stream: driver::CUstream,
        word: CUdeviceptr,
        value: u64,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees `stream`.
        unsafe { self.done.record_raw(stream) }?;
        self.writes.wait_event(&self.done)?;
        // SAFETY: `writes` is ours; the caller guarantees the word.
        unsafe { driver::stream_write_value64(&self.writes, word, value) }
    }
}
