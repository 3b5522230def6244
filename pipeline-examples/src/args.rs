//! Argument groups that several subcommands share (backend, ring shape, CUDA paths), and the
//! resolution of `--backend auto`.

use clap::ValueEnum;
use pipeline_core::BackendKind;
use pipeline_core::Mode;
use pipeline_core::limits::{self, Setting, ShapeError};
use pipeline_cuda::backend::{CudaOptions, MemoryPath, SyncMode, TimelineMemory};
use pipeline_cuda::policy::{self, FrontEnd, Inputs, LeadRequest, PolicyError, Resolution};

use crate::{gpu, size};

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

/// `--side-signals`: where a CUDA consumer waits for `ready` and writes `finished`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SideSignalsArg {
    /// On side streams for slots of 16 MiB and more (measured faster there), else on the
    /// stream that uses the batch.
    #[default]
    Auto,
    /// Always on side streams of the consumer's own.
    On,
    /// Always on the stream that uses the batch.
    Off,
}

impl SideSignalsArg {
    /// As [`CudaOptions::side_signals`].
    pub fn option(self) -> Option<bool> {
        match self {
            SideSignalsArg::Auto => None,
            SideSignalsArg::On => Some(true),
            SideSignalsArg::Off => Some(false),
        }
    }

    /// Whether a consumer of slots for batches of `batch_bytes` takes side signals (the
    /// library's own rule for `auto`, for a process that must know before the consumers
    /// attach).
    pub fn resolve(self, batch_bytes: u64) -> bool {
        let slot = pipeline_core::round_slot_bytes(batch_bytes);
        self.option()
            .unwrap_or_else(|| policy::signals::side_signals_auto(slot))
    }

    /// The name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            SideSignalsArg::Auto => "auto",
            SideSignalsArg::On => "on",
            SideSignalsArg::Off => "off",
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
    /// How `ready` is signalled: IPC events or timeline semaphores; auto takes semaphores with
    /// timeline words in device memory and events with host words (each measured the faster
    /// there on an H100, docs/benchmarks.md).
    #[arg(long, default_value = "auto")]
    sync: String,
    /// Where the timeline words (`finished`, and `ready` with --sync semaphore) live: host
    /// memory mapped for the GPU, or device memory (mapped by peer access on other GPUs;
    /// measured faster on an H100, docs/benchmarks.md). auto takes device memory unless the
    /// device cannot share it as POSIX fds or CUDA_DEVICE_MAX_CONNECTIONS is below 8.
    #[arg(long, default_value = "auto")]
    timeline_memory: String,
}

impl CudaArgs {
    /// Sets `inputs`' CUDA settings from these arguments (`auto` as `None`).
    fn set(&self, inputs: &mut Inputs) -> Result<(), String> {
        fn or_auto<T: std::str::FromStr<Err = String>>(s: &str) -> Result<Option<T>, String> {
            if s == "auto" {
                Ok(None)
            } else {
                s.parse().map(Some)
            }
        }
        inputs.handle = self.handle.parse()?;
        inputs.memory = or_auto::<MemoryPath>(&self.memory)?;
        inputs.timeline_memory = or_auto::<TimelineMemory>(&self.timeline_memory)?;
        inputs.sync = or_auto::<SyncMode>(&self.sync)?;
        Ok(())
    }

    /// Resolves `auto`s against the ring's device (the policy's rules) and builds the backend
    /// options.
    pub fn options(&self) -> Result<CudaOptions, String> {
        let mut inputs = Inputs {
            backend: Some(BackendKind::Cuda),
            ..Inputs::new(FrontEnd::CLI)
        };
        self.set(&mut inputs)?;
        let r = resolve(&inputs).map_err(|e| e.problem)?;
        r.cuda_options()
            .ok_or_else(|| "the CUDA backend resolved to host memory".into())
    }
}

/// Resolves every `auto` of `inputs` against this command's one probe ([`gpu::facts`]).
pub fn resolve(inputs: &Inputs) -> Result<Resolution, PolicyError> {
    let facts: &Result<_, String> = if inputs.backend == Some(BackendKind::Host) {
        // Never read for the host backend: no probe.
        &Err(String::new())
    } else {
        gpu::facts()
    };
    policy::resolve(inputs, facts)
}

