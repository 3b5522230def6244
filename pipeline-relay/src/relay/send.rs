//! The sender: a consumer of the local ring that carries each batch to the receiver.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{
    BackendKind, Consumer, ConsumerBackend, ConsumerConfig, HostConsumer, HostOptions,
    PendingAttach,
};
use pipeline_cuda::backend::{CudaConsumer, CudaOptions};
use pipeline_cuda::nccl::{self, Comm};

use super::comm::{connect_peer, init_comm};
use super::fault::Watch;
use super::messages::{BatchMeta, kind, ring_message};
use super::options::RelayOptions;
use super::report::{RelayError, RelayReport, err};
use crate::endpoint::Endpoint;
use crate::rendezvous::Listener;
use crate::secret::SharedSecret;
use crate::session::Session;
use crate::wire::Payload;

/// How long a session write may block (a peer that stopped reading is gone).
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Host A: consumes the ring at `upstream` and carries every batch to the receiver that
/// connects to `listen`. Returns when the upstream ring closes (after telling the receiver),
/// `stop` is set, or on an error (the peer gone, NCCL failed, the ring's producer died).
pub fn run_sender(
    upstream: &Path,
    listen: &Endpoint,
    secret: &SharedSecret,
    opts: &RelayOptions,
    stop: &AtomicBool,
) -> Result<RelayReport, RelayError> {
    let (seg, backend) =
        pipeline_core::observe(upstream, ConsumerConfig::default()).map_err(|e| {
            RelayError(format!(
                "looking at the ring at {}: {e}",
                upstream.display()
            ))
        })?;
    let layout = seg.layout();
    drop(seg);
    let mut report = RelayReport {
        backend: backend.to_string(),
        sessions: 1,
        ..RelayReport::default()
    };
    let id = match backend {
        BackendKind::Cuda => {
            let (lib, _) = nccl::load()
                .map_err(|e| RelayError(format!("the relay of a CUDA ring needs NCCL: {e}")))?;
            report.nccl = Some(lib);
            nccl::unique_id().map_err(err)?
        }
        BackendKind::Host => [0u8; 128],
    };
    if backend == BackendKind::Host
        && layout.slot_bytes as usize > crate::session::MAX_BODY - (1 << 20)
    {
        return Err(RelayError(format!(
            "a host ring's batches travel in one message each: slots of {} bytes are more than \
             the relay carries ({} bytes)",
            layout.slot_bytes,
            crate::session::MAX_BODY - (1 << 20)
        )));
    }
    let listener = Listener::bind(listen).map_err(err)?;
    tracing::info!(
        "relay: waiting for the receiver on {}",
        listener.local_addr().map_err(err)?
    );
    let payload = Payload {
        nccl_unique_id: id,
        slot_bytes: layout.slot_bytes,
        slot_count: layout.slot_count,
        world_size: 2,
        rank: 1,
    };
    let mut session = listener
        .accept_session(secret, &payload, opts.connect_timeout)
        .map_err(err)?;
    session
        .send(
            kind::RING,
            &ring_message(backend, layout.mode),
            WRITE_TIMEOUT,
        )
        .map_err(err)?;
    let pending = PendingAttach::connect(upstream, ConsumerConfig::default()).map_err(err)?;
    let result = match backend {
        BackendKind::Cuda => {
            let consumer: Consumer<CudaConsumer> = pending
                .finish(CudaOptions {
                    device: opts.device,
                    delivery: pipeline_core::Delivery::InPlace,
                    high_priority: opts.high_priority,
                    ..CudaOptions::default()
                })
                .map_err(err)?;
            let comm = init_comm(consumer.backend().context(), &id, 0, &session, opts, stop)?;
            connect_peer(&comm, consumer.backend().context(), 0, opts.connect_timeout)?;
            send_loop(consumer, &mut session, Some(comm), opts, stop, &mut report)
        }
        BackendKind::Host => {
            let consumer: Consumer<HostConsumer> =
                pending.finish(HostOptions::default()).map_err(err)?;
            send_loop(consumer, &mut session, None, opts, stop, &mut report)
        }
    };
    if let Err(e) = &result {
        let _ = session.send(kind::ABORT, e.0.as_bytes(), Duration::from_secs(1));
        report.error = Some(e.0.clone());
    }
    result.map(|()| report)
}

