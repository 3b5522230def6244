//! Publishing after, and releasing after, work on a caller's own streams
//! (`pipeline_cuda::ordering`), between two processes on one GPU.
//!
//! Each test runs its producer here and re-runs this test binary as the consumer (the
//! environment names the role). The caller's work is held back on the GPU behind a gate (a
//! stream wait on a host word that the host opens after a pause): a signal not ordered after
//! that work lets the other side run early, and the bytes it sees show it.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{Consumer, Mode, Producer, ProducerConfig, USER_HEADER_WORDS};
use pipeline_cuda::backend::{CudaConsumer, CudaOptions, CudaProducer};
use pipeline_cuda::driver::{
    Context, HostRegistration, PinnedBuffer, Stream, WaitCondition, memcpy_dtoh_async,
    memset_d8_async, stream_wait_value64,
};
use pipeline_cuda::ordering::{OrderWrites, PublishAfter, ReleaseAfter};

/// The environment variable that makes a run of this binary the consumer of a test.
const ROLE: &str = "GPIPE_ORDERING_TEST_SOCKET";
/// Bytes of each batch.
const LEN: usize = 1 << 20;
/// How long the gated work is held back: far longer than a copy of `LEN` bytes takes.
const HOLD: Duration = Duration::from_millis(300);
/// Any wait of these tests (an attach, a receive, an acquire).
const WAIT: Duration = Duration::from_secs(20);

/// Ends the process if the test is still running after `WAIT` twice over (a hang).
fn watchdog() {
    std::thread::spawn(|| {
        std::thread::sleep(4 * WAIT);
        eprintln!(
            "ordering test: still running after {:?}; giving up",
            4 * WAIT
        );
        std::process::exit(2);
    });
}

/// A host word the GPU can wait on: a stream waits until the host opens it.
struct Gate {
    // Declared first, so dropped first: unregistered while the page is still mapped.
    reg: HostRegistration,
    map: memmap2::MmapMut,
}

impl Gate {
    fn new(ctx: &std::sync::Arc<Context>) -> Gate {
        let mut map = memmap2::MmapMut::map_anon(4096).unwrap();
        // SAFETY: the page is mapped by `map`, which the Gate keeps until after the
        // registration is dropped (field order).
        let reg = unsafe { HostRegistration::new(ctx, map.as_mut_ptr(), 4096) }.unwrap();
        Gate { reg, map }
    }

    fn word(&self) -> &AtomicU64 {
        // SAFETY: the page is mapped, 4096-byte aligned and zeroed; the GPU reads it only
        // through the registration, the host only through this atomic.
        unsafe { &*self.map.as_ptr().cast::<AtomicU64>() }
    }

    /// Makes `stream` wait until the gate is open.
    fn hold(&self, stream: &Stream) {
        // SAFETY: the word is registered host memory, kept until the Gate drops, which the
        // tests do only after synchronizing every stream that waits on it.
        unsafe {
            stream_wait_value64(stream, self.reg.device_ptr(), 1, WaitCondition::Geq).unwrap()
        }
    }

    fn open(&self) {
        self.word().store(1, Ordering::Release);
    }
}

/// Runs this test again, as its consumer, on the ring at `socket`.
fn spawn_consumer(test: &str, socket: &std::path::Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, socket)
        .spawn()
        .unwrap()
}

/// Waits for the consumer to end and checks it passed.
fn consumer_passed(mut child: Child) {
    let deadline = Instant::now() + 2 * WAIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "the consumer failed: {status}");
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the consumer did not end within {:?}", 2 * WAIT);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn bind(test: &str, slots: u32) -> (Producer<CudaProducer>, std::path::PathBuf) {
    let socket =
        std::env::temp_dir().join(format!("gpipe-ordering-{test}-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots,
        batch_bytes: LEN as u64,
        mode: Mode::Broadcast,
        ..Default::default()
    };
    let p = Producer::bind(&socket, config, CudaOptions::default()).unwrap();
    (p, socket)
}

