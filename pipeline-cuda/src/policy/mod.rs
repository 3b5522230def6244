//! Every `auto` gpipe resolves, in one place: the command line (`gpipe`) and the Python
//! package both call [`resolve`] and keep no rule of their own. Where the two front-ends
//! choose differently on purpose, the difference is an input ([`FrontEnd`]), not a second
//! copy of a rule.
//!
//! [`resolve`] is a pure function of what was asked ([`Inputs`]) and what the machine has
//! ([`Facts`]: a [`ProbeReport`] and the process's `CUDA_DEVICE_MAX_CONNECTIONS`), so it can be
//! tested, and a saved `gpipe probe --json` report replayed, without a GPU. [`Facts::probe`]
//! is the thin layer that probes the driver (once; pass its result to every [`resolve`]).
//! Each resolved setting comes with the reason for it ([`Choice`]).
//!
//! | file | rule |
//! | --- | --- |
//! | `depth.rs` | `slots = auto`: the ring's depth |
//! | `lead.rs` | `max_lead = auto`: the producer's lead, from the GPU's L2 size |
//! | `memory.rs` | `backend = auto` and `memory = auto`: which backend, which memory path |
//! | `sync.rs` | `sync = auto` and `timeline_memory = auto` |
//! | `signals.rs` | `side_signals = auto`, and the hardware queues side signals want |
//! | `delivery.rs` | `delivery = auto`: a consumer reads in place or mirrors |
//! | `fanout.rs` | fan-out shape `auto`: direct, chain or tree |
//!
//! Delivery and the fan-out shape depend on where each consumer runs, which a producer's
//! resolution cannot know: the consumer's backend and the fan-out planner call their rules.

pub mod delivery;
pub mod depth;
pub mod fanout;
pub mod lead;
mod memory;
pub mod signals;
pub mod sync;

use std::fmt;

use pipeline_core::{BackendKind, Mode, ProducerConfig};
use serde::{Deserialize, Serialize};

use crate::backend::CudaOptions;
use crate::driver::CudaError;
use crate::memory::{HandleKind, MemoryPath};
use crate::probe::ProbeReport;
use crate::sync::{SyncMode, TimelineMemory};

/// The choices a front-end makes on purpose where the command line and the Python package
/// differ. Each is documented where it is used; [`FrontEnd::CLI`] and [`FrontEnd::PYTHON`] are
/// the two front-ends' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FrontEnd {
    /// `sync = auto` takes timeline words whatever the timeline memory: a consumer releases a
    /// dead producer's words itself, where an IPC event recorded by a dead process may never
    /// complete. The Python package sets it: a producer there lives inside an application
    /// that may die at any point. The command line takes the faster mode for the words'
    /// place ([`sync::rule_sync`]).
    pub ready_survives_producer: bool,
    /// `memory = auto` takes the VMM path for a broadcast ring where the device has it, so
    /// that consumers map the slots read-only (the Python package hands them to application
    /// code as tensors). The command line takes the first of pool, vmm, legacy.
    pub read_only_broadcast: bool,
    /// `backend = auto` takes CUDA only where NVRTC loads: the command line's fill and verify
    /// kernels are compiled with it. The Python package runs no kernels of its own.
    pub needs_nvrtc: bool,
}

impl FrontEnd {
    /// `gpipe produce`, `bench`, `soak` and `probe`.
    pub const CLI: FrontEnd = FrontEnd {
        ready_survives_producer: false,
        read_only_broadcast: false,
        needs_nvrtc: true,
    };
    /// `gpipe.Producer` and `gpipe.resolve`.
    pub const PYTHON: FrontEnd = FrontEnd {
        ready_survives_producer: true,
        read_only_broadcast: true,
        needs_nvrtc: false,
    };
}

/// What was asked for `max_lead`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeadRequest {
    /// Nothing: the ring's own bound (`slots`).
    Ring,
    /// `auto`: from the GPU's L2 size ([`lead::l2_max_lead`]).
    Auto,
    /// This many batches.
    Batches(u32),
}

