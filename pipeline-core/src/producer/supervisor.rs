//! The supervisor thread: accepts attach connections (backing off when accepts fail), runs
//! each handshake on a thread of its own, watches attached consumers' sockets for a Goodbye or
//! a hang-up, and applies the lag policy to backends' overdue waits.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::ProducerBackend;
use crate::ring;
use crate::sys;
use crate::wire;

use super::config::LagPolicy;
use super::state::{Attaching, Departure, MAX_HANDSHAKES, Shared};

impl<B: ProducerBackend> Shared<B> {
    /// The supervisor: accepts connections and watches attached consumers' sockets.
    pub(super) fn supervise(self: Arc<Self>, listener: UnixListener) {
        let tick = self.config.wait.tick;
        // Bytes of a Goodbye frame received so far, per connection.
        let mut partial: std::collections::HashMap<usize, Vec<u8>> = Default::default();
        // Handshakes in progress, with their connections: on the way out they are cut short
        // and joined, so that none outlives `close` (holding fds, or the backend).
        let mut attaching: Vec<(JoinHandle<()>, Arc<Attaching>)> = Vec::new();
        let mut accept = AcceptBackoff::default();
        while !self.stop_supervisor.load(Ordering::Acquire) {
            let snapshot: Vec<(u32, Arc<UnixStream>)> = {
                let m = self.members.lock();
                m.conns
                    .iter()
                    .enumerate()
                    .filter_map(|(i, c)| c.as_ref().map(|c| (i as u32, c.conn.clone())))
                    .collect()
            };
            // New connections wait in the listen backlog while accepting fails (backing off)
            // or while the most handshakes at once are in progress (each one's end wakes us).
            let paused = accept.paused_for();
            let listening = paused.is_none() && attaching.len() < MAX_HANDSHAKES;
            let base = if listening { 2 } else { 1 };
            let mut fds: Vec<BorrowedFd<'_>> = vec![self.waker.fd()];
            if listening {
                fds.push(listener.as_fd());
            }
            fds.extend(snapshot.iter().map(|(_, c)| c.as_fd()));
            let ready = match sys::poll_readable(&fds, paused.map_or(tick, |p| p.min(tick))) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("supervisor poll failed: {e}");
                    std::thread::sleep(tick);
                    continue;
                }
            };
            if ready[0].readable {
                self.waker.drain();
            }
            if listening && ready[1].readable {
                while attaching.len() < MAX_HANDSHAKES {
                    match listener.accept() {
                        Ok((conn, _)) => {
                            accept.succeeded();
                            let me = self.clone();
                            let conn = Arc::new(Attaching {
                                conn,
                                accepted: Instant::now(),
                                joined: AtomicBool::new(false),
                                ready: AtomicBool::new(false),
                                taken_over: AtomicBool::new(false),
                            });
                            let theirs = conn.clone();
                            let spawned = std::thread::Builder::new()
                                .name("gpipe-attach".into())
                                .spawn(move || {
                                    me.handshake(&theirs);
                                    // The supervisor may be waiting for a handshake to end.
                                    me.waker.wake();
                                });
                            match spawned {
                                Ok(h) => attaching.push((h, conn)),
                                Err(e) => {
                                    // The connection closes (dropped): its peer sees why
                                    // below, the log says it once per spell.
                                    wire::send_reject(
                                        &conn.conn,
                                        &format!("the producer cannot start a handshake: {e}"),
                                    );
                                    accept.failed(&e, "start a handshake thread", attaching.len());
                                    break;
                                }
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            accept.failed(&e, "accept attach connections", attaching.len());
                            break;
                        }
                    }
                }
            }
            for (i, (idx, conn)) in snapshot.iter().enumerate() {
                let r = ready[i + base];
                // Read before acting on a hang-up: a clean exit sends Goodbye, then closes.
                if r.readable {
                    let buf = partial.entry(Arc::as_ptr(conn) as usize).or_default();
                    match read_goodbye(conn, buf) {
                        Some(Ok(())) => self.depart(*idx, Departure::Left, "left"),
                        Some(Err((how, why))) => self.depart(*idx, how, &why),
                        None => {}
                    }
                } else if r.hangup {
                    self.depart(*idx, Departure::Died, "its socket hung up");
                }
            }
            if let LagPolicy::DetachAfter(limit) = self.config.lag {
                // Asked under the members lock, under which a new consumer at an index
                // activates only after its backend attach forgot the old one's waits: the
                // index named is the attach whose token we note, and only it is detached.
                let named = {
                    let m = self.members.lock();
                    self.backend
                        .overdue(limit)
                        .filter(|&c| m.active & ring::bit(c) != 0)
                        .map(|c| (c, self.claim_tokens[c as usize].load(Ordering::Acquire)))
                };
                if let Some((c, token)) = named {
                    self.depart_if(
                        c,
                        Some(token),
                        Departure::Detached,
                        &format!(
                            "the producer waited over {limit:?} for its work on a batch to finish (lag policy detach-after)"
                        ),
                    );
                }
            }
            self.fold_counters();
            partial.retain(|k, _| snapshot.iter().any(|(_, c)| Arc::as_ptr(c) as usize == *k));
            attaching.retain(|(h, _)| !h.is_finished());
            if self.closing.load(Ordering::Acquire) {
                self.cut_handshakes(&attaching);
            }
        }
        // None outlives `close` (holding fds, or the backend). `closing` is set before we
        // are stopped, but the loop may have read it unset last time round: cut again.
        self.cut_handshakes(&attaching);
        for (h, _) in attaching {
            let _ = h.join();
        }
    }
}

