//! What a front-end asks the policy ([`Inputs`]), and the choices it makes on purpose
//! ([`FrontEnd`]).

use pipeline_core::{BackendKind, Mode, ProducerConfig};
use serde::Serialize;

use super::depth;
use crate::memory::{HandleKind, MemoryPath};
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
    /// place ([`super::sync::rule_sync`]).
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
    /// `auto`: from the GPU's L2 size ([`super::lead::l2_max_lead`]).
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