/// What a front-end was asked: `None` is `auto` throughout.
#[derive(Clone, Debug, PartialEq)]
pub struct Inputs {
    /// The backend (`None`: CUDA when the ring's GPU can run it, else host memory).
    pub backend: Option<BackendKind>,
    /// The GPU the ring's slots live on (CUDA).
    pub device: usize,
    /// Delivery mode of the ring.
    pub mode: Mode,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// Slots in the ring.
    pub slots: Option<u32>,
    /// The most slot memory `slots = auto` may take, in bytes.
    pub depth_budget: u64,
    /// The producer-lead bound.
    pub max_lead: LeadRequest,
    /// The CUDA memory path.
    pub memory: Option<MemoryPath>,
    /// How pool and VMM handles travel.
    pub handle: HandleKind,
    /// How `ready` is signalled.
    pub sync: Option<SyncMode>,
    /// Where the timeline words live.
    pub timeline_memory: Option<TimelineMemory>,
    /// Whether a CUDA consumer of this ring waits and signals on side streams.
    pub side_signals: Option<bool>,
    /// The front-end's own choices.
    pub front_end: FrontEnd,
}

impl Inputs {
    /// Every setting at its default for `front_end`: the ring's own shape
    /// ([`ProducerConfig::default`]), the default depth budget, and `auto` for the rest.
    pub fn new(front_end: FrontEnd) -> Inputs {
        let ring = ProducerConfig::default();
        Inputs {
            backend: None,
            device: 0,
            mode: ring.mode,
            batch_bytes: ring.batch_bytes,
            slots: Some(ring.slots),
            depth_budget: depth::DEFAULT_DEPTH_BUDGET,
            max_lead: LeadRequest::Ring,
            memory: None,
            handle: HandleKind::PosixFd,
            sync: None,
            timeline_memory: None,
            side_signals: None,
            front_end,
        }
    }
}

/// One resolved setting and why it has that value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Choice<T> {
    /// The value.
    pub value: T,
    /// It came from `auto` (or a front-end's default the rule applies to), not from the
    /// caller.
    pub auto: bool,
    /// Why, in words ("given" when the caller gave it).
    pub reason: String,
}

impl<T> Choice<T> {
    fn given(value: T) -> Choice<T> {
        Choice {
            value,
            auto: false,
            reason: "given".into(),
        }
    }

    fn auto(value: T, reason: impl Into<String>) -> Choice<T> {
        Choice {
            value,
            auto: true,
            reason: reason.into(),
        }
    }
}

/// The CUDA settings of a resolution.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CudaChoices {
    /// The GPU the slots live on.
    pub device: usize,
    /// The memory path.
    pub memory: Choice<MemoryPath>,
    /// The handle kind (never `auto`).
    pub handle: HandleKind,
    /// How `ready` is signalled.
    pub sync: Choice<SyncMode>,
    /// Where the timeline words live.
    pub timeline_memory: Choice<TimelineMemory>,
    /// The GPU's L2 size, when the driver reports it (what `max_lead = auto` uses).
    pub l2_cache_bytes: Option<u64>,
}

/// Every setting [`resolve`] settled, each with its reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Resolution {
    /// Host memory or CUDA.
    pub backend: Choice<BackendKind>,
    /// Slots in the ring.
    pub slots: Choice<u32>,
    /// The producer-lead bound (`None`: the ring's own, `slots`).
    pub max_lead: Choice<Option<u32>>,
    /// The CUDA settings; `None` on the host backend.
    pub cuda: Option<CudaChoices>,
    /// Whether a CUDA consumer of this ring that leaves `side_signals` to `auto` takes them.
    pub side_signals: Choice<bool>,
    /// With side signals taken: why the process's `CUDA_DEVICE_MAX_CONNECTIONS` is short of
    /// what they want, and what to set.
    pub side_signals_queues: Option<String>,
}

impl Resolution {
    /// The CUDA backend's options (`None` on the host backend).
    pub fn cuda_options(&self) -> Option<CudaOptions> {
        let c = self.cuda.as_ref()?;
        Some(
            CudaOptions::default()
                .on_device(c.device)
                .with_memory(c.memory.value)
                .with_handle(c.handle)
                .with_sync(c.sync.value)
                .with_timeline_memory(c.timeline_memory.value),
        )
    }
}

/// Which setting a [`PolicyError`] is about (a front-end names it in its own words: a flag,
/// an argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// The backend (`cuda` asked where it cannot run).
    Backend,
    /// The memory path (one the device lacks).
    Memory,
    /// The producer-lead bound (`auto` without an L2 size).
    MaxLead,
}

/// A setting [`resolve`] cannot settle, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyError {
    /// The setting.
    pub setting: Setting,
    /// What is wrong and what to do.
    pub problem: String,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.problem)
    }
}

impl std::error::Error for PolicyError {}

/// What [`resolve`] reads about the machine: the driver and devices, and the process's
/// `CUDA_DEVICE_MAX_CONNECTIONS`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Facts {
    /// Everything [`crate::probe::probe`] found.
    pub report: ProbeReport,
    /// `CUDA_DEVICE_MAX_CONNECTIONS`, when set to a number.
    pub connections: Option<u32>,
}

