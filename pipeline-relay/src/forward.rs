//! Re-publishing on one host (issue #20's building block): a process that is a consumer of
//! one ring and the producer of another, copying each batch from the first into the second.
//! On a GPU node this forwards batches from the producer's GPU to another, where consumers
//! read them from their own GPU's memory, and lets a chain (GPU 0 → GPU 1 → GPU 2 ...) carry
//! them further without every consumer pulling from GPU 0's link.
//!
//! Per batch: the next slot of the downstream ring is acquired (so its consumers' back-pressure
//! holds the upstream batch, and through it the upstream producer), the batch is copied into it
//! (CUDA: on the downstream producer's stream, after the upstream `ready`; the upstream
//! `finished` is written after the copy), and, once the copy is complete, it is published with
//! the upstream header and tensor table (CUDA: its `ready` written on a stream of its own, not
//! behind the copies queued after it); up to three copies (`ForwardOptions::depth`) are in
//! flight at once, in slots taken ahead (`Producer::acquire_ahead`). The CUDA loop is in
//! `forward_cuda.rs`, the host one here.
//!
//! Chunked (`ForwardOptions::chunk_bytes`, [`crate::chunks`]): the copy is made chunk by chunk
//! with the ring's progress published after each, and a batch whose copy has begun upstream (the
//! upstream forwarder's progress board says so) is copied as its chunks land, before it is
//! published upstream; it is still published downstream only once received whole.
//!
//! A forwarded ring only ever holds whole batches: if the upstream producer dies with batches
//! whose `ready` never came, or mid-way through a chunked copy, they are not passed on. If the
//! forwarder dies, its downstream consumers get `ProducerDied` and the upstream ring goes on
//! without it (a departed consumer).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{
    BackendKind, Consumer, ConsumerConfig, HostConsumer, HostOptions, HostProducer, PendingAttach,
    Producer, ProducerConfig, WaitPolicy,
};
use pipeline_cuda::sync::SyncMode;

use crate::chunks::{self, Board, chunks, progress};
use crate::relay::{RelayError, RelayReport, acquire_loan};

pub(crate) fn err(e: impl std::fmt::Display) -> RelayError {
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
    /// Chunked forwarding (docs/multi-gpu.md, "Chunked forwarding"): copy each batch in
    /// chunks of this many bytes and publish the progress per chunk on a board next to the
    /// ring ([`crate::chunks`]), and, where the upstream ring is a forwarder's that chunks
    /// with the same size, start copying a batch chunk by chunk as it lands upstream. Batches
    /// are still published whole. None: whole batches (`pipeline_cuda::policy::fanout::chunk_bytes`
    /// gives the size `auto` uses).
    pub chunk_bytes: Option<u64>,
    /// CUDA: copies in flight at once (default 3, at most the ring's slots and lead).
    pub depth: Option<usize>,
    /// CUDA: the downstream ring's memory path (default: the pool). A forwarder whose
    /// downstream ring is read by a consumer in its own process needs a path that the process
    /// that exported the memory can import too: legacy IPC handles cannot be opened by their
    /// exporter; `gpipe consume --forward-from` uses VMM.
    pub memory: Option<pipeline_cuda::memory::MemoryPath>,
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
    // A receive that finds nothing must come back within microseconds, not at the upstream's
    // next publish: meanwhile copies in flight complete and wait to be published (issue #34;
    // the default policy sleeps up to 100 ms between looks at the clock).
    let wait = WaitPolicy {
        spin: Duration::from_micros(20),
        tick: Duration::from_micros(50),
    };
    let pending = PendingAttach::connect(
        upstream,
        ConsumerConfig {
            wait,
            ..ConsumerConfig::default()
        },
    )
    .map_err(err)?;
    let layout = pending.layout();
    let config = ProducerConfig {
        batch_bytes: layout.slot_bytes,
        mode: layout.mode,
        // A look for a free slot downstream that finds none comes back as soon, for the same
        // reason.
        wait,
        ..config
    };
    let mut report = RelayReport {
        backend: pending.backend().to_string(),
        sessions: 1,
        ..RelayReport::default()
    };
    // A forwarder that chunks makes its ring's progress board before the ring, so that the
    // next hop, which connects to the ring, finds it.
    let board_out = match opts.chunk_bytes {
        Some(c) => Some(
            Board::create(downstream, config.slots, layout.slot_bytes, c)
                .map_err(|e| RelayError(format!("making the chunk progress board: {e}")))?,
        ),
        None => None,
    };
    let board_in = opts.chunk_bytes.and_then(|c| {
        Board::open(upstream, layout.slot_count, layout.slot_bytes).filter(|b| b.chunk_bytes() == c)
    });
    let boards = Boards {
        out: board_out,
        up: board_in,
    };
    match pending.backend() {
        BackendKind::Host => {
            let consumer: Consumer<HostConsumer> =
                pending.finish(HostOptions::default()).map_err(err)?;
            let producer: Producer<HostProducer> =
                Producer::bind(downstream, config, HostOptions::default()).map_err(err)?;
            forward_host(consumer, producer, &boards, opts, stop, &mut report)?;
        }
        BackendKind::Cuda => {
            if let Err(e) = crate::forward_cuda::forward(
                pending,
                downstream,
                config,
                opts,
                &boards,
                stop,
                &mut report,
            ) {
                // Left to the process's exit with the abandoned ring's stream, which may still
                // write them (see `forward_cuda::forward`).
                std::mem::forget(boards);
                return Err(e);
            }
        }
    }
    Ok(report)
}