/// The inputs of `gpipe` for `backend`, a ring's shape and its CUDA settings.
pub fn inputs(backend: BackendArg, ring: &RingArgs, cuda: &CudaArgs) -> Result<Inputs, String> {
    let mut inputs = Inputs {
        backend: backend.kind(),
        ..Inputs::new(FrontEnd::CLI)
    };
    ring.set(&mut inputs);
    cuda.set(&mut inputs)?;
    Ok(inputs)
}

/// The shape of a ring: delivery mode, slots, batch size.
#[derive(clap::Args, Clone, Debug)]
pub struct RingArgs {
    /// Delivery mode: every consumer gets every batch, or each batch goes to one consumer.
    #[arg(long, value_enum, default_value = "broadcast")]
    pub mode: ModeArg,
    /// Slots in the ring, or `auto`: 8 with MPS running (or on the host backend); without
    /// MPS, where GPU time-slicing between the processes makes a deeper ring move more, the
    /// deepest of 8, 16, 32 and 64 whose slots fit --depth-budget, 8 when none does
    /// (`gpipe bench` measures those that fit and takes the best).
    #[arg(long, default_value = "8", value_parser = parse_slots)]
    pub slots: SlotsArg,
    /// The most slot memory `--slots auto` may take (units: KiB, MiB, GiB). The default, 2 GiB,
    /// is from a measurement: on an H100 without MPS a 4 GiB ring (64 x 64 MiB) moved less
    /// than a 2 GiB one (32 x 64 MiB).
    #[arg(long, value_parser = size::parse, default_value = "2GiB")]
    pub depth_budget: u64,
    /// Bytes per batch, from 1 byte to 64 GiB, a multiple of 8 (the test pattern's words);
    /// slots are rounded up to 2 MiB. Units: KiB, MiB, GiB, TiB (or K, M, G, T), KB, MB, GB,
    /// TB; decimals are accepted and rounded to the nearest byte (1.5MiB = 1572864). The ring,
    /// slots x slot size, must fit in the available host memory (host backend) or the GPU's
    /// free memory (CUDA).
    #[arg(long, value_parser = size::parse, default_value = "4MiB")]
    pub batch_bytes: u64,
    /// Write a batch only once the batch this many back was consumed by everyone who got it
    /// (default: the ring's own bound, --slots). A lead below --slots keeps the data in
    /// flight small enough to stay in a GPU's L2 cache; `auto` derives it from the GPU's L2
    /// size and the batch size (on the host backend: the ring's own bound).
    #[arg(long, value_parser = parse_lead)]
    pub max_lead: Option<LeadArg>,
}

/// Checks a ring's shape against gpipe's limits ([`pipeline_core::limits`], the rule the
/// library and the Python package apply too) before anything starts, naming the flag that is
/// out of range: `--slots`, `--batch-bytes`, and `consumers_flag` for the ring's consumer
/// capacity (`--max-consumers`, or `--consumers` where that sets it). `--slots auto` resolves
/// within the limits.
pub fn check_shape(
    slots: SlotsArg,
    batch_bytes: u64,
    max_consumers: u32,
    consumers_flag: &str,
) -> Result<(), String> {
    let slots = match slots {
        SlotsArg::Count(n) => n,
        SlotsArg::Auto => 8,
    };
    limits::check_shape(slots, batch_bytes, max_consumers)
        .map_err(|e| shape_error(&e, consumers_flag))
}

/// A [`ShapeError`] in the command line's words: the flag, then the library's message.
pub fn shape_error(e: &ShapeError, consumers_flag: &str) -> String {
    let flag = match e.setting() {
        Setting::Slots => "--slots",
        Setting::BatchBytes => "--batch-bytes",
        Setting::MaxConsumers => consumers_flag,
    };
    format!("{flag}: {}", e.problem())
}

