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
//! Below the rules: `inputs.rs` ([`Inputs`], [`FrontEnd`], [`LeadRequest`]: what was asked) and
//! `choice.rs` ([`Choice`], [`bytes_text`]: what every rule returns). This file holds the
//! resolver and its result.
//!
//! Delivery and the fan-out shape depend on where each consumer runs, which a producer's
//! resolution cannot know: the consumer's backend and the fan-out planner call their rules.

mod choice;
pub mod delivery;
pub mod depth;
pub mod fanout;
mod inputs;
pub mod lead;
mod memory;
pub mod signals;
pub mod sync;

use std::fmt;

use pipeline_core::BackendKind;
use serde::{Deserialize, Serialize};

use crate::backend::CudaOptions;
use crate::driver::CudaError;
use crate::memory::{HandleKind, MemoryPath};
use crate::probe::ProbeReport;
use crate::sync::{SyncMode, TimelineMemory};

pub use choice::{Choice, bytes_text};
pub use inputs::{FrontEnd, Inputs, LeadRequest};

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

#[cfg(test)]
mod tests;
