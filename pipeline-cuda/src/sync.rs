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
//! a dead peer never leaves a stream waiting for good. A caller's stream is joined into ours
//! through an ordering-only event.

use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::{Mutex, RwLock};
use pipeline_core::BackendError;
use serde::Serialize;

use crate::backend::be;
use crate::driver::{
    self, CUdeviceptr, Context, CudaError, Event, HostRegistration, Stream, WaitCondition,
};

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

impl SyncMode {
    /// Both modes.
    pub const ALL: [SyncMode; 2] = [SyncMode::Events, SyncMode::Semaphore];

    pub(crate) fn to_wire(self) -> u32 {
        match self {
            SyncMode::Events => 1,
            SyncMode::Semaphore => 2,
        }
    }

    pub(crate) fn from_wire(v: u32) -> Option<Self> {
        match v {
            1 => Some(SyncMode::Events),
            2 => Some(SyncMode::Semaphore),
            _ => None,
        }
    }
}

impl fmt::Display for SyncMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SyncMode::Events => "events",
            SyncMode::Semaphore => "semaphore",
        })
    }
}

impl FromStr for SyncMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "events" => Ok(SyncMode::Events),
            "semaphore" => Ok(SyncMode::Semaphore),
            _ => Err(format!("unknown sync mode {s:?}: use events or semaphore")),
        }
    }
}

/// A value past any real generation (sequences are below 2^48) that still compares as
/// "greater or equal" in the driver's wrapping comparison: it releases every wait.
pub(crate) const RELEASED: u64 = 1 << 62;

/// Timeline words: `rows × slots` u64 words in a sealed memfd, mapped here and registered with
/// the driver. Word `r * slots + k` holds a generation (`seq + 1`) for slot k: the last batch
/// ready in it (`ready` under semaphore sync, one row), or the last batch a consumer finished
/// in it (one row, in that consumer's own memfd: [`FinishedWords`]).
pub(crate) struct Timelines {
    // Field order matters: the registration must go before the mapping.
    reg: HostRegistration,
    map: MmapRaw,
    pub(crate) fd: OwnedFd,
    pub(crate) slots: u32,
    words: usize,
}

impl Timelines {
    fn bytes(rows: u32, slots: u32) -> u64 {
        (rows as u64 * slots as u64 * 8).div_ceil(4096) * 4096
    }

    /// `rows × slots` zeroed words (finished: a row per consumer; ready: one row).
    pub(crate) fn create(
        ctx: &Arc<Context>,
        rows: u32,
        slots: u32,
        name: &str,
    ) -> Result<Self, BackendError> {
        let fd = pipeline_core::sys::sealed_memfd(name, Self::bytes(rows, slots))?;
        Self::map(ctx, rows, slots, fd)
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
            reg,
            map,
            fd,
            slots,
            words: (rows * slots) as usize,
        })
    }

    fn index(&self, consumer: u32, slot: u32) -> usize {
        let i = consumer as usize * self.slots as usize + slot as usize;
        assert!(i < self.words, "timeline index out of range");
        i
    }

    pub(crate) fn device(&self, consumer: u32, slot: u32) -> CUdeviceptr {
        self.reg.device_ptr() + 8 * self.index(consumer, slot) as u64
    }

    pub(crate) fn host(&self, consumer: u32, slot: u32) -> &AtomicU64 {
        let i = self.index(consumer, slot);
        // SAFETY: i < words and the mapping holds words * 8 bytes, 8-aligned (page base); the
        // word is only ever accessed atomically (here) or by the GPU's stream memory ops.
        unsafe { &*(self.map.as_mut_ptr().add(8 * i) as *const AtomicU64) }
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
    /// The words of each index's current holder (None before the index's first attach). A
    /// row is replaced only by `install`, which the producer calls with every wait on the old
    /// row passed and no new wait being enqueued.
    rows: RwLock<Vec<Option<Timelines>>>,
    /// Words made for an attach in progress, per index.
    pending: Mutex<Vec<Option<Timelines>>>,
}

impl FinishedWords {
    /// Room for `capacity` consumer indices; no words exist until an attach.
    pub(crate) fn new(ctx: &Arc<Context>, capacity: u32, slots: u32) -> Self {
        let none = || (0..capacity).map(|_| None).collect::<Vec<_>>();
        Self {
            ctx: Arc::clone(ctx),
            slots,
            rows: RwLock::new(none()),
            pending: Mutex::new(none()),
        }
    }

    /// Makes zeroed words for the consumer attaching at index `consumer` and returns the fd
    /// to send it. Replaces words made for an earlier attempt at the index that never
    /// attached (nothing waits on those).
    pub(crate) fn fresh(&self, consumer: u32) -> Result<OwnedFd, BackendError> {
        let row = Timelines::create(&self.ctx, 1, self.slots, "gpipe-finished")?;
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
        self.rows.write()[consumer as usize] = Some(row);
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
    /// it: a stream wait for it would pass at once, and can be left out.
    pub(crate) fn reached(&self, consumer: u32, slot: u32, target: u64) -> bool {
        let rows = self.rows.read();
        rows.get(consumer as usize)
            .and_then(Option::as_ref)
            .is_some_and(|r| r.host(0, slot).load(Ordering::Acquire) >= target)
    }

    /// Stores `value` into every word of `consumer` (0: none finished; RELEASED: every wait
    /// passes), if it has attached.
    pub(crate) fn store_all(&self, consumer: u32, value: u64) {
        let rows = self.rows.read();
        if let Some(Some(row)) = rows.get(consumer as usize) {
            for k in 0..self.slots {
                row.host(0, k).store(value, Ordering::Release);
            }
        }
    }

    /// The current value of `consumer`'s word for `slot`, if it has attached.
    #[cfg(test)]
    pub(crate) fn load(&self, consumer: u32, slot: u32) -> Option<u64> {
        let rows = self.rows.read();
        rows.get(consumer as usize)?
            .as_ref()
            .map(|r| r.host(0, slot).load(Ordering::Acquire))
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
            // SAFETY: the word is in our registered timelines, mapped for our lifetime; the
            // caller guarantees `stream`.
            ReadySignal::Semaphore(words) => unsafe {
                driver::stream_write_value64_raw(stream, words.device(0, slot), seq + 1)
            },
        }
    }

    /// True when batch `seq` in `slot` is ready now (the producer's writes are complete), as
    /// the host can tell without waiting: the event has completed, or the word has reached the
    /// batch. Valid while the batch is held (the producer signals the slot again only after
    /// it is released).
    pub(crate) fn is_ready(&self, slot: u32, seq: u64) -> Result<bool, CudaError> {
        match self {
            ReadySignal::Events(events) => events[slot as usize].query(),
            ReadySignal::Semaphore(words) => Ok(words.host(0, slot).load(Ordering::Acquire) > seq),
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
        match self {
            // SAFETY: the caller guarantees `stream`; the event is ours, live for our life.
            ReadySignal::Events(events) => unsafe {
                Stream::raw_wait_event(stream, &events[slot as usize])
            },
            // SAFETY: the word is in our registered timelines, mapped for our lifetime; the
            // caller guarantees `stream`.
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
