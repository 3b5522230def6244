//! The CUDA forwarding loop of [`crate::run_forwarder`].
//!
//! Every copy runs on the downstream producer's stream, in a slot taken ahead
//! (`Producer::acquire_ahead`), up to `depth` copies in flight. A batch is published once
//! (a) the upstream published it whole and (b) its copy into our slot completed (the host
//! sees the copy's event), so the ring holds whole batches only. Its `ready` is then written
//! on a stream of ours that nothing else waits on, not on the copy stream, where it would
//! wait behind the copies queued after it (issue #34: that put up to two copies of latency on
//! every hop, and with it the ring's slots ran short at large batches).
//!
//! Chunked ([`crate::chunks`], `ForwardOptions::chunk_bytes`): each copy writes our board's
//! progress after each chunk; where the upstream ring has a board, a batch whose upstream copy
//! has begun is copied before it is published upstream, chunk by chunk, each chunk's copy
//! waiting on the GPU for the upstream progress of that chunk. The upstream `finished` of such
//! a batch is written once it is received, after its copy, on a stream of its own.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{Consumer, PendingAttach, Producer, ProducerConfig, SlotLoan};
use pipeline_cuda::backend::{CudaConsumer, CudaOptions, CudaProducer};
use pipeline_cuda::driver::{self, CUdeviceptr, Event, HostRegistration, Stream, WaitCondition};
use pipeline_cuda::ordering::PublishAfter;
use pipeline_cuda::sync::SyncMode;

use super::options::ForwardOptions;
use super::steps::{Boards, abandon, check_expected, err, finish, wait_downstream};
use crate::chunks::{Board, chunks, progress};
use crate::relay::{RelayError, RelayReport};

/// Copies in flight at once by default.
pub(crate) const DEPTH: usize = 3;

/// A board registered with the driver: its device address, for stream memory operations.
struct Mapped<'a> {
    board: &'a Board,
    base: CUdeviceptr,
    _reg: HostRegistration,
}

impl Mapped<'_> {
    fn word(&self, slot: u32) -> CUdeviceptr {
        self.base + self.board.offset(slot)
    }
}

fn map<'a>(
    board: &'a Board,
    ctx: &std::sync::Arc<driver::Context>,
) -> Result<Mapped<'a>, RelayError> {
    let (ptr, len) = board.raw();
    // SAFETY: the board's mapping (page-aligned, a whole number of pages) outlives the
    // registration: both live in this function's caller, the registration dropped first.
    let reg = unsafe { HostRegistration::new(ctx, ptr, len) }
        .map_err(|e| RelayError(format!("registering the chunk progress board: {e}")))?;
    Ok(Mapped {
        board,
        base: reg.device_ptr(),
        _reg: reg,
    })
}

