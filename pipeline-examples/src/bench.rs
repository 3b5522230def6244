//! `gpipe bench`: one producer (this process) and N consumer processes (this binary's
//! `consume` command), every batch verified, results checked for loss and duplication.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use pipeline_core::{
    Delivery, HostOptions, HostProducer, Mode, Producer, ProducerBackend, ProducerConfig,
};
use pipeline_cuda::backend::CudaProducer;

use pipeline_relay::{Fanout, FanoutPlan, RelayReport};

use crate::args::{
    BackendArg, CudaArgs, DepthChoice, RingArgs, SideSignalsArg, SlotsArg, resolve_backend,
};
use crate::work::{self, ConsumerReport, Fill};
use crate::{cuda_work, duration};

/// Arguments of `gpipe bench`.
#[derive(clap::Args)]
pub struct BenchCmd {
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
    /// Run the whole bench this many times (fresh consumers each time) and report the median
    /// repetition, the spread, and every repetition in the JSON.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeat: u32,
    /// Measure each batch's round trip (publish -> consumer done -> slot free); use with
    /// --slots 1.
    #[arg(long)]
    round_trip: bool,
    /// CUDA device of each consumer, one entry per consumer (e.g. 0,1,1); the producer runs
    /// on device 0. A consumer on another device reaches the slots by peer access.
    #[arg(long, value_delimiter = ',')]
    consumer_devices: Vec<usize>,
    /// How batches reach the consumers: in-place, mirror or auto (in place on the producer's
    /// GPU, mirrored on another); one value for all, or one per consumer (auto,mirror).
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    delivery: Vec<Delivery>,
    /// Mirroring consumers: batches each may hold at once (default: the ring's slot count).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    mirror_buffers: Option<u32>,
    /// CUDA consumers in place: wait for `ready` and write `finished` on side streams of
    /// their own (on) or on the stream that runs the verify (off); auto: on for slots of 16
    /// MiB and more (see `gpipe consume --help`). With them on, the run's processes get
    /// CUDA_DEVICE_MAX_CONNECTIONS=8 unless it is set: under MPS a process's streams would
    /// share hardware queues otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    side_signals: SideSignalsArg,
    /// How batches reach the GPUs other than the producer's (broadcast): direct (every
    /// consumer reads the producer's ring), chain (a forwarder per GPU copies from the GPU
    /// before it into a ring of its own), tree (a binary tree of forwarders), or auto. On the
    /// host backend, --consumer-devices then names groups of consumers, each with its own ring.
    #[arg(long, default_value = "direct")]
    fanout: Fanout,
    /// Times each consumer reads every batch (the first read verifies it): a stand-in for a
    /// model that reads its input more than once. One value for all, or one per consumer
    /// (16,1). The fair ceiling does the same reads.
    #[arg(long, value_delimiter = ',', default_value = "1", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    passes: Vec<u32>,
    /// CUDA: stamp the GPU start and end of the fill and of each consumer's verify of this
    /// many timed batches (the GPU's global timer, shared by every process), and report how
    /// busy the GPU was, how much the kernels overlapped, the idle gaps and the handover
    /// (verify start minus fill end) under `gpu_timeline`.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    gpu_timeline: u64,
    /// With --gpu-timeline: also write every stamp here (JSON; with --repeat, the last
    /// repetition's).
    #[arg(long, requires = "gpu_timeline")]
    gpu_timeline_out: Option<std::path::PathBuf>,
}

/// Runs `gpipe bench`.
pub fn command(cmd: BenchCmd) -> Result<ExitCode, String> {
    let mut args = BenchArgs {
        consumers: cmd.consumers,
        mode: cmd.ring.mode.into(),
        slots: cmd.ring.slots_or_default(),
        batch_bytes: cmd.ring.batch_bytes,
        max_lead: None,
        batches: cmd.batches,
        timeout: cmd.timeout,
        json: cmd.json,
        backend: "host",
        consumer_args: cmd
            .mirror_buffers
            .map(|n| vec!["--mirror-buffers".to_string(), n.to_string()])
            .into_iter()
            .flatten()
            .chain(["--side-signals".into(), cmd.side_signals.as_str().into()])
            .collect(),
        round_trip: cmd.round_trip,
        consumer_devices: cmd.consumer_devices.clone(),
        delivery: cmd.delivery.clone(),
        fanout: cmd.fanout,
        passes: cmd.passes.clone(),
        gpu_timeline: cmd.gpu_timeline,
        gpu_timeline_out: cmd.gpu_timeline_out.clone(),
        cuda_env: Vec::new(),
    };
    if cmd.round_trip && cmd.ring.slots != SlotsArg::Count(1) {
        return Err("--round-trip measures a single-slot round trip: add --slots 1".into());
    }
    if cmd.delivery.len() != 1 && cmd.delivery.len() != cmd.consumers as usize {
        return Err(format!(
            "--delivery names {} choices for {}: give one for all, or one per consumer",
            cmd.delivery.len(),
            duration::plural(u64::from(cmd.consumers), "consumer", "consumers")
        ));
    }
    if cmd.passes.len() > 1 && args.mode == Mode::Shared {
        return Err(
            "--passes takes one value in shared mode (each batch goes to one consumer, so the \
             fair ceiling needs one figure for all)"
                .into(),
        );
    }
    if cmd.passes.len() != 1 && cmd.passes.len() != cmd.consumers as usize {
        return Err(format!(
            "--passes names {} values for {}: give one for all, or one per consumer",
            cmd.passes.len(),
            duration::plural(u64::from(cmd.consumers), "consumer", "consumers")
        ));
    }
    if !cmd.consumer_devices.is_empty() && cmd.consumer_devices.len() != cmd.consumers as usize {
        return Err(format!(
            "--consumer-devices names {} device(s) for {}: give one per consumer",
            cmd.consumer_devices.len(),
            duration::plural(u64::from(cmd.consumers), "consumer", "consumers")
        ));
    }
    if cmd.gpu_timeline > 0 {
        if cmd.consumer_devices.iter().any(|&d| d != 0) || cmd.fanout != Fanout::Direct {
            return Err(
                "--gpu-timeline needs every consumer on the producer's GPU, reading its ring \
                 (each GPU has a timer of its own)"
                    .into(),
            );
        }
        // Each batch's fill and one verify per consumer are stamped: work besides them
        // would show as idle time, and a batch must reach every consumer once.
        if args.mode == Mode::Shared
            || cmd.passes.iter().any(|&p| p > 1)
            || cmd.delivery.contains(&Delivery::Mirror)
        {
            return Err(
                "--gpu-timeline stamps one fill and one verify per consumer of each batch: it \
                 needs --mode broadcast, --passes 1 and in-place delivery"
                    .into(),
            );
        }
    }
    let backend = resolve_backend(cmd.backend)?;
    if cmd.gpu_timeline > 0 && backend != BackendArg::Cuda {
        return Err("--gpu-timeline stamps GPU kernels: it needs --backend cuda".into());
    }
    let mut depth = cmd.ring.depth(backend == BackendArg::Cuda);
    if depth.auto && backend == BackendArg::Cuda && depth.slots > 8 {
        // No MPS: measure the depths within the budget, and take the best.
        depth = measure_depth(&args, &cmd)?;
    }
    if let Some(why) = &depth.why {
        eprintln!("gpipe bench: --slots auto: {} slots ({why})", depth.slots);
    }
    args.slots = depth.slots;
    let lead = cmd.ring.lead(backend == BackendArg::Cuda, depth.slots)?;
    args.max_lead = lead.max_lead;
    let side = cmd.side_signals;
    if let Some(why) =
        side_signals_with_lead(backend, side, args.batch_bytes, args.slots, args.max_lead)
    {
        eprintln!("gpipe bench: {why}");
    }
    let shape = args.plan().shape;
    if shape != Fanout::Direct && args.mode != Mode::Broadcast {
        return Err(format!(
            "--fanout {shape} forwards every batch to every GPU: it needs --mode broadcast"
        ));
    }
    if backend == BackendArg::Host && !cmd.consumer_devices.is_empty() && shape == Fanout::Direct {
        return Err(
            "--consumer-devices applies to the CUDA backend (or, on the host backend, to a \
             chain or tree --fanout, where it names groups of consumers)"
                .into(),
        );
    }
    if backend != BackendArg::Host {
        args.cuda_env = PROCESS_ENV.get().cloned().unwrap_or_default();
        for (k, v) in &args.cuda_env {
            eprintln!(
                "gpipe bench: the producer and consumers run with {k}={v} (side signals on and \
                 the variable unset: under MPS a process's streams would share hardware queues)"
            );
        }
    }
    let mut reports = Vec::new();
    for i in 0..cmd.repeat {
        if cmd.repeat > 1 && !cmd.json {
            eprintln!("gpipe bench: repetition {} of {}", i + 1, cmd.repeat);
        }
        let report = match backend {
            BackendArg::Host => {
                run::<HostProducer, _>(&args, HostOptions::default(), &mut work::HostFill)?
            }
            _ => {
                args.backend = "cuda";
                let mut r = run_cuda(&args, &cmd.cuda)?;
                if lead.auto {
                    r.extra["max_lead_auto"] = serde_json::to_value(lead).unwrap_or_default();
                }
                if depth.auto {
                    r.extra["slots_auto"] = serde_json::to_value(&depth).unwrap_or_default();
                }
                if !args.cuda_env.is_empty() {
                    r.extra["cuda_env"] = args.cuda_env.iter().cloned().collect();
                }
                r
            }
        };
        reports.push(report);
        if crate::STOP.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
    }
    let report = fold_repetitions(reports);
    crate::print_report(&report, cmd.json, report.problems.is_empty())
}