/// Checks, before anything is allocated, that a ring of `slots` for batches of `batch_bytes`
/// fits in the memory of `backend` (a concrete one: host memory available now, or GPU 0's free
/// memory), in the command line's words. The library applies the same check when it makes the
/// ring ([`limits::check_fits`]); this one only names the flags.
pub fn check_memory(backend: BackendArg, slots: u32, batch_bytes: u64) -> Result<(), String> {
    let (available, memory) = match backend {
        BackendArg::Host => (pipeline_core::sys::available_memory(), limits::Memory::Host),
        _ => {
            let free = pipeline_cuda::driver::Context::new(0)
                .and_then(|ctx| ctx.memory_info())
                .ok()
                .map(|(free, _total)| free);
            (free, limits::Memory::Gpu(0))
        }
    };
    let slot_bytes = limits::round_slot_bytes(batch_bytes);
    limits::check_fits(slots, slot_bytes, available, memory).map_err(|e| {
        format!(
            "{}: use fewer --slots or a smaller --batch-bytes",
            e.problem()
        )
    })
}

/// The test pattern's rule for a batch (`gpipe produce`, `bench`, `soak`): whole 8-byte words.
pub fn check_pattern_bytes(batch_bytes: u64) -> Result<(), String> {
    let word = 8;
    if batch_bytes % word == 0 {
        return Ok(());
    }
    let below = batch_bytes / word * word;
    let nearest = if below == 0 {
        format!("{}", below + word)
    } else {
        format!("{below} or {}", below + word)
    };
    Err(format!(
        "--batch-bytes: {batch_bytes} bytes is not a whole number of 8-byte words, which the \
         test pattern gpipe writes and verifies is made of: give {nearest}"
    ))
}

/// `--slots`: a number, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotsArg {
    /// Chosen by [`RingArgs::depth`] (or measured by `gpipe bench`).
    Auto,
    /// This many slots.
    Count(u32),
}

fn parse_slots(s: &str) -> Result<SlotsArg, String> {
    if s == "auto" {
        return Ok(SlotsArg::Auto);
    }
    // The range is the ring's rule, checked with the rest of its shape (check_shape).
    s.parse::<u32>().map(SlotsArg::Count).map_err(|_| {
        format!("{s:?} is not a number of slots: give a whole number (8 is usual) or auto")
    })
}

pub use pipeline_cuda::policy::depth::depths_within;

/// How `--slots` was resolved.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DepthChoice {
    /// The slot count.
    pub slots: u32,
    /// It came from `auto`.
    pub auto: bool,
    /// Why (in words), for `auto`.
    pub why: Option<String>,
    /// `gpipe bench`'s trial runs: (slots, batches/s).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub trials: Vec<(u32, f64)>,
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
    /// Sets `inputs`' ring settings from these arguments (`auto` as `None`).
    fn set(&self, inputs: &mut Inputs) {
        inputs.mode = self.mode.into();
        inputs.batch_bytes = self.batch_bytes;
        inputs.depth_budget = self.depth_budget;
        inputs.slots = match self.slots {
            SlotsArg::Auto => None,
            SlotsArg::Count(n) => Some(n),
        };
        inputs.max_lead = match self.max_lead {
            None => LeadRequest::Ring,
            Some(LeadArg::Auto) => LeadRequest::Auto,
            Some(LeadArg::Batches(n)) => LeadRequest::Batches(n),
        };
    }

    /// The inputs for these ring arguments on `cuda` (the backend already resolved).
    fn inputs(&self, cuda: bool) -> Inputs {
        let mut inputs = Inputs {
            backend: Some(if cuda {
                BackendKind::Cuda
            } else {
                BackendKind::Host
            }),
            ..Inputs::new(FrontEnd::CLI)
        };
        self.set(&mut inputs);
        inputs
    }

    /// The slot count, `auto` resolved by the policy's rule (no measurement:
    /// [`policy::depth::rule_depth`]) for the backend the ring runs on.
    pub fn depth(&self, cuda: bool) -> Result<DepthChoice, String> {
        let r = resolve(&self.inputs(cuda)).map_err(|e| e.problem)?;
        Ok(DepthChoice {
            slots: r.slots.value,
            auto: r.slots.auto,
            why: r.slots.auto.then_some(r.slots.reason),
            trials: Vec::new(),
        })
    }

    /// The slot count when it is a number (before `auto` is resolved: 8).
    pub fn slots_or_default(&self) -> u32 {
        match self.slots {
            SlotsArg::Count(n) => n,
            SlotsArg::Auto => 8,
        }
    }

    /// Resolves `--max-lead` for the backend the ring runs on (CUDA: the producer's device 0),
    /// with `slots` the resolved slot count.
    pub fn lead(&self, cuda: bool, slots: u32) -> Result<LeadChoice, String> {
        let mut inputs = self.inputs(cuda);
        inputs.slots = Some(slots);
        let r = resolve(&inputs).map_err(|e| format!("--max-lead auto: {e}"))?;
        let l2_bytes = r.cuda.as_ref().and_then(|c| c.l2_cache_bytes);
        let lead = r.max_lead;
        if lead.auto && cuda {
            eprintln!(
                "gpipe: --max-lead auto: {} ({})",
                lead.value
                    .map_or("the ring's own bound".to_string(), |n| format!(
                        "{n} batches"
                    )),
                lead.reason
            );
        }
        Ok(LeadChoice {
            max_lead: lead.value,
            auto: lead.auto,
            l2_bytes: if lead.auto { l2_bytes } else { None },
        })
    }
}

