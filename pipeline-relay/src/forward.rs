//! Re-publishing on one host (issue #20's building block): a process that is a consumer of
//! one ring and the producer of another, copying each batch from the first into the second.
//! On a GPU node this forwards batches from the producer's GPU to another, where consumers
//! read them from their own GPU's memory, and lets a chain (GPU 0 → GPU 1 → GPU 2 ...) carry
//! them further without every consumer pulling from GPU 0's link.
//!
//! Per batch: the next slot of the downstream ring is acquired (so its consumers' back-pressure
//! holds the upstream batch, and through it the upstream producer), the batch is copied into it
//! (CUDA: on the downstream slot's stream, after the upstream `ready`; the upstream `finished` is
//! written on that stream after the copy), and, once the copy is complete, it is published with
//! the upstream header and tensor table; up to three copies are in flight at once, in slots
//! taken ahead (`Producer::acquire_ahead`). A forwarded ring only ever holds whole batches: if the
//! upstream producer dies with batches whose `ready` never came, they are not passed on. If the forwarder dies, its downstream consumers get `ProducerDied` and the
//! upstream ring goes on without it (a departed consumer).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{
    BackendKind, Consumer, ConsumerConfig, HostConsumer, HostOptions, HostProducer, PendingAttach,
    Producer, ProducerConfig, SlotLoan,
};
use pipeline_cuda::backend::{CudaConsumer, CudaOptions, CudaProducer};
use pipeline_cuda::driver::{self, Event};
use pipeline_cuda::sync::SyncMode;

use crate::relay::{RelayError, RelayReport, acquire_loan};

fn err(e: impl std::fmt::Display) -> RelayError {
    RelayError(e.to_string())
}

/// How a forwarder runs, beyond its downstream ring's [`ProducerConfig`].
#[derive(Clone, Debug, Default)]
pub struct ForwardOptions {
    /// CUDA device of the downstream ring (default: the upstream producer's).
    pub device: Option<usize>,
    /// Take no batch from upstream until this many consumers attached downstream, so that
    /// in broadcast none of them misses the first batches (upstream waits meanwhile: the
    /// forwarder is attached there and holds its producer back).
    pub wait_for_consumers: u32,
    /// How long to wait for them (default 60 s).
    pub wait_timeout: Option<Duration>,
    /// CUDA: how the downstream ring signals `ready` (default: timeline words,
    /// [`SyncMode::Semaphore`], which the downstream consumers release themselves if this
    /// forwarder dies with copies in flight; with IPC events, their streams could wait forever).
    pub sync: Option<SyncMode>,
}

