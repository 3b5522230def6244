//! `gpipe`: run, feed, consume, inspect and benchmark gpipe rings.

mod bench;
mod cuda_work;
mod duration;
mod size;
mod soak;
mod work;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use pipeline_core::{
    Consumer, ConsumerBackend, ConsumerConfig, HostConsumer, HostOptions, HostProducer, LagPolicy,
    Mode, PendingAttach, Producer, ProducerBackend, ProducerConfig,
};

use pipeline_cuda::backend::{
    CudaConsumer, CudaOptions, CudaProducer, HandleKind, MemoryPath, SyncMode,
};

use crate::work::{Check, ConsumeOptions, Fill};

/// Set by SIGINT/SIGTERM.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to a static atomic, which is async-signal-safe;
        // `signal` is called before any other thread could race on the disposition.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

#[derive(Parser)]
#[command(
    name = "gpipe",
    version,
    about = "Zero-copy GPU/host batch pipelines between processes"
)]
struct Cli {
    /// Log filter (e.g. info, debug, pipeline_core=debug); also RUST_LOG.
    #[arg(long, global = true, default_value = "warn")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// CUDA if a GPU is usable, else host.
    Auto,
    /// Slots in host shared memory.
    Host,
    /// Slots in an exportable CUDA memory pool.
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    Broadcast,
    Shared,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Broadcast => Mode::Broadcast,
            ModeArg::Shared => Mode::Shared,
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
struct CudaArgs {
    /// CUDA memory path: stream-ordered pool, VMM (cuMemCreate) or legacy cudaIpc handles;
    /// auto takes the first the device supports in that order.
    #[arg(long, default_value = "auto")]
    memory: String,
    /// How pool and VMM handles are shared: posix_fd (same host) or fabric (needs IMEX).
    #[arg(long, default_value = "posix_fd")]
    handle: String,
    /// How `ready` is signalled: IPC events or timeline semaphores; auto takes events (measured
    /// faster on an H100, docs/benchmarks.md).
    #[arg(long, default_value = "auto")]
    sync: String,
}

impl CudaArgs {
    /// Resolves `auto`s against the device and builds the backend options.
    fn options(&self) -> Result<CudaOptions, String> {
        let handle: HandleKind = self.handle.parse()?;
        let report = pipeline_cuda::probe::probe().map_err(|e| e.to_string())?;
        let memory = match self.memory.as_str() {
            "auto" => report
                .auto_memory_path_for(0, handle)
                .map_err(|e| e.to_string())?,
            m => {
                let m: MemoryPath = m.parse()?;
                let caps = report.devices.first().ok_or("no CUDA device is visible")?;
                caps.check_path(m, handle).map_err(|e| e.to_string())?;
                m
            }
        };
        let sync = match self.sync.as_str() {
            "auto" => cuda_work::auto_sync(&report),
            y => y.parse::<SyncMode>()?,
        };
        Ok(CudaOptions::default()
            .with_memory(memory)
            .with_handle(handle)
            .with_sync(sync))
    }
}

#[derive(clap::Args, Clone, Debug)]
struct RingArgs {
    /// Delivery mode: every consumer gets every batch, or each batch goes to one consumer.
    #[arg(long, value_enum, default_value = "broadcast")]
    mode: ModeArg,
    /// Slots in the ring.
    #[arg(long, default_value_t = 8)]
    slots: u32,
    /// Bytes per batch (units: KiB, MiB, GiB, K, M, G); slots are rounded up to 2 MiB.
    #[arg(long, value_parser = size::parse, default_value = "4MiB")]
    batch_bytes: u64,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start a producer and N consumer processes, verify every batch, report throughput.
    Bench {
        /// Which backend.
        #[arg(long, value_enum, default_value = "auto")]
        backend: BackendArg,
        /// Consumer processes.
        #[arg(long, default_value_t = 2)]
        consumers: u32,
        #[command(flatten)]
        ring: RingArgs,
        #[command(flatten)]
        cuda: CudaArgs,
        /// Batches to publish.
        #[arg(long, default_value_t = 2000)]
        batches: u64,
        /// Fail (and kill the consumers) if the run takes longer than this (30s, 10m, 1h, or
        /// seconds).
        #[arg(long, value_parser = duration::parse, default_value = "300s")]
        timeout: Duration,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Measure each batch's round trip (publish -> consumer done -> slot free); use with
        /// --slots 1.
        #[arg(long)]
        round_trip: bool,
    },
    /// Run a ring for a while with consumers joining, leaving and being killed at random;
    /// report batches delivered, verified and lost (must be 0) and the producer's memory and
    /// open fds (must not grow).
    Soak {
        /// Which backend.
        #[arg(long, value_enum, default_value = "auto")]
        backend: BackendArg,
        /// How long (30s, 10m, 1h, or seconds).
        #[arg(long, value_parser = duration::parse, default_value = "60s")]
        duration: Duration,
        /// Most consumer processes at once.
        #[arg(long, default_value_t = 6)]
        max_consumers: u32,
        #[command(flatten)]
        ring: RingArgs,
        #[command(flatten)]
        cuda: CudaArgs,
        /// Seed of the random schedule (replay a failing run with the same seed).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Mean milliseconds between chaos actions (starting or killing a consumer).
        #[arg(long, default_value_t = 150)]
        tick_ms: u64,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show the CUDA devices, driver, the capabilities gpipe uses and the path it takes.
    Probe {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Run a producer that publishes pattern batches until Ctrl-C (or --batches).
    Produce {
        /// Socket path consumers attach to.
        #[arg(long)]
        socket: PathBuf,
        /// Which backend.
        #[arg(long, value_enum, default_value = "auto")]
        backend: BackendArg,
        #[command(flatten)]
        ring: RingArgs,
        #[command(flatten)]
        cuda: CudaArgs,
        /// Stop after this many batches (default: run until Ctrl-C).
        #[arg(long)]
        batches: Option<u64>,
        /// Most batches per second (default: as fast as consumers release).
        #[arg(long)]
        rate: Option<f64>,
        /// Most consumers at once (at most 63).
        #[arg(long, default_value_t = 16)]
        max_consumers: u32,
        /// Also allow this uid to attach (repeatable).
        #[arg(long)]
        allow_uid: Vec<u32>,
        /// Also allow peers whose group is this gid (repeatable).
        #[arg(long)]
        allow_gid: Vec<u32>,
        /// Detach a consumer that holds a needed slot, or whose GPU work on a batch the
        /// producer waits for, longer than this many ms (default: wait).
        #[arg(long)]
        detach_after_ms: Option<u64>,
    },
    /// Attach to a producer and consume batches until it closes (or Ctrl-C).
    Consume {
        /// The producer's socket.
        #[arg(long)]
        socket: PathBuf,
        /// Verify each batch's checksum.
        #[arg(long)]
        verify: bool,
        /// Stop after this many batches.
        #[arg(long)]
        max_batches: Option<u64>,
        /// Write every received sequence number here (u64 little-endian).
        #[arg(long)]
        seq_log: Option<PathBuf>,
        /// Print the final report as JSON.
        #[arg(long)]
        json: bool,
        /// Sleep this many microseconds per batch (simulates work).
        #[arg(long, default_value_t = 0)]
        work_us: u64,
        /// Internal: run as a bench consumer (JSON report on stdout).
        #[arg(long, hide = true)]
        bench_child: bool,
    },
    /// Show the live state of a ring: slots, sequence numbers, consumers, lag, liveness.
    Inspect {
        /// The producer's socket.
        #[arg(long)]
        socket: PathBuf,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
}

/// Colour in logs only on a terminal, and never when `NO_COLOR` is set to anything non-empty
/// (no-color.org): `gpipe produce ... 2>log` writes plain text.
fn use_color(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(use_color(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR"),
        ))
        .init();
    install_signal_handlers();
    match run(cli.cmd) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpipe: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Resolves `auto` to a concrete backend, saying why when it falls back to host.
fn resolve_backend(b: BackendArg) -> Result<BackendArg, String> {
    match b {
        BackendArg::Auto => match cuda_usable() {
            Ok(()) => Ok(BackendArg::Cuda),
            Err(why) => {
                eprintln!("gpipe: no usable CUDA GPU ({why}); using the host backend");
                Ok(BackendArg::Host)
            }
        },
        BackendArg::Cuda => cuda_usable()
            .map(|_| BackendArg::Cuda)
            .map_err(|why| format!("--backend cuda: {why}")),
        other => Ok(other),
    }
}

fn cuda_usable() -> Result<(), String> {
    cuda_work::usable()
}

fn run(cmd: Cmd) -> Result<ExitCode, String> {
    match cmd {
        Cmd::Bench {
            backend,
            consumers,
            ring,
            batches,
            timeout,
            json,
            round_trip,
            cuda,
        } => {
            let mut args = bench::BenchArgs {
                consumers,
                mode: ring.mode.into(),
                slots: ring.slots,
                batch_bytes: ring.batch_bytes,
                batches,
                timeout,
                json,
                backend: "host",
                consumer_args: Vec::new(),
                round_trip,
            };
            if round_trip && ring.slots != 1 {
                return Err("--round-trip measures a single-slot round trip: add --slots 1".into());
            }
            let report = match resolve_backend(backend)? {
                BackendArg::Host => {
                    bench::run::<HostProducer, _>(&args, HostOptions, &mut work::HostFill)?
                }
                _ => {
                    args.backend = "cuda";
                    let mps = pipeline_cuda::probe::probe()
                        .map(|r| r.mps_active())
                        .unwrap_or(false);
                    if !mps && !json {
                        eprintln!(
                            "gpipe: MPS is not running, so the GPU time-slices between processes; \
                             for higher throughput start it (nvidia-cuda-mps-control -d)"
                        );
                    }
                    let options = cuda.options()?;
                    let mut report = bench::run::<CudaProducer, _>(
                        &args,
                        options,
                        &mut cuda_work::CudaFill::default(),
                    )?;
                    let ceiling =
                        cuda_work::ceiling(ring.batch_bytes, ring.slots, batches.min(4000))
                            .map_err(|e| format!("measuring the single-process ceiling: {e}"))?;
                    let overlapped = cuda_work::two_stream_ceiling(
                        ring.batch_bytes,
                        ring.slots,
                        batches.min(4000),
                    )
                    .map_err(|e| format!("measuring the two-stream ceiling: {e}"))?;
                    let lag = (ring.slots / 2).max(1);
                    let lagged = cuda_work::lagged_ceiling(
                        ring.batch_bytes,
                        ring.slots,
                        batches.min(4000),
                        lag,
                    )
                    .map_err(|e| format!("measuring the lagged ceiling: {e}"))?;
                    report.extra = serde_json::json!({
                        "memory": options.memory.to_string(),
                        "handle": options.handle.to_string(),
                        "sync": options.sync.to_string(),
                        "attach_us": report.per_consumer.first().and_then(|c| c.attach.clone()),
                        "ceiling_batches_per_s": ceiling,
                        "lagged_ceiling_batches_per_s": lagged,
                        "pool_ceiling_batches_per_s": cuda_work::pool_ceiling(ring.batch_bytes, ring.slots, batches.min(4000))
                            .map_err(|e| format!("measuring the pool ceiling: {e}"))?,
                        "lag": lag,
                        "two_stream_ceiling_batches_per_s": overlapped,
                        "ratio_to_ceiling": report.batches_per_s / ceiling,
                        "mps_active": mps,
                    });
                    report
                }
            };
            print_report(&report, json, report.problems.is_empty())
        }
        Cmd::Produce {
            socket,
            backend,
            ring,
            batches,
            rate,
            max_consumers,
            allow_uid,
            allow_gid,
            detach_after_ms,
            cuda,
        } => {
            let config = ProducerConfig {
                slots: ring.slots,
                batch_bytes: ring.batch_bytes,
                mode: ring.mode.into(),
                max_consumers,
                allowed_uids: allow_uid,
                allowed_gids: allow_gid,
                lag: detach_after_ms
                    .map(|ms| LagPolicy::DetachAfter(Duration::from_millis(ms)))
                    .unwrap_or_default(),
                ..Default::default()
            };
            if ring.batch_bytes % 8 != 0 {
                return Err("--batch-bytes must be a multiple of 8".into());
            }
            match resolve_backend(backend)? {
                BackendArg::Host => produce::<HostProducer, _>(
                    &socket,
                    config,
                    HostOptions,
                    &mut work::HostFill,
                    batches,
                    rate,
                    ring.batch_bytes,
                ),
                _ => produce::<CudaProducer, _>(
                    &socket,
                    config,
                    cuda.options()?,
                    &mut cuda_work::CudaFill::default(),
                    batches,
                    rate,
                    ring.batch_bytes,
                ),
            }
        }
        Cmd::Consume {
            socket,
            verify,
            max_batches,
            seq_log,
            json,
            work_us,
            bench_child,
        } => {
            let json = json || bench_child;
            // A refused or failed attach still ends with a report when one is asked for,
            // so that a harness (bench, soak) learns why rather than seeing silence.
            let failed = |e: String| {
                if json {
                    let r = work::ConsumerReport {
                        pid: std::process::id(),
                        error: Some(e.clone()),
                        attach_failed: true,
                        ..Default::default()
                    };
                    if let Ok(line) = serde_json::to_string(&r) {
                        println!("{line}");
                    }
                }
                e
            };
            let pending = PendingAttach::connect(&socket, ConsumerConfig::default())
                .map_err(|e| failed(e.to_string()))?;
            let opts = ConsumeCmd {
                verify,
                max_batches,
                seq_log,
                json,
                quiet: bench_child,
                work_us,
            };
            match pending.backend() {
                pipeline_core::BackendKind::Host => {
                    let c: Consumer<HostConsumer> = pending
                        .finish(HostOptions)
                        .map_err(|e| failed(e.to_string()))?;
                    consume(c, &mut work::HostCheck::default(), &opts, None)
                }
                pipeline_core::BackendKind::Cuda => {
                    let c: Consumer<CudaConsumer> = pending
                        .finish(CudaOptions::default())
                        .map_err(|e| failed(e.to_string()))?;
                    let attach = serde_json::to_value(c.backend().import_timings()).ok();
                    consume(c, &mut cuda_work::CudaCheck::default(), &opts, attach)
                }
            }
        }
        Cmd::Soak {
            backend,
            duration,
            max_consumers,
            ring,
            seed,
            tick_ms,
            json,
            cuda,
        } => {
            let mut args = soak::SoakArgs {
                tick_ms,
                duration,
                max_consumers,
                mode: ring.mode.into(),
                slots: ring.slots,
                batch_bytes: ring.batch_bytes,
                seed,
                backend: "host",
            };
            let report = match resolve_backend(backend)? {
                BackendArg::Host => {
                    soak::run::<HostProducer, _>(&args, HostOptions, &mut work::HostFill)?
                }
                _ => {
                    args.backend = "cuda";
                    soak::run::<CudaProducer, _>(
                        &args,
                        cuda.options()?,
                        &mut cuda_work::CudaFill::default(),
                    )?
                }
            };
            print_report(&report, json, report.problems.is_empty())
        }
        Cmd::Probe { json } => match pipeline_cuda::probe::probe() {
            Ok(report) => {
                // What `--memory auto --sync auto` resolves to (the paths as measured in
                // docs/benchmarks.md), or why CUDA cannot be used.
                let path = report
                    .auto_memory_path_for(0, HandleKind::PosixFd)
                    .map(|m| format!("memory {m}, sync {}", cuda_work::auto_sync(&report)))
                    .map_err(|e| e.to_string())
                    .and_then(|p| {
                        pipeline_cuda::kernels::ensure_nvrtc()
                            .map(|_| p)
                            .map_err(|e| format!("the benchmark kernels need NVRTC: {e}"))
                    });
                if json {
                    let mut v = serde_json::to_value(&report).map_err(|e| e.to_string())?;
                    v["chosen_path"] = match &path {
                        Ok(p) => serde_json::Value::String(p.clone()),
                        Err(e) => serde_json::Value::String(format!("none: {e}")),
                    };
                    v["mps_active"] = serde_json::Value::Bool(report.mps_active());
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
                    );
                } else {
                    print!("{report}");
                    match &path {
                        Ok(p) => println!("\ngpipe will use (auto): {p}"),
                        Err(e) => println!("\ngpipe cannot use CUDA here: {e}"),
                    }
                }
                Ok(if path.is_ok() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                })
            }
            Err(e) => {
                eprintln!("gpipe probe: no usable CUDA GPU: {e}");
                Ok(ExitCode::FAILURE)
            }
        },
        Cmd::Inspect { socket, json } => {
            let (seg, backend) = pipeline_core::observe(&socket, ConsumerConfig::default())
                .map_err(|e| e.to_string())?;
            let snap = pipeline_core::inspect::Snapshot::read(&seg, &backend.to_string());
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&snap).map_err(|e| e.to_string())?
                );
            } else {
                print!("{snap}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Prints a run's report (JSON or text); the exit code says whether it found problems.
fn print_report<R: serde::Serialize + std::fmt::Display>(
    report: &R,
    json: bool,
    ok: bool,
) -> Result<ExitCode, String> {
    if json {
        let text = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
        println!("{text}");
    } else {
        print!("{report}");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn produce<B: ProducerBackend, F: Fill<B>>(
    socket: &std::path::Path,
    config: ProducerConfig,
    options: B::Options,
    fill: &mut F,
    batches: Option<u64>,
    rate: Option<f64>,
    len: u64,
) -> Result<ExitCode, String> {
    let mut producer: Producer<B> =
        Producer::bind(socket, config, options).map_err(|e| e.to_string())?;
    eprintln!(
        "gpipe: producing on {} ({} backend); Ctrl-C stops",
        socket.display(),
        B::KIND
    );
    let start = Instant::now();
    let mut last = Instant::now();
    let mut last_n = 0u64;
    let interval = rate
        .filter(|r| *r > 0.0)
        .map(|r| Duration::from_secs_f64(1.0 / r));
    let mut timing = work::ProduceTiming::default();
    let n = work::produce_loop(
        &mut producer,
        fill,
        batches,
        len,
        &STOP,
        &mut timing,
        |n, consumers| {
            if let Some(iv) = interval {
                let due = start + iv * n as u32;
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            if last.elapsed() >= Duration::from_secs(1) {
                let dt = last.elapsed().as_secs_f64();
                eprintln!(
                    "gpipe: {} batches published ({:.0}/s), {}",
                    n,
                    (n - last_n) as f64 / dt,
                    duration::plural(consumers, "consumer", "consumers")
                );
                last = Instant::now();
                last_n = n;
            }
        },
    );
    let stats = producer.close();
    eprintln!(
        "gpipe: producer stopped after {} batches; consumers attached {}, left {}, died {}, detached {}, requeued batches {}",
        stats.published, stats.attached, stats.left, stats.died, stats.detached, stats.requeued
    );
    n.map(|_| ExitCode::SUCCESS)
}

struct ConsumeCmd {
    verify: bool,
    max_batches: Option<u64>,
    seq_log: Option<PathBuf>,
    json: bool,
    quiet: bool,
    work_us: u64,
}

fn consume<B: ConsumerBackend, C: Check<B>>(
    mut consumer: Consumer<B>,
    check: &mut C,
    opts: &ConsumeCmd,
    attach: Option<serde_json::Value>,
) -> Result<ExitCode, String> {
    if !opts.quiet {
        eprintln!(
            "gpipe: attached as consumer #{} ({} mode, {} slots); Ctrl-C stops",
            consumer.index(),
            consumer.layout().mode,
            consumer.layout().slot_count
        );
    }
    let mut slow;
    let check: Option<&mut C> = if opts.verify { Some(check) } else { None };
    let (report, seqs) = if opts.work_us > 0 {
        slow = Slow {
            inner: check,
            us: opts.work_us,
        };
        work::consume_loop(
            &mut consumer,
            Some(&mut slow),
            &ConsumeOptions {
                max_batches: opts.max_batches,
                stop: &STOP,
                keep_seqs: opts.seq_log.is_some(),
                progress: !opts.quiet,
            },
        )
    } else {
        work::consume_loop(
            &mut consumer,
            check,
            &ConsumeOptions {
                max_batches: opts.max_batches,
                stop: &STOP,
                keep_seqs: opts.seq_log.is_some(),
                progress: !opts.quiet,
            },
        )
    };
    drop(consumer);
    let mut report = report;
    report.attach = attach;
    if let Some(p) = &opts.seq_log {
        bench::write_seq_log(p, &seqs).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    if opts.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "consumer #{}: {} batches, {:.3} GB, {} checksum mismatches{}",
            report.index,
            report.received,
            report.bytes as f64 / 1e9,
            report.mismatches,
            report
                .error
                .as_ref()
                .map(|e| format!("; ended with: {e}"))
                .unwrap_or_default()
        );
    }
    Ok(if report.error.is_none() && report.mismatches == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Wraps a check with a per-batch sleep (simulated work).
struct Slow<'a, C> {
    inner: Option<&'a mut C>,
    us: u64,
}

impl<B: ConsumerBackend, C: Check<B>> Check<B> for Slow<'_, C> {
    fn check(&mut self, batch: &pipeline_core::Batch<B>) -> Result<(), String> {
        std::thread::sleep(Duration::from_micros(self.us));
        match self.inner.as_deref_mut() {
            Some(c) => c.check(batch),
            None => Ok(()),
        }
    }
    fn finish(&mut self, consumer: &Consumer<B>) -> Result<Vec<u64>, String> {
        match self.inner.as_deref_mut() {
            Some(c) => c.finish(consumer),
            None => Ok(Vec::new()),
        }
    }
}

#[cfg(test)]
mod color_tests {
    use super::use_color;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_color(true, None));
        assert!(!use_color(false, None));
        assert!(!use_color(true, Some("1".into())));
        assert!(use_color(true, Some("".into())));
    }
}
