//! Mirror delivery on the CUDA backend: copy streams of the consumer's copy each batch with
//! the copy engine into a buffer of its own, on its own GPU, and write `finished` for the
//! producer's slot right after the copy, so the slot frees as soon as the copy is done. The
//! user reads the local copy.
//!
//! Ordering: slot k's copy stream waits `ready[k]` and, for a buffer used before, `freed[j]`
//! (its last users' work) and, where the buffer's last copy was on another copy stream,
//! `copied[j]` (that copy, which `freed[j]` follows only where the releasing stream waited for
//! it: a consumer that let a batch go unused did not), then copies slot k into buffer j,
//! records `copied[j]` and writes `finished[k] = seq + 1`. A stream that uses the copy waits
//! `copied[j]` (the consumer's own stream does, unless the caller defers that to its streams).
//! The release records `freed[j]` on the consumer's stream, after the streams the batch was
//! used on were joined into it (as the in-place release does before `finished`), so the next
//! copy into buffer j comes after that work. The copies of the next batches overlap the
//! user's kernels on this one: copy engine and SMs run side by side.
//!
//! The figures behind the rule of [`pipeline_core::Delivery::Auto`] ([`crate::policy::delivery::mirrors`]),
//! measured on 2×H200 (NVLink, driver 580.159.04,
//! 2026-11-23, docs/multi-gpu.md): on the producer's GPU, in place (a copy only costs
//! bandwidth); on another GPU, mirrored. One consumer on GPU 1 verifying each batch once
//! moved, in GB/s, in place vs mirrored (two copy streams, median of 3 in one run): 138 vs 174
//! at 2 MiB, 252 vs 275 at 8 MiB, 332 vs 360 at 64 MiB and 315 vs 339 at 256 MiB; with two
//! consumers on GPU 1 at 64 MiB the ring moved 152 vs 176. Only NVLink between two H200s was
//! measured; on PCIe the rule is unmeasured. With one copy stream mirror was slower
//! below 64 MiB (102 GB/s at 2 MiB), and `auto` then read small slots in place. A consumer
//! that reads each batch more than once gains still more from a mirror (its later reads come
//! from its own memory, at HBM speed). A mirror costs memory on the consumer's GPU: its
//! buffers, the ring's slot count by default ([`crate::backend::CudaOptions::mirror_buffers`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use pipeline_core::{BackendError, MirrorTable};

use crate::driver::{self, CUdeviceptr, Context, CudaError, DeviceBuffer, Event, Stream};

/// Copy streams of a mirroring consumer unless `GPIPE_MIRROR_STREAMS` says otherwise (1-8).
/// Slot k's batches are copied on stream k mod n, so one slot's `finished` words are written
/// in order on one stream, while consecutive batches' copies overlap each other's ordering
/// work (the ready wait, the event, the `finished` write). Measured on 2×H200 (driver
/// 580.159.04, 2026-11-23, one consumer on GPU 1, median of 3, docs/multi-gpu.md): against
/// one stream, two moved 174 vs 105 GB/s at 2 MiB, 359 vs 345 at 64 MiB and 339 vs 336 at
/// 256 MiB; four, in a later run of 2 repetitions, 179, 361 and 340, so two it is.
pub const DEFAULT_MIRROR_STREAMS: usize = 2;

/// The number of copy streams: `GPIPE_MIRROR_STREAMS` if set to 1-8, else the default (with
/// a warning for any other value).
fn copy_streams() -> usize {
    let Ok(v) = std::env::var("GPIPE_MIRROR_STREAMS") else {
        return DEFAULT_MIRROR_STREAMS;
    };
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=8).contains(&n) => n,
        _ => {
            tracing::warn!(
                "GPIPE_MIRROR_STREAMS={v:?} is not a number from 1 to 8: using \
                 {DEFAULT_MIRROR_STREAMS}"
            );
            DEFAULT_MIRROR_STREAMS
        }
    }
}