/// Consumes the ring at `upstream` and re-publishes every batch in a ring of its own at
/// `downstream` (same slot size and mode; `config` gives the rest, e.g. its slots and lag
/// policy). Returns when the upstream ring closes (closing the downstream one, after its
/// consumers are done with the last batch), `stop` is set, or on an error.
pub fn run_forwarder(
    upstream: &Path,
    downstream: &Path,
    config: ProducerConfig,
    opts: &ForwardOptions,
    stop: &AtomicBool,
) -> Result<RelayReport, RelayError> {
    let device = opts.device;
    let pending = PendingAttach::connect(upstream, ConsumerConfig::default()).map_err(err)?;
    let layout = pending.layout();
    let config = ProducerConfig {
        batch_bytes: layout.slot_bytes,
        mode: layout.mode,
        ..config
    };
    let mut report = RelayReport {
        backend: pending.backend().to_string(),
        sessions: 1,
        ..RelayReport::default()
    };
    let tick = Duration::from_millis(100);
    let mut started: Option<Instant> = None;
    match pending.backend() {
        BackendKind::Host => {
            let mut consumer: Consumer<HostConsumer> =
                pending.finish(HostOptions::default()).map_err(err)?;
            let mut producer: Producer<HostProducer> =
                Producer::bind(downstream, config, HostOptions::default()).map_err(err)?;
            if let Err(e) = wait_downstream(&producer, opts, stop) {
                return Err(abandon(producer, e));
            }
            while !stop.load(Ordering::Relaxed) {
                let batch = match consumer.recv_timeout(tick) {
                    Ok(Some(b)) => b,
                    Ok(None) => break,
                    Err(pipeline_core::Error::Timeout(_)) => continue,
                    Err(e) => return Err(abandon(producer, err(e))),
                };
                started.get_or_insert_with(Instant::now);
                // While we wait for room downstream, the upstream producer may die: then
                // our consumers' GPU work waits on batches that never come, and so would we.
                let loan = match acquire_loan(&mut producer, stop, tick, || {
                    consumer.check_producer().map_err(err)
                }) {
                    Ok(Some(l)) => l,
                    Ok(None) => break,
                    Err(e) => return Err(abandon(producer, e)),
                };
                let published = producer.resume(loan).and_then(|mut slot| {
                    let n = batch.len() as usize;
                    slot.memory()[..n].copy_from_slice(batch.data());
                    slot.publish_with(batch.len(), batch.header(), batch.tensors())
                });
                if let Err(e) = published {
                    return Err(abandon(producer, err(e)));
                }
                report.batches += 1;
                report.bytes += batch.len();
            }
            finish(producer, stop, &mut report);
        }
        BackendKind::Cuda => {
            let mut consumer: Consumer<CudaConsumer> = pending
                .finish(CudaOptions {
                    device,
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
                    ..CudaOptions::default()
                },
            )
            .map_err(err)?;
            if let Err(e) = wait_downstream(&producer, opts, stop) {
                return Err(abandon(producer, e));
            }
            // Copies in flight at once: each batch is published once its copy is complete
            // (whole batches only), while the next ones are already copying.
            let layout = producer.layout();
            let depth = (DEPTH as u32)
                .min(layout.slot_count)
                .min(producer.max_lead().unwrap_or(u32::MAX)) as usize;
            let ctx = producer.backend().context().clone();
            let events = Event::new_plain(&ctx).and_then(|j| {
                (0..depth)
                    .map(|_| Event::new_plain(&ctx))
                    .collect::<Result<Vec<_>, _>>()
                    .map(|c| (j, c))
            });
            let (joined, copied) = match events {
                Ok(e) => e,
                Err(e) => return Err(abandon(producer, err(e))),
            };
            let mut inflight: VecDeque<InFlight> = VecDeque::new();
            let mut next_event = 0usize;
            let outcome = (|| -> Result<(), RelayError> {
                let mut out = Out {
                    producer: &mut producer,
                    inflight: &mut inflight,
                    copied: &copied,
                    report: &mut report,
                };
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    // Publish, without waiting, what is whole already.
                    out.settle(&consumer, Settle::Whole, stop)?;
                    let wait = if out.inflight.is_empty() {
                        tick
                    } else {
                        Duration::ZERO
                    };
                    let batch = match consumer.recv_timeout(wait) {
                        Ok(Some(b)) => b,
                        Ok(None) => {
                            // The upstream ring closed: publish what is in flight, then end.
                            out.settle(&consumer, Settle::All, stop)?;
                            return Ok(());
                        }
                        Err(pipeline_core::Error::Timeout(_)) => {
                            // Nothing new: the oldest copy is what there is to wait for.
                            if !out.settle(&consumer, Settle::Oldest, stop)? {
                                return Ok(());
                            }
                            continue;
                        }
                        Err(e) => return Err(err(e)),
                    };
                    started.get_or_insert_with(Instant::now);
                    if out.inflight.len() == depth
                        && !out.settle(&consumer, Settle::Oldest, stop)?
                    {
                        return Ok(());
                    }
                    // While we wait for room downstream, the upstream producer may die: then
                    // our consumers' GPU work waits on batches that never come, and so would
                    // we.
                    let loan = loop {
                        if stop.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        consumer.check_producer().map_err(err)?;
                        // Publish what is whole while we wait: a consumer may hold its
                        // batches until it gets the next one, which would otherwise wait
                        // here for a slot that consumer holds.
                        out.settle(&consumer, Settle::Whole, stop)?;
                        let wait = if out.inflight.is_empty() {
                            tick
                        } else {
                            Duration::from_millis(1)
                        };
                        match out.producer.acquire_ahead(wait) {
                            Ok(l) => break l,
                            Err(pipeline_core::Error::Timeout(_)) => continue,
                            Err(e) => return Err(err(e)),
                        }
                    };
                    let mem = out.producer.loan_memory(&loan).map_err(err)?;
                    let view = batch.data();
                    // The slot's stream waits for the upstream batch's `ready` (which the
                    // consumer's stream waits for), then copies it.
                    joined.record(view.stream).map_err(err)?;
                    mem.stream.wait_event(&joined).map_err(err)?;
                    if view.len > 0 {
                        // The upstream batch is published and held until after the
                        // `finished` written below on this stream, after the copy; the slot
                        // is ours (taken ahead, unpublished) and its stream waits for its
                        // previous consumers.
                        // SAFETY: both are `view.len <= slot_bytes` bytes (same slot size),
                        // unshared.
                        unsafe {
                            driver::memcpy_async(mem.ptr, view.ptr, view.len as usize, mem.stream)
                        }
                        .map_err(err)?;
                    }
                    // SAFETY: the slot's stream is a live stream of the same (primary)
                    // context as the consumer's; it holds every use of the upstream batch
                    // (the copy).
                    unsafe {
                        batch.backend().signal_finished_on(
                            mem.stream.raw(),
                            batch.slot(),
                            batch.seq(),
                        )
                    }
                    .map_err(err)?;
                    copied[next_event].record(mem.stream).map_err(err)?;
                    out.inflight.push_back(InFlight {
                        loan,
                        event: next_event,
                        len: batch.len(),
                        header: *batch.header(),
                        tensors: batch.tensors().to_vec(),
                    });
                    next_event = (next_event + 1) % depth;
                    drop(batch);
                }
            })();
            if let Err(e) = outcome {
                return Err(abandon(producer, e));
            }
            finish(producer, stop, &mut report);
        }
    }
    if let Some(t) = started {
        report.elapsed_s = t.elapsed().as_secs_f64();
    }
    Ok(report)
}

