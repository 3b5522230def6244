//! The relay: a ring's batches carried to another host.
//!
//! **Sender** (host A, [`run_sender`]): an ordinary consumer of the local ring. For each batch
//! it sends the batch's description (sequence number, length, user header, tensor table) as a
//! session message, then the bytes: over NCCL (`ncclSend` on the consumer's stream, which
//! already waits for `ready`; the release writes `finished` after it, so the slot frees once
//! the send is complete on the GPU) for a CUDA ring, inline in the message for a host ring.
//!
//! **Receiver** (host B, [`run_receiver`]): an ordinary producer of a ring of its own, with
//! the sender's shape. A CUDA batch is received with `ncclRecv` straight into a slot taken
//! ahead (`Producer::acquire_ahead`; up to four receives in flight), and only once the receive
//! has completed without an NCCL error is it published: a sender that dies mid-batch can never
//! hand B's consumers half a batch. A completed receive is published when the next batch's
//! description arrives, when B waits for room, or when four are in flight; a sender that
//! pauses leaves its last batch unpublished until it sends again or ends.
//! B's consumers are plain gpipe consumers.
//!
//! Back-pressure carries across: B acquires a slot only when B's consumers have released one,
//! it posts no receive meanwhile, so A's sends wait, so A's releases wait, so A's producer waits
//! (under its lag policy, as for any consumer).
//!
//! Faults: each side watches the other (the TCP connection's end, and NCCL's asynchronous
//! error) and aborts the communicator at the first sign, so no stream waits for ever on a peer
//! that is gone. The sender then exits with an error (its own ring goes on without it: a
//! departed consumer); the receiver keeps its ring and, with `rejoin`, waits for a sender to
//! connect again.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{
    BackendKind, Consumer, ConsumerBackend, ConsumerConfig, DType, HostConsumer, HostOptions,
    HostProducer, Mode, PendingAttach, Producer, ProducerConfig, TensorInfo, USER_HEADER_WORDS,
};
use pipeline_cuda::backend::{CudaConsumer, CudaOptions, CudaProducer};
use pipeline_cuda::driver::{self, DeviceBuffer, Event, Stream};
use pipeline_cuda::nccl::{self, Comm};

use crate::endpoint::Endpoint;
use crate::rendezvous::{Listener, connect_session};
use crate::secret::SharedSecret;
use crate::session::{Session, SessionError, peer_gone};
use crate::wire::Payload;

/// Message kinds after the rendezvous.
mod kind {
    /// Sender → receiver, first: the ring's backend and mode.
    pub const RING: u8 = 1;
    /// Sender → receiver: one batch's description (and, for a host ring, its bytes).
    pub const BATCH: u8 = 2;
    /// Sender → receiver: the sender's ring closed; nothing follows.
    pub const END: u8 = 3;
    /// Either way: the side is stopping because of this error (text).
    pub const ABORT: u8 = 4;
}

/// Options of both sides.
#[derive(Clone, Debug)]
pub struct RelayOptions {
    /// Bounds the rendezvous (waiting for the peer included) and NCCL's setup.
    pub connect_timeout: Duration,
    /// How often the sides look at the peer while waiting.
    pub tick: Duration,
    /// CUDA device of this side (sender: default the producer's; receiver: default 0).
    pub device: Option<usize>,
    /// Receiver: after the sender is gone, wait for one to connect again (keeping the ring).
    pub rejoin: bool,
    /// Receiver: slots of its ring (default: the sender's ring's).
    pub slots: Option<u32>,
    /// CUDA: run the NCCL transfers on streams of the device's highest priority, so that
    /// their blocks start ahead of waiting blocks of the work beside them (the producer's on
    /// the sending GPU, the consumers' on the receiving one). Default: off. On 2×H200 with
    /// MPS and a verifying consumer beside the receiver it changed nothing (64 MiB: 288.8
    /// GB/s high, 287.0 normal; docs/relay.md).
    pub high_priority: bool,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            connect_timeout: Duration::from_secs(60),
            tick: Duration::from_millis(100),
            device: None,
            rejoin: false,
            slots: None,
            high_priority: false,
        }
    }
}

