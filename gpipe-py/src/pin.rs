//! `pin_memory=True` on a host ring: its batches page-locked with the CUDA driver, so that a
//! copy from one to a GPU is a DMA that returns at once (as from torch's pinned memory)
//! instead of a copy through the driver's staging buffers that holds the host.
//!
//! The lock lives exactly as long as the mapping: pipeline-core keeps it beside the memory
//! (`HostOptions::on_map`) and drops it just before unmapping, so no registration outlives
//! its pages (a later mapping at the same address would be read from stale pages).

use std::sync::Arc;

use pipeline_core::MapGuard;
use pipeline_cuda::driver::{Context, HostRegistration, SavedContext, current_device};

/// `HostOptions::on_map`: page-locks `len` bytes at `ptr`, read-only and portable to every
/// GPU of the process. The context is the primary one of the calling thread's current device
/// (torch's `current_device`, whose context it is), or of device 0 where the thread has none;
/// the thread's current context is left as it was.
pub(crate) fn page_lock(ptr: *const u8, len: usize) -> Result<MapGuard, String> {
    lock(ptr, len).inspect_err(|_| REFUSED.with(|r| r.set(true)))
}

thread_local! {
    /// Set where [`page_lock`] failed on this thread: the attach that called it raises
    /// `PinError` ([`take_refusal`]), which a caller can tell from every other attach error.
    static REFUSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the page-lock failed on this thread since the last call (which clears it). The
/// attach calls it on its own thread, where `HostOptions::on_map` ran.
pub(crate) fn take_refusal() -> bool {
    REFUSED.with(|r| r.replace(false))
}

fn lock(ptr: *const u8, len: usize) -> Result<MapGuard, String> {
    let start = |e| format!("pin_memory: cannot start CUDA ({e})");
    let ordinal = current_device().map_err(start)?.unwrap_or(0);
    let saved = SavedContext::save().map_err(start)?;
    let ctx: Arc<Context> = Context::new(ordinal)
        .map_err(|e| format!("pin_memory: cannot start CUDA on device {ordinal} ({e})"))?;
    // SAFETY: pipeline-core keeps the returned guard until just before it unmaps these `len`
    // bytes (`HostOptions::on_map`), so the range stays mapped for the registration's life.
    let lock = unsafe { HostRegistration::read_only(&ctx, ptr, len) }.map_err(|e| {
        format!(
            "pin_memory: CUDA could not page-lock the ring's {} MiB on device {ordinal} ({e}); \
             leave pin_memory out where the driver cannot register host memory read-only",
            len >> 20
        )
    })?;
    drop(saved); // the thread's own context again
    Ok(Box::new(lock))
}