/// What [`set_process_env`] set.
static PROCESS_ENV: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();

/// What a CUDA run's processes need in their environment: side signals (as `--side-signals`
/// resolves for slots of `batch_bytes`) want a process's streams on hardware queues of their
/// own, so `CUDA_DEVICE_MAX_CONNECTIONS=8` where it is unset (measured under MPS, with it
/// set for the producer and the consumers: docs/benchmarks.md). A value the user set is kept.
fn cuda_env(side: SideSignalsArg, batch_bytes: u64) -> Vec<(String, String)> {
    if side.resolve(batch_bytes) && pipeline_cuda::probe::max_connections().is_none() {
        let n = pipeline_cuda::probe::SIDE_SIGNALS_CONNECTIONS;
        vec![("CUDA_DEVICE_MAX_CONNECTIONS".into(), n.to_string())]
    } else {
        Vec::new()
    }
}

/// Sets [`cuda_env`] in this process's environment, which the consumer processes inherit
/// (CUDA reads it when a context is made).
///
/// # Safety
/// No other thread may exist yet (call it first thing in `main`): setting the environment
/// races with any other thread reading it.
pub unsafe fn set_process_env(cmd: &BenchCmd) {
    // SAFETY: the caller guarantees that this is the only thread.
    let vars = unsafe { set_cuda_env(cmd.backend, cmd.side_signals, cmd.ring.batch_bytes) };
    let _ = PROCESS_ENV.set(vars);
}

/// Sets [`cuda_env`] for a CUDA (or auto) backend in this process's environment and returns
/// what it set.
///
/// # Safety
/// As for [`set_process_env`].
pub unsafe fn set_cuda_env(
    backend: BackendArg,
    side: SideSignalsArg,
    batch_bytes: u64,
) -> Vec<(String, String)> {
    if backend == BackendArg::Host {
        return Vec::new();
    }
    let vars = cuda_env(side, batch_bytes);
    for (k, v) in &vars {
        // SAFETY: the caller guarantees that no other thread exists, so nothing reads the
        // environment concurrently.
        unsafe { std::env::set_var(k, v) };
    }
    vars
}

/// A warning when the consumers take side signals and the producer's lead is bounded below
/// the ring: on an H100 the two together ran slower than either alone (8 and 16 MiB,
/// docs/benchmarks.md).
fn side_signals_with_lead(
    backend: BackendArg,
    side: SideSignalsArg,
    batch_bytes: u64,
    slots: u32,
    max_lead: Option<u32>,
) -> Option<String> {
    let lead = max_lead.filter(|&l| l < slots)?;
    (backend != BackendArg::Host && side.resolve(batch_bytes)).then(|| {
        format!(
            "side signals with a lead bound of {lead} batches: measured slower together than \
             either alone (docs/benchmarks.md); keep one, e.g. add --side-signals off"
        )
    })
}

/// `--slots auto` on a GPU without MPS: a short run at each depth within the budget (the
/// same consumers, batch size and mode), and the depth that moved the most batches.
fn measure_depth(args: &BenchArgs, cmd: &BenchCmd) -> Result<DepthChoice, String> {
    let depths = crate::args::depths_within(cmd.ring.batch_bytes, cmd.ring.depth_budget);
    let mut trial = args.clone();
    trial.json = true;
    trial.backend = "cuda";
    trial.round_trip = false;
    // About a quarter of a second each at the rates seen without MPS, at least 200 batches.
    trial.batches = (args.batches / 4).clamp(200, 2000);
    let options = cmd.cuda.options()?;
    let mut trials = Vec::new();
    for &d in &depths {
        trial.slots = d;
        // The lead bound the run will have at this depth (--max-lead auto depends on it).
        trial.max_lead = cmd.ring.lead(true, d)?.max_lead;
        let r = run::<CudaProducer, _>(&trial, options, &mut cuda_work::CudaFill::default())?;
        if !r.problems.is_empty() {
            return Err(format!(
                "--slots auto: the trial run at {d} slots failed: {}",
                r.problems.join("; ")
            ));
        }
        eprintln!(
            "gpipe bench: --slots auto: {d} slots: {:.0} batches/s",
            r.batches_per_s
        );
        trials.push((d, r.batches_per_s));
    }
    let best = trials
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(8, |t| t.0);
    Ok(DepthChoice {
        slots: best,
        auto: true,
        why: Some(format!(
            "MPS is not running: measured {} within the {} budget; {best} moved the most",
            trials
                .iter()
                .map(|(d, r)| format!("{d}: {}/s", compact_rate(*r)))
                .collect::<Vec<_>>()
                .join(", "),
            crate::size::format(cmd.ring.depth_budget)
        )),
        trials,
    })
}

