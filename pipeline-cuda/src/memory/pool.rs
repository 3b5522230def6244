//! The pool path ([`MemoryPath::Pool`](super::MemoryPath::Pool)): one exportable stream-ordered
//! pool, one allocation per slot. The producer shares the pool once (an fd or a fabric handle)
//! and each slot's pointer export; a consumer imports the pool once and each pointer once.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Instant;

use pipeline_core::BackendError;

use super::{HandleKind, ImportTimings, ProducerShare, Share, fabric_failure, fabric_or, micros};
use crate::driver::{CUdeviceptr, Context, CudaError, MemPool, PointerExport, Stream};

/// The producer's slots on the pool path: the pool, its share, and per slot the allocation and
/// its pointer export.
pub(crate) struct PoolSlots {
    pool: MemPool,
    pub(crate) share: ProducerShare,
    ptrs: Vec<CUdeviceptr>,
    pub(crate) exports: Vec<PointerExport>,
}

impl ProducerShare {
    fn of_pool(pool: &MemPool, handle: HandleKind) -> Result<ProducerShare, CudaError> {
        Ok(match handle {
            HandleKind::PosixFd => ProducerShare::Fd(pool.export_fd()?),
            HandleKind::Fabric => ProducerShare::Fabric(
                pool.export_fabric()
                    .map_err(|e| fabric_failure("exporting the pool", e))?,
            ),
        })
    }
}

impl PoolSlots {
    /// Creates the pool, allocates `n` slots of `slot_bytes` from it and exports them.
    pub(crate) fn create(
        ctx: &Arc<Context>,
        stream: &Stream,
        n: usize,
        slot_bytes: usize,
        handle: HandleKind,
    ) -> Result<PoolSlots, CudaError> {
        let total = slot_bytes
            .checked_mul(n)
            .ok_or_else(|| CudaError::InvalidArgument("ring size overflows".into()))?;
        let pool = MemPool::new_exportable(ctx, total, handle.pool_handle_type())
            .map_err(|e| fabric_or(handle, "creating a fabric-exportable pool", e))?;
        let share = ProducerShare::of_pool(&pool, handle)?;
        // Built first, so that a failure below frees what was allocated (Drop).
        let mut slots = PoolSlots {
            pool,
            share,
            ptrs: Vec::with_capacity(n),
            exports: Vec::with_capacity(n),
        };
        {
            let PoolSlots {
                pool,
                ptrs,
                exports,
                ..
            } = &mut slots;
            let mut fill = || -> Result<(), CudaError> {
                for _ in 0..n {
                    ptrs.push(pool.alloc_async(slot_bytes, stream)?);
                }
                // Setup only: the allocations must exist before they are exported.
                stream.synchronize()?;
                for &p in ptrs.iter() {
                    exports.push(pool.export_pointer(p)?);
                }
                Ok(())
            };
            if let Err(e) = fill() {
                // Let the allocations complete before Drop frees them on its stream.
                let _ = stream.synchronize();
                return Err(e);
            }
        }
        Ok(slots)
    }

    /// Device memory the pool holds now (its reservation).
    pub(crate) fn device_bytes(&self) -> Option<u64> {
        self.pool.reserved_bytes().ok()
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        self.ptrs[slot]
    }

    /// Frees every slot, ordered on `stream` (see [`super::ProducerSlots::release`]).
    pub(crate) fn release(&mut self, stream: &Stream) {
        let PoolSlots { pool, ptrs, .. } = self;
        for ptr in ptrs.drain(..) {
            // SAFETY: each pointer came from alloc_async on this pool and is freed
            // once (drained), after the stream finished all work that used it.
            if let Err(e) = unsafe { pool.free_async(ptr, stream) } {
                tracing::error!("CUDA producer teardown: freeing a slot failed: {e}");
            }
        }
    }
}