/// A forwarder's chunk progress boards: its own ring's (None: it copies whole batches) and
/// its upstream ring's, when the upstream forwarder chunks with the same chunk size (None:
/// it starts a copy once the upstream batch is published).
pub(crate) struct Boards {
    pub(crate) out: Option<Board>,
    pub(crate) up: Option<Board>,
}

/// The host backend's forwarding loop. With chunking, a batch whose upstream copy has begun
/// (its progress board says so) is copied chunk by chunk as each chunk lands, then published
/// once the upstream published it whole; without, each batch is copied once received.
fn forward_host(
    mut consumer: Consumer<HostConsumer>,
    mut producer: Producer<HostProducer>,
    boards: &Boards,
    opts: &ForwardOptions,
    stop: &AtomicBool,
    report: &mut RelayReport,
) -> Result<(), RelayError> {
    let tick = Duration::from_millis(100);
    if let Err(e) = wait_downstream(&producer, opts, stop) {
        return Err(abandon(producer, e));
    }
    let up_slots = consumer.layout().slot_count;
    let slot_bytes = consumer.layout().slot_bytes;
    let mut started: Option<Instant> = None;
    // The upstream batch expected next, once one came.
    let mut next: Option<u64> = None;
    let outcome = (|| -> Result<(), RelayError> {
        while !stop.load(Ordering::Relaxed) {
            // Chunked: the next upstream batch, if its copy began upstream.
            if let (Some(up), Some(x)) = (&boards.up, next) {
                let k = (x % u64::from(up_slots)) as u32;
                if up.load(k) >= progress(x, 0) {
                    let Some(loan) = acquire_loan(&mut producer, stop, tick, || {
                        consumer.check_producer().map_err(err)
                    })?
                    else {
                        return Ok(());
                    };
                    let mut slot = producer.resume(loan).map_err(err)?;
                    let seq_out = slot.seq();
                    let k_out = slot.index();
                    let src = consumer.backend().slot_ptr(k);
                    let out = boards.out.as_ref();
                    if let Some(o) = out {
                        o.store(k_out, progress(seq_out, 0));
                    }
                    for (c, (off, n)) in chunks(slot_bytes, up.chunk_bytes()).enumerate() {
                        if !wait_progress(up, k, progress(x, c as u32 + 1), &consumer, stop)? {
                            return Ok(());
                        }
                        let dst = &mut slot.memory()[off as usize..(off + n) as usize];
                        // SAFETY: `src` is the upstream slot `k`, slot_bytes long, mapped while
                        // the consumer lives; chunk c of batch x in it landed (the acquiring
                        // load above saw its progress, stored after the bytes), and the
                        // upstream producer rewrites the slot only after we release batch x.
                        let from = unsafe {
                            std::slice::from_raw_parts(src.add(off as usize), n as usize)
                        };
                        dst.copy_from_slice(from);
                        if let Some(o) = out {
                            o.store(k_out, progress(seq_out, c as u32 + 1));
                        }
                    }
                    // Published only once the upstream published batch x whole.
                    let batch = loop {
                        if stop.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        match consumer.recv_timeout(tick) {
                            Ok(Some(b)) => break b,
                            Ok(None) => return Ok(()),
                            Err(pipeline_core::Error::Timeout(_)) => continue,
                            Err(e) => return Err(err(e)),
                        }
                    };
                    check_expected(batch.seq(), x)?;
                    started.get_or_insert_with(Instant::now);
                    slot.publish_with(batch.len(), batch.header(), batch.tensors())
                        .map_err(err)?;
                    report.batches += 1;
                    report.bytes += batch.len();
                    report.copied_ahead += 1;
                    next = Some(x + 1);
                    continue;
                }
            }
            let wait = if boards.up.is_some() && next.is_some() {
                Duration::from_micros(50)
            } else {
                tick
            };
            let batch = match consumer.recv_timeout(wait) {
                Ok(Some(b)) => b,
                Ok(None) => return Ok(()),
                Err(pipeline_core::Error::Timeout(_)) => continue,
                Err(e) => return Err(err(e)),
            };
            started.get_or_insert_with(Instant::now);
            next = Some(batch.seq() + 1);
            // While we wait for room downstream, the upstream producer may die: then our
            // consumers' GPU work waits on batches that never come, and so would we.
            let Some(loan) = acquire_loan(&mut producer, stop, tick, || {
                consumer.check_producer().map_err(err)
            })?
            else {
                return Ok(());
            };
            let mut slot = producer.resume(loan).map_err(err)?;
            let (seq_out, k_out) = (slot.seq(), slot.index());
            let n = batch.len();
            match &boards.out {
                Some(o) => {
                    o.store(k_out, progress(seq_out, 0));
                    for (c, (off, len)) in chunks(n, o.chunk_bytes()).enumerate() {
                        let (a, b) = (off as usize, (off + len) as usize);
                        slot.memory()[a..b].copy_from_slice(&batch.data()[a..b]);
                        o.store(k_out, progress(seq_out, c as u32 + 1));
                    }
                    // A short batch: every chunk of the slot counts as landed.
                    o.store(k_out, progress(seq_out, o.chunk_count()));
                }
                None => slot.memory()[..n as usize].copy_from_slice(batch.data()),
            }
            slot.publish_with(n, batch.header(), batch.tensors())
                .map_err(err)?;
            report.batches += 1;
            report.bytes += n;
        }
        Ok(())
    })();
    if let Some(t) = started {
        report.elapsed_s = t.elapsed().as_secs_f64();
    }
    match outcome {
        Ok(()) => {
            finish(producer, stop, report);
            Ok(())
        }
        Err(e) => Err(abandon(producer, e)),
    }
}