/// What a side did.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RelayReport {
    /// "cuda" or "host".
    pub backend: String,
    /// Batches carried.
    pub batches: u64,
    /// Bytes carried.
    pub bytes: u64,
    /// Seconds from the first batch to the last.
    pub elapsed_s: f64,
    /// The NCCL library used (CUDA).
    pub nccl: Option<String>,
    /// Sessions the receiver served (more than 1 after a rejoin).
    pub sessions: u32,
    /// Why it stopped, if not because the ring closed.
    pub error: Option<String>,
    /// Forwarder: when its consumers were done with the last batch (seconds since the Unix
    /// epoch), if it got that far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drained_at_unix_s: Option<f64>,
}

impl RelayReport {
    /// GB/s over the run.
    pub fn gb_per_s(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            self.bytes as f64 / self.elapsed_s / 1e9
        } else {
            0.0
        }
    }
}

/// Why the relay stopped.
#[derive(Debug)]
pub struct RelayError(pub String);

impl std::fmt::Display for RelayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RelayError {}

fn err(e: impl std::fmt::Display) -> RelayError {
    RelayError(e.to_string())
}

/// How long a session write may block (a peer that stopped reading is gone).
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// Batch descriptions on the wire.

/// One batch's description: sequence number, length, user header, tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchMeta {
    /// The sender's sequence number.
    pub seq: u64,
    /// Bytes.
    pub len: u64,
    /// The user header.
    pub header: [u64; USER_HEADER_WORDS],
    /// The named tensors.
    pub tensors: Vec<TensorInfo>,
}

impl BatchMeta {
    /// Encodes the description, then `data` (host rings; empty for CUDA).
    pub fn encode(&self, data: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + USER_HEADER_WORDS * 8 + data.len());
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        for h in &self.header {
            b.extend_from_slice(&h.to_le_bytes());
        }
        b.extend_from_slice(&(self.tensors.len() as u32).to_le_bytes());
        for t in &self.tensors {
            let name = t.name.as_str().as_bytes();
            b.push(name.len() as u8);
            b.extend_from_slice(name);
            b.extend_from_slice(&t.dtype.to_code().to_le_bytes());
            b.push(t.shape().len() as u8);
            for x in t.shape().iter().chain(t.strides()) {
                b.extend_from_slice(&x.to_le_bytes());
            }
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        b.extend_from_slice(&(data.len() as u64).to_le_bytes());
        b.extend_from_slice(data);
        b
    }