/// `Mirror::last_stream` of a buffer no copy was enqueued into yet.
const NO_STREAM: usize = usize::MAX;

/// A consumer's own buffers, its copy streams, per buffer the events that mark its copy done
/// and its last user's work done, and which batch each buffer holds.
pub(crate) struct Mirror {
    buffers: Vec<DeviceBuffer>,
    copy: Vec<Stream>,
    copied: Vec<Event>,
    freed: Vec<Event>,
    /// Per buffer: `freed` was recorded (the buffer held a batch before).
    used: Vec<AtomicBool>,
    /// Per buffer: the copy stream its last copy was enqueued on ([`NO_STREAM`]: none yet).
    last_stream: Vec<AtomicUsize>,
    table: MirrorTable,
    next: AtomicUsize,
}

impl Mirror {
    /// Allocates `count` buffers of `bytes` on the consumer's device.
    pub(crate) fn new(ctx: &Arc<Context>, count: u32, bytes: u64) -> Result<Mirror, BackendError> {
        if count == 0 {
            return Err("mirror delivery needs at least one buffer of its own".into());
        }
        let len = usize::try_from(bytes).map_err(|_| "slot size overflows usize")?;
        let be = crate::error::be;
        let mut buffers = Vec::with_capacity(count as usize);
        let (mut copied, mut freed) = (Vec::new(), Vec::new());
        for j in 0..count {
            buffers.push(DeviceBuffer::new(ctx, len).map_err(|e| {
                format!(
                    "allocating mirror buffer {j} of {count} ({bytes} bytes each) on GPU {}: \
                     {e}; ask for fewer mirror buffers, or deliver in place",
                    ctx.device().ordinal()
                )
            })?);
            copied.push(Event::new_plain(ctx).map_err(be)?);
            freed.push(Event::new_plain(ctx).map_err(be)?);
        }
        Ok(Mirror {
            buffers,
            copy: (0..copy_streams())
                .map(|_| Stream::new(ctx))
                .collect::<Result<_, _>>()
                .map_err(be)?,
            copied,
            freed,
            used: (0..count).map(|_| AtomicBool::new(false)).collect(),
            last_stream: (0..count).map(|_| AtomicUsize::new(NO_STREAM)).collect(),
            table: MirrorTable::new(count as usize),
            next: AtomicUsize::new(0),
        })
    }

    /// The copy stream of slot `slot`'s batches (their copies and `finished` writes run on
    /// it, always the same one for a slot).
    pub(crate) fn stream(&self, slot: u32) -> &Stream {
        &self.copy[self.stream_index(slot)]
    }

    fn stream_index(&self, slot: u32) -> usize {
        slot as usize % self.copy.len()
    }

    /// The number of buffers.
    pub(crate) fn len(&self) -> usize {
        self.buffers.len()
    }

    /// `Some(buffers)` when every buffer holds a batch.
    pub(crate) fn full(&self) -> Option<usize> {
        self.table.is_full().then(|| self.len())
    }

    /// The buffer holding batch `seq`, if it was mirrored and not yet released.
    pub(crate) fn find(&self, seq: u64) -> Option<usize> {
        self.table.find(seq)
    }

    /// The device address of buffer `j`.
    pub(crate) fn ptr(&self, j: usize) -> CUdeviceptr {
        self.buffers[j].ptr()
    }

    /// The event recorded after the copy into buffer `j`.
    pub(crate) fn copied(&self, j: usize) -> &Event {
        &self.copied[j]
    }

    /// Gives back the buffer of batch `seq`, recording on `after` (the consumer's stream,
    /// into which the batch's users were joined) the point its next copy must wait for.
    /// Returns false when no buffer held the batch.
    pub(crate) fn give_back(&self, seq: u64, after: &Stream) -> Result<bool, CudaError> {
        let Some(j) = self.table.find(seq) else {
            return Ok(false);
        };
        // Recorded before the buffer is free: the next `copy_in` that takes it sees it. If
        // the record fails, the next copy could not wait for the users: wait for them here.
        let r = self.freed[j].record(after).or_else(|e| {
            after.synchronize()?;
            Err(e)
        });
        self.used[j].store(true, Ordering::Release);
        self.table.give_back(seq);
        r.map(|()| true)
    }

