//! NCCL's own point-to-point bandwidth, for comparison with the relay (`gpipe relay
//! nccl-bench`).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use pipeline_cuda::driver::{self, DeviceBuffer, Event, Stream};
use pipeline_cuda::nccl;

use super::comm::{connect_peer, init_comm};
use super::fault::Watch;
use super::options::RelayOptions;
use super::report::{RelayError, err};
use crate::endpoint::Endpoint;
use crate::rendezvous::{Listener, connect_session};
use crate::secret::SharedSecret;
use crate::wire::Payload;

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
/// peer's connection has been closed for
/// [`SENDER_GONE_GRACE`](super::fault::SENDER_GONE_GRACE) with our transfers pending, and the
/// watcher is stopped before the communicator is aborted. The two sides end with one small
/// transfer from the receiver to the sender, so the sender leaves only after the receiver's
/// last receive completed.
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
