//! What `gpipe bench` is given: its arguments ([`BenchCmd`]), the settings of one run
//! ([`BenchArgs`]) and the backend it resolved to ([`Backend`]).

use std::time::Duration;

use pipeline_core::{Delivery, Mode};
use pipeline_cuda::policy::fanout::{CHUNK_ENV, Chunking, chunk_bytes};
use pipeline_relay::{Fanout, FanoutPlan};

use crate::args::{BackendArg, CudaArgs, RingArgs, SideSignalsArg};
use crate::duration;

/// Arguments of `gpipe bench`.
#[derive(clap::Args)]
pub struct BenchCmd {
    /// Which backend.
    #[arg(long, value_enum, default_value = "auto")]
    pub(super) backend: BackendArg,
    /// Consumer processes.
    #[arg(long, default_value_t = 2)]
    pub(super) consumers: u32,
    #[command(flatten)]
    pub(super) ring: RingArgs,
    #[command(flatten)]
    pub(super) cuda: CudaArgs,
    /// Batches to publish.
    #[arg(long, default_value_t = 2000)]
    pub(super) batches: u64,
    /// Fail (and kill the consumers) if the run takes longer than this (30s, 10m, 1h, or
    /// seconds).
    #[arg(long, value_parser = duration::parse, default_value = "300s")]
    pub(super) timeout: Duration,
    /// Print the report as JSON.
    #[arg(long)]
    pub(super) json: bool,
    /// Run the whole bench this many times (fresh consumers each time) and report the median
    /// repetition, the spread, and every repetition in the JSON.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(super) repeat: u32,
    /// Measure each batch's round trip (publish -> consumer done -> slot free); use with
    /// --slots 1.
    #[arg(long)]
    pub(super) round_trip: bool,
    /// CUDA device of each consumer, one entry per consumer (e.g. 0,1,1); the producer runs
    /// on device 0. A consumer on another device reaches the slots by peer access.
    #[arg(long, value_delimiter = ',')]
    pub(super) consumer_devices: Vec<usize>,
    /// How batches reach the consumers: in-place, mirror or auto (in place on the producer's
    /// GPU, mirrored on another); one value for all, or one per consumer (auto,mirror).
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    pub(super) delivery: Vec<Delivery>,
    /// Mirroring consumers: batches each may hold at once (default: the ring's slot count).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub(super) mirror_buffers: Option<u32>,
    /// CUDA consumers in place: wait for `ready` and write `finished` on side streams of
    /// their own (on) or on the stream that runs the verify (off); auto: on for slots of 16
    /// MiB and more (see `gpipe consume --help`). With them on, the run's processes get
    /// CUDA_DEVICE_MAX_CONNECTIONS=8 unless it is set: under MPS a process's streams would
    /// share hardware queues otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    pub(super) side_signals: SideSignalsArg,
    /// How batches reach the GPUs other than the producer's (broadcast): direct (every
    /// consumer reads the producer's ring), chain (a forwarder per GPU copies from the GPU
    /// before it into a ring of its own), tree (a binary tree of forwarders), or auto. On the
    /// host backend, --consumer-devices then names groups of consumers, each with its own ring.
    #[arg(long, default_value = "direct")]
    pub(super) fanout: Fanout,
    /// Chain or tree: how a forwarder moves each batch: in chunks of this size (`16MiB`), the
    /// next forwarder copying each chunk once it landed; `off`: whole batches; `auto`: the
    /// rule in pipeline_cuda::policy::fanout (docs/multi-gpu.md, "Chunked forwarding"), or
    /// GPIPE_FANOUT_CHUNK (off or a size) where that is set.
    #[arg(long, default_value = "auto", value_parser = parse_chunking)]
    pub(super) chunk: Chunking,
    /// Chain or tree: where each GPU's forwarder runs: in-consumer (in the process of the
    /// first consumer on that GPU, so that without MPS the GPU is not time-sliced between
    /// two processes), process (a `gpipe relay forward` process of its own), or auto
    /// (in-consumer).
    #[arg(long, value_enum, default_value = "auto")]
    pub(super) forwarders: ForwardersArg,
    /// Chain or tree, CUDA: copies each forwarder keeps in flight (default 3).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(super) forward_depth: Option<u32>,
    /// Chain or tree, CUDA, forwarders in the consumers: the memory path of their rings
    /// (`gpipe consume --forward-memory`; default vmm, which the consumer in the same process
    /// can import).
    #[arg(long)]
    pub(super) forward_memory: Option<pipeline_cuda::memory::MemoryPath>,
    /// Times each consumer reads every batch (the first read verifies it): a stand-in for a
    /// model that reads its input more than once. One value for all, or one per consumer
    /// (16,1). The fair ceiling does the same reads.
    #[arg(long, value_delimiter = ',', default_value = "1", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(super) passes: Vec<u32>,
    /// CUDA: stamp the GPU start and end of the fill and of each consumer's verify of this
    /// many timed batches (the GPU's global timer, shared by every process), and report how
    /// busy the GPU was, how much the kernels overlapped, the idle gaps and the handover
    /// (verify start minus fill end) under `gpu_timeline`.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub(super) gpu_timeline: u64,
    /// With --gpu-timeline: also write every stamp here (JSON; with --repeat, the last
    /// repetition's).
    #[arg(long, requires = "gpu_timeline")]
    pub(super) gpu_timeline_out: Option<std::path::PathBuf>,
}

