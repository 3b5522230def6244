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
//! slot enums here, which dispatch to them. What the paths share sits below them, one file per
//! concept: the names of the paths and handle kinds (`path.rs`), fabric handles' IMEX check
//! (`fabric.rs`), the handles in transit (`share.rs`) and the import timings (`timings.rs`).
//! The bytes of the export blob are in `export.rs`.

use std::sync::Arc;

use pipeline_core::{BackendError, RingLayout};

use crate::driver::{CUdeviceptr, Context, CudaError, Stream};

mod fabric;
mod legacy;
mod path;
mod pool;
mod share;
mod timings;
mod vmm;

pub(crate) use fabric::fabric_failure;
use fabric::fabric_or;
pub use fabric::{FABRIC_HINT, IMEX_CHANNEL_DIR, imex_channel_present};
use legacy::{LegacyImports, LegacySlots};
pub(crate) use path::TWO_MIB;
pub use path::{HandleKind, MemoryPath};
use pool::{PoolImports, PoolSlots};
pub(crate) use share::{ProducerShare, Share, SlotExport};
pub use timings::ImportTimings;
pub(crate) use timings::micros;
pub use vmm::MAX_VMM_FD_SLOTS;
use vmm::{VmmImports, VmmSlots};

/// The producer's slots, per path. Owns the allocations, their mappings and their exports.
pub(crate) enum ProducerSlots {
    Pool(PoolSlots),
    Vmm(VmmSlots),
    Legacy(LegacySlots),
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
