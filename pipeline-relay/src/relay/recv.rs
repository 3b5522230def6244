//! The receiver: a producer of a ring of its own that publishes each batch the sender sends.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{BackendKind, HostOptions, HostProducer, Mode, Producer, ProducerConfig};
use pipeline_cuda::backend::{CudaOptions, CudaProducer};
use pipeline_cuda::driver::{Event, Stream};
use pipeline_cuda::nccl;

use super::comm::{connect_peer, init_comm};
use super::fault::Watch;
use super::messages::{BatchMeta, FromSender, kind, parse_ring};
use super::options::RelayOptions;
use super::report::{RelayError, RelayReport, err};
use crate::endpoint::Endpoint;
use crate::rendezvous::connect_session;
use crate::secret::SharedSecret;
use crate::session::{Session, SessionError};
use crate::wire::Payload;

/// Host B: connects to the sender at `connect`, makes a ring of the sender's shape at
/// `downstream` and publishes every batch received. Returns when the sender's ring closes,
/// `stop` is set, or on an error (with `rejoin`, a lost sender is waited for again instead).
pub fn run_receiver(
    connect: &Endpoint,
    downstream: &Path,
    secret: &SharedSecret,
    config: ProducerConfig,
    opts: &RelayOptions,
    stop: &AtomicBool,
) -> Result<RelayReport, RelayError> {
    let (payload, mut session) =
        connect_session(connect, secret, opts.connect_timeout).map_err(err)?;
    let (kind_, body) = session.recv(Some(opts.connect_timeout)).map_err(err)?;
    if kind_ != kind::RING {
        return Err(RelayError(format!(
            "expected the ring message, got kind {kind_}"
        )));
    }
    let (backend, mode) = parse_ring(&body).map_err(RelayError)?;
    let config = ProducerConfig {
        slots: opts.slots.unwrap_or(payload.slot_count),
        batch_bytes: payload.slot_bytes,
        mode,
        ..config
    };
    let mut report = RelayReport {
        backend: backend.to_string(),
        ..RelayReport::default()
    };
    let first = (payload, session);
    let ring = (backend, mode);
    let to = Rejoin {
        connect,
        secret,
        opts,
        stop,
        ring,
    };
    match backend {
        BackendKind::Cuda => {
            let (lib, _) = nccl::load()
                .map_err(|e| RelayError(format!("the relay of a CUDA ring needs NCCL: {e}")))?;
            report.nccl = Some(lib);
            let options = CudaOptions {
                device: Some(opts.device.unwrap_or(0)),
                ..CudaOptions::default()
            };
            let producer: Producer<CudaProducer> =
                Producer::bind(downstream, config, options).map_err(err)?;
            serve(
                producer,
                first,
                &to,
                &mut report,
                |p, payload, session, report| {
                    recv_loop_cuda(p, session, &payload, opts, stop, report)
                },
            )?;
        }
        BackendKind::Host => {
            let producer: Producer<HostProducer> =
                Producer::bind(downstream, config, HostOptions::default()).map_err(err)?;
            serve(
                producer,
                first,
                &to,
                &mut report,
                |p, _, session, report| recv_loop_host(p, session, opts, stop, report),
            )?;
        }
    }
    Ok(report)
}

/// Where a receiver finds a sender again.
struct Rejoin<'a> {
    connect: &'a Endpoint,
    secret: &'a SharedSecret,
    opts: &'a RelayOptions,
    stop: &'a AtomicBool,
    ring: (BackendKind, Mode),
}

/// Runs `one` for the first session and, with `--rejoin`, for each sender that connects
/// after one is lost; closes the ring when a session ends cleanly or the relay is stopped,
/// and abandons it ([`abandon`]) when a session fails and no other may follow.
fn serve<B: pipeline_core::ProducerBackend>(
    mut producer: Producer<B>,
    first: (Payload, Session),
    to: &Rejoin<'_>,
    report: &mut RelayReport,
    mut one: impl FnMut(&mut Producer<B>, Payload, Session, &mut RelayReport) -> Result<(), RelayError>,
) -> Result<(), RelayError> {
    let mut next = Some(first);
    loop {
        let (payload, session) = match next.take() {
            Some(p) => p,
            None => {
                let slot_bytes = producer.layout().slot_bytes;
                match rejoin(to.connect, to.secret, to.opts, to.stop, to.ring, slot_bytes) {
                    Some(p) => p,
                    None => break,
                }
            }
        };
        report.sessions += 1;
        match one(&mut producer, payload, session, report) {
            Ok(()) => break,
            Err(e) if to.opts.rejoin && !to.stop.load(Ordering::Relaxed) => {
                tracing::warn!("relay: {e}; waiting for the sender to rejoin");
                report.error = Some(e.0.clone());
            }
            Err(e) => {
                report.error = Some(e.0.clone());
                return Err(abandon(producer, e));
            }
        }
    }
    producer.close();
    Ok(())
}

