//! Ordering a ring's signals on the caller's CUDA streams.
//!
//! The core's [`Slot::publish_with`] signals `ready` on the producer's own stream and
//! [`Batch::release`] writes `finished` on the consumer's; either is right only for work that
//! ran on that stream. A caller whose writes (or reads) run on streams of its own (a torch or
//! CuPy stream, several of them) orders the ring's signals after that work with these
//! extension traits instead:
//!
//! - [`OrderWrites`] on a producer's [`Slot`] (and on the [`Producer`], for a binding that
//!   keeps only a loan): `order_writes_on` makes a caller's stream wait for the slot's
//!   previous consumers (the waits the acquire enqueued).
//! - [`PublishAfter`] on a producer's [`Slot`]: `publish_after` publishes with `ready`
//!   ordered after the work on the given streams.
//! - [`ReleaseAfter`] on a consumer's [`Batch`]: `order_reads_on` makes a caller's stream wait
//!   for the batch's `ready`; `release_after` (and `drop_after`) release with `finished`
//!   ordered after the work on the given streams.
//!
//! With one stream (the usual case) the signal is written on that stream itself, so no stream
//! waits on another of the same process per batch, which matters when the GPU time-slices
//! between processes (no MPS); with several, the ring's own stream waits for each of them and
//! the signal follows there. The backend remembers a signal written on a caller's stream
//! ("presignalled"), so that the publish or the release that follows adds none of its own; a
//! publish that fails forgets it again. Which of the two ways a signal takes, and the
//! forgetting, are decided here and nowhere else; the Python package only translates.

use pipeline_core::{Batch, ConsumerBackend, Error, Producer, Slot, TensorInfo, USER_HEADER_WORDS};

use crate::backend::{CudaConsumer, CudaProducer};
use crate::driver::{CUstream, CudaError};

fn backend_error(e: CudaError) -> Error {
    Error::Backend(Box::new(e))
}

/// A producer's ordering on the caller's streams (CUDA).
pub trait OrderWrites {
    /// Makes a caller's `stream` wait for everything enqueued on the producer's stream so far:
    /// after an acquire, the waits for the slot's previous consumers, so writes on `stream`
    /// come after their reads. gpipe's own waits stay on its stream, where the lag watch
    /// counts them; the caller's stream waits one event.
    ///
    /// # Safety
    /// `stream` is a live stream handle of the producer's context, or `CU_STREAM_LEGACY` (1)
    /// / `CU_STREAM_PER_THREAD` (2).
    unsafe fn order_writes_on(&self, stream: CUstream) -> Result<(), Error>;
}

/// Publishing a producer's slot after the work on the caller's streams (CUDA).
pub trait PublishAfter {
    /// Publishes the batch as [`Slot::publish_with`] does, with `ready` ordered after the
    /// work enqueued so far on every one of `streams` (none: after the producer's stream
    /// alone, as `publish_with`). Returns the batch's sequence number.
    ///
    /// A batch longer than the slot is refused before anything is signalled; if the publish
    /// fails after the signal, the signal written on a caller's stream is forgotten and the
    /// slot's next publish signals again.
    ///
    /// # Safety
    /// Each of `streams` is as for [`OrderWrites::order_writes_on`], and holds or waits for
    /// every write of the batch that is not on the producer's stream.
    unsafe fn publish_after(
        self,
        streams: &[CUstream],
        len: u64,
        header: &[u64; USER_HEADER_WORDS],
        tensors: &[TensorInfo],
    ) -> Result<u64, Error>;
}

impl OrderWrites for Slot<'_, CudaProducer> {
    unsafe fn order_writes_on(&self, stream: CUstream) -> Result<(), Error> {
        // SAFETY: the caller guarantees `stream`.
        unsafe { self.backend().order_after(stream) }.map_err(backend_error)
    }
}

/// For a binding that keeps only a [`pipeline_core::SlotLoan`] between calls: the producer's
/// stream holds the waits of the last acquire until the next publish.
impl OrderWrites for Producer<CudaProducer> {
    unsafe fn order_writes_on(&self, stream: CUstream) -> Result<(), Error> {
        // SAFETY: the caller guarantees `stream`.
        unsafe { self.backend().order_after(stream) }.map_err(backend_error)
    }
}

