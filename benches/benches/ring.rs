//! Criterion benchmarks of the gpipe ring on the host backend, across processes.
//!
//! The producer runs in the benchmark process; the consumer runs in a second process, which
//! is this same binary re-executed with `GPIPE_BENCH_ROLE=consumer` and
//! `GPIPE_BENCH_SOCKET=<path>`. The consumer releases every batch as soon as it receives it,
//! so the numbers measure the ring itself (publish, wake-up, release), not any work.
//!
//! Groups:
//!
//! * `round_trip`: one slot, 64-byte batches. With one slot, `acquire` waits for the consumer
//!   to release the previous batch, so one iteration is one publish → consumer observes →
//!   release → producer observes round trip. Reference: two threads ping-ponging a token
//!   through two `crossbeam_channel::bounded(1)` channels in one process.
//! * `throughput`: eight slots, 4 KiB and 1 MiB batches written with the CPU. Reference: a
//!   producer thread and a consumer thread in one process passing a pool of eight recycled
//!   `Vec<u8>` buffers around two bounded channels, writing the same number of bytes.
//!
//! Run with `cargo bench -p gpipe-benches`.

use std::hint::black_box;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{BenchmarkGroup, Criterion, Throughput, measurement::WallTime};
use crossbeam_channel::{Receiver, Sender, bounded};
use pipeline_core::{
    Consumer, HostConsumer, HostOptions, HostProducer, Mode, Producer, ProducerConfig,
};

/// Environment variable selecting the role of a re-executed benchmark binary.
const ROLE_VAR: &str = "GPIPE_BENCH_ROLE";
/// Environment variable carrying the socket path to the consumer process.
const SOCKET_VAR: &str = "GPIPE_BENCH_SOCKET";

/// Bytes published per batch in the round-trip benchmark.
const ROUND_TRIP_BYTES: u64 = 64;
/// Slots (and pool buffers) in the throughput benchmarks.
const THROUGHPUT_SLOTS: u32 = 8;
/// Batch sizes of the throughput benchmarks, with their names.
const THROUGHPUT_SIZES: [(&str, usize); 2] = [("4KiB", 4 << 10), ("1MiB", 1 << 20)];

fn main() {
    // The consumer role must be handled before criterion parses arguments or prints anything.
    if std::env::var_os(ROLE_VAR).is_some_and(|r| r == "consumer") {
        std::process::exit(consumer_main());
    }

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20)
        .configure_from_args();
    bench_round_trip(&mut c);
    bench_throughput(&mut c);
    c.final_summary();
}

/// The consumer process: attach, release every batch at once, exit when the ring closes.
fn consumer_main() -> i32 {
    let Some(path) = std::env::var_os(SOCKET_VAR) else {
        eprintln!("gpipe bench consumer: {SOCKET_VAR} is not set");
        return 2;
    };
    let mut consumer = match Consumer::<HostConsumer>::attach(&path, HostOptions::default()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpipe bench consumer: attach failed: {e}");
            return 1;
        }
    };
    loop {
        match consumer.recv() {
            Ok(Some(batch)) => drop(batch),
            Ok(None) => return 0,
            Err(e) => {
                eprintln!("gpipe bench consumer: recv failed: {e}");
                return 1;
            }
        }
    }
}

/// A producer in this process with one consumer process attached.
struct CrossProcessRing {
    producer: Option<Producer<HostProducer>>,
    child: Child,
    path: PathBuf,
}

impl CrossProcessRing {
    /// Binds a ring with `slots` slots of at least `batch_bytes`, spawns the consumer process
    /// and waits for it to attach.
    fn start(name: &str, slots: u32, batch_bytes: u64) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "gpipe-bench-{}-{}-{name}.sock",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let config = ProducerConfig {
            slots,
            batch_bytes,
            mode: Mode::Broadcast,
            ..Default::default()
        };
        let producer = Producer::<HostProducer>::bind(&path, config, HostOptions::default())
            .unwrap_or_else(|e| panic!("bind {}: {e}", path.display()));
        let exe = std::env::current_exe().expect("current_exe");
        let child = Command::new(exe)
            .env(ROLE_VAR, "consumer")
            .env(SOCKET_VAR, &path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn the consumer process");
        let mut ring = Self {
            producer: Some(producer),
            child,
            path,
        };
        if let Err(e) = ring
            .producer()
            .wait_for_consumers(1, Duration::from_secs(10))
        {
            let status = ring.child.try_wait();
            panic!("the consumer process did not attach: {e} (child status: {status:?})");
        }
        ring
    }

    fn producer(&mut self) -> &mut Producer<HostProducer> {
        self.producer.as_mut().expect("producer is open")
    }

