//! `gpipe bench`: one producer (this process) and N consumer processes (this binary's
//! `consume` command), every batch verified, results checked for loss and duplication.
//!
//! | file | holds |
//! | --- | --- |
//! | `mod.rs` | the arguments ([`BenchCmd`]), what a run is given ([`BenchArgs`]), and [`command`]: resolve, run each repetition, report |
//! | `checks.rs` | the checks of the arguments, and the warnings about them |
//! | `env.rs` | the environment a CUDA run's processes need (`CUDA_DEVICE_MAX_CONNECTIONS`) |
//! | `depth.rs` | `--slots auto` without MPS: a trial run at each depth |
//! | `spawn.rs` | one run: the ring, the forwarders and consumer processes, the timed loop, their reports |
//! | `seq_log.rs` | the consumers' sequence logs, and the batches lost or duplicated by them |
//! | `cuda.rs` | a CUDA run: the run, then the single-process ceilings it is measured against |
//! | `timeline.rs` | `--gpu-timeline`: what the GPU did over the stamped batches |
//! | `hint.rs` | the hint a CUDA run gives when MPS is not running |
//! | `stats.rs` | `--repeat`: the median repetition and the spread |
//! | `report.rs` | the report ([`report::BenchReport`]) and its text |

mod checks;
mod cuda;
mod depth;
mod env;
mod hint;
mod report;
mod seq_log;
mod spawn;
mod stats;
mod timeline;

use std::process::ExitCode;
use std::time::Duration;

use pipeline_core::{Delivery, HostOptions, HostProducer, Mode};
use pipeline_relay::{Fanout, FanoutPlan};

use crate::args::{BackendArg, CudaArgs, RingArgs, SideSignalsArg, resolve_backend};
use crate::duration;
use crate::work;

pub use env::{set_cuda_env, set_process_env};
pub use seq_log::{read_seq_log, write_seq_log};

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

/// The backend a run uses (`--backend auto` resolved).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Slots in host shared memory.
    Host,
    /// Slots in GPU memory.
    Cuda,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Host => "host",
            Backend::Cuda => "cuda",
        })
    }
}

/// Runs `gpipe bench`.
pub fn command(cmd: BenchCmd) -> Result<ExitCode, String> {
    let mut args = BenchArgs::of(&cmd);
    checks::arguments(&cmd, &args)?;
    let resolved = resolve_backend(cmd.backend)?;
    checks::gpu_timeline_backend(&cmd, resolved)?;
    let cuda = resolved == BackendArg::Cuda;
    if cuda {
        args.backend = Backend::Cuda;
    }
    let mut depth = cmd.ring.depth(cuda);
    crate::args::check_memory(resolved, depth.slots, cmd.ring.batch_bytes)?;
    if depth.auto && cuda && depth.slots > 8 {
        // No MPS: measure the depths within the budget, and take the best.
        depth = depth::measure(&args, &cmd)?;
    }
    if let Some(why) = &depth.why {
        eprintln!("gpipe bench: --slots auto: {} slots ({why})", depth.slots);
    }
    args.slots = depth.slots;
    let lead = cmd.ring.lead(cuda, depth.slots)?;
    args.max_lead = lead.max_lead;
    if let Some(why) = checks::side_signals_with_lead(
        resolved,
        cmd.side_signals,
        args.batch_bytes,
        args.slots,
        args.max_lead,
    ) {
        eprintln!("gpipe bench: {why}");
    }
    checks::fanout(&cmd, &args, resolved)?;
    if resolved != BackendArg::Host {
        args.cuda_env = env::process_env();
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
        let report = match args.backend {
            Backend::Host => {
                spawn::run::<HostProducer, _>(&args, HostOptions::default(), &mut work::HostFill)?
            }
            Backend::Cuda => cuda::run(&args, &cmd.cuda, lead, &depth)?,
        };
        reports.push(report);
        if crate::STOP.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
    }
    let report = stats::fold_repetitions(reports);
    crate::print_report(&report, cmd.json, report.problems.is_empty())
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
    /// The backend.
    pub backend: Backend,
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
    /// The settings `cmd` gives before anything is resolved: the host backend, the slot count
    /// asked for (8 for `auto`), no lead bound.
    fn of(cmd: &BenchCmd) -> BenchArgs {
        BenchArgs {
            consumers: cmd.consumers,
            mode: cmd.ring.mode.into(),
            slots: cmd.ring.slots_or_default(),
            batch_bytes: cmd.ring.batch_bytes,
            max_lead: None,
            batches: cmd.batches,
            timeout: cmd.timeout,
            json: cmd.json,
            backend: Backend::Host,
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
        }
    }

    /// How many times consumer `i` reads every batch.
    pub fn passes_of(&self, i: u32) -> u32 {
        self.passes
            .get(i as usize)
            .or(self.passes.first())
            .copied()
            .unwrap_or(1)
    }

    /// The CUDA device of each consumer (the producer's, 0, where none was named).
    pub fn devices(&self) -> Vec<usize> {
        if self.consumer_devices.is_empty() {
            vec![0; self.consumers as usize]
        } else {
            self.consumer_devices.clone()
        }
    }

    /// The rings of the run and which one each consumer reads.
    pub fn plan(&self) -> FanoutPlan {
        pipeline_relay::plan_fanout(self.fanout, 0, &self.devices(), self.batch_bytes)
    }
}