impl Facts {
    /// Probes the driver and every device, and reads the environment: the one probe a
    /// process needs for every [`resolve`].
    pub fn probe() -> Result<Facts, CudaError> {
        Ok(Facts::of(
            crate::probe::probe()?,
            signals::max_connections(),
        ))
    }

    /// Facts from a report (for example a saved `gpipe probe --json`, whose per-device path
    /// table is recomputed) and a `CUDA_DEVICE_MAX_CONNECTIONS`.
    pub fn of(mut report: ProbeReport, connections: Option<u32>) -> Facts {
        for d in &mut report.devices {
            d.memory_paths = d.path_support();
        }
        Facts {
            report,
            connections,
        }
    }
}

/// Resolves every `auto` of `inputs` against `facts` (`Err`: why the driver could not be
/// probed; never read when `inputs` asks for the host backend).
pub fn resolve(inputs: &Inputs, facts: &Result<Facts, String>) -> Result<Resolution, PolicyError> {
    let cuda_facts = || -> Result<&Facts, String> { facts.as_ref().map_err(Clone::clone) };
    let usable = || -> Result<&Facts, String> {
        let f = cuda_facts()?;
        memory::cuda_usable(&f.report, inputs.device, inputs.front_end)?;
        Ok(f)
    };
    let (backend, facts) = match inputs.backend {
        Some(BackendKind::Host) => (Choice::given(BackendKind::Host), None),
        Some(BackendKind::Cuda) => {
            let f = usable().map_err(|problem| PolicyError {
                setting: Setting::Backend,
                problem,
            })?;
            (Choice::given(BackendKind::Cuda), Some(f))
        }
        None => match usable() {
            Ok(f) => (
                Choice::auto(
                    BackendKind::Cuda,
                    format!("CUDA device {} can run the ring", inputs.device),
                ),
                Some(f),
            ),
            Err(why) => (
                Choice::auto(BackendKind::Host, format!("no usable CUDA GPU ({why})")),
                None,
            ),
        },
    };
    let cuda = match facts {
        None => None,
        Some(f) => {
            // cuda_usable found the device.
            let caps = memory::device(&f.report, inputs.device).map_err(|problem| PolicyError {
                setting: Setting::Backend,
                problem,
            })?;
            let memory = memory::resolve(
                inputs.memory,
                inputs.handle,
                inputs.mode,
                inputs.front_end,
                caps,
            )
            .map_err(|problem| PolicyError {
                setting: Setting::Memory,
                problem,
            })?;
            let vmm_fds = caps
                .check_path(MemoryPath::Vmm, HandleKind::PosixFd)
                .is_ok();
            let words = sync::resolve_words(inputs.timeline_memory, vmm_fds, f.connections);
            let sync = sync::resolve_sync(
                inputs.sync,
                words.value,
                inputs.front_end.ready_survives_producer,
            );
            Some(CudaChoices {
                device: inputs.device,
                memory,
                handle: inputs.handle,
                sync,
                timeline_memory: words,
                l2_cache_bytes: caps.l2_cache_bytes,
            })
        }
    };
    let mps = facts.is_some_and(|f| f.report.mps_active());
    let slots = depth::resolve(
        inputs.slots,
        cuda.is_some(),
        mps,
        inputs.batch_bytes,
        inputs.depth_budget,
    );
    let max_lead = lead::resolve(
        inputs.max_lead,
        cuda.is_some(),
        cuda.as_ref().and_then(|c| c.l2_cache_bytes),
        inputs.batch_bytes,
        slots.value,
    )
    .map_err(|problem| PolicyError {
        setting: Setting::MaxLead,
        problem,
    })?;
    let slot_bytes = pipeline_core::round_slot_bytes(inputs.batch_bytes);
    let side_signals = signals::resolve(inputs.side_signals, cuda.is_some(), slot_bytes);
    let side_signals_queues = match facts {
        Some(f) if side_signals.value => signals::side_signals_connections_for(f.connections).err(),
        _ => None,
    };
    Ok(Resolution {
        backend,
        slots,
        max_lead,
        cuda,
        side_signals,
        side_signals_queues,
    })
}

/// Bytes in the largest binary unit that divides them whole: `2 GiB`, `3 MiB`, `4 KiB`,
/// `100 B` (how reasons and the command line write sizes).
pub fn bytes_text(b: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b >= 1 << shift && b % (1 << shift) == 0 {
            return format!("{} {unit}", b >> shift);
        }
    }
    format!("{b} B")
}

#[cfg(test)]
mod tests;