/// A consumer's imports on the pool path: the imported pool and each slot's imported pointer.
pub(crate) struct PoolImports {
    pool: MemPool,
    ptrs: Vec<CUdeviceptr>,
}

impl PoolImports {
    /// Imports the pool (recording the time in `timings`), then each slot's pointer once
    /// (one entry per slot in `slot_times`).
    pub(crate) fn import(
        ctx: &Arc<Context>,
        pool: Share,
        pointers: Vec<PointerExport>,
        timings: &mut ImportTimings,
        slot_times: &mut Vec<f64>,
    ) -> Result<PoolImports, BackendError> {
        let t = Instant::now();
        let pool = match pool {
            Share::Fd(fd) => MemPool::import_fd(ctx, fd.as_fd())?,
            Share::Fabric(f) => MemPool::import_fabric(ctx, &f)
                .map_err(|e| fabric_failure("importing the pool", e))?,
        };
        pool.set_access(ctx.device(), true)?;
        timings.pool_import_us = micros(t);
        // Import each allocation once: a second import of the same allocation would
        // share the mapping and the first free would unmap both.
        let mut seen = HashSet::new();
        if !pointers.iter().all(|p| seen.insert(*p)) {
            return Err("the producer exported one pool allocation for two slots".into());
        }
        let mut ptrs = Vec::with_capacity(pointers.len());
        for p in &pointers {
            let t = Instant::now();
            match pool.import_pointer(p) {
                Ok(ptr) => ptrs.push(ptr),
                Err(e) => {
                    free_pool_ptrs(&pool, &mut ptrs, "partial imports");
                    return Err(e.into());
                }
            }
            slot_times.push(micros(t));
        }
        Ok(PoolImports { pool, ptrs })
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        self.ptrs[slot]
    }

    /// Number of slots.
    pub(crate) fn len(&self) -> usize {
        self.ptrs.len()
    }

    /// Frees every imported pointer, ordered on `stream` (see
    /// [`super::ConsumerSlots::release`]).
    pub(crate) fn release(&mut self, stream: &Stream) {
        let PoolImports { pool, ptrs } = self;
        for ptr in ptrs.drain(..) {
            // SAFETY: each pointer was imported once from this pool and is freed once
            // (drained), after the stream finished all our work on it.
            if let Err(e) = unsafe { pool.free_async(ptr, stream) } {
                tracing::error!("CUDA consumer teardown: freeing an import failed: {e}");
            }
        }
    }
}

/// Frees pool pointers (allocations or imports) that no work has used, or whose work is done:
/// those of a setup that failed half-way. Normal teardown goes through `release`.
fn free_pool_ptrs(pool: &MemPool, ptrs: &mut Vec<CUdeviceptr>, what: &str) {
    if ptrs.is_empty() {
        return;
    }
    let stream = match Stream::new(pool.context()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("CUDA: cannot free {what}: {e}");
            return;
        }
    };
    for ptr in ptrs.drain(..) {
        // SAFETY: each pointer came from this pool (allocated or imported once), no work in
        // flight uses it (the caller's setup failed before any, or its stream is idle), and
        // it is freed once (drained).
        if let Err(e) = unsafe { pool.free_async(ptr, &stream) } {
            tracing::error!("CUDA: freeing {what} failed: {e}");
        }
    }
    if let Err(e) = stream.synchronize() {
        tracing::error!("CUDA: freeing {what}: {e}");
    }
}

impl Drop for PoolSlots {
    fn drop(&mut self) {
        // Only a setup that failed half-way gets here with pool slots left (`release` drains
        // them); VMM mappings and legacy buffers free themselves.
        free_pool_ptrs(&self.pool, &mut self.ptrs, "the slots of a failed setup");
    }
}

impl Drop for PoolImports {
    fn drop(&mut self) {
        // As for PoolSlots: only an attach that failed after the imports gets here with
        // pool imports left.
        free_pool_ptrs(&self.pool, &mut self.ptrs, "the imports of a failed attach");
    }
}
