//! What a ring is, as `gpipe.Producer` and `gpipe.Consumer` both report it.

use pipeline_core::{BackendKind, Mode};

use crate::dlpack::DLDevice;

/// The ring's shape and place, which a producer and a consumer report through the same
/// getters (`socket`, `backend`, `mode`, `slots`, `slot_bytes`, `device`).
pub(crate) struct RingInfo {
    /// The socket path consumers attach to.
    pub(crate) socket: String,
    pub(crate) backend: BackendKind,
    pub(crate) mode: Mode,
    /// Slots in the ring.
    pub(crate) slots: u32,
    /// Capacity of each slot in bytes.
    pub(crate) slot_bytes: u64,
    /// The producer's slots' device, or the device a consumer's batches are on.
    pub(crate) device: DLDevice,
}

impl RingInfo {
    /// The socket path.
    pub(crate) fn socket(&self) -> &str {
        &self.socket
    }

    /// "host" or "cuda".
    pub(crate) fn backend(&self) -> String {
        self.backend.to_string()
    }

    /// "broadcast" or "shared".
    pub(crate) fn mode(&self) -> String {
        self.mode.to_string()
    }

    /// "cpu" or "cuda:N".
    pub(crate) fn device(&self) -> String {
        self.device.name()
    }
}