    /// Decodes a description and the data after it; every field is checked (a peer's bytes).
    pub fn decode(body: &[u8]) -> Result<(BatchMeta, &[u8]), String> {
        let mut r = body;
        let mut take = |n: usize, what: &str| -> Result<&[u8], String> {
            if r.len() < n {
                return Err(format!("batch message ends inside {what}"));
            }
            let (a, rest) = r.split_at(n);
            r = rest;
            Ok(a)
        };
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        let seq = u64_at(take(8, "the sequence number")?);
        let len = u64_at(take(8, "the length")?);
        let mut header = [0u64; USER_HEADER_WORDS];
        for h in &mut header {
            *h = u64_at(take(8, "the header")?);
        }
        let n = u32::from_le_bytes(take(4, "the tensor count")?.try_into().unwrap_or([0; 4]));
        if n as usize > pipeline_core::tensor::MAX_TENSORS {
            return Err(format!(
                "batch {seq}: {n} tensors (at most {})",
                pipeline_core::tensor::MAX_TENSORS
            ));
        }
        let mut tensors = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let nl = take(1, "a tensor name")?[0] as usize;
            let name = std::str::from_utf8(take(nl, "a tensor name")?)
                .map_err(|_| format!("batch {seq}: a tensor name is not UTF-8"))?
                .to_string();
            let code = u32::from_le_bytes(take(4, "a dtype")?.try_into().unwrap_or([0; 4]));
            let dtype = DType::from_code(code)
                .ok_or_else(|| format!("batch {seq}: tensor {name}: unknown dtype code {code}"))?;
            let nd = take(1, "a tensor rank")?[0] as usize;
            if nd > pipeline_core::tensor::MAX_DIMS {
                return Err(format!("batch {seq}: tensor {name} has {nd} dimensions"));
            }
            let mut dims = Vec::with_capacity(2 * nd);
            for _ in 0..2 * nd {
                dims.push(u64_at(take(8, "a tensor shape")?));
            }
            let offset = u64_at(take(8, "a tensor offset")?);
            let t = TensorInfo::new(&name, dtype, &dims[..nd], Some(&dims[nd..]), offset)
                .map_err(|e| format!("batch {seq}: {e}"))?;
            if t.end() > len {
                return Err(format!(
                    "batch {seq}: tensor {name} ends past the batch ({len} bytes)"
                ));
            }
            tensors.push(t);
        }
        let dl = u64_at(take(8, "the data length")?);
        let data = take(
            usize::try_from(dl).map_err(|_| "data length overflows")?,
            "the data",
        )?;
        if !r.is_empty() {
            return Err(format!("batch {seq}: {} bytes after the message", r.len()));
        }
        Ok((
            BatchMeta {
                seq,
                len,
                header,
                tensors,
            },
            data,
        ))
    }
}

fn ring_message(backend: BackendKind, mode: Mode) -> Vec<u8> {
    let mut b = backend.to_u32().to_le_bytes().to_vec();
    b.extend_from_slice(&(mode as u32).to_le_bytes());
    b
}

fn parse_ring(body: &[u8]) -> Result<(BackendKind, Mode), String> {
    if body.len() != 8 {
        return Err(format!("ring message of {} bytes (8 expected)", body.len()));
    }
    let code = u32::from_le_bytes(body[..4].try_into().unwrap_or([0; 4]));
    let backend = BackendKind::from_u32(code).ok_or_else(|| format!("unknown backend {code}"))?;
    let mode = match u32::from_le_bytes(body[4..].try_into().unwrap_or([0; 4])) {
        m if m == Mode::Broadcast as u32 => Mode::Broadcast,
        m if m == Mode::Shared as u32 => Mode::Shared,
        m => return Err(format!("unknown mode {m}")),
    };
    Ok((backend, mode))
}

// ---------------------------------------------------------------------------------------
// The watcher: one thread per session that notices when the peer is gone.

/// How long the receiver keeps waiting for a receive after the sender's connection ended.
const SENDER_GONE_GRACE: Duration = Duration::from_secs(2);