impl BackendArg {
    /// As the policy's input (`None`: auto).
    pub fn kind(self) -> Option<BackendKind> {
        match self {
            BackendArg::Auto => None,
            BackendArg::Host => Some(BackendKind::Host),
            BackendArg::Cuda => Some(BackendKind::Cuda),
        }
    }
}

/// Resolves `auto` to a concrete backend (the policy's rule), saying why when it falls back
/// to host.
pub fn resolve_backend(b: BackendArg) -> Result<BackendArg, String> {
    let inputs = Inputs {
        backend: b.kind(),
        ..Inputs::new(FrontEnd::CLI)
    };
    let r = resolve(&inputs).map_err(|e| format!("--backend cuda: {e}"))?;
    Ok(match r.backend.value {
        BackendKind::Cuda => BackendArg::Cuda,
        BackendKind::Host => {
            if b == BackendArg::Auto {
                eprintln!("gpipe: {}; using the host backend", r.backend.reason);
            }
            BackendArg::Host
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Both {
        #[command(flatten)]
        ring: RingArgs,
        #[command(flatten)]
        cuda: CudaArgs,
    }

    #[test]
    fn one_command_probes_the_driver_once() {
        use clap::Parser;
        let a = Both::parse_from(["t", "--slots", "auto", "--max-lead", "auto"]);
        let before = pipeline_cuda::probe::probes_run();
        // What `gpipe bench` resolves, in its order, on whatever this machine has.
        let backend = resolve_backend(BackendArg::Auto).unwrap();
        let cuda = backend == BackendArg::Cuda;
        let depth = a.ring.depth(cuda).unwrap();
        let _ = a.ring.lead(cuda, depth.slots);
        let _ = a.cuda.options();
        let _ = resolve_backend(BackendArg::Cuda);
        let probes = pipeline_cuda::probe::probes_run() - before;
        assert!(probes <= 1, "{probes} probes for one command");
    }

    #[test]
    fn slots_parse_as_a_count_or_auto() {
        assert_eq!(parse_slots("auto"), Ok(SlotsArg::Auto));
        assert_eq!(parse_slots("16"), Ok(SlotsArg::Count(16)));
        assert!(parse_slots("deep").unwrap_err().contains("number of slots"));
        assert!(check_shape(parse_slots("0").unwrap(), 4 << 20, 16, "--max-consumers").is_err());
    }

    #[test]
    fn shape_errors_name_the_flag() {
        let e = check_shape(SlotsArg::Count(5000), 4 << 20, 16, "--max-consumers").unwrap_err();
        assert!(e.starts_with("--slots: "), "{e}");
        let e = check_shape(SlotsArg::Auto, 0, 16, "--max-consumers").unwrap_err();
        assert!(e.starts_with("--batch-bytes: "), "{e}");
        let e = check_shape(SlotsArg::Auto, 4 << 20, 64, "--consumers").unwrap_err();
        assert!(e.starts_with("--consumers: "), "{e}");
        assert_eq!(
            check_shape(SlotsArg::Auto, 4 << 20, 16, "--max-consumers"),
            Ok(())
        );
        assert_eq!(check_pattern_bytes(16), Ok(()));
        assert!(
            check_pattern_bytes(1_153_434)
                .unwrap_err()
                .contains("1153432 or 1153440")
        );
        assert!(check_pattern_bytes(3).unwrap_err().contains("give 8"));
    }
}
