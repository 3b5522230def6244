//! Where the CUDA backend's slots live, per memory path, and how they are shared.
//!
//! Three paths, all with the same ring protocol and the same `ready` events / `finished`
//! timelines (see [`crate::backend`] and [`crate::sync`]):
//!
//! * [`MemoryPath::Pool`]: one exportable stream-ordered pool, one allocation per slot; the
//!   consumer imports the pool once and each slot's pointer once.
//! * [`MemoryPath::Vmm`]: one `cuMemCreate` allocation per slot, exported as one shareable handle
//!   per slot; the consumer imports each and maps it into its own address space.
//! * [`MemoryPath::Legacy`]: one `cuMemAlloc` allocation per slot, shared with its legacy IPC
//!   handle (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`).
//!
//! The pool and VMM paths share their handles either as POSIX file descriptors
//! ([`HandleKind::PosixFd`], passed with `SCM_RIGHTS`) or as fabric handles
//! ([`HandleKind::Fabric`], 64 bytes in the export blob; needs an IMEX channel).
//!
//! Each path's code (create, export, import, release) lives in its own file: `pool.rs`,
//! `vmm.rs`, `legacy.rs`. The backend sees one interface, the producer's and the consumer's
//! slot enums here, which dispatch to them. The bytes of the export blob are in `export.rs`.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

use pipeline_core::{BackendError, RingLayout};
use serde::Serialize;

use crate::driver::{CUdeviceptr, Context, CudaError, FabricHandle, PoolHandleType, Stream};
use crate::export::SlotExport;

mod legacy;
mod pool;
mod vmm;

use legacy::{LegacyImports, LegacySlots};
use pool::{PoolImports, PoolSlots};
pub use vmm::MAX_VMM_FD_SLOTS;
use vmm::{VmmImports, VmmSlots};

/// How the slots' GPU memory is allocated and shared with consumers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryPath {
    /// An exportable stream-ordered memory pool (`cuMemPoolCreate`), one allocation per slot.
    #[default]
    Pool,
    /// Virtual memory management: one `cuMemCreate` allocation per slot, each exported.
    Vmm,
    /// Legacy IPC: one `cuMemAlloc` allocation per slot, shared with `cuIpcGetMemHandle`.
    Legacy,
}

crate::names::named_enum!(MemoryPath, "memory path", [
    Pool = "pool" (1) [],
    Vmm = "vmm" (2) [],
    Legacy = "legacy" (3) ["ipc"],
]);

impl MemoryPath {
    /// Whether the path can share its memory with `handle`.
    pub fn supports(self, handle: HandleKind) -> bool {
        !(self == MemoryPath::Legacy && handle == HandleKind::Fabric)
    }
}

/// How the pool and VMM paths' handles travel to consumers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HandleKind {
    /// POSIX file descriptors, passed over the socket with `SCM_RIGHTS`.
    #[default]
    PosixFd,
    /// Fabric handles (`CUmemFabricHandle`, 64 bytes in the export blob). Need an IMEX channel
    /// (`/dev/nvidia-caps-imex-channels`) and a multi-node NVLink system's IMEX daemon.
    Fabric,
}

crate::names::named_enum!(HandleKind, "handle kind", [
    PosixFd = "posix_fd" (1) ["posix-fd", "fd", "posix"],
    Fabric = "fabric" (2) [],
]);

impl HandleKind {
    /// The driver handle type.
    pub fn pool_handle_type(self) -> PoolHandleType {
        match self {
            HandleKind::PosixFd => PoolHandleType::PosixFd,
            HandleKind::Fabric => PoolHandleType::Fabric,
        }
    }
}

/// Where the IMEX channel device nodes live.
pub const IMEX_CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";

/// Whether an IMEX channel device node (`/dev/nvidia-caps-imex-channels/channel*`) exists:
/// fabric handles need one.
pub fn imex_channel_present() -> bool {
    std::fs::read_dir(IMEX_CHANNEL_DIR).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("channel"))
    })
}