/// Copies the first `LEN` bytes at `src` to a new host buffer on `stream`, and returns the
/// buffer (read it after synchronizing).
fn copy_out(
    ctx: &std::sync::Arc<Context>,
    src: pipeline_cuda::driver::CUdeviceptr,
    stream: &Stream,
) -> PinnedBuffer {
    let host = PinnedBuffer::new(ctx, LEN).unwrap();
    // SAFETY: `src` is a batch of at least LEN bytes, held until the copy completes (the
    // callers release it after, or ordered after, this copy); `host` is LEN bytes the host
    // reads only after synchronizing `stream`.
    unsafe { memcpy_dtoh_async(host.as_ptr(), src, LEN, stream) }.unwrap();
    host
}

/// The distinct byte values of a host buffer, for messages.
fn bytes_of(host: &PinnedBuffer) -> Vec<u8> {
    // SAFETY: every copy into `host` is complete (the stream was synchronized).
    let mut seen: Vec<u8> = unsafe { host.as_slice() }.to_vec();
    seen.sort_unstable();
    seen.dedup();
    seen
}

/// Publish after: batch 0's bytes are written on one caller stream, batch 1's half on each of
/// two, all held back behind a gate; the consumer must see every byte written.
#[test]
#[ignore = "needs a CUDA GPU"]
fn publish_after_callers_streams_the_consumer_sees_their_writes() {
    const TEST: &str = "publish_after_callers_streams_the_consumer_sees_their_writes";
    watchdog();
    if let Ok(socket) = std::env::var(ROLE) {
        let mut c = Consumer::<CudaConsumer>::attach(socket, CudaOptions::default()).unwrap();
        let ctx = c.backend().context().clone();
        for (seq, value) in [(0u64, 0xA5u8), (1, 0x5A)] {
            let b = c.recv_timeout(WAIT).unwrap().expect("a batch");
            assert_eq!(b.seq(), seq);
            let view = b.data();
            // The consumer's stream waited for `ready` when the batch was received.
            let host = copy_out(&ctx, view.ptr, view.stream);
            view.stream.synchronize().unwrap();
            assert_eq!(
                bytes_of(&host),
                [value],
                "batch {seq}: ready came before the writes on the caller's streams"
            );
            b.release().unwrap();
        }
        return;
    }
    let (mut p, socket) = bind("publish", 2);
    let child = spawn_consumer(TEST, &socket);
    p.wait_for_consumers(1, WAIT).unwrap();
    let ctx = p.backend().context().clone();
    let gate = Gate::new(&ctx);
    let callers = [Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap()];
    for (seq, value, streams) in [(0u64, 0xA5u8, 1usize), (1, 0x5A, 2)] {
        let mut slot = p.acquire_timeout(WAIT).unwrap();
        assert_eq!(slot.seq(), seq);
        let mem = slot.memory();
        let ptr = mem.ptr;
        // Zeroes on the producer's stream: what a consumer reads if it runs early.
        // SAFETY: the slot is ours until published; LEN <= its capacity.
        unsafe { memset_d8_async(ptr, 0, LEN, mem.stream) }.unwrap();
        let part = LEN / streams;
        for (k, caller) in callers[..streams].iter().enumerate() {
            // SAFETY: a live stream of the producer's context.
            unsafe { slot.order_writes_on(caller.raw()) }.unwrap();
            gate.hold(caller);
            // SAFETY: as above; the caller's stream is ordered after the zeroing.
            unsafe { memset_d8_async(ptr + (k * part) as u64, value, part, caller) }.unwrap();
        }
        let raw: Vec<_> = callers[..streams].iter().map(Stream::raw).collect();
        let header = [0; USER_HEADER_WORDS];
        // SAFETY: live streams of the producer's context, holding every write of the batch.
        let published = unsafe { slot.publish_after(&raw, LEN as u64, &header, &[]) };
        assert_eq!(published.unwrap(), seq);
        std::thread::sleep(HOLD);
        gate.open();
        for caller in &callers {
            caller.synchronize().unwrap();
        }
        gate.word().store(0, Ordering::Release);
    }
    consumer_passed(child);
    p.close();
}