/// `--forwarders`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ForwardersArg {
    /// In-consumer.
    Auto,
    /// In the process of the first consumer on the forwarder's GPU.
    InConsumer,
    /// A `gpipe relay forward` process each.
    Process,
}

/// `--chunk`: auto, off or a size.
fn parse_chunking(s: &str) -> Result<Chunking, String> {
    match s.trim() {
        "auto" => Ok(Chunking::Auto),
        "off" => Ok(Chunking::Off),
        size => match crate::size::parse(size)? {
            0 => Err("--chunk 0: give a size of at least 1 byte, off or auto".into()),
            n => Ok(Chunking::Bytes(n)),
        },
    }
}

/// The chunking `--chunk` asks for, with GPIPE_FANOUT_CHUNK standing in for `auto` where set.
fn chunking_of(asked: Chunking) -> Result<Chunking, String> {
    match (asked, std::env::var(CHUNK_ENV)) {
        (Chunking::Auto, Ok(v)) if !v.trim().is_empty() && v.trim() != "auto" => {
            parse_chunking(&v).map_err(|e| format!("{CHUNK_ENV}={v}: {e}"))
        }
        (c, _) => Ok(c),
    }
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
    /// Chain or tree: the chunking asked for (resolved per run by [`BenchArgs::chunk_bytes`]).
    pub chunking: Chunking,
    /// Chain or tree: each forwarder runs in its GPU's first consumer's process.
    pub forwarders_in_consumers: bool,
    /// Chain or tree, CUDA: copies in flight per forwarder.
    pub forward_depth: Option<u32>,
    /// Chain or tree, CUDA, forwarders in the consumers: their rings' memory path.
    pub forward_memory: Option<pipeline_cuda::memory::MemoryPath>,
    /// Reads of every batch by each consumer (one entry: all of them).
    pub passes: Vec<u32>,
    /// CUDA: record the GPU start and end of this many timed batches' fill and verify.
    pub gpu_timeline: u64,
    /// Where to write those stamps (JSON), if anywhere.
    pub gpu_timeline_out: Option<std::path::PathBuf>,
    /// Environment variables this process set for itself, before CUDA, and so for every
    /// process of the run, which inherit them ([`super::set_process_env`]).
    pub cuda_env: Vec<(String, String)>,
}

/// Batches published before timing starts (verified like the others, not timed).
pub fn warmup_of(batches: u64) -> u64 {
    (batches / 5).min(100)
}

impl BenchArgs {
    /// The settings `cmd` gives before anything is resolved: the host backend, the slot count
    /// asked for (8 for `auto`), no lead bound.
    pub(super) fn of(cmd: &BenchCmd) -> BenchArgs {
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
            chunking: cmd.chunk,
            forwarders_in_consumers: cmd.forwarders != ForwardersArg::Process,
            forward_depth: cmd.forward_depth,
            forward_memory: cmd.forward_memory,
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

    /// Chain or tree: the chunk size each forwarder uses (None: whole batches), from
    /// `--chunk` (or GPIPE_FANOUT_CHUNK) and the rule in pipeline_cuda::policy::fanout.
    pub fn chunk_bytes(&self) -> Result<Option<u64>, String> {
        Ok(chunk_bytes(chunking_of(self.chunking)?, self.batch_bytes))
    }

    /// The rings of the run and which one each consumer reads.
    pub fn plan(&self) -> FanoutPlan {
        pipeline_relay::plan_fanout(self.fanout, 0, &self.devices(), self.batch_bytes)
    }
}