/// What to do when fabric handles cannot be used.
pub const FABRIC_HINT: &str = "fabric handles need an IMEX channel \
     (/dev/nvidia-caps-imex-channels) and multi-node NVLink with the IMEX daemon running; on a \
     single host use POSIX fd handles instead";

/// Wraps a driver failure of a fabric-handle step into a [`CudaError::Unsupported`] that says
/// what is missing.
pub(crate) fn fabric_failure(step: &str, e: CudaError) -> CudaError {
    let channel = if imex_channel_present() {
        "an IMEX channel is present"
    } else {
        "no IMEX channel is present"
    };
    CudaError::Unsupported {
        what: format!("fabric handles are not usable here ({step}: {e}; {channel})"),
        hint: FABRIC_HINT.into(),
    }
}

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

/// 2 MiB: the slot alignment, and the unit VMM allocations are rounded to.
pub(crate) const TWO_MIB: u64 = 2 << 20;

/// The producer's slots, per path. Owns the allocations, their mappings and their exports.
pub(crate) enum ProducerSlots {
    Pool(PoolSlots),
    Vmm(VmmSlots),
    Legacy(LegacySlots),
}

/// A handle the producer keeps to hand out: an fd it clones per consumer, or fabric bytes.
pub(crate) enum ProducerShare {
    Fd(OwnedFd),
    Fabric(FabricHandle),
}

/// Maps a fabric-handle creation failure to a clear error; other failures pass unchanged.
fn fabric_or(handle: HandleKind, step: &str, e: CudaError) -> CudaError {
    if handle == HandleKind::Fabric && matches!(e, CudaError::Driver { .. }) {
        fabric_failure(step, e)
    } else {
        e
    }
}

impl ProducerSlots {
    /// Allocates and exports the ring's slots on `memory`, sharing them as `handle`.
    pub(crate) fn create(
        ctx: &Arc<Context>,
        stream: &Stream,
        layout: &RingLayout,
        memory: MemoryPath,
        handle: HandleKind,
    ) -> Result<ProducerSlots, CudaError> {
        if !memory.supports(handle) {
            return Err(CudaError::InvalidArgument(format!(
                "the {memory} memory path cannot use {handle} handles (fabric handles apply to \
                 the pool and vmm paths)"
            )));
        }
        let n = layout.slot_count as usize;
        let slot_bytes = usize::try_from(layout.slot_bytes)
            .map_err(|_| CudaError::InvalidArgument("slot size overflows usize".into()))?;
        Ok(match memory {
            MemoryPath::Pool => {
                ProducerSlots::Pool(PoolSlots::create(ctx, stream, n, slot_bytes, handle)?)
            }
            MemoryPath::Vmm => {
                ProducerSlots::Vmm(VmmSlots::create(ctx, layout, n, slot_bytes, handle)?)
            }
            MemoryPath::Legacy => ProducerSlots::Legacy(LegacySlots::create(ctx, n, slot_bytes)?),
        })
    }

    /// Device memory the slots hold: the pool's reservation, or the fixed allocations.
    pub(crate) fn device_bytes(&self, slot_bytes: u64) -> Option<u64> {
        match self {
            ProducerSlots::Pool(s) => s.device_bytes(),
            ProducerSlots::Vmm(s) => s.device_bytes(),
            ProducerSlots::Legacy(s) => s.device_bytes(slot_bytes),
        }
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        match self {
            ProducerSlots::Pool(s) => s.ptr(slot),
            ProducerSlots::Vmm(s) => s.ptr(slot),
            ProducerSlots::Legacy(s) => s.ptr(slot),
        }
    }

    /// Frees every slot. Call after the stream finished all work on them and after the
    /// consumers detached; synchronise the stream afterwards (pool frees are stream-ordered).
    pub(crate) fn release(&mut self, stream: &Stream) {
        match self {
            ProducerSlots::Pool(s) => s.release(stream),
            ProducerSlots::Vmm(s) => s.release(),
            ProducerSlots::Legacy(s) => s.release(),
        }
    }
}