/// Waits for a sender to connect again (with `--rejoin`), until `stop`: a failed attempt
/// (a timeout, a wrong secret, a sender of another kind of ring) is logged and retried.
/// `None` once stopped.
fn rejoin(
    connect: &Endpoint,
    secret: &SharedSecret,
    opts: &RelayOptions,
    stop: &AtomicBool,
    ring: (BackendKind, Mode),
    slot_bytes: u64,
) -> Option<(Payload, Session)> {
    while !stop.load(Ordering::Relaxed) {
        let attempt = (|| -> Result<(Payload, Session), RelayError> {
            let (p, mut s) = connect_session(connect, secret, opts.connect_timeout).map_err(err)?;
            let (k, body) = s.recv(Some(opts.connect_timeout)).map_err(err)?;
            if k != kind::RING || parse_ring(&body).map_err(RelayError)? != ring {
                return Err(RelayError(
                    "the sender that connected carries another kind of ring".into(),
                ));
            }
            if p.slot_bytes > slot_bytes {
                return Err(RelayError(format!(
                    "the sender that connected has slots of {} bytes; this ring's are {slot_bytes}",
                    p.slot_bytes
                )));
            }
            Ok((p, s))
        })();
        match attempt {
            Ok(p) => return Some(p),
            Err(e) => {
                tracing::warn!("relay: rejoin: {e}; trying again");
                std::thread::sleep(opts.tick);
            }
        }
    }
    None
}

/// The sender failed and no other will come: leave this side's ring as a crashed producer
/// would ([`Producer::abandon`]), so that its consumers get `ProducerDied` rather than a clean
/// end that would hide the batches that never came.
fn abandon<B: pipeline_core::ProducerBackend>(producer: Producer<B>, e: RelayError) -> RelayError {
    producer.abandon();
    RelayError(format!(
        "{e}; this ring is abandoned (its consumers see the producer die)"
    ))
}

/// Receives the next message, looking at `stop` and at the watcher every tick.
fn next_message(
    session: &mut Session,
    watch: &Watch,
    opts: &RelayOptions,
    stop: &AtomicBool,
) -> Result<Option<(u8, Vec<u8>)>, RelayError> {
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        match session.recv(Some(opts.tick)) {
            Ok(m) => return Ok(Some(m)),
            Err(SessionError::Timeout) => {
                if let Some(why) = watch.failure() {
                    return Err(RelayError(format!("the sender is gone: {why}")));
                }
            }
            Err(e) => return Err(RelayError(format!("the sender is gone: {e}"))),
        }
    }
}

/// The receiver's one dispatch of the sender's messages (both backends): the next message,
/// received as [`next_message`] does and dispatched by [`FromSender::parse`]; `None` once
/// `stop` is set. After END the sender may close the connection: the watcher is told that
/// this is no failure. The sender's ABORT and any unexpected message are errors.
fn next_from_sender(
    session: &mut Session,
    watch: &Watch,
    opts: &RelayOptions,
    stop: &AtomicBool,
) -> Result<Option<FromSender>, RelayError> {
    let Some((k, body)) = next_message(session, watch, opts, stop)? else {
        return Ok(None);
    };
    let message = FromSender::parse(k, body).map_err(RelayError)?;
    if matches!(message, FromSender::End) {
        watch.peer_may_close();
    }
    Ok(Some(message))
}

/// Acquires the next slot, giving up if the sender fails meanwhile. Returns a loan
/// ([`Producer::resume`] takes it back), so that the wait can be a loop.
fn acquire_checked<B: pipeline_core::ProducerBackend>(
    producer: &mut Producer<B>,
    watch: &Watch,
    opts: &RelayOptions,
    stop: &AtomicBool,
) -> Result<Option<pipeline_core::SlotLoan>, RelayError> {
    // Waiting here is for this ring's consumers, not for the sender: the sender's end
    // matters once the messages it sent have been read (next_message), NCCL's at once.
    acquire_loan(producer, stop, opts.tick, || match watch.nccl_failure() {
        Some(why) => Err(RelayError(format!("the sender is gone: {why}"))),
        None => Ok(()),
    })
}

/// The producer's next slot as a loan, waiting `tick` at a time for its consumers; `None`
/// once `stop` is set; `check` runs between waits and ends the wait with its error.
pub(crate) fn acquire_loan<B: pipeline_core::ProducerBackend>(
    producer: &mut Producer<B>,
    stop: &AtomicBool,
    tick: Duration,
    mut check: impl FnMut() -> Result<(), RelayError>,
) -> Result<Option<pipeline_core::SlotLoan>, RelayError> {
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        check()?;
        match producer.acquire_timeout(tick) {
            Ok(s) => return Ok(Some(s.into_loan())),
            Err(pipeline_core::Error::Timeout(_)) => continue,
            Err(e) => return Err(err(e)),
        }
    }
}

