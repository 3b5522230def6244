//! Joining the two-rank NCCL communicator and connecting the pair, each bounded: a peer that
//! is gone, one that does not join in time, or a stop ends the wait.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_cuda::driver::{DeviceBuffer, Event, Stream};
use pipeline_cuda::nccl::Comm;

use super::options::RelayOptions;
use super::report::{RelayError, err};
use crate::session::{Session, peer_gone};

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
pub(super) fn init_comm(
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
pub(super) fn connect_peer(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
