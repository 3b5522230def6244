//! Argument groups that several subcommands share (backend, ring shape, CUDA paths), and the
//! resolution of `--backend auto`.

use clap::ValueEnum;
use pipeline_core::Mode;
use pipeline_cuda::backend::{CudaOptions, HandleKind, MemoryPath, SyncMode};

use crate::{cuda_work, size};

/// `--backend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// CUDA if a GPU is usable, else host.
    Auto,
    /// Slots in host shared memory.
    Host,
    /// Slots in an exportable CUDA memory pool.
    Cuda,
}

/// `--mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
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

/// How the CUDA backend shares memory and signals `ready`.
#[derive(clap::Args, Clone, Debug)]
pub struct CudaArgs {
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
    pub fn options(&self) -> Result<CudaOptions, String> {
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

/// The shape of a ring: delivery mode, slots, batch size.
#[derive(clap::Args, Clone, Debug)]
pub struct RingArgs {
    /// Delivery mode: every consumer gets every batch, or each batch goes to one consumer.
    #[arg(long, value_enum, default_value = "broadcast")]
    pub mode: ModeArg,
    /// Slots in the ring.
    #[arg(long, default_value_t = 8)]
    pub slots: u32,
    /// Bytes per batch (units: KiB, MiB, GiB, K, M, G); slots are rounded up to 2 MiB.
    #[arg(long, value_parser = size::parse, default_value = "4MiB")]
    pub batch_bytes: u64,
    /// Write a batch only once the batch this many back was consumed by everyone who got it
    /// (default: the ring's own bound, --slots). A lead below --slots keeps the data in
    /// flight small enough to stay in a GPU's L2 cache; `auto` derives it from the GPU's L2
    /// size and the batch size (on the host backend: the ring's own bound).
    #[arg(long, value_parser = parse_lead)]
    pub max_lead: Option<LeadArg>,
}

/// `--max-lead`: a number of batches, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeadArg {
    /// From the GPU's L2 size and the batch size.
    Auto,
    /// This many batches.
    Batches(u32),
}

fn parse_lead(s: &str) -> Result<LeadArg, String> {
    if s == "auto" {
        return Ok(LeadArg::Auto);
    }
    match s.parse::<u32>() {
        Ok(n) if n >= 1 => Ok(LeadArg::Batches(n)),
        _ => Err(format!(
            "{s:?} is not a lead: give a number of batches (1 or more) or auto"
        )),
    }
}

/// How `--max-lead` was resolved: the bound, and for `auto` what it came from.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct LeadChoice {
    /// The producer-lead bound (None: the ring's own, --slots).
    pub max_lead: Option<u32>,
    /// It came from `auto`.
    pub auto: bool,
    /// The L2 size `auto` used (CUDA).
    pub l2_bytes: Option<u64>,
}

impl RingArgs {
    /// Resolves `--max-lead` for the backend the ring runs on (CUDA: the producer's device 0).
    pub fn lead(&self, cuda: bool) -> Result<LeadChoice, String> {
        match self.max_lead {
            None => Ok(LeadChoice::default()),
            Some(LeadArg::Batches(n)) => Ok(LeadChoice {
                max_lead: Some(n),
                ..LeadChoice::default()
            }),
            Some(LeadArg::Auto) if !cuda => Ok(LeadChoice {
                auto: true,
                ..LeadChoice::default()
            }),
            Some(LeadArg::Auto) => {
                let (lead, l2) =
                    pipeline_cuda::probe::auto_max_lead(0, self.batch_bytes, self.slots)
                        .map_err(|e| format!("--max-lead auto: reading the L2 size: {e}"))?;
                eprintln!(
                    "gpipe: --max-lead auto: {} ({} MiB L2, {} per batch, {} slots)",
                    lead.map_or("the ring's own bound".to_string(), |n| format!(
                        "{n} batches"
                    )),
                    l2 >> 20,
                    crate::size::format(self.batch_bytes),
                    self.slots
                );
                Ok(LeadChoice {
                    max_lead: lead,
                    auto: true,
                    l2_bytes: Some(l2),
                })
            }
        }
    }
}

/// Resolves `auto` to a concrete backend, saying why when it falls back to host.
pub fn resolve_backend(b: BackendArg) -> Result<BackendArg, String> {
    match b {
        BackendArg::Auto => match cuda_work::usable() {
            Ok(()) => Ok(BackendArg::Cuda),
            Err(why) => {
                eprintln!("gpipe: no usable CUDA GPU ({why}); using the host backend");
                Ok(BackendArg::Host)
            }
        },
        BackendArg::Cuda => cuda_work::usable()
            .map(|_| BackendArg::Cuda)
            .map_err(|why| format!("--backend cuda: {why}")),
        other => Ok(other),
    }
}