    /// Closes the ring and reaps the consumer process (killing it after 5 s).
    fn finish(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(producer) = self.producer.take() else {
            return;
        };
        producer.close();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() {
                        eprintln!("gpipe bench consumer exited with {status}");
                    }
                    break;
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                _ => {
                    eprintln!("gpipe bench consumer did not exit within 5 s; killing it");
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for CrossProcessRing {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn bench_round_trip(c: &mut Criterion) {
    let mut group = c.benchmark_group("round_trip");

    let mut ring = CrossProcessRing::start("rt", 1, ROUND_TRIP_BYTES);
    group.bench_function("gpipe_host_1slot", |b| {
        b.iter_custom(|iters| {
            let producer = ring.producer();
            let start = Instant::now();
            for _ in 0..iters {
                // Waits until the consumer released the previous batch.
                let slot = producer.acquire().expect("acquire");
                slot.publish(ROUND_TRIP_BYTES).expect("publish");
            }
            // Wait for the last batch's release too, so `iters` round trips are complete;
            // an unpublished slot goes back to the ring (the next acquire gets it again).
            let _ = producer.acquire().expect("acquire");
            start.elapsed()
        })
    });
    ring.finish();

    let ping_pong = PingPong::start();
    group.bench_function("crossbeam_threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for i in 0..iters {
                ping_pong.ping.send(i).expect("send ping");
                black_box(ping_pong.pong.recv().expect("recv pong"));
            }
            start.elapsed()
        })
    });
    ping_pong.finish();

    group.finish();
}

/// An echo thread bouncing tokens back through a second `bounded(1)` channel.
struct PingPong {
    ping: Sender<u64>,
    pong: Receiver<u64>,
    echo: JoinHandle<()>,
}

impl PingPong {
    fn start() -> Self {
        let (ping, ping_rx) = bounded::<u64>(1);
        let (pong_tx, pong) = bounded::<u64>(1);
        let echo = std::thread::spawn(move || {
            for token in ping_rx {
                if pong_tx.send(token).is_err() {
                    break;
                }
            }
        });
        Self { ping, pong, echo }
    }

    fn finish(self) {
        drop(self.ping);
        self.echo.join().expect("echo thread panicked");
    }
}

fn bench_throughput(c: &mut Criterion) {
    let mut group = c.benchmark_group("throughput");
    for (name, bytes) in THROUGHPUT_SIZES {
        // Small batches: report batches/s; large ones: bytes/s.
        let throughput = if bytes < (1 << 20) {
            Throughput::Elements(1)
        } else {
            Throughput::Bytes(bytes as u64)
        };
        group.throughput(throughput);
        bench_gpipe_throughput(&mut group, name, bytes);
        bench_crossbeam_throughput(&mut group, name, bytes);
    }
    group.finish();
}

fn bench_gpipe_throughput(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, bytes: usize) {
    let mut ring = CrossProcessRing::start(name, THROUGHPUT_SLOTS, bytes as u64);
    let mut fill = 0u8;
    group.bench_function(format!("gpipe_host_{THROUGHPUT_SLOTS}slots_{name}"), |b| {
        let producer = ring.producer();
        b.iter(|| {
            let mut slot = producer.acquire().expect("acquire");
            fill = fill.wrapping_add(1);
            slot.memory()[..bytes].fill(black_box(fill));
            slot.publish(bytes as u64).expect("publish")
        })
    });
    ring.finish();
}

fn bench_crossbeam_throughput(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, bytes: usize) {
    let pool = BufferPool::start(THROUGHPUT_SLOTS as usize, bytes);
    let mut fill = 0u8;
    group.bench_function(format!("crossbeam_threads_{name}"), |b| {
        b.iter(|| {
            // Waits until the consumer handed a buffer back, like gpipe's acquire.
            let mut buf = pool.free.recv().expect("recv free buffer");
            fill = fill.wrapping_add(1);
            buf[..bytes].fill(black_box(fill));
            pool.full.send(buf).expect("send full buffer");
        })
    });
    pool.finish();
}

/// A pool of buffers going around two bounded channels between this thread (the producer)
/// and a consumer thread that returns each buffer as soon as it receives it.
struct BufferPool {
    full: Sender<Vec<u8>>,
    free: Receiver<Vec<u8>>,
    consumer: JoinHandle<()>,
}

impl BufferPool {
    fn start(count: usize, bytes: usize) -> Self {
        let (full, full_rx) = bounded::<Vec<u8>>(count);
        let (free_tx, free) = bounded::<Vec<u8>>(count);
        for _ in 0..count {
            free_tx.send(vec![0u8; bytes]).expect("fill the pool");
        }
        let consumer = std::thread::spawn(move || {
            for buf in full_rx {
                if free_tx.send(black_box(buf)).is_err() {
                    break;
                }
            }
        });
        Self {
            full,
            free,
            consumer,
        }
    }

    fn finish(self) {
        drop(self.full);
        self.consumer.join().expect("pool consumer thread panicked");
    }
}
