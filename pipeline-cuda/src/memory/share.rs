//! The handles a ring's slots travel with: what the producer keeps to hand out
//! ([`ProducerShare`]), and what a consumer received in the export blob and has not imported
//! yet ([`SlotExport`], [`Share`]). Their bytes are read and written in `export.rs`.

use std::os::fd::OwnedFd;

use crate::driver::{FabricHandle, IpcMemHandle, PointerExport};

/// The path-specific part of the export blob, as bytes and fds (parsed, not yet imported).
pub(crate) enum SlotExport {
    /// The pool's handle, then one pointer export per slot.
    Pool {
        pool: Share,
        pointers: Vec<PointerExport>,
    },
    /// Per slot: a handle to an allocation of `alloc_bytes`.
    Vmm {
        alloc_bytes: u64,
        allocations: Vec<Share>,
    },
    /// Per slot: a legacy IPC handle.
    Legacy { handles: Vec<IpcMemHandle> },
}

/// One shareable handle: an fd (sent with `SCM_RIGHTS`) or fabric bytes (in the blob).
pub(crate) enum Share {
    Fd(OwnedFd),
    Fabric(FabricHandle),
}

/// A handle the producer keeps to hand out: an fd it clones per consumer, or fabric bytes.
pub(crate) enum ProducerShare {
    Fd(OwnedFd),
    Fabric(FabricHandle),
}