/// The CUDA bench: the run itself, then, in this process, the single-process ceilings it is
/// measured against, and a hint when MPS is not running.
fn run_cuda(args: &BenchArgs, cuda: &CudaArgs) -> Result<BenchReport, String> {
    let mps = pipeline_cuda::probe::probe()
        .map(|r| r.mps_active())
        .unwrap_or(false);
    let options = cuda.options()?;
    let mut fill = cuda_work::CudaFill::with_timeline(warmup_of(args.batches), args.gpu_timeline);
    let mut report = run::<CudaProducer, _>(args, options, &mut fill)?;
    let timeline = match fill.timeline()? {
        Some(fills) => {
            let verifies: Vec<Vec<[u64; 2]>> = report
                .per_consumer
                .iter_mut()
                .map(|c| c.gpu_timeline.take().unwrap_or_default())
                .collect();
            if let Some(path) = &args.gpu_timeline_out {
                let raw = serde_json::json!({
                    "first_seq": warmup_of(args.batches),
                    "fills": fills,
                    "verifies": verifies,
                });
                std::fs::write(path, raw.to_string())
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            }
            Some(timeline_summary(&fills, &verifies))
        }
        None => None,
    };
    let (bytes, slots, batches) = (args.batch_bytes, args.slots, args.batches.min(4000));
    let ceiling = cuda_work::ceiling(bytes, slots, batches)
        .map_err(|e| format!("measuring the single-process ceiling: {e}"))?;
    let overlapped = cuda_work::two_stream_ceiling(bytes, slots, batches)
        .map_err(|e| format!("measuring the two-stream ceiling: {e}"))?;
    let lag = (slots / 2).max(1);
    let lagged = cuda_work::lagged_ceiling(bytes, slots, batches, lag)
        .map_err(|e| format!("measuring the lagged ceiling: {e}"))?;
    let pool = cuda_work::pool_ceiling(bytes, slots, batches)
        .map_err(|e| format!("measuring the pool ceiling: {e}"))?;
    // The fair ceiling: the run's own work per batch (1 fill + N verifies in broadcast with N
    // consumers, 1 + 1 in shared; each consumer's --passes times), on one stream and spread
    // over streams; the better counts.
    let reads: Vec<u32> = match args.mode {
        Mode::Broadcast => (0..args.consumers.max(1))
            .map(|i| args.passes_of(i))
            .collect(),
        Mode::Shared => vec![args.passes_of(0)],
    };
    let verifies: u32 = reads.iter().sum();
    let fair_one = cuda_work::fair_ceiling(bytes, slots, batches, &reads, false)
        .map_err(|e| format!("measuring the fair ceiling on one stream: {e}"))?;
    let fair_spread = cuda_work::fair_ceiling(bytes, slots, batches, &reads, true)
        .map_err(|e| format!("measuring the fair ceiling over streams: {e}"))?;
    let fair = fair_one.max(fair_spread);
    let mut extra = serde_json::json!({
        "memory": options.memory.to_string(),
        "handle": options.handle.to_string(),
        "sync": options.sync.to_string(),
        "timeline_memory": options.timeline_memory.to_string(),
        "attach_us": report.per_consumer.first().and_then(|c| c.attach.clone()),
        "ceiling_batches_per_s": ceiling,
        "lagged_ceiling_batches_per_s": lagged,
        "pool_ceiling_batches_per_s": pool,
        "lag": lag,
        "two_stream_ceiling_batches_per_s": overlapped,
        "ratio_to_ceiling": report.batches_per_s / ceiling,
        "fair_ceiling_batches_per_s": fair,
        "fair_ceiling_one_stream_batches_per_s": fair_one,
        "fair_ceiling_spread_batches_per_s": fair_spread,
        "fair_ceiling_verifies_per_batch": verifies,
        "ratio_to_fair_ceiling": report.batches_per_s / fair,
        "mps_active": mps,
        "producer_device": 0,
        "consumer_devices": if args.consumer_devices.is_empty() {
            vec![0; args.consumers as usize]
        } else {
            args.consumer_devices.clone()
        },
        "delivery": report
            .per_consumer
            .iter()
            .map(|c| c.delivery.clone().unwrap_or_default())
            .collect::<Vec<_>>(),
    });
    if let Some(t) = timeline {
        extra["gpu_timeline"] = t;
    }
    // Consumers on other GPUs: the same-run single-process ceilings of the link, per device.
    let mut others: Vec<usize> = args
        .consumer_devices
        .iter()
        .copied()
        .filter(|&d| d != 0)
        .collect();
    others.sort_unstable();
    others.dedup();
    let mut peers = Vec::new();
    for d in others {
        let copy = cuda_work::peer_copy_ceiling(bytes, 0, d, slots, batches)
            .map_err(|e| format!("measuring the peer-copy ceiling 0 -> {d}: {e}"))?;
        let read = cuda_work::remote_read_ceiling(bytes, 0, d, slots, batches)
            .map_err(|e| format!("measuring the remote-read ceiling 0 -> {d}: {e}"))?;
        peers.push(serde_json::json!({
            "device": d,
            "peer_copy_ceiling_batches_per_s": copy,
            "peer_copy_ceiling_gb_per_s": copy * bytes as f64 / 1e9,
            "remote_read_ceiling_batches_per_s": read,
            "remote_read_ceiling_gb_per_s": read * bytes as f64 / 1e9,
        }));
    }
    if !peers.is_empty() {
        extra["peer_ceilings"] = serde_json::Value::Array(peers);
    }
    if let Some(hint) = mps_hint(mps, report.batches_per_s, ceiling, report.round_trip_p50_us) {
        extra[MPS_HINT] = serde_json::Value::String(hint);
    }
    report.extra = extra;
    Ok(report)
}

/// Settings of one bench run (from the command line).
#[derive(Clone, Debug)]
pub struct BenchArgs {
    /// Consumer processes.
    pub consumers: u32,
    /// Delivery mode.
    pub mode: Mode,
    /// Slots.
    pub slots: u32,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// The producer-lead bound (None: the ring's own).
    pub max_lead: Option<u32>,
    /// Batches to publish.
    pub batches: u64,
    /// Whole-run limit.
    pub timeout: Duration,
    /// JSON output.
    pub json: bool,
    /// Backend name for the report.
    pub backend: &'static str,
    /// Extra arguments for the consumer processes (backend selection).
    pub consumer_args: Vec<String>,
    /// Measure each batch's round trip (publish -> consumer done -> slot free); needs 1 slot.
    pub round_trip: bool,
    /// CUDA device of each consumer (empty: the producer's).
    pub consumer_devices: Vec<usize>,
    /// Delivery of each consumer (one entry: all of them).
    pub delivery: Vec<Delivery>,
    /// How batches reach the other GPUs.
    pub fanout: Fanout,
    /// Reads of every batch by each consumer (one entry: all of them).
    pub passes: Vec<u32>,
    /// CUDA: record the GPU start and end of this many timed batches' fill and verify.
    pub gpu_timeline: u64,
    /// Where to write those stamps (JSON), if anywhere.
    pub gpu_timeline_out: Option<std::path::PathBuf>,
    /// Environment variables this process set for itself, before CUDA, and so for every
    /// process of the run, which inherit them ([`set_process_env`]).
    pub cuda_env: Vec<(String, String)>,
}

/// Batches published before timing starts (verified like the others, not timed).
pub fn warmup_of(batches: u64) -> u64 {
    (batches / 5).min(100)
}

impl BenchArgs {
    /// How many times consumer `i` reads every batch.
    pub fn passes_of(&self, i: u32) -> u32 {
        self.passes
            .get(i as usize)
            .or(self.passes.first())
            .copied()
            .unwrap_or(1)
    }

    /// The rings of the run and which one each consumer reads.
    pub fn plan(&self) -> FanoutPlan {
        let devices = if self.consumer_devices.is_empty() {
            vec![0; self.consumers as usize]
        } else {
            self.consumer_devices.clone()
        };
        pipeline_relay::plan_fanout(self.fanout, 0, &devices, self.batch_bytes)
    }
}

/// The bench result.
#[derive(Debug, serde::Serialize)]
pub struct BenchReport {
    /// Backend used.
    pub backend: String,
    /// Delivery mode.
    pub mode: Mode,
    /// Consumers.
    pub consumers: u32,
    /// Slots.
    pub slots: u32,
    /// The producer-lead bound, when one was set (`--max-lead`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_lead: Option<u32>,
    /// Reads of every batch by each consumer (`--passes`), one entry per consumer.
    pub passes: Vec<u32>,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// Batches published.
    pub published: u64,
    /// Seconds from the first timed batch (after the warm-up) to the last release.
    pub elapsed_s: f64,
    /// Batches published before timing started (verified, not timed).
    pub warmup: u64,
    /// Batches per second published and fully consumed.
    pub batches_per_s: f64,
    /// GB/s of batches handed over (published bytes / s).
    pub gb_per_s: f64,
    /// GB/s delivered summed over consumers (broadcast: x consumers).
    pub delivered_gb_per_s: f64,
    /// Each consumer's report.
    pub per_consumer: Vec<ConsumerReport>,
    /// Batches that failed verification.
    pub mismatches: u64,
    /// Batches lost (never delivered where they should have been).
    pub lost: u64,
    /// Batches delivered more than once (shared) or twice to one consumer.
    pub duplicated: u64,
    /// Seconds the producer spent in `acquire` waiting for consumers to release (whole run).
    pub producer_acquire_wait_s: f64,
    /// Seconds the producer spent in its fill (enqueueing the fill kernel), timed batches.
    #[serde(default)]
    pub producer_fill_s: f64,
    /// Seconds the producer spent in `publish` (signalling `ready`), timed batches.
    #[serde(default)]
    pub producer_publish_s: f64,
    /// Batches the producer's fill and publish times cover (the timed ones).
    #[serde(default)]
    pub producer_host_timed: u64,
    /// Round trip publish -> consumer done -> slot free, median (µs), with `--round-trip`.
    pub round_trip_p50_us: Option<f64>,
    /// Round trip, 99th percentile (µs).
    pub round_trip_p99_us: Option<f64>,
    /// Problems found, in words.
    pub problems: Vec<String>,
    /// A chain or tree fan-out: its rings and forwarders.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fanout: Option<FanoutReport>,
    /// Extra measurements the backend adds (e.g. the CUDA single-process ceiling).
    pub extra: serde_json::Value,
    /// With `--repeat N` (N > 1): every repetition and the spread; the rest of the report is
    /// the repetition with the median rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetitions: Option<Repetitions>,
}

/// The repetitions of a `--repeat` run.
#[derive(Debug, serde::Serialize)]
pub struct Repetitions {
    /// Batches per second over the repetitions.
    pub batches_per_s: Spread,
    /// The ratio to the fair ceiling (CUDA), each repetition against its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to_fair_ceiling: Option<Spread>,
    /// Each repetition's figures, in the order they ran.
    pub runs: Vec<serde_json::Value>,
}

/// Median, minimum and maximum of a figure over repetitions.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of `xs` (non-empty; NaNs sort last).
    pub fn of(xs: &[f64]) -> Spread {
        let mut v = xs.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }
}