impl PublishAfter for Slot<'_, CudaProducer> {
    unsafe fn publish_after(
        self,
        streams: &[CUstream],
        len: u64,
        header: &[u64; USER_HEADER_WORDS],
        tensors: &[TensorInfo],
    ) -> Result<u64, Error> {
        // The one check of the publish that a caller's argument can fail, made before a
        // signal is written on a caller's stream (the publish makes it again).
        if len > self.capacity() {
            return Err(Error::InvalidArgument(format!(
                "batch of {len} bytes exceeds the slot capacity {}",
                self.capacity()
            )));
        }
        let (index, seq) = (self.index(), self.seq());
        let backend = self.backend();
        match streams {
            [] => {}
            // SAFETY: the caller guarantees the stream and that it holds the batch's writes.
            [s] => unsafe { backend.signal_ready_on(*s, index, seq) }.map_err(backend_error)?,
            many => {
                for &s in many {
                    // SAFETY: as above.
                    unsafe { backend.join(s) }.map_err(backend_error)?;
                }
            }
        }
        // The publish consumes the slot, and with it the borrow of the producer: keep the
        // address of the backend for forgetting the signal.
        let backend = std::ptr::NonNull::from(backend);
        let published = self.publish_with(len, header, tensors);
        if published.is_err() {
            // The backend lives in the producer's shared state (an `Arc`) for at least the
            // slot's lifetime `'_`, longer than this call, and is only ever borrowed shared.
            // SAFETY: so this shared borrow is valid; `forget_presignal` takes `&self`.
            unsafe { backend.as_ref() }.forget_presignal(index);
        }
        published
    }
}

/// A consumer's ordering on the caller's streams (CUDA).
pub trait ReleaseAfter {
    /// Makes a caller's `stream` wait until the batch is ready (the producer's writes are
    /// done), as the receive does for the consumer's own stream. Valid while the batch is
    /// held.
    ///
    /// # Safety
    /// `stream` is a live stream handle of the consumer's context, or `CU_STREAM_LEGACY` (1)
    /// / `CU_STREAM_PER_THREAD` (2).
    unsafe fn order_reads_on(&self, stream: CUstream) -> Result<(), Error>;

    /// Releases the batch as [`Batch::release`] does, with `finished` ordered after the work
    /// enqueued so far on every one of `streams` (none: after the consumer's stream alone).
    /// The batch is released even when the ordering fails; the work is then waited for on
    /// the host first, so the producer never overwrites the slot under it. Returns the first
    /// error, of the ordering or of the release.
    ///
    /// # Safety
    /// Each of `streams` is as for [`ReleaseAfter::order_reads_on`], and holds or waits for
    /// every use of the batch that is not on the consumer's stream.
    unsafe fn release_after(self, streams: &[CUstream]) -> Result<(), Error>;

    /// As [`ReleaseAfter::release_after`], but the release is a drop's: its error is kept
    /// for the consumer's next receive, as a dropped [`Batch`]'s is. Returns the ordering's
    /// error alone.
    ///
    /// # Safety
    /// As for [`ReleaseAfter::release_after`].
    unsafe fn drop_after(self, streams: &[CUstream]) -> Result<(), Error>;
}

/// Orders the batch's `finished` after the work on `streams`. On failure the work is waited
/// for on the host: the release then writes `finished` on the consumer's stream, which does
/// not wait for the caller's.
///
/// # Safety
/// As for [`ReleaseAfter::release_after`].
unsafe fn order_release(b: &Batch<CudaConsumer>, streams: &[CUstream]) -> Result<(), Error> {
    let backend = b.backend();
    let ordered = match streams {
        [] => Ok(()),
        // SAFETY: the caller guarantees the stream and that it holds the batch's uses.
        [s] => unsafe { backend.signal_finished_on(*s, b.slot(), b.seq()) },
        many => {
            let mut failed = None;
            for &s in many {
                // SAFETY: as above.
                if let Err(e) = unsafe { backend.join(s) } {
                    failed.get_or_insert(e);
                }
            }
            failed.map_or(Ok(()), Err)
        }
    };
    ordered.map_err(|e| {
        // A stream not ordered before the release: let all the work complete first.
        let _ = backend.complete_now();
        backend_error(e)
    })
}

impl ReleaseAfter for Batch<CudaConsumer> {
    unsafe fn order_reads_on(&self, stream: CUstream) -> Result<(), Error> {
        // SAFETY: the caller guarantees `stream`; the batch is held.
        unsafe {
            self.backend()
                .wait_ready_on(stream, self.slot(), self.seq())
        }
        .map_err(backend_error)
    }

    unsafe fn release_after(self, streams: &[CUstream]) -> Result<(), Error> {
        // SAFETY: the caller's guarantees.
        let ordered = unsafe { order_release(&self, streams) };
        let released = self.release();
        ordered.and(released)
    }

    unsafe fn drop_after(self, streams: &[CUstream]) -> Result<(), Error> {
        // SAFETY: the caller's guarantees.
        let ordered = unsafe { order_release(&self, streams) };
        drop(self);
        ordered
    }
}