/// Forwards the CUDA ring `pending` is attached to into a ring at `downstream`.
pub(crate) fn forward(
    pending: PendingAttach,
    downstream: &Path,
    config: ProducerConfig,
    opts: &ForwardOptions,
    boards: &Boards,
    stop: &AtomicBool,
    report: &mut RelayReport,
) -> Result<(), RelayError> {
    let mut consumer: Consumer<CudaConsumer> = pending
        .finish(CudaOptions {
            device: opts.device,
            delivery: pipeline_core::Delivery::InPlace,
            ..CudaOptions::default()
        })
        .map_err(err)?;
    let here = consumer.backend().device_ordinal();
    let mut producer: Producer<CudaProducer> = Producer::bind(
        downstream,
        config,
        CudaOptions {
            device: Some(here),
            sync: opts.sync.unwrap_or(SyncMode::Semaphore),
            memory: opts.memory.unwrap_or_default(),
            ..CudaOptions::default()
        },
    )
    .map_err(err)?;
    if let Err(e) = wait_downstream(&producer, opts, stop) {
        return Err(abandon(producer, e));
    }
    let layout = producer.layout();
    let depth = (opts.depth.unwrap_or(DEPTH).max(1) as u32)
        .min(layout.slot_count)
        .min(producer.max_lead().unwrap_or(u32::MAX)) as usize;
    let ctx = producer.backend().context().clone();
    let setup = (|| -> Result<_, RelayError> {
        let joined = Event::new_plain(&ctx).map_err(err)?;
        let copied = (0..depth)
            .map(|_| Event::new_plain(&ctx))
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        let publish = Stream::new(&ctx).map_err(err)?;
        let release = Stream::new(&ctx).map_err(err)?;
        let out = boards.out.as_ref().map(|b| map(b, &ctx)).transpose()?;
        let up = boards.up.as_ref().map(|b| map(b, &ctx)).transpose()?;
        Ok((joined, copied, publish, release, out, up))
    })();
    let (joined, copied, publish, release, out_board, up_board) = match setup {
        Ok(s) => s,
        Err(e) => return Err(abandon(producer, e)),
    };
    let mut run = Run {
        consumer: &mut consumer,
        producer: &mut producer,
        inflight: VecDeque::new(),
        copied: &copied,
        next_event: std::cell::Cell::new(0),
        depth,
        publish: &publish,
        release: &release,
        joined: &joined,
        out_board: out_board.as_ref(),
        up_board: up_board.as_ref(),
        next_up: None,
        report,
        started: None,
    };
    let outcome = run.run(stop);
    if let Some(t) = run.started {
        run.report.elapsed_s = t.elapsed().as_secs_f64();
    }
    let unconfirmed = run.inflight.iter().any(|f| f.confirmed.is_none());
    drop(run);
    if outcome.is_err() && unconfirmed && consumer.check_producer().is_err() {
        // Our stream may wait for chunks a dead writer never writes: free it, so that it
        // drains (before anything synchronises it). What those copies wrote is never
        // published.
        if let Some(b) = &boards.up {
            b.release_all();
        }
    }
    match outcome {
        Ok(()) => {
            // Copies begun from the upstream board for batches that never came (the ring
            // closed, or we were stopped) end in finite time: their upstream copies had begun.
            producer.cancel_ahead();
            finish(producer, stop, report);
            Ok(())
        }
        Err(e) => {
            let e = abandon(producer, e);
            // The abandoned ring's stream is left to the process's exit (it may still run
            // copies that write our board): so are the boards' registrations.
            std::mem::forget(out_board);
            std::mem::forget(up_board);
            Err(e)
        }
    }
}

/// A batch being copied into a slot taken ahead, published once the copy is complete and the
/// upstream batch received.
struct InFlight {
    loan: SlotLoan,
    event: usize,
    /// The upstream batch it copies.
    up_seq: u64,
    /// Once the upstream batch was received: what to publish with it.
    confirmed: Option<Confirmed>,
}

struct Confirmed {
    len: u64,
    header: [u64; pipeline_core::USER_HEADER_WORDS],
    tensors: Vec<pipeline_core::TensorInfo>,
}

/// What `Run::settle` waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// Nothing: publish the oldest copies that are already complete.
    Whole,
    /// The oldest copy, then the ones after it that are already complete.
    Oldest,
    /// Every received copy in flight.
    All,
}

struct Run<'a> {
    consumer: &'a mut Consumer<CudaConsumer>,
    producer: &'a mut Producer<CudaProducer>,
    inflight: VecDeque<InFlight>,
    copied: &'a [Event],
    next_event: std::cell::Cell<usize>,
    depth: usize,
    /// Where `ready` is written for a batch whose copy completed.
    publish: &'a Stream,
    /// Where the upstream `finished` of a batch copied ahead is written, after its copy.
    release: &'a Stream,
    joined: &'a Event,
    out_board: Option<&'a Mapped<'a>>,
    up_board: Option<&'a Mapped<'a>>,
    /// The upstream batch to take next (copied ahead or received), once one came.
    next_up: Option<u64>,
    report: &'a mut RelayReport,
    started: Option<Instant>,
}