/// Folds the reports of `--repeat` runs into one: the repetition with the median rate, every
/// problem of every repetition, and the spread.
fn fold_repetitions(mut reports: Vec<BenchReport>) -> BenchReport {
    if reports.len() == 1 {
        return reports.remove(0);
    }
    let rates: Vec<f64> = reports.iter().map(|r| r.batches_per_s).collect();
    let fair: Vec<f64> = reports
        .iter()
        .filter_map(|r| r.extra["ratio_to_fair_ceiling"].as_f64())
        .collect();
    let runs = reports
        .iter()
        .enumerate()
        .map(|(i, r)| {
            serde_json::json!({
                "repetition": i + 1,
                "batches_per_s": r.batches_per_s,
                "gb_per_s": r.gb_per_s,
                "elapsed_s": r.elapsed_s,
                "ratio_to_fair_ceiling": r.extra["ratio_to_fair_ceiling"],
                "fair_ceiling_batches_per_s": r.extra["fair_ceiling_batches_per_s"],
                "round_trip_p50_us": r.round_trip_p50_us,
                "problems": r.problems,
            })
        })
        .collect();
    let mut order: Vec<usize> = (0..reports.len()).collect();
    order.sort_by(|&a, &b| rates[a].total_cmp(&rates[b]));
    let mid = order[(order.len() - 1) / 2];
    let problems: Vec<String> = reports
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.problems
                .iter()
                .map(move |p| format!("repetition {}: {p}", i + 1))
        })
        .collect();
    let mut report = reports.swap_remove(mid);
    report.problems = problems;
    report.repetitions = Some(Repetitions {
        batches_per_s: Spread::of(&rates),
        ratio_to_fair_ceiling: (fair.len() == rates.len()).then(|| Spread::of(&fair)),
        runs,
    });
    report
}

struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn temp_dir() -> Result<PathBuf, String> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("gpipe-bench-{}-{nanos}", std::process::id()));
    std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    Ok(dir)
}