/// Waits on the host until `slot` of the upstream board reaches `target` (`Ok(true)`), `stop`
/// is set (`Ok(false)`), or the upstream producer died (an error: the batch is never
/// published downstream).
fn wait_progress(
    board: &Board,
    slot: u32,
    target: u64,
    consumer: &Consumer<HostConsumer>,
    stop: &AtomicBool,
) -> Result<bool, RelayError> {
    let t0 = Instant::now();
    let mut checked = t0;
    loop {
        let v = board.load(slot);
        if v >= target && v != chunks::RELEASED {
            return Ok(true);
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let now = Instant::now();
        if v == chunks::RELEASED || now.duration_since(checked) >= Duration::from_millis(1) {
            consumer.check_producer().map_err(err)?;
            if v == chunks::RELEASED {
                return Err(RelayError(
                    "the upstream ring's chunk progress was released: its writer died".into(),
                ));
            }
            checked = now;
        }
        if now.duration_since(t0) < Duration::from_micros(200) {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// A chunked forwarder copies the upstream batch it expects next; the upstream must then
/// publish exactly that one.
pub(crate) fn check_expected(got: u64, expected: u64) -> Result<(), RelayError> {
    if got == expected {
        Ok(())
    } else {
        Err(RelayError(format!(
            "the upstream ring published batch {got} where the chunked copy expected batch \
             {expected} (a lag policy that skips batches?): chunked forwarding needs every \
             batch; forward whole batches (chunking off) on this ring"
        )))
    }
}

/// Waits for `opts.wait_for_consumers` downstream, or until `stop` (the forwarding loop then
/// sees it and ends).
pub(crate) fn wait_downstream<B: pipeline_core::ProducerBackend>(
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
pub(crate) fn finish<B: pipeline_core::ProducerBackend>(
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
pub(crate) fn abandon<B: pipeline_core::ProducerBackend>(
    producer: Producer<B>,
    e: RelayError,
) -> RelayError {
    producer.abandon();
    RelayError(format!(
        "the upstream ring: {e}; the downstream ring is abandoned (its consumers see the \
         producer die)"
    ))
}