impl Run<'_> {
    fn run(&mut self, stop: &AtomicBool) -> Result<(), RelayError> {
        let tick = Duration::from_millis(100);
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            // Publish, without waiting, what is whole already.
            self.settle(Settle::Whole, stop)?;
            self.copy_ahead()?;
            let pending_ahead = self.inflight.iter().any(|f| f.confirmed.is_none());
            let wait = if pending_ahead || (self.up_board.is_some() && self.next_up.is_some()) {
                Duration::from_micros(20)
            } else if self.inflight.is_empty() {
                tick
            } else {
                Duration::ZERO
            };
            let batch = match self.consumer.recv_timeout(wait) {
                Ok(Some(b)) => b,
                Ok(None) => {
                    // The upstream ring closed: publish what is in flight, then end.
                    self.settle(Settle::All, stop)?;
                    return Ok(());
                }
                Err(pipeline_core::Error::Timeout(_)) => {
                    // Nothing new: the oldest copy is what there is to wait for, if its
                    // upstream batch came.
                    if !pending_ahead
                        && !self.inflight.is_empty()
                        && !self.settle(Settle::Oldest, stop)?
                    {
                        return Ok(());
                    }
                    continue;
                }
                Err(e) => return Err(err(e)),
            };
            self.started.get_or_insert_with(Instant::now);
            if let Some(f) = self.inflight.iter_mut().find(|f| f.confirmed.is_none()) {
                // Copied ahead: this must be the batch copied.
                check_expected(batch.seq(), f.up_seq)?;
                f.confirmed = Some(Confirmed {
                    len: batch.len(),
                    header: *batch.header(),
                    tensors: batch.tensors().to_vec(),
                });
                self.release
                    .wait_event(&self.copied[f.event])
                    .map_err(err)?;
                // SAFETY: our release stream is a live stream of the consumer's (primary)
                // context; it waits for the copy, the batch's only use.
                unsafe {
                    batch.backend().signal_finished_on(
                        self.release.raw(),
                        batch.slot(),
                        batch.seq(),
                    )
                }
                .map_err(err)?;
                drop(batch);
                continue;
            }
            self.next_up = Some(batch.seq() + 1);
            if self.inflight.len() == self.depth && !self.settle(Settle::Oldest, stop)? {
                return Ok(());
            }
            let Some(loan) = self.take_slot(stop)? else {
                return Ok(());
            };
            let dst = self.producer.loan_memory(&loan).map_err(err)?.ptr;
            // The loan's stream is the producer's.
            let stream = self.producer.backend().stream();
            let view = batch.data();
            // The slot's stream waits for the upstream batch's `ready` (which the consumer's
            // stream waits for), then copies it.
            self.joined.record(view.stream).map_err(err)?;
            stream.wait_event(self.joined).map_err(err)?;
            // The upstream batch is published and held until after the `finished` written
            // below on this stream, after the copy; the slot is ours (taken ahead, unpublished).
            // SAFETY: so both ranges are live and unshared; both are `view.len <= slot_bytes`.
            unsafe {
                self.enqueue_copy(
                    stream,
                    dst,
                    view.ptr,
                    view.len,
                    loan.seq(),
                    loan.index(),
                    None,
                )
            }?;
            // SAFETY: the slot's stream is a live stream of the same (primary) context as the
            // consumer's; it holds every use of the upstream batch (the copy).
            unsafe {
                batch
                    .backend()
                    .signal_finished_on(stream.raw(), batch.slot(), batch.seq())
            }
            .map_err(err)?;
            let event = self.record(stream)?;
            self.inflight.push_back(InFlight {
                loan,
                event,
                up_seq: batch.seq(),
                confirmed: Some(Confirmed {
                    len: batch.len(),
                    header: *batch.header(),
                    tensors: batch.tensors().to_vec(),
                }),
            });
            drop(batch);
        }
    }

    /// Chunked, with an upstream board: copies the next upstream batch ahead if its copy
    /// began upstream and a copy can be in flight.
    fn copy_ahead(&mut self) -> Result<(), RelayError> {
        let (Some(up), Some(x)) = (self.up_board, self.next_up) else {
            return Ok(());
        };
        if self.inflight.len() >= self.depth {
            return Ok(());
        }
        let up_slots = self.consumer.layout().slot_count;
        let k = (x % u64::from(up_slots)) as u32;
        if up.board.load(k) < progress(x, 0) {
            return Ok(());
        }
        let loan = match self.producer.acquire_ahead(Duration::ZERO) {
            Ok(l) => l,
            Err(pipeline_core::Error::Timeout(_)) => return Ok(()),
            Err(e) => return Err(err(e)),
        };
        let dst = self.producer.loan_memory(&loan).map_err(err)?.ptr;
        // The loan's stream is the producer's.
        let stream = self.producer.backend().stream();
        let src = self.consumer.backend().slot_ptr(k);
        let len = self.consumer.layout().slot_bytes;
        // Upstream slot `k` stays mapped while our consumer lives; each chunk is read only
        // after its progress says it landed, and the slot is rewritten only after our
        // `finished` for x. Our slot is ours (taken ahead); both are slot_bytes long.
        // SAFETY: so every copied range is live, complete and not written meanwhile.
        unsafe {
            self.enqueue_copy(
                stream,
                dst,
                src,
                len,
                loan.seq(),
                loan.index(),
                Some((up, k, x)),
            )
        }?;
        let event = self.record(stream)?;
        self.inflight.push_back(InFlight {
            loan,
            event,
            up_seq: x,
            confirmed: None,
        });
        self.next_up = Some(x + 1);
        self.report.copied_ahead += 1;
        Ok(())
    }

    /// Enqueues the copy of `len` bytes into our slot on `stream`: whole, or chunk by chunk
    /// with our board's progress after each chunk (and its start before the first), each
    /// chunk waiting for the upstream board's progress of batch `up.2` in slot `up.1` first.
    ///
    /// # Safety
    /// `src` and `dst` are valid for `len` bytes as [`driver::memcpy_async`] requires, once
    /// the waits enqueued here pass.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_copy(
        &self,
        stream: &Stream,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        len: u64,
        seq_out: u64,
        slot_out: u32,
        up: Option<(&Mapped<'_>, u32, u64)>,
    ) -> Result<(), RelayError> {
        let Some(out) = self.out_board else {
            if len > 0 {
                // SAFETY: the caller guarantees both ranges.
                unsafe { driver::memcpy_async(dst, src, len as usize, stream) }.map_err(err)?;
            }
            return Ok(());
        };
        let chunk = match up {
            Some((u, _, _)) => u.board.chunk_bytes(),
            None => out.board.chunk_bytes(),
        };
        let word = out.word(slot_out);
        // Each memory operation below: the board words are registered host memory, 8-byte
        // aligned, whose registration `forward` drops only after the producer (whose teardown
        // drains this stream) is gone, or never (an abandoned ring).
        // SAFETY: the word as just said; the stream is live.
        unsafe { driver::stream_write_value64(stream, word, progress(seq_out, 0)) }.map_err(err)?;
        for (c, (off, n)) in chunks(len, chunk).enumerate() {
            if let Some((u, k, x)) = up {
                // SAFETY: the upstream board's word, registered as ours is (see above).
                unsafe {
                    driver::stream_wait_value64(
                        stream,
                        u.word(k),
                        progress(x, c as u32 + 1),
                        WaitCondition::Geq,
                    )
                }
                .map_err(err)?;
            }
            // SAFETY: the caller guarantees both ranges; this chunk is inside them.
            unsafe { driver::memcpy_async(dst + off, src + off, n as usize, stream) }
                .map_err(err)?;
            // SAFETY: our board's word (see above).
            unsafe { driver::stream_write_value64(stream, word, progress(seq_out, c as u32 + 1)) }
                .map_err(err)?;
        }
        // A short batch: every chunk of the slot counts as landed.
        // SAFETY: our board's word (see above).
        unsafe {
            driver::stream_write_value64(stream, word, progress(seq_out, out.board.chunk_count()))
        }
        .map_err(err)?;
        Ok(())
    }

    /// Records the next copy event on `stream`; returns its index.
    fn record(&self, stream: &Stream) -> Result<usize, RelayError> {
        let e = self.next_event.get();
        self.copied[e].record(stream).map_err(err)?;
        self.next_event.set((e + 1) % self.depth);
        Ok(e)
    }

    /// Takes the next downstream slot ahead, publishing what is whole while it waits; watches
    /// the upstream producer meanwhile. None: stopped.
    fn take_slot(&mut self, stop: &AtomicBool) -> Result<Option<SlotLoan>, RelayError> {
        let tick = Duration::from_millis(100);
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            // While we wait for room downstream, the upstream producer may die: then our
            // consumers' GPU work waits on batches that never come, and so would we.
            self.consumer.check_producer().map_err(err)?;
            // Publish what is whole while we wait: a consumer may hold its batches until it
            // gets the next one, which would otherwise wait here for a slot that consumer
            // holds.
            self.settle(Settle::Whole, stop)?;
            // With copies in flight, come back soon to publish those that complete.
            let wait = if self.inflight.is_empty() {
                tick
            } else {
                Duration::from_micros(100)
            };
            match self.producer.acquire_ahead(wait) {
                Ok(l) => return Ok(Some(l)),
                Err(pipeline_core::Error::Timeout(_)) => continue,
                Err(e) => return Err(err(e)),
            }
        }
    }

    /// Publishes received copies in flight, oldest first, as `how` says; stops at the first
    /// copy whose upstream batch has not come. `Ok(false)`: stopped while waiting.
    fn settle(&mut self, how: Settle, stop: &AtomicBool) -> Result<bool, RelayError> {
        let mut waited = false;
        while let Some(f) = self.inflight.front() {
            if f.confirmed.is_none() {
                break;
            }
            let wait = how == Settle::All || (how == Settle::Oldest && !waited);
            if wait {
                if !wait_whole(&self.copied[f.event], self.consumer, stop)? {
                    return Ok(false);
                }
            } else if !self.copied[f.event].query().map_err(err)? {
                break;
            }
            waited = true;
            self.publish_front()?;
        }
        Ok(true)
    }

    /// Publishes the oldest batch in flight (its copy is complete, its upstream batch was
    /// received). The upstream producer is checked first: if it died, a consumer of its ring
    /// may have released the waits on its `ready` (they are shared), and a copy that
    /// completed may hold a half-written batch.
    fn publish_front(&mut self) -> Result<(), RelayError> {
        self.consumer.check_producer().map_err(err)?;
        let Some(f) = self.inflight.pop_front() else {
            return Ok(());
        };
        let Some(c) = f.confirmed else {
            return Ok(());
        };
        // `ready` on our publish stream, which waits for the (complete) copy and nothing
        // else, rather than on the copy stream behind the copies queued after this one.
        self.publish
            .wait_event(&self.copied[f.event])
            .map_err(err)?;
        let slot = self.producer.resume(f.loan).map_err(err)?;
        // SAFETY: the publish stream is a live stream of the producer's context, and waits for
        // the batch's one write (the copy, complete).
        unsafe { slot.publish_after(&[self.publish.raw()], c.len, &c.header, &c.tensors) }
            .map_err(err)?;
        self.report.batches += 1;
        self.report.bytes += c.len;
        Ok(())
    }
}

/// Waits until `copied` completed (`Ok(true)`), `stop` is set (`Ok(false)`), or the upstream
/// producer died (an error; the consumer then releases what waits on its signals). Spins for
/// a short while first: a copy of a few MiB takes microseconds. Copies in flight behind it
/// keep the copy engine busy meanwhile.
fn wait_whole(
    copied: &Event,
    consumer: &Consumer<CudaConsumer>,
    stop: &AtomicBool,
) -> Result<bool, RelayError> {
    let t0 = Instant::now();
    let mut checked = t0;
    loop {
        if copied.query().map_err(err)? {
            return Ok(true);
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let now = Instant::now();
        if now.duration_since(checked) >= Duration::from_millis(1) {
            consumer.check_producer().map_err(err)?;
            checked = now;
        }
        if now.duration_since(t0) < Duration::from_micros(200) {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}