/// Runs the bench with backend `B` filled by `fill`. `extra` may add measurements.
pub fn run<B: ProducerBackend, F: Fill<B>>(
    args: &BenchArgs,
    options: B::Options,
    fill: &mut F,
) -> Result<BenchReport, String> {
    let dir = temp_dir()?;
    let result = run_in(&dir, args, options, fill);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_in<B: ProducerBackend, F: Fill<B>>(
    dir: &Path,
    args: &BenchArgs,
    options: B::Options,
    fill: &mut F,
) -> Result<BenchReport, String> {
    if args.batch_bytes % 8 != 0 || args.batch_bytes == 0 {
        return Err("--batch-bytes must be a positive multiple of 8".into());
    }
    let sock = dir.join("ring.sock");
    let plan = args.plan();
    let ring_sock = |r: usize| {
        if r == 0 {
            sock.clone()
        } else {
            dir.join(format!("ring-{r}.sock"))
        }
    };
    let config = ProducerConfig {
        slots: args.slots,
        batch_bytes: args.batch_bytes,
        mode: args.mode,
        max_consumers: plan.attachments(0).max(1),
        drain_timeout: Duration::from_secs(30),
        max_lead: args.max_lead,
        ..Default::default()
    };
    let deadline = Instant::now() + args.timeout;
    let mut producer: Producer<B> =
        Producer::bind(&sock, config, options).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Children(Vec::new());
    // Forwarders first (a parent's ring before its children's), each waiting for everything
    // that reads its ring before it takes a batch.
    let mut forwarders = Children(Vec::new());
    for (r, node) in plan.rings.iter().enumerate().skip(1) {
        let parent = ring_sock(node.parent.unwrap_or(0));
        wait_for_socket(&parent, &mut forwarders, deadline)?;
        let n = plan.attachments(r);
        let mut cmd = Command::new(&exe);
        cmd.args(["relay", "forward", "--json", "--upstream"])
            .arg(&parent)
            .arg("--socket")
            .arg(ring_sock(r))
            .args(["--slots", &args.slots.to_string()])
            .args(["--max-consumers", &n.max(1).to_string()])
            .args(["--wait-for-consumers", &n.to_string()]);
        if args.backend == "cuda" {
            cmd.args(["--device", &node.device.to_string()]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start forwarder process: {e}"))?;
        forwarders.0.push(child);
    }
    for i in 0..args.consumers {
        let ring = plan.consumer_ring.get(i as usize).copied().unwrap_or(0);
        wait_for_socket(&ring_sock(ring), &mut forwarders, deadline)?;
        let device = (args.backend == "cuda")
            .then(|| args.consumer_devices.get(i as usize))
            .flatten();
        let child = Command::new(&exe)
            .arg("consume")
            .arg("--socket")
            .arg(ring_sock(ring))
            .arg("--verify")
            .arg("--bench-child")
            .arg("--seq-log")
            .arg(dir.join(format!("consumer-{i}.seq")))
            .arg("--passes")
            .arg(args.passes_of(i).to_string())
            .arg("--timed-from")
            .arg(warmup_of(args.batches).to_string())
            .args(&args.consumer_args)
            .args(
                (args.gpu_timeline > 0 && args.backend == "cuda")
                    .then(|| {
                        [
                            "--gpu-timeline".to_string(),
                            format!("{}:{}", warmup_of(args.batches), args.gpu_timeline),
                        ]
                    })
                    .into_iter()
                    .flatten(),
            )
            .args(
                device
                    .map(|d| ["--device".to_string(), d.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .args(
                args.delivery
                    .get(i as usize)
                    .or(args.delivery.first())
                    .map(|d| ["--delivery".to_string(), d.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start consumer process: {e}"))?;
        children.0.push(child);
    }
    // Wait for everything that reads the producer's ring to attach (a child that exits early
    // fails the run).
    while producer.consumers() < plan.attachments(0) {
        for c in children.0.iter_mut().chain(forwarders.0.iter_mut()) {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(format!(
                    "a consumer or forwarder process exited before attaching ({st})"
                ));
            }
        }
        if Instant::now() >= deadline.min(Instant::now() + Duration::from_secs(60)) {
            return Err("consumers did not attach in time".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let bar = if std::io::stderr().is_terminal() && !args.json {
        let b = indicatif::ProgressBar::new(args.batches);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} batches ({per_sec})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(b)
    } else {
        None
    };
    let stop = AtomicBool::new(false);
    let mut timing = work::ProduceTiming {
        round_trips: args.round_trip.then(Vec::new),
        timed_from: warmup_of(args.batches),
        ..Default::default()
    };
    // The first batches warm up (kernel compilation, first touches) and are not timed, but
    // they are verified like every other.
    let warmup = warmup_of(args.batches);
    let mut timed_from: Option<Instant> = (warmup == 0).then(Instant::now);
    let mut timed_from_wall = std::time::SystemTime::now();
    let published = work::produce_loop(
        &mut producer,
        fill,
        Some(args.batches),
        args.batch_bytes,
        &stop,
        &mut timing,
        |n, _| {
            if n == warmup {
                timed_from = Some(Instant::now());
                timed_from_wall = std::time::SystemTime::now();
            }
            if let Some(b) = &bar {
                if n % 64 == 0 {
                    b.set_position(n);
                }
            }
        },
    );
    // The timed run ends when every consumer has released (and, on a GPU, finished) the
    // last batch; closing (consumers detach, free their imports, exit) is not timed.
    let flushed = producer
        .flush(Duration::from_secs(60))
        .map_err(|e| e.to_string())
        .and_then(|_| fill.settle(producer.backend()));
    let mut elapsed = timed_from.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
    let stats = producer.close();
    flushed?;
    // A fan-out's run ends when the last ring drained: each forwarder says when its own did.
    let mut problems = Vec::new();
    let forwarded = collect_forwarders(&mut forwarders, deadline, &mut problems);
    if let Ok(start) = timed_from_wall.duration_since(std::time::UNIX_EPOCH) {
        for f in forwarded.iter().flatten() {
            if let Some(t) = f.drained_at_unix_s {
                elapsed = elapsed.max(t - start.as_secs_f64());
            }
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let published = published?;
    // Collect consumer reports.
    let mut per_consumer = Vec::new();
    let ended = wait_all_with_output(std::mem::take(&mut children.0), deadline);
    for (i, (status, out)) in ended.into_iter().enumerate() {
        let report = out
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<ConsumerReport>(l).ok());
        match (status, report) {
            (None, _) => problems.push(format!("consumer {i} hung and was killed")),
            (Some(_), None) => problems.push(format!("consumer {i} gave no report")),
            (Some(st), Some(r)) => {
                if let Some(e) = &r.error {
                    problems.push(format!("consumer {i}: {e}"));
                } else if !st.success() {
                    problems.push(format!("consumer {i} exited with {st}"));
                }
                per_consumer.push(r);
            }
        }
    }
    // Exact loss/duplication check from the sequence logs.
    let mut lost = 0u64;
    let mut duplicated = 0u64;
    let logs: Vec<Vec<u64>> = (0..args.consumers)
        .map(|i| read_seq_log(&dir.join(format!("consumer-{i}.seq"))))
        .collect();
    match args.mode {
        Mode::Broadcast => {
            for (i, log) in logs.iter().enumerate() {
                let mut seen = vec![0u32; published as usize];
                for &s in log {
                    if (s as usize) < seen.len() {
                        seen[s as usize] += 1;
                    }
                }
                let l = seen.iter().filter(|&&c| c == 0).count() as u64;
                let d = seen.iter().filter(|&&c| c > 1).count() as u64;
                if l > 0 {
                    problems.push(format!("consumer {i} missed {l} batches"));
                }
                if d > 0 {
                    problems.push(format!("consumer {i} got {d} batches twice"));
                }
                lost += l;
                duplicated += d;
            }
        }
        Mode::Shared => {
            let mut seen = vec![0u32; published as usize];
            for log in &logs {
                for &s in log {
                    if (s as usize) < seen.len() {
                        seen[s as usize] += 1;
                    }
                }
            }
            lost = seen.iter().filter(|&&c| c == 0).count() as u64;
            duplicated = seen.iter().filter(|&&c| c > 1).count() as u64;
            if lost > 0 {
                problems.push(format!("{lost} batches reached no consumer"));
            }
            if duplicated > 0 {
                problems.push(format!(
                    "{duplicated} batches reached more than one consumer"
                ));
            }
        }
    }
    let mismatches: u64 = per_consumer.iter().map(|r| r.mismatches).sum();
    if mismatches > 0 {
        problems.push(format!("{mismatches} batches failed checksum verification"));
    }
    if stats.died > 0 || stats.detached > 0 {
        problems.push(format!(
            "{} died and {} detached during the run",
            duration::plural(stats.died, "consumer", "consumers"),
            stats.detached
        ));
    }
    let mut rtt = timing.round_trips.take().unwrap_or_default();
    rtt.sort_by(f64::total_cmp);
    let pct = |p: f64| -> Option<f64> {
        (!rtt.is_empty()).then(|| rtt[((rtt.len() - 1) as f64 * p).round() as usize] * 1e6)
    };
    let timed = published.saturating_sub(warmup);
    let delivered: u64 =
        per_consumer.iter().map(|r| r.bytes).sum::<u64>() * timed / published.max(1);
    let bytes = timed * args.batch_bytes;
    Ok(BenchReport {
        backend: args.backend.to_string(),
        mode: args.mode,
        consumers: args.consumers,
        slots: args.slots,
        max_lead: args.max_lead,
        passes: (0..args.consumers).map(|i| args.passes_of(i)).collect(),
        batch_bytes: args.batch_bytes,
        published,
        elapsed_s: elapsed,
        warmup,
        batches_per_s: timed as f64 / elapsed,
        gb_per_s: bytes as f64 / elapsed / 1e9,
        delivered_gb_per_s: delivered as f64 / elapsed / 1e9,
        per_consumer,
        mismatches,
        lost,
        duplicated,
        producer_acquire_wait_s: timing.acquire_wait.as_secs_f64(),
        producer_fill_s: timing.fill.as_secs_f64(),
        producer_publish_s: timing.publish.as_secs_f64(),
        producer_host_timed: timing.timed,
        round_trip_p50_us: pct(0.5),
        round_trip_p99_us: pct(0.99),
        problems,
        fanout: (plan.shape != Fanout::Direct).then(|| FanoutReport {
            shape: plan.shape,
            depth: plan.depth(),
            rings: plan
                .rings
                .iter()
                .enumerate()
                .map(|(r, node)| RingReport {
                    device: node.device,
                    parent: node.parent,
                    consumers: plan.consumer_ring.iter().filter(|&&c| c == r).count(),
                    forwarder: r
                        .checked_sub(1)
                        .and_then(|i| forwarded.get(i).cloned().flatten()),
                })
                .collect(),
        }),
        extra: serde_json::Value::Null,
        repetitions: None,
    })
}

/// Waits for a ring's socket to appear (made by a forwarder started just before).
fn wait_for_socket(
    path: &Path,
    forwarders: &mut Children,
    deadline: Instant,
) -> Result<(), String> {
    let until = deadline.min(Instant::now() + Duration::from_secs(60));
    while !path.exists() {
        for c in &mut forwarders.0 {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(format!(
                    "a forwarder process exited before its ring was up ({st})"
                ));
            }
        }
        if Instant::now() >= until {
            return Err(format!(
                "the ring at {} did not come up in time",
                path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Waits for the forwarders to end (the producer's ring closed, so each closes its own once
/// its consumers are done) and reads their reports.
fn collect_forwarders(
    forwarders: &mut Children,
    deadline: Instant,
    problems: &mut Vec<String>,
) -> Vec<Option<RelayReport>> {
    let mut out = Vec::new();
    let ended = wait_all_with_output(std::mem::take(&mut forwarders.0), deadline);
    for (i, (status, text)) in ended.into_iter().enumerate() {
        let report = text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<RelayReport>(l).ok());
        // A forwarder that failed prints {"error": "..."} instead of a report.
        let failure = text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .and_then(|v| v["error"].as_str().map(str::to_string));
        let ring = i + 1;
        match (&status, &report) {
            (None, _) => problems.push(format!("the forwarder of ring {ring} hung and was killed")),
            (Some(st), None) => problems.push(format!(
                "the forwarder of ring {ring} failed ({st}): {}",
                failure.as_deref().unwrap_or("no report")
            )),
            (Some(st), Some(r)) => {
                if let Some(e) = &r.error {
                    problems.push(format!("the forwarder of ring {ring}: {e}"));
                } else if !st.success() {
                    problems.push(format!("the forwarder of ring {ring} exited with {st}"));
                }
            }
        }
        out.push(report);
    }
    out
}

/// Waits for every child (killing those still running at `deadline`: None) and returns
/// each one's stdout. Every stdout is read from the start, on a thread of its own: a child
/// whose report is larger than a pipe holds would otherwise block writing it while we wait
/// for it to exit.
fn wait_all_with_output(
    children: Vec<Child>,
    deadline: Instant,
) -> Vec<(Option<std::process::ExitStatus>, String)> {
    let mut children = children;
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            c.stdout.take().map(|mut so| {
                std::thread::spawn(move || {
                    let mut text = String::new();
                    let _ = std::io::Read::read_to_string(&mut so, &mut text);
                    text
                })
            })
        })
        .collect();
    children
        .iter_mut()
        .zip(readers)
        .map(|(c, reader)| {
            let status = wait_child(c, deadline);
            let text = reader.and_then(|r| r.join().ok()).unwrap_or_default();
            (status, text)
        })
        .collect()
}

/// Waits for a child until `deadline`, then kills it (None: it had to be killed).
fn wait_child(c: &mut Child, deadline: Instant) -> Option<std::process::ExitStatus> {
    loop {
        match c.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
        }
    }
}

/// The rings of a chain or tree fan-out, in the bench report.
#[derive(Debug, serde::Serialize)]
pub struct FanoutReport {
    /// The shape run (`auto` resolved).
    pub shape: Fanout,
    /// The most forwarders between the producer and a consumer.
    pub depth: usize,
    /// Ring 0 is the producer's; each other is fed by a forwarder from its parent.
    pub rings: Vec<RingReport>,
}

/// One ring of a fan-out.
#[derive(Debug, serde::Serialize)]
pub struct RingReport {
    /// Its GPU (on the host backend: the group named in --consumer-devices).
    pub device: usize,
    /// The ring it is forwarded from.
    pub parent: Option<usize>,
    /// Bench consumers reading it.
    pub consumers: usize,
    /// Its forwarder's report.
    pub forwarder: Option<RelayReport>,
}

/// Reads a sequence log written by [`write_seq_log`] (missing file: empty).
pub fn read_seq_log(path: &Path) -> Vec<u64> {
    std::fs::read(path)
        .map(|b| {
            b.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        })
        .unwrap_or_default()
}

/// Writes a sequence log (u64 little-endian each).
pub fn write_seq_log(path: &Path, seqs: &[u64]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(seqs.len() * 8);
    for s in seqs {
        b.extend_from_slice(&s.to_le_bytes());
    }
    std::fs::write(path, b)
}

/// Writes a JSON value as labelled lines ("ceiling batches per s: 142907"), nested objects
/// indented, for the text report (`--json` keeps the raw object).
fn write_labelled(
    f: &mut std::fmt::Formatter<'_>,
    v: &serde_json::Value,
    depth: usize,
) -> std::fmt::Result {
    fn scalar(v: &serde_json::Value) -> String {
        match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => u.to_string(),
                (_, Some(i), _) => i.to_string(),
                (_, _, Some(x)) if x.abs() >= 100.0 => format!("{x:.0}"),
                (_, _, Some(x)) => format!("{x:.3}"),
                _ => n.to_string(),
            },
            serde_json::Value::Array(a) => a.iter().map(scalar).collect::<Vec<_>>().join(", "),
            serde_json::Value::Null => "-".into(),
            other => other.to_string(),
        }
    }
    let pad = "  ".repeat(depth);
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let label = k.replace('_', " ");
                if v.is_object() {
                    writeln!(f, "{pad}{label}:")?;
                    write_labelled(f, v, depth + 1)?;
                } else {
                    writeln!(f, "{pad}{label}: {}", scalar(v))?;
                }
            }
            Ok(())
        }
        other => writeln!(f, "{pad}{}", scalar(other)),
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let passes = if self.passes.iter().all(|&p| p == 1) {
            String::new()
        } else {
            let list: Vec<String> = self.passes.iter().map(u32::to_string).collect();
            format!(" | reads per batch {}", list.join(","))
        };
        writeln!(
            f,
            "gpipe bench: backend {} | mode {} | {} | {} slots | {} per batch{passes}",
            self.backend,
            self.mode,
            duration::plural(self.consumers, "consumer", "consumers"),
            self.slots,
            crate::size::format(self.batch_bytes)
        )?;
        writeln!(
            f,
            "  {} timed batches (after {} warm-up) in {:.3} s: {:.0} batches/s, {:.2} GB/s handed over ({:.2} GB/s delivered to all consumers)",
            self.published - self.warmup,
            self.warmup,
            self.elapsed_s,
            self.batches_per_s,
            self.gb_per_s,
            self.delivered_gb_per_s
        )?;
        if let Some(rep) = &self.repetitions {
            let b = rep.batches_per_s;
            write!(
                f,
                "  {} repetitions: {:.0} batches/s median ({:.0}..{:.0}); figures below are the median one's",
                rep.runs.len(),
                b.median,
                b.min,
                b.max
            )?;
            if let Some(r) = rep.ratio_to_fair_ceiling {
                write!(
                    f,
                    "; ratio to fair ceiling {:.3} median ({:.3}..{:.3})",
                    r.median, r.min, r.max
                )?;
            }
            writeln!(f)?;
        }
        if let Some(fan) = &self.fanout {
            let unit = if self.backend == "cuda" {
                "GPU"
            } else {
                "group"
            };
            writeln!(
                f,
                "  fan-out {} (depth {}): {}",
                fan.shape,
                fan.depth,
                fan.rings
                    .iter()
                    .enumerate()
                    .map(|(i, r)| match (r.parent, &r.forwarder) {
                        (None, _) => {
                            format!("ring 0 on {unit} {} ({} consumers)", r.device, r.consumers)
                        }
                        (Some(p), fw) => format!(
                            "ring {i} on {unit} {} from ring {p} ({} consumers, {} batches forwarded)",
                            r.device,
                            r.consumers,
                            fw.as_ref().map(|f| f.batches).unwrap_or(0)
                        ),
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            )?;
        }
        for r in &self.per_consumer {
            let place = match (&r.delivery, r.device) {
                (Some(d), Some(g)) => format!(", {d} on GPU {g}"),
                (Some(d), None) if d == "mirror" => format!(", {d}"),
                _ => String::new(),
            };
            writeln!(
                f,
                "  consumer #{:<2} pid {:>7}: {:>8} batches, {} checksum mismatches{}{}",
                r.index,
                r.pid,
                r.received,
                r.mismatches,
                if r.verified { "" } else { " (not verified)" },
                place
            )?;
        }
        writeln!(
            f,
            "  where the time went: producer waited {:.3} s for free slots; consumers waited {} s for batches",
            self.producer_acquire_wait_s,
            self.per_consumer
                .iter()
                .map(|r| format!("{:.3}", r.recv_wait_s))
                .collect::<Vec<_>>()
                .join("/")
        )?;
        // Host time per batch of each side's own steps: where a side that never waits spends
        // its time (a host-bound side shows here, not in the waits above).
        let per = |s: f64, n: u64| if n == 0 { 0.0 } else { s * 1e6 / n as f64 };
        writeln!(
            f,
            "  host µs per batch: producer fill {:.2}, publish {:.2}; consumers check {}, release {}",
            per(self.producer_fill_s, self.producer_host_timed),
            per(self.producer_publish_s, self.producer_host_timed),
            self.per_consumer
                .iter()
                .map(|r| format!("{:.2}", per(r.check_s, r.host_timed)))
                .collect::<Vec<_>>()
                .join("/"),
            self.per_consumer
                .iter()
                .map(|r| format!("{:.2}", per(r.release_s, r.host_timed)))
                .collect::<Vec<_>>()
                .join("/")
        )?;
        if let (Some(p50), Some(p99)) = (self.round_trip_p50_us, self.round_trip_p99_us) {
            writeln!(
                f,
                "  round trip (publish -> consumer done -> slot free): p50 {p50:.1} µs, p99 {p99:.1} µs"
            )?;
        }
        let mut figures = self.extra.clone();
        let hint = figures.as_object_mut().and_then(|m| m.remove(MPS_HINT));
        if !figures.is_null() {
            write_labelled(f, &figures, 1)?;
        }
        if let Some(serde_json::Value::String(hint)) = hint {
            writeln!(f, "  hint: {hint}")?;
        }
        if self.problems.is_empty() {
            writeln!(f, "  OK: every batch verified; none lost, none duplicated")
        } else {
            for p in &self.problems {
                writeln!(f, "  PROBLEM: {p}")?;
            }
            Ok(())
        }
    }
}

/// The key of the MPS hint in a CUDA report's `extra`; the text report prints it last, as
/// `hint: ...`.
const MPS_HINT: &str = "mps_hint";

/// What MPS did for the same bench elsewhere, with where it comes from: never this run's.
const MPS_ON_AN_H100: &str = "docs/benchmarks.md, on an H100 with 2 MiB batches and 1 \
     consumer: MPS took gpipe bench from 20.2k to 110k batches/s, 0.14x to 0.77x of the \
     ceiling, and a batch's round trip from 288 to 17 µs";

/// The hint a CUDA bench gives when MPS is not running (`None` when it is), from this run's
/// figures where they are usable: its rate against its own one-process ceiling, and with
/// `--round-trip` its median round trip. Much of the share of the ceiling a run misses is
/// the GPU time-slicing between the processes, which MPS avoids.
fn mps_hint(
    mps_active: bool,
    batches_per_s: f64,
    ceiling: f64,
    round_trip_p50_us: Option<f64>,
) -> Option<String> {
    if mps_active {
        return None;
    }
    let usable = |x: &f64| x.is_finite() && *x > 0.0;
    let ratio = (usable(&batches_per_s) && usable(&ceiling)).then(|| batches_per_s / ceiling);
    let mut measured = Vec::new();
    if let Some(r) = ratio {
        measured.push(format!(
            "this run reached {r:.2}x of the one-process ceiling measured here ({} vs {} batches/s)",
            compact_rate(batches_per_s),
            compact_rate(ceiling)
        ));
    }
    if let Some(rt) = round_trip_p50_us.filter(usable) {
        measured.push(format!("a batch's round trip took {rt:.0} µs (p50)"));
    }
    let mut hint = String::from("MPS is not running");
    if !measured.is_empty() {
        hint += ": ";
        hint += &measured.join(" and ");
    }
    hint += match ratio {
        Some(r) if r >= 0.9 => {
            "; time-slicing between the processes cost little throughput in this run, but MPS \
             still shortens each hand-off"
        }
        Some(_) => {
            "; the GPU time-slicing between the producer's and the consumers' processes costs \
             much of the rest, and MPS avoids it by running their work side by side"
        }
        None if measured.is_empty() => {
            ", so the GPU time-slices between the producer's and the consumers' processes; MPS \
             avoids that by running their work side by side"
        }
        None => {
            "; the GPU time-slices between the producer's and the consumers' processes, and MPS \
             avoids that by running their work side by side"
        }
    };
    Some(format!(
        "{hint} ({MPS_ON_AN_H100}). Start it with: nvidia-cuda-mps-control -d"
    ))
}

/// What the GPU did over the stamped batches, from the (start, end) GPU times (ns) of each
/// batch's fill and of each consumer's verify (zeros: not stamped; such batches are left
/// out): the span, how much of it some kernel ran (`busy`) and two ran at once (`overlap`),
/// the idle gaps between kernels, each kernel's duration, and the handover: how long after
/// its fill ended a batch's verify started.
pub fn timeline_summary(fills: &[[u64; 2]], verifies: &[Vec<[u64; 2]>]) -> serde_json::Value {
    let ok = |t: &[u64; 2]| t[0] > 0 && t[1] >= t[0];
    let complete: Vec<usize> = (0..fills.len())
        .filter(|&i| ok(&fills[i]) && verifies.iter().all(|v| v.get(i).is_some_and(ok)))
        .collect();
    if complete.is_empty() {
        return serde_json::json!({ "batches": 0 });
    }
    let mut spans: Vec<[u64; 2]> = Vec::new();
    let (mut fill_us, mut verify_us, mut handover_us) = (Vec::new(), Vec::new(), Vec::new());
    for &i in &complete {
        let f = fills[i];
        spans.push(f);
        fill_us.push((f[1] - f[0]) as f64 / 1e3);
        for v in verifies {
            let v = v[i];
            spans.push(v);
            verify_us.push((v[1] - v[0]) as f64 / 1e3);
            handover_us.push((v[0] as f64 - f[1] as f64) / 1e3);
        }
    }
    // Sweep the starts and ends: time with at least one kernel running, with two or more,
    // and the gaps with none.
    let mut events: Vec<(u64, i32)> = spans.iter().flat_map(|s| [(s[0], 1), (s[1], -1)]).collect();
    events.sort_unstable();
    let (t0, t1) = (events[0].0, events[events.len() - 1].0);
    let (mut running, mut last) = (0i32, t0);
    let (mut busy, mut overlap) = (0u64, 0u64);
    let mut gaps_us: Vec<f64> = Vec::new();
    for (t, d) in events {
        let dt = t - last;
        match running {
            0 if dt > 0 => gaps_us.push(dt as f64 / 1e3),
            0 => {}
            1 => busy += dt,
            _ => {
                busy += dt;
                overlap += dt;
            }
        }
        running += d;
        last = t;
    }
    let span = (t1 - t0).max(1) as f64;
    let pct = |xs: &mut Vec<f64>, q: f64| -> f64 {
        if xs.is_empty() {
            return 0.0;
        }
        xs.sort_by(f64::total_cmp);
        xs[((xs.len() - 1) as f64 * q).round() as usize]
    };
    let gap_total: f64 = gaps_us.iter().sum();
    let round = |x: f64| (x * 100.0).round() / 100.0;
    serde_json::json!({
        "batches": complete.len(),
        "span_us": round(span / 1e3),
        "per_batch_us": round(span / 1e3 / complete.len() as f64),
        "busy": round(busy as f64 / span),
        "overlap": round(overlap as f64 / span),
        "fill_us_p50": round(pct(&mut fill_us, 0.5)),
        "verify_us_p50": round(pct(&mut verify_us, 0.5)),
        "handover_us_p50": round(pct(&mut handover_us, 0.5)),
        "handover_us_p99": round(pct(&mut handover_us, 0.99)),
        "idle_gaps": gaps_us.len(),
        "idle_gap_us_total": round(gap_total),
        "idle_gap_us_p50": round(pct(&mut gaps_us, 0.5)),
        "idle_gap_us_max": round(pct(&mut gaps_us, 1.0)),
    })
}

/// Batches per second in three significant figures: 20.1k, 143k, 950.
fn compact_rate(x: f64) -> String {
    if x >= 1e5 {
        format!("{:.0}k", x / 1e3)
    } else if x >= 1e4 {
        format!("{:.1}k", x / 1e3)
    } else if x >= 1e3 {
        format!("{:.2}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

#[cfg(test)]
mod report_tests {
    use super::write_labelled;

    struct Show(serde_json::Value);
    impl std::fmt::Display for Show {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write_labelled(f, &self.0, 1)
        }
    }

    #[test]
    fn extra_figures_become_labelled_lines() {
        let v = serde_json::json!({
            "ceiling_batches_per_s": 142907.4,
            "ratio_to_ceiling": 0.7712,
            "memory": "pool",
            "attach": {"total_us": 812, "slots": [31, 40]},
        });
        let text = Show(v).to_string();
        assert!(text.contains("  ceiling batches per s: 142907\n"), "{text}");
        assert!(text.contains("  ratio to ceiling: 0.771\n"), "{text}");
        assert!(text.contains("  memory: pool\n"), "{text}");
        assert!(
            text.contains("  attach:\n    slots: 31, 40\n    total us: 812\n"),
            "{text}"
        );
        assert!(!text.contains('{'), "{text}");
    }
}

#[cfg(test)]
mod mps_hint_tests {
    use super::{BenchReport, MPS_HINT, Spread, compact_rate, fold_repetitions, mps_hint};

    #[test]
    fn no_hint_when_mps_is_running() {
        assert_eq!(mps_hint(true, 20_138.0, 128_000.0, None), None);
        assert_eq!(mps_hint(true, f64::NAN, 0.0, Some(288.0)), None);
    }

    #[test]
    fn a_run_far_below_its_ceiling_is_told_what_mps_recovers() {
        let hint = mps_hint(false, 20_138.0, 128_000.0, None).unwrap();
        assert!(
            hint.starts_with(
                "MPS is not running: this run reached 0.16x of the one-process ceiling measured \
                 here (20.1k vs 128k batches/s); the GPU time-slicing between the producer's and \
                 the consumers' processes costs much of the rest, and MPS avoids it"
            ),
            "{hint}"
        );
        // The H100 figures are cited as such, and the fix is named.
        assert!(
            hint.contains(" side by side (docs/benchmarks.md, on an H100 with 2 MiB batches"),
            "{hint}"
        );
        assert!(
            hint.ends_with(". Start it with: nvidia-cuda-mps-control -d"),
            "{hint}"
        );
        assert!(!hint.contains("round trip took"), "{hint}");
    }

    #[test]
    fn the_round_trip_is_quoted_when_measured() {
        let hint = mps_hint(false, 3_412.0, 143_196.0, Some(287.6)).unwrap();
        assert!(
            hint.contains(
                "0.02x of the one-process ceiling measured here (3.41k vs 143k batches/s) and a \
                 batch's round trip took 288 µs (p50); the GPU time-slicing"
            ),
            "{hint}"
        );
    }

    #[test]
    fn a_run_near_its_ceiling_is_not_promised_throughput() {
        let hint = mps_hint(false, 14_100.0, 14_966.0, None).unwrap();
        assert!(
            hint.contains(
                "0.94x of the one-process ceiling measured here (14.1k vs 15.0k batches/s); \
                 time-slicing between the processes cost little throughput in this run, but \
                 MPS still shortens each hand-off"
            ),
            "{hint}"
        );
        assert!(!hint.contains("much of the rest"), "{hint}");
    }

    #[test]
    fn unusable_figures_give_the_hint_without_them() {
        for (rate, ceiling) in [
            (f64::INFINITY, 1e5),
            (0.0, 1e5),
            (1e4, f64::NAN),
            (1e4, 0.0),
        ] {
            let hint = mps_hint(false, rate, ceiling, None).unwrap();
            assert!(
                hint.starts_with(
                    "MPS is not running, so the GPU time-slices between the producer's and the \
                     consumers' processes; MPS avoids that"
                ),
                "{hint}"
            );
            assert!(!hint.contains("this run"), "{hint}");
            assert!(!hint.contains("inf") && !hint.contains("NaN"), "{hint}");
        }
        let hint = mps_hint(false, f64::NAN, 1e5, Some(290.0)).unwrap();
        assert!(
            hint.starts_with(
                "MPS is not running: a batch's round trip took 290 µs (p50); the GPU time-slices"
            ),
            "{hint}"
        );
    }

    #[test]
    fn rates_in_three_figures() {
        assert_eq!(compact_rate(950.4), "950");
        assert_eq!(compact_rate(3_412.0), "3.41k");
        assert_eq!(compact_rate(20_138.0), "20.1k");
        assert_eq!(compact_rate(143_196.0), "143k");
    }

    #[test]
    fn repetitions_fold_into_the_median_one_with_every_problem() {
        let mk = |rate: f64, fair: f64, problem: Option<&str>| {
            let mut r = report(serde_json::json!({ "ratio_to_fair_ceiling": fair }));
            r.batches_per_s = rate;
            r.problems = problem.map(|p| vec![p.to_string()]).unwrap_or_default();
            r
        };
        let folded = fold_repetitions(vec![
            mk(300.0, 0.9, None),
            mk(100.0, 0.3, Some("lost 1")),
            mk(200.0, 0.6, None),
        ]);
        assert_eq!(folded.batches_per_s, 200.0);
        assert_eq!(folded.problems, ["repetition 2: lost 1"]);
        let rep = folded.repetitions.as_ref().unwrap();
        assert_eq!(
            (
                rep.batches_per_s.median,
                rep.batches_per_s.min,
                rep.batches_per_s.max
            ),
            (200.0, 100.0, 300.0)
        );
        assert_eq!(rep.ratio_to_fair_ceiling.unwrap().median, 0.6);
        assert_eq!(rep.runs.len(), 3);
        assert_eq!(rep.runs[1]["batches_per_s"], 100.0);
        assert!(
            folded
                .to_string()
                .contains("3 repetitions: 200 batches/s median (100..300)")
        );
        // An even count takes the mean of the middle two as the median figure.
        assert_eq!(Spread::of(&[4.0, 1.0, 3.0, 2.0]).median, 2.5);
        // One repetition is the report itself.
        let one = fold_repetitions(vec![mk(5.0, 0.5, None)]);
        assert!(one.repetitions.is_none());
    }

    fn report(extra: serde_json::Value) -> BenchReport {
        BenchReport {
            backend: "cuda".into(),
            mode: pipeline_core::Mode::Broadcast,
            consumers: 1,
            slots: 8,
            max_lead: None,
            passes: vec![1],
            batch_bytes: 2 << 20,
            published: 2000,
            elapsed_s: 0.1,
            warmup: 100,
            batches_per_s: 20_138.0,
            gb_per_s: 42.0,
            delivered_gb_per_s: 42.0,
            per_consumer: Vec::new(),
            mismatches: 0,
            lost: 0,
            duplicated: 0,
            producer_acquire_wait_s: 0.0,
            producer_fill_s: 0.0,
            producer_publish_s: 0.0,
            producer_host_timed: 0,
            round_trip_p50_us: None,
            round_trip_p99_us: None,
            problems: Vec::new(),
            fanout: None,
            extra,
            repetitions: None,
        }
    }

    #[test]
    fn the_gpu_timeline_gives_busy_overlap_gaps_and_handover() {
        let us = |a: u64, b: u64| [a * 1000, b * 1000];
        // Batch 0: fill 100-200, verify 250-350; batch 1: fill 300-400, verify 450-500;
        // batch 2 was not stamped on the consumer and is left out.
        let fills = [us(100, 200), us(300, 400), us(600, 700)];
        let verifies = vec![vec![us(250, 350), us(450, 500), [0, 0]]];
        let t = super::timeline_summary(&fills, &verifies);
        assert_eq!(t["batches"], 2);
        assert_eq!(t["span_us"], 400.0);
        assert_eq!(t["per_batch_us"], 200.0);
        assert_eq!(t["busy"], 0.75, "{t}"); // 300 of 400 µs
        assert_eq!(t["overlap"], 0.13, "{t}"); // 300-350: fill 1 and verify 0
        assert_eq!(t["idle_gaps"], 2, "{t}");
        assert_eq!(t["idle_gap_us_total"], 100.0, "{t}");
        assert_eq!(t["idle_gap_us_max"], 50.0, "{t}");
        assert_eq!(t["handover_us_p50"], 50.0, "{t}");
        assert_eq!(t["fill_us_p50"], 100.0, "{t}");
        // Nothing stamped: nothing to say.
        let none = super::timeline_summary(&[[0, 0]], &[vec![[0, 0]]]);
        assert_eq!(none["batches"], 0);
    }

    #[test]
    fn the_text_report_gives_each_sides_host_time_per_batch() {
        let mut r = report(serde_json::json!({}));
        r.producer_fill_s = 0.008; // 2000 timed batches: 4 µs each
        r.producer_publish_s = 0.003;
        r.producer_host_timed = 2000;
        r.per_consumer = vec![crate::work::ConsumerReport {
            received: 1100,
            host_timed: 1000,
            check_s: 0.007,
            release_s: 0.0015,
            ..Default::default()
        }];
        let text = r.to_string();
        assert!(
            text.contains(
                "  host µs per batch: producer fill 4.00, publish 1.50; consumers check 7.00, \
                 release 1.50\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn the_text_report_prints_the_hint_last_not_as_a_figure() {
        let hint = mps_hint(false, 20_138.0, 128_000.0, None).unwrap();
        let mut extra = serde_json::json!({"ceiling_batches_per_s": 128000.0, "mps_active": false});
        extra[MPS_HINT] = serde_json::Value::String(hint.clone());
        let text = report(extra).to_string();
        assert!(text.contains("  ceiling batches per s: 128000\n"), "{text}");
        assert!(!text.contains("mps hint"), "{text}");
        assert!(
            text.ends_with(&format!(
                "  hint: {hint}\n  OK: every batch verified; none lost, none duplicated\n"
            )),
            "{text}"
        );
        // Without the hint (MPS running, host backend) the report has no hint line.
        let text = report(serde_json::json!({"mps_active": true})).to_string();
        assert!(!text.contains("hint"), "{text}");
        let text = report(serde_json::Value::Null).to_string();
        assert!(!text.contains("hint"), "{text}");
    }

    #[test]
    fn the_text_report_names_the_reads_per_batch_only_when_not_one() {
        let plain = report(serde_json::Value::Null).to_string();
        assert!(!plain.contains("reads per batch"), "{plain}");
        let mut r = report(serde_json::Value::Null);
        r.passes = vec![16, 1];
        let text = r.to_string();
        assert!(
            text.lines()
                .next()
                .unwrap()
                .ends_with("per batch | reads per batch 16,1"),
            "{text}"
        );
    }
}

#[cfg(test)]
mod cuda_env_tests {
    use super::{cuda_env, side_signals_with_lead};
    use crate::args::{BackendArg, SideSignalsArg};

    #[test]
    fn side_signals_with_a_bounded_lead_are_flagged() {
        use BackendArg::{Cuda, Host};
        use SideSignalsArg::{Auto, Off, On};
        let w = |b, s, bytes: u64, lead| side_signals_with_lead(b, s, bytes, 8, lead).is_some();
        // 16 MiB: auto takes side signals; with a lead below the ring's 8 slots, flagged.
        assert!(w(Cuda, Auto, 16 << 20, Some(2)));
        assert!(!w(Cuda, Off, 16 << 20, Some(2)));
        assert!(!w(Host, On, 16 << 20, Some(2)));
        assert!(!w(Cuda, Auto, 16 << 20, Some(8))); // the ring's own bound
        assert!(!w(Cuda, Auto, 16 << 20, None));
        // 8 MiB: auto leaves them off; asked for, flagged.
        assert!(!w(Cuda, Auto, 8 << 20, Some(2)));
        assert!(w(Cuda, On, 8 << 20, Some(2)));
    }

    #[test]
    fn eight_queues_go_with_side_signals_only_and_never_override_the_user() {
        let want = if pipeline_cuda::probe::max_connections().is_some() {
            Vec::new() // the user's value is kept
        } else {
            vec![("CUDA_DEVICE_MAX_CONNECTIONS".to_string(), "8".to_string())]
        };
        // Auto: side signals from 16 MiB slots (a 15 MiB batch rounds up to a 16 MiB slot).
        assert_eq!(cuda_env(SideSignalsArg::Auto, 2 << 20), []);
        assert_eq!(cuda_env(SideSignalsArg::Auto, 8 << 20), []);
        assert_eq!(cuda_env(SideSignalsArg::Auto, 15 << 20), want);
        assert_eq!(cuda_env(SideSignalsArg::Auto, 64 << 20), want);
        // Asked for: on at any size, never when off.
        assert_eq!(cuda_env(SideSignalsArg::On, 2 << 20), want);
        assert_eq!(cuda_env(SideSignalsArg::Off, 64 << 20), []);
    }
}
