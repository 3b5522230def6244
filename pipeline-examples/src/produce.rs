//! `gpipe produce`: a producer that publishes pattern batches until Ctrl-C (or `--batches`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pipeline_core::{
    HostOptions, HostProducer, LagPolicy, Producer, ProducerBackend, ProducerConfig,
};
use pipeline_cuda::backend::CudaProducer;

use crate::args::{BackendArg, CudaArgs, RingArgs, resolve_backend};
use crate::work::{self, Fill};
use crate::{STOP, cuda_work, duration};

/// Arguments of `gpipe produce`.
#[derive(clap::Args)]
pub struct ProduceCmd {
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
    /// Publish nothing until this many consumers have attached (up to 5 minutes).
    #[arg(long, default_value_t = 0)]
    wait_for_consumers: u32,
}

/// Runs `gpipe produce`.
pub fn command(cmd: ProduceCmd) -> Result<ExitCode, String> {
    let mut config = ProducerConfig {
        slots: cmd.ring.slots_or_default(),
        batch_bytes: cmd.ring.batch_bytes,
        mode: cmd.ring.mode.into(),
        max_lead: None,
        max_consumers: cmd.max_consumers,
        allowed_uids: cmd.allow_uid,
        allowed_gids: cmd.allow_gid,
        lag: cmd
            .detach_after_ms
            .map(|ms| LagPolicy::DetachAfter(Duration::from_millis(ms)))
            .unwrap_or_default(),
        ..Default::default()
    };
    if cmd.ring.batch_bytes % 8 != 0 {
        return Err("--batch-bytes must be a multiple of 8".into());
    }
    let backend = resolve_backend(cmd.backend)?;
    let depth = cmd.ring.depth(backend == BackendArg::Cuda);
    if let Some(why) = &depth.why {
        eprintln!("gpipe: --slots auto: {} slots ({why})", depth.slots);
    }
    config.slots = depth.slots;
    config.max_lead = cmd
        .ring
        .lead(backend == BackendArg::Cuda, depth.slots)?
        .max_lead;
    match backend {
        BackendArg::Host => produce::<HostProducer, _>(
            &cmd.socket,
            config,
            HostOptions::default(),
            &mut work::HostFill,
            cmd.batches,
            cmd.rate,
            cmd.ring.batch_bytes,
            cmd.wait_for_consumers,
        ),
        _ => produce::<CudaProducer, _>(
            &cmd.socket,
            config,
            cmd.cuda.options()?,
            &mut cuda_work::CudaFill::default(),
            cmd.batches,
            cmd.rate,
            cmd.ring.batch_bytes,
            cmd.wait_for_consumers,
        ),
    }
}

/// Binds a producer on `socket` and publishes `len`-byte batches, at most `rate` a second,
/// until `batches` are out, Ctrl-C or an error.
#[allow(clippy::too_many_arguments)]
fn produce<B: ProducerBackend, F: Fill<B>>(
    socket: &Path,
    config: ProducerConfig,
    options: B::Options,
    fill: &mut F,
    batches: Option<u64>,
    rate: Option<f64>,
    len: u64,
    wait_for: u32,
) -> Result<ExitCode, String> {
    let mut producer: Producer<B> =
        Producer::bind(socket, config, options).map_err(|e| e.to_string())?;
    eprintln!(
        "gpipe: producing on {} ({} backend); Ctrl-C stops",
        socket.display(),
        B::KIND
    );
    if wait_for > 0 {
        eprintln!("gpipe: waiting for {wait_for} consumer(s) to attach");
        producer
            .wait_for_consumers(wait_for, Duration::from_secs(300))
            .map_err(|e| format!("waiting for {wait_for} consumer(s): {e}"))?;
    }
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

/// Under MPS a producer of slots large enough for its consumers to take side signals wants
/// its streams on hardware queues of their own, so this sets `CUDA_DEVICE_MAX_CONNECTIONS=8`
/// where it is unset (measured: docs/benchmarks.md), and says so.
///
/// # Safety
/// As for [`crate::bench::set_process_env`]: first thing in `main`, the only thread.
pub unsafe fn set_process_env(cmd: &ProduceCmd) {
    // SAFETY: the caller guarantees that this is the only thread.
    let vars = unsafe {
        crate::bench::set_cuda_env(
            cmd.backend,
            crate::args::SideSignalsArg::Auto,
            cmd.ring.batch_bytes,
        )
    };
    for (k, v) in vars {
        eprintln!("gpipe produce: running with {k}={v} (batches large enough for side signals)");
    }
}
