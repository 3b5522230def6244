//! Argument groups that several subcommands share (backend, ring shape, CUDA paths), and the
//! resolution of `--backend auto`.

use clap::ValueEnum;
use pipeline_core::Mode;
use pipeline_core::limits::{self, Setting, ShapeError};
use pipeline_cuda::backend::{CudaOptions, HandleKind, MemoryPath, SyncMode, TimelineMemory};

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
            .unwrap_or_else(|| pipeline_cuda::sync::side_signals_auto(slot))
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
        let words: TimelineMemory = match self.timeline_memory.as_str() {
            "auto" => pipeline_cuda::probe::auto_timeline_memory(&report, 0).0,
            w => w.parse()?,
        };
        let sync = match self.sync.as_str() {
            "auto" => gpu::auto_sync(words),
            y => y.parse::<SyncMode>()?,
        };
        Ok(CudaOptions::default()
            .with_memory(memory)
            .with_handle(handle)
            .with_sync(sync)
            .with_timeline_memory(words))
    }
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

pub use pipeline_cuda::probe::depths_within;

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
    /// The slot count, `auto` resolved by rule (no measurement): 8 on the host backend or
    /// with MPS running; without MPS the deepest of [`pipeline_cuda::probe::AUTO_DEPTHS`] within --depth-budget,
    /// because time-slicing between processes hands the GPU over in slices of a few
    /// milliseconds and a deeper ring lets each process do more per slice (docs/benchmarks.md).
    pub fn depth(&self, cuda: bool) -> DepthChoice {
        match self.slots {
            SlotsArg::Count(n) => DepthChoice {
                slots: n,
                ..DepthChoice::default()
            },
            SlotsArg::Auto => {
                let mps = cuda
                    && pipeline_cuda::probe::probe()
                        .map(|r| r.mps_active())
                        .unwrap_or(false);
                let (slots, why) = if !cuda {
                    (8, "the host backend".to_string())
                } else if mps {
                    (8, "MPS is running".to_string())
                } else {
                    let d = pipeline_cuda::probe::rule_depth(
                        false,
                        self.batch_bytes,
                        self.depth_budget,
                    );
                    (
                        d,
                        format!(
                            "MPS is not running: the deepest ring within the {} budget",
                            size::format(self.depth_budget)
                        ),
                    )
                };
                DepthChoice {
                    slots,
                    auto: true,
                    why: Some(why),
                    trials: Vec::new(),
                }
            }
        }
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
                let (lead, l2) = pipeline_cuda::probe::auto_max_lead(0, self.batch_bytes, slots)
                    .map_err(|e| format!("--max-lead auto: reading the L2 size: {e}"))?;
                eprintln!(
                    "gpipe: --max-lead auto: {} ({} MiB L2, {} per batch, {} slots)",
                    lead.map_or("the ring's own bound".to_string(), |n| format!(
                        "{n} batches"
                    )),
                    l2 >> 20,
                    crate::size::format(self.batch_bytes),
                    slots
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
        BackendArg::Auto => match gpu::usable() {
            Ok(()) => Ok(BackendArg::Cuda),
            Err(why) => {
                eprintln!("gpipe: no usable CUDA GPU ({why}); using the host backend");
                Ok(BackendArg::Host)
            }
        },
        BackendArg::Cuda => gpu::usable()
            .map(|_| BackendArg::Cuda)
            .map_err(|why| format!("--backend cuda: {why}")),
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn auto_depths_stay_within_the_budget() {
        // 2 MiB slots: 64 x 2 MiB = 128 MiB fits 2 GiB.
        assert_eq!(depths_within(2 << 20, 2 << 30), vec![8, 16, 32, 64]);
        // 64 MiB slots within 2 GiB: 32 x 64 MiB = 2 GiB fits, 64 x does not.
        assert_eq!(depths_within(64 << 20, 2 << 30), vec![8, 16, 32]);
        // A batch of 3 MiB takes a 4 MiB slot.
        assert_eq!(depths_within(3 << 20, 64 << 20), vec![8, 16]);
        // Nothing fits: still 8 (the ring's usual depth).
        assert_eq!(depths_within(1 << 30, 1 << 30), vec![8]);
    }
}
