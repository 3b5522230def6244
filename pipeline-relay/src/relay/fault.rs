//! The watcher: one thread per session that notices when the peer is gone.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_cuda::nccl::Comm;

use super::report::{RelayError, err};
use crate::session::{Session, peer_gone};

/// How long the receiver keeps waiting for a receive after the sender's connection ended.
pub(super) const SENDER_GONE_GRACE: Duration = Duration::from_secs(2);

/// Watches a session's peer every tick: NCCL's asynchronous error, and the TCP connection's
/// end (until [`Watch::peer_may_close`]). It records the first failure; the main thread, which
/// looks at [`Watch::failure`] between its own NCCL calls, aborts the communicator. Only once
/// the main thread has stopped calling NCCL and waits for the GPU ([`Watch::arm`]) does the
/// watcher abort it itself, so an abort never frees the communicator under a call in flight.
pub(super) struct Watch {
    failed: Arc<parking_lot::Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    armed: Arc<AtomicBool>,
    ended: Arc<AtomicBool>,
    comm: Option<Arc<Comm>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    /// Watches `comm` and the session's connection every `tick`.
    pub(super) fn start(
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

    pub(super) fn failure(&self) -> Option<String> {
        self.failed.lock().clone()
    }

    /// An NCCL failure only (not the connection's end, which may come with messages still
    /// to read: a sender that sent its last batches and END, then exited).
    pub(super) fn nccl_failure(&self) -> Option<String> {
        self.failure().filter(|w| w.starts_with("NCCL"))
    }

    /// Why the receiver must give up on the sender, if it must: an NCCL failure at once; the
    /// connection's end once it has lasted [`SENDER_GONE_GRACE`] (`gone_at` keeps when it was
    /// first seen). A sender exits only after its sends completed, so a receive still pending
    /// that long after will never complete.
    pub(super) fn sender_gone(&self, gone_at: &mut Option<Instant>) -> Option<RelayError> {
        self.gone_for_good(gone_at, "the sender is gone")
    }

    /// As [`Watch::sender_gone`], for any peer whose transfers we still wait for; the error
    /// reads `{what}: {why}`.
    pub(super) fn gone_for_good(
        &self,
        gone_at: &mut Option<Instant>,
        what: &str,
    ) -> Option<RelayError> {
        if let Some(why) = self.nccl_failure() {
            return Some(RelayError(format!("{what}: {why}")));
        }
        let why = self.failure()?;
        let t = *gone_at.get_or_insert_with(Instant::now);
        (t.elapsed() > SENDER_GONE_GRACE).then(|| RelayError(format!("{what}: {why}")))
    }

    /// The peer said it is done (END): its closing the connection is no failure now.
    pub(super) fn peer_may_close(&self) {
        self.ended.store(true, Ordering::Release);
    }

    /// The main thread makes no more NCCL calls and is about to wait for the GPU: from now on
    /// a failure aborts the communicator at once (and one already seen does so now).
    pub(super) fn arm(&self) {
        self.armed.store(true, Ordering::Release);
        if self.failure().is_some() {
            self.halt();
            if let Some(c) = &self.comm {
                c.abort();
            }
        }
    }

    /// Asks the watcher to stop (it ends within a tick).
    pub(super) fn halt(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Stops the watcher, waits for it, then aborts the communicator.
    pub(super) fn halt_and_abort(&mut self) {
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