    /// For batch `seq` in the producer's slot `slot` at `src` (`len` bytes): takes a free
    /// buffer and enqueues on the slot's copy stream, after `wait_ready` (which makes a stream
    /// wait for the batch's `ready`) and the buffer's last copy and release, the copy, the
    /// `copied` event and then `finished` (`write_finished`). On failure the buffer is free
    /// again, with `copied` recorded after any copy into it that was enqueued.
    pub(crate) fn copy_in(
        &self,
        slot: u32,
        seq: u64,
        src: CUdeviceptr,
        len: u64,
        wait_ready: impl FnOnce(&Stream) -> Result<(), CudaError>,
        write_finished: impl FnOnce(&Stream) -> Result<(), CudaError>,
    ) -> Result<usize, BackendError> {
        let hint = self.next.load(Ordering::Relaxed);
        let j = self.table.take(seq, hint).ok_or_else(|| {
            format!(
                "every one of the consumer's {} mirror buffers holds a batch",
                self.len()
            )
        })?;
        self.next.store((j + 1) % self.len(), Ordering::Relaxed);
        let (si, s) = (self.stream_index(slot), self.stream(slot));
        let mut copy_enqueued = false;
        let r = (|| {
            wait_ready(s)?;
            // The buffer's last users and its last copy are usually long done: wait only for
            // what is not. The last copy needs its own wait where it was enqueued on another
            // copy stream (on this one, stream order puts it first): `freed[j]` follows it only
            // where the stream that released the batch waited for `copied[j]`, and one that
            // never used the batch did not.
            if self.used[j].load(Ordering::Acquire) && !self.freed[j].query()? {
                s.wait_event(&self.freed[j])?;
            }
            let last = self.last_stream[j].load(Ordering::Acquire);
            if last != NO_STREAM && last != si && !self.copied[j].query()? {
                s.wait_event(&self.copied[j])?;
            }
            if len > 0 {
                let bytes = usize::try_from(len).map_err(|_| {
                    CudaError::InvalidArgument("batch length overflows usize".into())
                })?;
                // Why the copy is sound: `src` is the published batch, `len <= slot_bytes` (the
                // ring checked it), readable from this device (the import set access). The
                // producer does not write it before our `finished`, written after this copy on
                // the same stream; for a shared-mode claim the producer will not wait for, the
                // ring completes this copy (`complete_now`) before it releases the slot.
                // Buffer j was free, and this stream waits for its last batch's users
                // (`freed[j]`, or a synchronize if that record failed) and its last copy
                // (`copied[j]`, recorded after every copy enqueued, also a failed batch's).
                // SAFETY: both ranges are valid and unshared for the copy, as argued above.
                unsafe { driver::memcpy_async(self.buffers[j].ptr(), src, bytes, s) }?;
                copy_enqueued = true;
                self.last_stream[j].store(si, Ordering::Release);
            }
            self.copied[j].record(s)?;
            copy_enqueued = false; // `copied[j]` covers it from here
            write_finished(s)
        })();
        if copy_enqueued {
            // The copy is queued but `copied[j]` was not recorded after it: try again, so the
            // next copy into this buffer (perhaps on the other stream) waits for this one.
            // Failing twice means a broken context, where nothing queued will run.
            if let Err(again) = self.copied[j].record(s) {
                tracing::warn!("mirror: recording a failed batch's copy: {again}");
            }
        }
        if let Err(e) = r {
            self.table.give_back(seq);
            return Err(crate::error::be(e));
        }
        Ok(j)
    }
}
