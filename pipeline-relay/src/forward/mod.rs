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
//! `cuda.rs`, the host one in `host.rs`.
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
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use pipeline_core::{
    BackendKind, Consumer, ConsumerConfig, HostConsumer, HostOptions, HostProducer, PendingAttach,
    Producer, ProducerConfig, WaitPolicy,
};

use crate::chunks::Board;
use crate::relay::{RelayError, RelayReport};

mod cuda;
mod host;
mod options;
mod steps;

pub use options::ForwardOptions;
use steps::{Boards, err};

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
            host::forward_host(consumer, producer, &boards, opts, stop, &mut report)?;
        }
        BackendKind::Cuda => {
            if let Err(e) = cuda::forward(
                pending,
                downstream,
                config,
                opts,
                &boards,
                stop,
                &mut report,
            ) {
                // Left to the process's exit with the abandoned ring's stream, which may still
                // write them (see `cuda::forward`).
                std::mem::forget(boards);
                return Err(e);
            }
        }
    }
    Ok(report)
}
