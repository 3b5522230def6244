//! Re-publishing on one host (issue #20's building block): a process that is a consumer of
//! one ring and the producer of another, copying each batch from the first into the second.
//! On a GPU node this forwards batches from the producer's GPU to another, where consumers
//! read them from their own GPU's memory, and lets a chain (GPU 0 → GPU 1 → GPU 2 ...) carry
//! them further without every consumer pulling from GPU 0's link.
//!
//! Per batch: the next slot of the downstream ring is acquired (so its consumers' back-pressure
//! holds the upstream batch, and through it the upstream producer), the batch is copied into it
//! (CUDA: on the downstream slot's stream, after the upstream `ready`; the upstream `finished` is
//! written on that stream after the copy), and it is published with the upstream header and
//! tensor table. If the forwarder dies, its downstream consumers get `ProducerDied` and the
//! upstream ring goes on without it (a departed consumer).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{
    BackendKind, Consumer, ConsumerConfig, HostConsumer, HostOptions, HostProducer, PendingAttach,
    Producer, ProducerConfig,
};
use pipeline_cuda::backend::{CudaConsumer, CudaOptions, CudaProducer};
use pipeline_cuda::driver::{self, Event};

use crate::relay::{RelayError, RelayReport, acquire_loan};

fn err(e: impl std::fmt::Display) -> RelayError {
    RelayError(e.to_string())
}

/// Consumes the ring at `upstream` and re-publishes every batch in a ring of its own at
/// `downstream` (same slot size and mode; `config` gives the rest, e.g. its slots and lag
/// policy), on CUDA device `device` (default: the upstream producer's). Returns when the
/// upstream ring closes (closing the downstream one), `stop` is set, or on an error.
pub fn run_forwarder(
    upstream: &Path,
    downstream: &Path,
    config: ProducerConfig,
    device: Option<usize>,
    stop: &AtomicBool,
) -> Result<RelayReport, RelayError> {
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
            while !stop.load(Ordering::Relaxed) {
                let batch = match consumer.recv_timeout(tick) {
                    Ok(Some(b)) => b,
                    Ok(None) => break,
                    Err(pipeline_core::Error::Timeout(_)) => continue,
                    Err(e) => return Err(abandon(producer, e)),
                };
                started.get_or_insert_with(Instant::now);
                let Some(loan) = acquire_loan(&mut producer, stop, tick, || Ok(()))? else {
                    break;
                };
                let mut slot = producer.resume(loan).map_err(err)?;
                let n = batch.len() as usize;
                slot.memory()[..n].copy_from_slice(batch.data());
                slot.publish_with(batch.len(), batch.header(), batch.tensors())
                    .map_err(err)?;
                report.batches += 1;
                report.bytes += batch.len();
            }
            producer.close();
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
                    ..CudaOptions::default()
                },
            )
            .map_err(err)?;
            let joined = Event::new_plain(producer.backend().context()).map_err(err)?;
            while !stop.load(Ordering::Relaxed) {
                let batch = match consumer.recv_timeout(tick) {
                    Ok(Some(b)) => b,
                    Ok(None) => break,
                    Err(pipeline_core::Error::Timeout(_)) => continue,
                    Err(e) => return Err(abandon(producer, e)),
                };
                started.get_or_insert_with(Instant::now);
                let Some(loan) = acquire_loan(&mut producer, stop, tick, || Ok(()))? else {
                    break;
                };
                let mut slot = producer.resume(loan).map_err(err)?;
                let mem = slot.memory();
                let view = batch.data();
                // The slot's stream waits for the upstream batch's `ready` (which the
                // consumer's stream waits for), then copies it.
                joined.record(view.stream).map_err(err)?;
                mem.stream.wait_event(&joined).map_err(err)?;
                if view.len > 0 {
                    // The upstream batch is published and held until after the `finished`
                    // written below on this stream, after the copy; the slot is ours until
                    // publish and its stream waits for its previous consumers.
                    // SAFETY: both are `view.len <= slot_bytes` bytes (same slot size), unshared.
                    unsafe {
                        driver::memcpy_async(mem.ptr, view.ptr, view.len as usize, mem.stream)
                    }
                    .map_err(err)?;
                }
                // SAFETY: the slot's stream is a live stream of the same (primary) context as
                // the consumer's; it holds every use of the upstream batch (the copy).
                unsafe {
                    batch
                        .backend()
                        .signal_finished_on(mem.stream.raw(), batch.slot(), batch.seq())
                }
                .map_err(err)?;
                let (len, header, tensors) =
                    (batch.len(), *batch.header(), batch.tensors().to_vec());
                drop(batch);
                slot.publish_with(len, &header, &tensors).map_err(err)?;
                report.batches += 1;
                report.bytes += len;
            }
            producer.close();
        }
    }
    if let Some(t) = started {
        report.elapsed_s = t.elapsed().as_secs_f64();
    }
    Ok(report)
}

/// The upstream ring failed (its producer died, we were detached): leave the downstream ring
/// as a crashed producer would, so that its consumers get `ProducerDied` when this process
/// exits, not a clean end that would hide the batches that never came. The producer is
/// deliberately not dropped (its drop closes the ring cleanly); the caller should exit.
fn abandon<B: pipeline_core::ProducerBackend>(
    producer: Producer<B>,
    e: pipeline_core::Error,
) -> RelayError {
    std::mem::forget(producer);
    RelayError(format!(
        "the upstream ring: {e}; the downstream ring is abandoned (its consumers will see \
         the producer die when this process exits)"
    ))
}
