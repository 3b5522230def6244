//! The steps both forwarding loops share: the error type's wording, the chunk progress boards,
//! checking the batch a chunked copy expected, waiting for the downstream slot, publishing or
//! abandoning a copy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pipeline_core::Producer;

use super::options::ForwardOptions;
use crate::chunks::Board;
use crate::relay::{RelayError, RelayReport};

pub(super) fn err(e: impl std::fmt::Display) -> RelayError {
    RelayError(e.to_string())
}

/// A forwarder's chunk progress boards: its own ring's (None: it copies whole batches) and
/// its upstream ring's, when the upstream forwarder chunks with the same chunk size (None:
/// it starts a copy once the upstream batch is published).
pub(super) struct Boards {
    pub(super) out: Option<Board>,
    pub(super) up: Option<Board>,
}

/// A chunked forwarder copies the upstream batch it expects next; the upstream must then
/// publish exactly that one.
pub(super) fn check_expected(got: u64, expected: u64) -> Result<(), RelayError> {
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
pub(super) fn wait_downstream<B: pipeline_core::ProducerBackend>(
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
pub(super) fn finish<B: pipeline_core::ProducerBackend>(
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
pub(super) fn abandon<B: pipeline_core::ProducerBackend>(
    producer: Producer<B>,
    e: RelayError,
) -> RelayError {
    producer.abandon();
    RelayError(format!(
        "the upstream ring: {e}; the downstream ring is abandoned (its consumers see the \
         producer die)"
    ))
}