/// What the sender does per backend: send the bytes of a batch.
trait SendBytes: ConsumerBackend {
    /// Host: the bytes go in the message. CUDA: enqueue the NCCL send on the batch's stream.
    fn inline(batch: &pipeline_core::Batch<Self>) -> Option<Vec<u8>>;
    fn nccl_send(batch: &pipeline_core::Batch<Self>, comm: &Comm) -> Result<(), RelayError>;
}

impl SendBytes for HostConsumer {
    fn inline(batch: &pipeline_core::Batch<Self>) -> Option<Vec<u8>> {
        Some(batch.data().to_vec())
    }
    fn nccl_send(_: &pipeline_core::Batch<Self>, _: &Comm) -> Result<(), RelayError> {
        Err(RelayError("a host ring is relayed without NCCL".into()))
    }
}

impl SendBytes for CudaConsumer {
    fn inline(_: &pipeline_core::Batch<Self>) -> Option<Vec<u8>> {
        None
    }
    fn nccl_send(batch: &pipeline_core::Batch<Self>, comm: &Comm) -> Result<(), RelayError> {
        let view = batch.data();
        if view.len == 0 {
            return Ok(());
        }
        // SAFETY: the batch is published and held until it is released after this call; its
        // stream already waits for `ready`, and the release writes `finished` after the send
        // on the same stream, so the producer does not rewrite the slot before it is sent.
        unsafe { comm.send(view.ptr, view.len as usize, 1, view.stream.raw()) }.map_err(err)
    }
}

fn send_loop<B: SendBytes>(
    mut consumer: Consumer<B>,
    session: &mut Session,
    comm: Option<Arc<Comm>>,
    opts: &RelayOptions,
    stop: &AtomicBool,
    report: &mut RelayReport,
) -> Result<(), RelayError> {
    // The receiver sends nothing but an abort message: bound what we accept from it.
    session.set_max_body(1 << 20);
    let mut watch = Watch::start(comm.clone(), session, opts.tick)?;
    let mut started: Option<Instant> = None;
    let outcome = loop {
        if let Some(why) = watch.failure() {
            break Err(RelayError(format!("the receiver is gone: {why}")));
        }
        if stop.load(Ordering::Relaxed) {
            break Ok(false);
        }
        let batch = match consumer.recv_timeout(opts.tick) {
            Ok(Some(b)) => b,
            Ok(None) => {
                let _ = session.send(kind::END, &[], WRITE_TIMEOUT);
                break Ok(true);
            }
            Err(pipeline_core::Error::Timeout(_)) => continue,
            Err(e) => break Err(RelayError(format!("the local ring: {e}"))),
        };
        started.get_or_insert_with(Instant::now);
        let meta = BatchMeta {
            seq: batch.seq(),
            len: batch.len(),
            header: *batch.header(),
            tensors: batch.tensors().to_vec(),
        };
        let data = B::inline(&batch);
        let body = meta.encode(data.as_deref().unwrap_or(&[]));
        if let Err(e) = session.send(kind::BATCH, &body, WRITE_TIMEOUT) {
            break Err(RelayError(format!(
                "the receiver is gone: sending batch {}: {e}",
                meta.seq
            )));
        }
        if let Some(c) = &comm {
            if let Err(e) = B::nccl_send(&batch, c) {
                break Err(e);
            }
        }
        drop(batch);
        report.batches += 1;
        report.bytes += meta.len;
    };
    match &outcome {
        // The ring ended and the receiver was told: let the sends enqueued complete (the
        // consumer's teardown waits for them), aborting only if the receiver goes meanwhile.
        Ok(true) => {
            watch.peer_may_close();
            watch.arm();
        }
        // Stopped (Ctrl-C) or failed: sends in flight may never be received; end them now,
        // so that the consumer's teardown (a context synchronize) finishes.
        Ok(false) | Err(_) => watch.halt_and_abort(),
    }
    drop(consumer);
    if let (Some(t), Ok(true)) = (started, &outcome) {
        report.elapsed_s = t.elapsed().as_secs_f64();
    }
    drop(watch);
    drop(comm);
    outcome.map(|_| ())
}