fn recv_loop_host(
    producer: &mut Producer<HostProducer>,
    mut session: Session,
    opts: &RelayOptions,
    stop: &AtomicBool,
    report: &mut RelayReport,
) -> Result<(), RelayError> {
    // A slot's bytes and their description.
    session.set_max_body(producer.layout().slot_bytes as usize + (1 << 20));
    let watch = Watch::start(None, &session, opts.tick)?;
    let mut started: Option<Instant> = None;
    loop {
        // None: stopped; END: the sender's ring closed.
        let Some(FromSender::Batch(meta, data)) =
            next_from_sender(&mut session, &watch, opts, stop)?
        else {
            return Ok(());
        };
        let data = data.bytes();
        if data.len() as u64 != meta.len {
            return Err(RelayError(format!(
                "batch {}: {} bytes sent for a batch of {}",
                meta.seq,
                data.len(),
                meta.len
            )));
        }
        let Some(loan) = acquire_checked(producer, &watch, opts, stop)? else {
            return Ok(());
        };
        let mut slot = producer.resume(loan).map_err(err)?;
        let mem = slot.memory();
        if data.len() > mem.len() {
            return Err(RelayError(format!(
                "batch {} of {} bytes does not fit a slot of {}",
                meta.seq,
                data.len(),
                mem.len()
            )));
        }
        mem[..data.len()].copy_from_slice(data);
        slot.publish_with(meta.len, &meta.header, &meta.tensors)
            .map_err(err)?;
        started.get_or_insert_with(Instant::now);
        report.batches += 1;
        report.bytes += meta.len;
        if let Some(t) = started {
            report.elapsed_s = t.elapsed().as_secs_f64();
        }
    }
}

/// The receiver's receives in flight (CUDA): each batch is received straight into a slot
/// taken ahead, and published once the host saw the receive complete.
struct Receives {
    /// Recorded after each receive (on `stream`).
    received: Vec<Event>,
    /// Recorded on the producer's stream once a slot is taken (its previous consumers' work
    /// ordered there), waited by `stream` before the receive.
    taken: Event,
    stream: Stream,
}

/// Receives in flight before the oldest is published.
const RECEIVES: usize = 4;

impl Receives {
    fn new(producer: &Producer<CudaProducer>, high_priority: bool) -> Result<Receives, RelayError> {
        let ctx = producer.backend().context();
        Ok(Receives {
            received: (0..RECEIVES)
                .map(|_| Event::new_plain(ctx))
                .collect::<Result<Vec<_>, _>>()
                .map_err(err)?,
            taken: Event::new_plain(ctx).map_err(err)?,
            stream: if high_priority {
                Stream::new_high_priority(ctx)
            } else {
                Stream::new(ctx)
            }
            .map_err(err)?,
        })
    }
}