/// A consumer's imported slots, per path.
pub(crate) enum ConsumerSlots {
    Pool(PoolImports),
    Vmm(VmmImports),
    Legacy(LegacyImports),
}

impl ConsumerSlots {
    /// Imports every slot of `export` once, recording the time per step in `timings`.
    /// Imports every slot once. `read_only`: map VMM slots read-only (the pool and legacy
    /// paths cannot be).
    pub(crate) fn import(
        ctx: &Arc<Context>,
        export: SlotExport,
        timings: &mut ImportTimings,
        read_only: bool,
    ) -> Result<ConsumerSlots, BackendError> {
        let mut slot_times = Vec::new();
        let slots = match export {
            SlotExport::Pool { pool, pointers } => ConsumerSlots::Pool(PoolImports::import(
                ctx,
                pool,
                pointers,
                timings,
                &mut slot_times,
            )?),
            SlotExport::Vmm {
                alloc_bytes,
                allocations,
            } => ConsumerSlots::Vmm(VmmImports::import(
                ctx,
                alloc_bytes,
                allocations,
                read_only,
                &mut slot_times,
            )?),
            SlotExport::Legacy { handles } => {
                ConsumerSlots::Legacy(LegacyImports::import(ctx, handles, &mut slot_times)?)
            }
        };
        timings.slot_imports_us = slot_times.iter().sum();
        timings.slot_import_max_us = slot_times.iter().copied().fold(0.0, f64::max);
        Ok(slots)
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        match self {
            ConsumerSlots::Pool(s) => s.ptr(slot),
            ConsumerSlots::Vmm(s) => s.ptr(slot),
            ConsumerSlots::Legacy(s) => s.ptr(slot),
        }
    }

    /// Number of slots.
    pub(crate) fn len(&self) -> usize {
        match self {
            ConsumerSlots::Pool(s) => s.len(),
            ConsumerSlots::Vmm(s) => s.len(),
            ConsumerSlots::Legacy(s) => s.len(),
        }
    }

    /// Drops every import: pool pointers freed (stream-ordered), VMM mappings unmapped,
    /// released and their address ranges freed, legacy handles closed. Call after the stream
    /// finished all work on them; synchronise the stream afterwards.
    pub(crate) fn release(&mut self, stream: &Stream) {
        match self {
            ConsumerSlots::Pool(s) => s.release(stream),
            ConsumerSlots::Vmm(s) => s.release(),
            ConsumerSlots::Legacy(s) => s.release(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print() {
        for m in MemoryPath::ALL {
            assert_eq!(m.to_string().parse::<MemoryPath>().unwrap(), m);
            assert_eq!(MemoryPath::from_wire(m.to_wire()), Some(m));
        }
        for h in HandleKind::ALL {
            assert_eq!(h.to_string().parse::<HandleKind>().unwrap(), h);
            assert_eq!(HandleKind::from_wire(h.to_wire()), Some(h));
        }
        assert!("auto".parse::<MemoryPath>().is_err());
        assert_eq!(MemoryPath::default(), MemoryPath::Pool);
        assert_eq!(HandleKind::default(), HandleKind::PosixFd);
        assert!(!MemoryPath::Legacy.supports(HandleKind::Fabric));
        assert!(MemoryPath::Vmm.supports(HandleKind::Fabric));
    }

    #[test]
    fn fabric_failures_name_the_imex_channel() {
        let e = fabric_failure(
            "creating",
            CudaError::InvalidArgument("driver said no".into()),
        );
        let text = e.to_string();
        assert!(text.contains("/dev/nvidia-caps-imex-channels"), "{text}");
        assert!(text.contains("multi-node NVLink"), "{text}");
        assert!(text.contains("driver said no"), "{text}");
    }
}