/// Copies in flight at once in a CUDA forwarder.
const DEPTH: usize = 3;

/// A batch being copied into a slot taken ahead, published once the copy is complete.
struct InFlight {
    loan: SlotLoan,
    event: usize,
    len: u64,
    header: [u64; pipeline_core::USER_HEADER_WORDS],
    tensors: Vec<pipeline_core::TensorInfo>,
}

/// Where a CUDA forwarder publishes its copies: the downstream producer, the copies in flight
/// and their events.
struct Out<'a> {
    producer: &'a mut Producer<CudaProducer>,
    inflight: &'a mut VecDeque<InFlight>,
    copied: &'a [Event],
    report: &'a mut RelayReport,
}

/// What [`Out::settle`] waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// Nothing: publish the oldest copies that are already complete.
    Whole,
    /// The oldest copy, then the ones after it that are already complete.
    Oldest,
    /// Every copy in flight.
    All,
}

impl Out<'_> {
    /// Publishes copies in flight, oldest first, as `how` says; `consumer` is the upstream
    /// one (checked before each publish). `Ok(false)`: stopped while waiting.
    fn settle(
        &mut self,
        consumer: &Consumer<CudaConsumer>,
        how: Settle,
        stop: &AtomicBool,
    ) -> Result<bool, RelayError> {
        let mut waited = false;
        while let Some(f) = self.inflight.front() {
            let wait = how == Settle::All || (how == Settle::Oldest && !waited);
            if wait {
                if !wait_whole(&self.copied[f.event], consumer, stop)? {
                    return Ok(false);
                }
            } else if !self.copied[f.event].query().map_err(err)? {
                break;
            }
            waited = true;
            self.publish_front(consumer)?;
        }
        Ok(true)
    }

    /// Publishes the oldest batch in flight (its copy is complete). The upstream producer is
    /// checked first: if it died, a consumer of its ring may have released the waits on its
    /// `ready` (they are shared), and a copy that completed may hold a half-written batch.
    fn publish_front(&mut self, consumer: &Consumer<CudaConsumer>) -> Result<(), RelayError> {
        consumer.check_producer().map_err(err)?;
        let Some(f) = self.inflight.pop_front() else {
            return Ok(());
        };
        self.producer
            .resume(f.loan)
            .map_err(err)?
            .publish_with(f.len, &f.header, &f.tensors)
            .map_err(err)?;
        self.report.batches += 1;
        self.report.bytes += f.len;
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

/// Waits for `opts.wait_for_consumers` downstream, or until `stop` (the forwarding loop then
/// sees it and ends).
fn wait_downstream<B: pipeline_core::ProducerBackend>(
    producer: &Producer<B>,
    opts: &ForwardOptions,
    stop: &AtomicBool,
) -> Result<(), RelayError> {
    if opts.wait_for_consumers == 0 {
        return Ok(());
    }
    producer
        .wait_for_consumers_or_stop(
            opts.wait_for_consumers,
            opts.wait_timeout.unwrap_or(Duration::from_secs(60)),
            &|| stop.load(Ordering::Relaxed),
        )
        .map(|_| ())
        .map_err(|e| {
            RelayError(format!(
                "waiting for {} consumer(s) downstream: {e}",
                opts.wait_for_consumers
            ))
        })
}

/// The upstream ring closed (or we were stopped): wait until the downstream consumers are
/// done with the last batch, note when that was (a wall-clock time, so that a fan-out's
/// runner can find when its last ring drained), and close.
fn finish<B: pipeline_core::ProducerBackend>(
    mut producer: Producer<B>,
    stop: &AtomicBool,
    report: &mut RelayReport,
) {
    if !stop.load(Ordering::Relaxed) {
        match producer.flush(Duration::from_secs(60)) {
            Ok(()) => {
                report.drained_at_unix_s = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_secs_f64());
            }
            Err(e) => report.error = Some(format!("draining the downstream ring: {e}")),
        }
    }
    producer.close();
}

/// The upstream ring failed (its producer died, we were detached): leave the downstream ring
/// as a crashed producer would ([`Producer::abandon`]), so that its consumers get
/// `ProducerDied` at once, not a clean end that would hide the batches that never came.
fn abandon<B: pipeline_core::ProducerBackend>(producer: Producer<B>, e: RelayError) -> RelayError {
    producer.abandon();
    RelayError(format!(
        "the upstream ring: {e}; the downstream ring is abandoned (its consumers see the \
         producer die)"
    ))
}