/// The supervisor's response to failing accepts (`EMFILE` when the process is out of file
/// descriptors, say): it stops accepting for a while, doubling the pause up to a second, and
/// logs the cause once per spell of failures rather than once per attempt.
#[derive(Default)]
struct AcceptBackoff {
    /// When the current spell of failures began, and how many failures it has seen.
    failing: Option<(Instant, u64)>,
    /// No accepts before this.
    paused_until: Option<Instant>,
    pause: Duration,
}

impl AcceptBackoff {
    const FIRST_PAUSE: Duration = Duration::from_millis(10);
    const MOST_PAUSE: Duration = Duration::from_secs(1);

    /// How long accepting stays paused, if it is.
    fn paused_for(&self) -> Option<Duration> {
        let left = self.paused_until?.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    fn failed(&mut self, e: &std::io::Error, what: &str, handshakes: usize) {
        match &mut self.failing {
            Some((_, n)) => *n += 1,
            None => {
                let cause = if e.raw_os_error() == Some(rustix::io::Errno::MFILE.raw_os_error()) {
                    format!(
                        "this process has as many files open as its limit allows (ulimit -n: {}; {handshakes} handshakes in progress); raise the limit",
                        sys::open_file_limit()
                            .map_or_else(|| "unlimited".to_string(), |l| l.to_string())
                    )
                } else if e.raw_os_error() == Some(rustix::io::Errno::NFILE.raw_os_error()) {
                    "the whole system is out of file descriptors (fs.file-max)".to_string()
                } else {
                    format!("{handshakes} handshakes in progress")
                };
                tracing::warn!(
                    "cannot {what}: {e} ({cause}); new attaches wait in the socket's backlog, retried with a pause of up to {:?} (logged once until it recovers)",
                    Self::MOST_PAUSE
                );
                self.failing = Some((Instant::now(), 1));
                self.pause = Self::FIRST_PAUSE;
            }
        }
        self.paused_until = Some(Instant::now() + self.pause);
        self.pause = (self.pause * 2).min(Self::MOST_PAUSE);
    }

    fn succeeded(&mut self) {
        if let Some((since, n)) = self.failing.take() {
            tracing::info!(
                "accepting attach connections again after {n} failed attempts over {:?}",
                since.elapsed()
            );
        }
        self.paused_until = None;
    }
}

/// After attaching, a consumer may only say Goodbye: a 12-byte frame with an empty body.
/// Reads what is there without blocking and keeps partial bytes in `buf`, so a peer that
/// trickles bytes cannot hold up the supervisor. `None`: nothing complete yet.
fn read_goodbye(conn: &UnixStream, buf: &mut Vec<u8>) -> Option<Result<(), (Departure, String)>> {
    let mut chunk = [0u8; 12];
    let want = 12 - buf.len();
    match rustix::net::recv(conn, &mut chunk[..want], rustix::net::RecvFlags::DONTWAIT) {
        Ok((0, _)) => return Some(Err((Departure::Died, "its socket closed".into()))),
        Ok((n, _)) => buf.extend_from_slice(&chunk[..n.min(want)]),
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => return None,
        Err(e) => return Some(Err((Departure::Died, format!("its socket failed: {e}")))),
    }
    if buf.len() < 12 {
        return None;
    }
    let mut prefix = [0u8; 12];
    prefix.copy_from_slice(buf);
    Some(match wire::decode_prefix(&prefix) {
        Ok((6, 0)) => Ok(()),
        Ok((kind, len)) => Err((
            Departure::Detached,
            format!(
                "sent a message of kind {kind} ({len} bytes) after attaching; only Goodbye is allowed"
            ),
        )),
        Err(e) => Err((Departure::Detached, e.to_string())),
    })
}