/// Watches a session's peer every tick: NCCL's asynchronous error, and the TCP connection's
/// end (until [`Watch::peer_may_close`]). It records the first failure; the main thread, which
/// looks at [`Watch::failure`] between its own NCCL calls, aborts the communicator. Only once
/// the main thread has stopped calling NCCL and waits for the GPU ([`Watch::arm`]) does the
/// watcher abort it itself, so an abort never frees the communicator under a call in flight.
struct Watch {
    failed: Arc<parking_lot::Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    armed: Arc<AtomicBool>,
    ended: Arc<AtomicBool>,
    comm: Option<Arc<Comm>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    /// Watches `comm` and the session's connection every `tick`.
    fn start(
        comm: Option<Arc<Comm>>,
        session: &Session,
        tick: Duration,
    ) -> Result<Watch, RelayError> {
        let stream = session.try_clone_stream().map_err(err)?;
        let failed = Arc::new(parking_lot::Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let ended = Arc::new(AtomicBool::new(false));
        let (f, s, a, e, c) = (
            failed.clone(),
            stop.clone(),
            armed.clone(),
            ended.clone(),
            comm.clone(),
        );
        let thread = std::thread::Builder::new()
            .name("gpipe-relay-watch".into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    let mut why = None;
                    if let Some(c) = &c {
                        if let Err(err) = c.async_error() {
                            why = Some(format!("NCCL: {err}"));
                        }
                    }
                    if why.is_none() && !e.load(Ordering::Acquire) && peer_gone(&stream) {
                        why = Some("the peer closed the connection".to_string());
                    }
                    if let Some(w) = why {
                        *f.lock() = Some(w);
                        if a.load(Ordering::Acquire) {
                            if let Some(c) = &c {
                                c.abort();
                            }
                        }
                        return;
                    }
                    std::thread::sleep(tick);
                }
            })
            .map_err(err)?;
        Ok(Watch {
            failed,
            stop,
            armed,
            ended,
            comm,
            thread: Some(thread),
        })
    }

    fn failure(&self) -> Option<String> {
        self.failed.lock().clone()
    }

    /// An NCCL failure only (not the connection's end, which may come with messages still
    /// to read: a sender that sent its last batches and END, then exited).
    fn nccl_failure(&self) -> Option<String> {
        self.failure().filter(|w| w.starts_with("NCCL"))
    }

    /// Why the receiver must give up on the sender, if it must: an NCCL failure at once; the
    /// connection's end once it has lasted [`SENDER_GONE_GRACE`] (`gone_at` keeps when it was
    /// first seen). A sender exits only after its sends completed, so a receive still pending
    /// that long after will never complete.
    fn sender_gone(&self, gone_at: &mut Option<Instant>) -> Option<RelayError> {
        self.gone_for_good(gone_at, "the sender is gone")
    }

    /// As [`Watch::sender_gone`], for any peer whose transfers we still wait for; the error
    /// reads `{what}: {why}`.
    fn gone_for_good(&self, gone_at: &mut Option<Instant>, what: &str) -> Option<RelayError> {
        if let Some(why) = self.nccl_failure() {
            return Some(RelayError(format!("{what}: {why}")));
        }
        let why = self.failure()?;
        let t = *gone_at.get_or_insert_with(Instant::now);
        (t.elapsed() > SENDER_GONE_GRACE).then(|| RelayError(format!("{what}: {why}")))
    }

    /// The peer said it is done (END): its closing the connection is no failure now.
    fn peer_may_close(&self) {
        self.ended.store(true, Ordering::Release);
    }

    /// The main thread makes no more NCCL calls and is about to wait for the GPU: from now on
    /// a failure aborts the communicator at once (and one already seen does so now).
    fn arm(&self) {
        self.armed.store(true, Ordering::Release);
        if self.failure().is_some() {
            self.halt();
            if let Some(c) = &self.comm {
                c.abort();
            }
        }
    }

    /// Asks the watcher to stop (it ends within a tick).
    fn halt(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Stops the watcher, waits for it, then aborts the communicator.
    fn halt_and_abort(&mut self) {
        self.halt();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(c) = &self.comm {
            c.abort();
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.halt();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------
// The sender.

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

// ---------------------------------------------------------------------------------------
// The receiver.

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
        let Some((k, body)) = next_message(&mut session, &watch, opts, stop)? else {
            return Ok(());
        };
        match k {
            kind::END => {
                watch.peer_may_close();
                return Ok(());
            }
            kind::ABORT => {
                return Err(RelayError(format!(
                    "the sender stopped: {}",
                    String::from_utf8_lossy(&body)
                )));
            }
            kind::BATCH => {}
            other => return Err(RelayError(format!("unexpected message kind {other}"))),
        }
        let (meta, data) = BatchMeta::decode(&body).map_err(RelayError)?;
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

/// Runs `setup` (NCCL's communicator setup, which blocks until every rank joined and has no
/// bound of its own) on a thread of its own, and waits at most `timeout` for it, looking
/// every `tick` at the session's connection and at `stop`: a peer that closed it, one that did
/// not join in time, or a stop gives an error here at once. The setup thread is then left to
/// NCCL; should its setup still complete, it hands the result to `late` (which aborts the
/// communicator).
fn bounded_setup<T: Send + 'static>(
    what: &str,
    setup: impl FnOnce() -> Result<T, RelayError> + Send + 'static,
    late: impl FnOnce(T) + Send + 'static,
    peer: &std::net::TcpStream,
    timeout: Duration,
    tick: Duration,
    stop: &AtomicBool,
) -> Result<T, RelayError> {
    // A rendezvous channel: a result is either taken here or, once this side gave up and
    // dropped its end, handed back to the setup thread (`SendError`) for `late`, never left
    // in a buffer to be dropped unaborted.
    let (tx, rx) = std::sync::mpsc::sync_channel(0);
    std::thread::Builder::new()
        .name("gpipe-relay-setup".into())
        .spawn(move || {
            if let Err(std::sync::mpsc::SendError(Ok(t))) = tx.send(setup()) {
                late(t);
            }
        })
        .map_err(err)?;
    let deadline = Instant::now() + timeout;
    loop {
        match rx.recv_timeout(tick.min(Duration::from_millis(100))) {
            Ok(r) => return r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(RelayError(format!(
                    "{what}: the setup thread ended without a result"
                )));
            }
        }
        if peer_gone(peer) {
            return Err(RelayError(format!(
                "{what}: the peer closed the connection before NCCL's setup completed"
            )));
        }
        if stop.load(Ordering::Acquire) {
            return Err(RelayError(format!(
                "{what}: stopped before NCCL's setup completed"
            )));
        }
        if Instant::now() >= deadline {
            return Err(RelayError(format!(
                "{what}: NCCL's setup did not complete within {timeout:?} (is the peer alive? \
                 NCCL_DEBUG=INFO on both sides says more)"
            )));
        }
    }
}

/// Joins the two-rank communicator as `rank`, bounded as [`bounded_setup`] says.
fn init_comm(
    ctx: &Arc<pipeline_cuda::driver::Context>,
    id: &[u8; 128],
    rank: i32,
    session: &Session,
    opts: &RelayOptions,
    stop: &AtomicBool,
) -> Result<Arc<Comm>, RelayError> {
    let peer = session.try_clone_stream().map_err(err)?;
    let (ctx, id) = (Arc::clone(ctx), *id);
    let comm = bounded_setup(
        "joining the NCCL communicator",
        move || Comm::init(&ctx, &id, 2, rank).map_err(err),
        |late: Comm| late.abort(),
        &peer,
        opts.connect_timeout,
        opts.tick,
        stop,
    )?;
    Ok(Arc::new(comm))
}

/// NCCL connects two ranks lazily, at their first send/recv, which would make the first batch
/// pay for setting up the link (and a run's first figures look slower than the link). The
/// relay makes that connection at setup instead, with one small transfer from the sender
/// (rank 0) to the receiver (rank 1), bounded by `timeout`: a peer that cannot complete it is
/// found before any batch is taken from the ring.
fn connect_peer(
    comm: &Comm,
    ctx: &Arc<pipeline_cuda::driver::Context>,
    rank: i32,
    timeout: Duration,
) -> Result<(), RelayError> {
    const BYTES: usize = 256;
    let buf = DeviceBuffer::new(ctx, BYTES).map_err(err)?;
    let stream = Stream::new(ctx).map_err(err)?;
    let done = Event::new_plain(ctx).map_err(err)?;
    // SAFETY: our own buffer of BYTES, used by this transfer only, on our own stream, which
    // is synchronised below before the buffer is dropped (also after an abort).
    unsafe {
        if rank == 0 {
            comm.send(buf.ptr(), BYTES, 1, stream.raw())
        } else {
            comm.recv(buf.ptr(), BYTES, 0, stream.raw())
        }
    }
    .map_err(err)?;
    done.record(&stream).map_err(err)?;
    let deadline = Instant::now() + timeout.min(Duration::from_secs(30));
    let outcome = loop {
        match done.query() {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(RelayError(format!("connecting to the peer over NCCL: {e}"))),
        }
        if let Err(e) = comm.async_error() {
            break Err(RelayError(format!("connecting to the peer over NCCL: {e}")));
        }
        if Instant::now() >= deadline {
            break Err(RelayError(
                "connecting to the peer over NCCL: no transfer completed in time (is the peer \
                 alive?)"
                    .into(),
            ));
        }
        std::thread::sleep(Duration::from_micros(100));
    };
    if outcome.is_err() {
        comm.abort();
    }
    let _ = stream.synchronize();
    outcome
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
            let Some((k_, body)) = next_message(&mut session, &watch, opts, stop)? else {
                return Ok(());
            };
            match k_ {
                kind::END => {
                    // The sender is done and may close the connection; what it sent is
                    // still published.
                    watch.peer_may_close();
                    ended = true;
                    continue;
                }
                kind::ABORT => {
                    return Err(RelayError(format!(
                        "the sender stopped: {}",
                        String::from_utf8_lossy(&body)
                    )));
                }
                kind::BATCH => {}
                other => return Err(RelayError(format!("unexpected message kind {other}"))),
            }
            let (meta, data) = BatchMeta::decode(&body).map_err(RelayError)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_descriptions_round_trip_and_garbage_is_refused() {
        let t = TensorInfo::new("x", DType::F32, &[2, 3], None, 0).unwrap();
        let u = TensorInfo::new("label", DType::I64, &[2], None, 256).unwrap();
        let mut header = [0u64; USER_HEADER_WORDS];
        header[0] = 42;
        let meta = BatchMeta {
            seq: 7,
            len: 512,
            header,
            tensors: vec![t, u],
        };
        let body = meta.encode(b"abc");
        let (back, data) = BatchMeta::decode(&body).unwrap();
        assert_eq!(back, meta);
        assert_eq!(data, b"abc");
        // Every truncation is an error, never a panic.
        for n in 0..body.len() {
            assert!(BatchMeta::decode(&body[..n]).is_err(), "prefix {n}");
        }
        // A tensor past the batch's end.
        let bad = BatchMeta {
            len: 16,
            ..meta.clone()
        };
        let e = BatchMeta::decode(&bad.encode(&[])).unwrap_err();
        assert!(e.contains("ends past the batch"), "{e}");
        // Trailing bytes.
        let mut long = meta.encode(&[]);
        long.push(0);
        assert!(
            BatchMeta::decode(&long)
                .unwrap_err()
                .contains("after the message")
        );
    }

    fn tcp_pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn bounded_setup_passes_results_through() {
        let (ours, _theirs) = tcp_pair();
        let tick = Duration::from_millis(10);
        let t = Duration::from_secs(5);
        let go = AtomicBool::new(false);
        let ok = bounded_setup("t", || Ok(7u32), |_| {}, &ours, t, tick, &go);
        assert_eq!(ok.unwrap(), 7);
        let e = bounded_setup::<u32>(
            "t",
            || Err(RelayError("no NCCL".into())),
            |_| {},
            &ours,
            t,
            tick,
            &go,
        );
        assert_eq!(e.unwrap_err().0, "no NCCL");
    }

    #[test]
    fn bounded_setup_gives_up_in_time_and_hands_a_late_result_back() {
        let (ours, _theirs) = tcp_pair();
        let (late_tx, late_rx) = std::sync::mpsc::channel();
        let t0 = Instant::now();
        let e = bounded_setup(
            "joining",
            || {
                std::thread::sleep(Duration::from_millis(600));
                Ok(42u32)
            },
            move |v| late_tx.send(v).unwrap(),
            &ours,
            Duration::from_millis(200),
            Duration::from_millis(10),
            &AtomicBool::new(false),
        )
        .unwrap_err();
        let waited = t0.elapsed();
        assert!(e.0.contains("did not complete within"), "{e}");
        assert!(
            waited < Duration::from_millis(550),
            "gave up after {waited:?}"
        );
        // The setup finished after we gave up: its result is handed to `late`, not leaked.
        assert_eq!(late_rx.recv_timeout(Duration::from_secs(5)).unwrap(), 42);
    }

    /// A 3 s setup under a 30 s limit, watching `session` and `stop` every 10 ms: the error
    /// that ends it early.
    fn slow_join(session: &std::net::TcpStream, stop: &AtomicBool) -> RelayError {
        bounded_setup(
            "joining",
            || {
                std::thread::sleep(Duration::from_secs(3));
                Ok(())
            },
            |_| {},
            session,
            Duration::from_secs(30),
            Duration::from_millis(10),
            stop,
        )
        .unwrap_err()
    }

    #[test]
    fn bounded_setup_notices_a_peer_that_closed_the_connection() {
        let (ours, theirs) = tcp_pair();
        let t0 = Instant::now();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(theirs);
        });
        let e = slow_join(&ours, &AtomicBool::new(false));
        closer.join().unwrap();
        assert!(e.0.contains("peer closed the connection"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn bounded_setup_stops_when_asked() {
        let (ours, _theirs) = tcp_pair();
        let stop = AtomicBool::new(true);
        let t0 = Instant::now();
        let e = slow_join(&ours, &stop);
        assert!(e.0.contains("stopped"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn ring_messages_round_trip() {
        for b in [BackendKind::Host, BackendKind::Cuda] {
            for m in [Mode::Broadcast, Mode::Shared] {
                assert_eq!(parse_ring(&ring_message(b, m)).unwrap(), (b, m));
            }
        }
        assert!(parse_ring(&[9; 8]).is_err());
        assert!(parse_ring(&[1; 3]).is_err());
    }
}

// ---------------------------------------------------------------------------------------
// NCCL's own point-to-point bandwidth, for comparison with the relay.

/// Transfers [`nccl_bench`] enqueues between two looks at the GPU; two such chunks are in
/// flight at most.
const BENCH_CHUNK: u64 = 32;

/// Which side of [`nccl_bench`] this process is.
#[derive(Clone, Debug)]
pub enum BenchSide {
    /// Listens, makes the unique id, and sends.
    Send(Endpoint),
    /// Connects and receives.
    Recv(Endpoint),
}

/// NCCL's own send/recv between the two sides, with the same bindings the relay uses:
/// `iters` messages of `bytes` from one device buffer to another, after `iters / 10 + 1`
/// untimed ones. Returns GB/s as the receiver timed it (the sender returns its own view).
///
/// Bounded as the relay is: the rendezvous connection stays open; joining the communicator
/// and the first transfer (NCCL connects the pair there) give up after `timeout` or when the
/// peer goes; at most two chunks of [`BENCH_CHUNK`] transfers are in flight, so no NCCL call
/// blocks on a full queue; every wait for the GPU gives up on an NCCL error or once the
/// peer's connection has been closed for [`SENDER_GONE_GRACE`] with our transfers pending,
/// and the watcher is stopped before the communicator is aborted. The two sides end with one
/// small transfer from the receiver to the sender, so the sender leaves only after the
/// receiver's last receive completed.
pub fn nccl_bench(
    side: &BenchSide,
    secret: &SharedSecret,
    bytes: u64,
    iters: u64,
    device: usize,
    timeout: Duration,
) -> Result<f64, RelayError> {
    if bytes == 0 || iters == 0 {
        return Err(RelayError(
            "nccl-bench: bytes and iterations must be at least 1".into(),
        ));
    }
    nccl::load().map_err(err)?;
    driver::init().map_err(err)?;
    let ctx = Arc::new(pipeline_cuda::driver::Context::new(device).map_err(err)?);
    let (id, rank, session) = match side {
        BenchSide::Send(listen) => {
            let id = nccl::unique_id().map_err(err)?;
            let payload = Payload {
                nccl_unique_id: id,
                slot_bytes: bytes.max(1),
                slot_count: 1,
                world_size: 2,
                rank: 1,
            };
            let session = Listener::bind(listen)
                .map_err(err)?
                .accept_session(secret, &payload, timeout)
                .map_err(err)?;
            (id, 0, session)
        }
        BenchSide::Recv(connect) => {
            let (p, session) = connect_session(connect, secret, timeout).map_err(err)?;
            (p.nccl_unique_id, 1, session)
        }
    };
    let opts = RelayOptions {
        connect_timeout: timeout,
        ..RelayOptions::default()
    };
    let stop = AtomicBool::new(false);
    let comm = init_comm(&ctx, &id, rank, &session, &opts, &stop)?;
    // NCCL connects the pair at the first transfer: bounded, before the watcher starts (so
    // an abort here races no other thread).
    connect_peer(&comm, &ctx, rank, timeout)?;
    let mut watch = Watch::start(Some(Arc::clone(&comm)), &session, opts.tick)?;
    let buf = DeviceBuffer::new(&ctx, bytes as usize).map_err(err)?;
    let stream = Stream::new(&ctx).map_err(err)?;
    let marks = [
        Event::new_plain(&ctx).map_err(err)?,
        Event::new_plain(&ctx).map_err(err)?,
    ];
    let done = Event::new_plain(&ctx).map_err(err)?;
    // Waits until `event` (recorded on the stream) has passed; an NCCL error, or the peer
    // gone for good with the event still pending, ends the wait.
    let wait = |event: &Event| -> Result<(), RelayError> {
        let mut gone_at = None;
        loop {
            if event.query().map_err(err)? {
                return Ok(());
            }
            if let Some(e) = watch.gone_for_good(&mut gone_at, "nccl-bench: the peer is gone") {
                return Err(e);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    };
    // One transfer of `n` bytes: rank 0 sends to rank 1 (or, `back`, receives from it).
    let transfer = |n: usize, back: bool| -> Result<(), RelayError> {
        // SAFETY: our own buffer of `bytes` (n <= bytes), used on this stream only; the
        // stream is synchronised (or the communicator aborted) before the buffer is dropped.
        unsafe {
            if (rank == 0) != back {
                comm.send(buf.ptr(), n, 1 - rank, stream.raw())
            } else {
                comm.recv(buf.ptr(), n, 1 - rank, stream.raw())
            }
        }
        .map_err(err)
    };
    let mut chunks = 0u64;
    // `n` transfers in chunks, each chunk's end marked by one of the two events: before a
    // chunk reuses an event, the chunk two back (which recorded it) must have completed.
    let mut run = |n: u64| -> Result<(), RelayError> {
        let mut left = n;
        while left > 0 {
            let mark = &marks[(chunks % 2) as usize];
            if chunks >= 2 {
                wait(mark)?;
            }
            if let Some(why) = watch.nccl_failure() {
                return Err(RelayError(format!("nccl-bench: {why}")));
            }
            let k = left.min(BENCH_CHUNK);
            for _ in 0..k {
                transfer(bytes as usize, false)?;
            }
            mark.record(&stream).map_err(err)?;
            chunks += 1;
            left -= k;
        }
        Ok(())
    };
    let finish = || -> Result<(), RelayError> {
        done.record(&stream).map_err(err)?;
        wait(&done)
    };
    let timed = (|| {
        run(iters / 10 + 1)?;
        finish()?;
        let t = Instant::now();
        run(iters)?;
        finish()?;
        let secs = t.elapsed().as_secs_f64();
        // The receiver tells the sender it is done: one byte back.
        transfer(1, true)?;
        finish()?;
        comm.async_error().map_err(err)?;
        Ok(bytes as f64 * iters as f64 / secs / 1e9)
    })();
    if timed.is_err() {
        // The watcher is stopped and joined before the abort: it never calls into a
        // communicator being freed.
        watch.halt_and_abort();
    }
    // Nothing is in flight once the transfers completed or the communicator was aborted.
    let _ = stream.synchronize();
    drop(watch);
    timed
}