/// Publishes a batch whose receive completed (into the slot of `loan`, the next to publish)
/// and counts it; the clock runs from `started`.
fn publish_received(
    producer: &mut Producer<CudaProducer>,
    meta: BatchMeta,
    loan: pipeline_core::SlotLoan,
    started: Option<Instant>,
    report: &mut RelayReport,
) -> Result<(), RelayError> {
    producer
        .resume(loan)
        .map_err(err)?
        .publish_with(meta.len, &meta.header, &meta.tensors)
        .map_err(err)?;
    report.batches += 1;
    report.bytes += meta.len;
    if let Some(t) = started {
        report.elapsed_s = t.elapsed().as_secs_f64();
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn recv_loop_cuda(
    producer: &mut Producer<CudaProducer>,
    mut session: Session,
    payload: &Payload,
    opts: &RelayOptions,
    stop: &AtomicBool,
    report: &mut RelayReport,
) -> Result<(), RelayError> {
    // Descriptions only (the bytes come over NCCL).
    session.set_max_body(1 << 20);
    let slot_bytes = producer.layout().slot_bytes;
    if payload.slot_bytes > slot_bytes {
        return Err(RelayError(format!(
            "the sender's slots are {} bytes; this ring's are {slot_bytes}",
            payload.slot_bytes
        )));
    }
    // Fresh per session: nothing of a session that ended in an abort is reused.
    let st = Receives::new(producer, opts.high_priority)?;
    let comm = init_comm(
        producer.backend().context(),
        &payload.nccl_unique_id,
        1,
        &session,
        opts,
        stop,
    )?;
    connect_peer(&comm, producer.backend().context(), 1, opts.connect_timeout)?;
    let mut watch = Watch::start(Some(comm.clone()), &session, opts.tick)?;
    let layout = producer.layout();
    let depth = RECEIVES
        .min(layout.slot_count as usize)
        .min(producer.max_lead().map_or(usize::MAX, |l| l as usize))
        .max(1);
    let mut inflight: std::collections::VecDeque<(BatchMeta, pipeline_core::SlotLoan, usize)> =
        Default::default();
    let mut next = 0usize;
    let mut started: Option<Instant> = None;
    let mut ended = false;
    let result = (|| -> Result<(), RelayError> {
        loop {
            // Publish the oldest receive once it is complete, when as many are in flight as
            // may be, or nothing more is coming.
            while inflight.len() == depth || (ended && !inflight.is_empty()) {
                let (meta, loan, k) = inflight
                    .pop_front()
                    .ok_or_else(|| RelayError("receives in flight".into()))?;
                let mut closed_at: Option<Instant> = None;
                loop {
                    if st.received[k].query().map_err(err)? {
                        break;
                    }
                    if let Some(e) = watch.sender_gone(&mut closed_at) {
                        return Err(e);
                    }
                    if stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_micros(20));
                }
                // Complete, but with an NCCL error meanwhile? Then it may be partial: never
                // publish it.
                if let Some(why) = watch.nccl_failure() {
                    return Err(RelayError(format!("batch {}: {why}", meta.seq)));
                }
                publish_received(producer, meta, loan, started, report)?;
            }
            if ended {
                return Ok(());
            }
            let (meta, data) = match next_from_sender(&mut session, &watch, opts, stop)? {
                Some(FromSender::Batch(meta, data)) => (meta, data),
                Some(FromSender::End) => {
                    // The sender is done and may close the connection; what it sent is
                    // still published.
                    ended = true;
                    continue;
                }
                None => return Ok(()),
            };
            let data = data.bytes();
            if !data.is_empty() || meta.len > slot_bytes {
                return Err(RelayError(format!(
                    "batch {}: {} bytes in a CUDA batch message, length {} for slots of {slot_bytes}",
                    meta.seq,
                    data.len(),
                    meta.len,
                )));
            }
            started.get_or_insert_with(Instant::now);
            // The batch is received straight into the next slot, taken ahead of the ones
            // still in flight; it is published only once the receive completed.
            let mut gone_at: Option<Instant> = None;
            let loan = loop {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                // As when publishing; nor would this wait end, if our consumers hold every
                // slot until they get the batch still pending.
                if let Some(e) = watch.sender_gone(&mut gone_at) {
                    return Err(e);
                }
                // Publish the receives that completed while we wait: a consumer may hold its
                // batches until it gets the next one, which would otherwise wait here for a
                // slot that consumer holds.
                while let Some(&(_, _, k)) = inflight.front() {
                    if !st.received[k].query().map_err(err)? {
                        break;
                    }
                    if let Some(why) = watch.nccl_failure() {
                        return Err(RelayError(format!("the sender is gone: {why}")));
                    }
                    let Some((meta, loan, _)) = inflight.pop_front() else {
                        break;
                    };
                    publish_received(producer, meta, loan, started, report)?;
                }
                let wait = if inflight.is_empty() {
                    opts.tick
                } else {
                    Duration::from_millis(1)
                };
                match producer.acquire_ahead(wait) {
                    Ok(l) => break l,
                    Err(pipeline_core::Error::Timeout(_)) => continue,
                    Err(e) => return Err(err(e)),
                }
            };
            let k = next;
            next = (next + 1) % depth;
            let mem = producer.loan_memory(&loan).map_err(err)?;
            // The receive waits for what the slot's stream ordered before its writes (its
            // previous consumers' work).
            st.taken.record(mem.stream).map_err(err)?;
            st.stream.wait_event(&st.taken).map_err(err)?;
            if meta.len > 0 {
                // SAFETY: the slot (taken ahead, unpublished: ours alone) holds slot_bytes >=
                // meta.len (checked above); nothing reads it before the receive completed
                // (seen on the host before publish); the stream is ours.
                unsafe { comm.recv(mem.ptr, meta.len as usize, 0, st.stream.raw()) }
                    .map_err(err)?;
            }
            st.received[k].record(&st.stream).map_err(err)?;
            inflight.push_back((meta, loan, k));
        }
    })();
    if result.is_err() || stop.load(Ordering::Relaxed) {
        watch.halt_and_abort();
    } else {
        watch.arm();
    }
    // Our receives are done (or ended by the abort) before the communicator goes; slots
    // taken ahead and not published go back (a rejoined session starts at the next batch).
    if let Err(e) = st.stream.synchronize() {
        tracing::warn!("relay: synchronizing the receive stream: {e}");
    }
    producer.cancel_ahead();
    drop(watch);
    drop(comm);
    result
}
