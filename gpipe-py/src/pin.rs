//! `pin_memory=True` on a host ring: its batches page-locked with the CUDA driver, so that a
//! copy from one to a GPU is a DMA that returns at once (as from torch's pinned memory)
//! instead of a copy through the driver's staging buffers that holds the host.
//!
//! The lock lives exactly as long as the mapping: pipeline-core keeps it beside the memory
//! (`HostOptions::on_map`) and drops it just before unmapping, so no registration outlives
//! its pages (a later mapping at the same address would be read from stale pages).

use std::sync::Arc;

use pipeline_core::MapGuard;
use pipeline_cuda::driver::{Context, HostRegistration};

/// `HostOptions::on_map`: page-locks `len` bytes at `ptr`, read-only and portable to every
/// GPU of the process (the context is device 0's primary one, which torch shares).
pub(crate) fn page_lock(ptr: *const u8, len: usize) -> Result<MapGuard, String> {
    let ctx: Arc<Context> =
        Context::new(0).map_err(|e| format!("pin_memory: cannot start CUDA on device 0 ({e})"))?;
    // SAFETY: pipeline-core keeps the returned guard until just before it unmaps these `len`
    // bytes (`HostOptions::on_map`), so the range stays mapped for the registration's life.
    let lock = unsafe { HostRegistration::read_only(&ctx, ptr, len) }.map_err(|e| {
        format!(
            "pin_memory: CUDA could not page-lock the ring's {} MiB ({e}); the locked-memory limit (ulimit -l) may be too low",
            len >> 20
        )
    })?;
    Ok(Box::new(lock))
}
