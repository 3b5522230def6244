//! How long a consumer's import (attach) took, per step.

use std::time::Instant;

use serde::Serialize;

use super::path::{HandleKind, MemoryPath};

/// How long a consumer's import (attach) took, per step, in microseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ImportTimings {
    /// The memory path the producer uses.
    pub memory: MemoryPath,
    /// The handle kind the producer uses.
    pub handle: HandleKind,
    /// Slots imported.
    pub slots: u32,
    /// Driver init, context, capability check and stream creation.
    pub setup_us: f64,
    /// Pool path: importing the pool and setting its access (0 on the other paths).
    pub pool_import_us: f64,
    /// All slots: pool pointer imports, or VMM import + reserve + map + set access, or legacy
    /// IPC opens.
    pub slot_imports_us: f64,
    /// The slowest single slot of `slot_imports_us`.
    pub slot_import_max_us: f64,
    /// Opening the `ready` IPC events, all slots.
    pub event_opens_us: f64,
    /// Mapping and registering the `finished` timelines.
    pub timelines_us: f64,
    /// The whole import, from the blob's arrival to the reply.
    pub total_us: f64,
}

impl ImportTimings {
    /// Mean time per slot of `slot_imports_us` (0 for no slots).
    pub fn slot_import_mean_us(&self) -> f64 {
        if self.slots == 0 {
            0.0
        } else {
            self.slot_imports_us / f64::from(self.slots)
        }
    }
}

/// Microseconds since `t`.
pub(crate) fn micros(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}