/// Release after: the consumer reads each batch on caller streams held back behind a gate,
/// and releases after them; the producer's next write of the one slot must wait for those
/// reads. Batch 0 is read on one stream (`release_after`), batch 1 on two (`drop_after`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn release_after_callers_streams_the_producers_next_write_waits() {
    const TEST: &str = "release_after_callers_streams_the_producers_next_write_waits";
    const VALUES: [u8; 3] = [0x11, 0x22, 0x33];
    watchdog();
    if let Ok(socket) = std::env::var(ROLE) {
        let mut c = Consumer::<CudaConsumer>::attach(socket, CudaOptions::default()).unwrap();
        let ctx = c.backend().context().clone();
        let gate = Gate::new(&ctx);
        let callers = [Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap()];
        for (seq, streams) in [(0u64, 1usize), (1, 2)] {
            let b = c.recv_timeout(WAIT).unwrap().expect("a batch");
            assert_eq!(b.seq(), seq);
            let ptr = b.data().ptr;
            let part = LEN / streams;
            let mut copies = Vec::new();
            for (k, caller) in callers[..streams].iter().enumerate() {
                // SAFETY: a live stream of the consumer's context.
                unsafe { b.order_reads_on(caller.raw()) }.unwrap();
                gate.hold(caller);
                let host = PinnedBuffer::new(&ctx, part).unwrap();
                // SAFETY: the batch is held until the release, ordered after this copy;
                // `host` is read after synchronizing the stream.
                unsafe { memcpy_dtoh_async(host.as_ptr(), ptr + (k * part) as u64, part, caller) }
                    .unwrap();
                copies.push(host);
            }
            let raw: Vec<_> = callers[..streams].iter().map(Stream::raw).collect();
            if streams == 1 {
                // SAFETY: a live stream of the consumer's context, holding every use of the
                // batch.
                unsafe { b.release_after(&raw) }.unwrap();
            } else {
                // SAFETY: as above, for each stream.
                unsafe { b.drop_after(&raw) }.unwrap();
            }
            // The producer now writes the next batch into the same slot, unless the release
            // waits for the reads.
            std::thread::sleep(HOLD);
            gate.open();
            for caller in &callers {
                caller.synchronize().unwrap();
            }
            gate.word().store(0, Ordering::Release);
            for host in &copies {
                assert_eq!(
                    bytes_of(host),
                    [VALUES[seq as usize]],
                    "batch {seq}: the producer wrote the slot before the reads on the \
                     caller's streams were done"
                );
            }
        }
        let b = c.recv_timeout(WAIT).unwrap().expect("a batch");
        let view = b.data();
        let host = copy_out(&ctx, view.ptr, view.stream);
        view.stream.synchronize().unwrap();
        assert_eq!(bytes_of(&host), [VALUES[2]], "the last batch");
        return;
    }
    let (mut p, socket) = bind("release", 1);
    let child = spawn_consumer(TEST, &socket);
    p.wait_for_consumers(1, WAIT).unwrap();
    for (seq, value) in VALUES.into_iter().enumerate() {
        let mut slot = p.acquire_timeout(WAIT).unwrap();
        assert_eq!(slot.seq(), seq as u64);
        let mem = slot.memory();
        // On the producer's stream, after its waits for the slot's previous consumer.
        // SAFETY: the slot is ours until published; LEN <= its capacity.
        unsafe { memset_d8_async(mem.ptr, value, LEN, mem.stream) }.unwrap();
        slot.publish(LEN as u64).unwrap();
    }
    consumer_passed(child);
    p.close();
}
