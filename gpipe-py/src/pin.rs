//! `pin_memory=True` (or `"try"`) on a host ring: its batches page-locked with the CUDA
//! driver, so that a copy from one to a GPU is a DMA that returns at once (as from torch's
//! pinned memory) instead of a copy through the driver's staging buffers that holds the host.
//!
//! The lock lives exactly as long as the mapping: pipeline-core keeps it beside the memory
//! (`HostOptions::on_map`) and drops it just before unmapping, so no registration outlives
//! its pages (a later mapping at the same address would be read from stale pages).

use std::sync::Arc;

use pipeline_core::MapGuard;
use pipeline_cuda::driver::{Context, HostRegistration, SavedContext, current_device};

/// What a Consumer's `pin_memory` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PinMode {
    /// `False`: the batches are read from pageable memory.
    Off,
    /// `True`: page-locked, or the attach fails with `PinError`.
    On,
    /// `"try"`: page-locked where the driver allows it, else read unlocked; the attach stands
    /// either way, so no batch published meanwhile is missed, and the consumer says why.
    Try,
}

/// `HostOptions::on_map` for `pin_memory=True`: page-locks `len` bytes at `ptr`, read-only
/// and portable to every GPU of the process. The context is the primary one of the calling
/// thread's current device (torch's `current_device`, whose context it is), or of device 0
/// where the thread has none; the thread's current context is left as it was. A refusal
/// fails the attach, which raises `PinError` ([`take_refusal`]).
pub(crate) fn page_lock(ptr: *const u8, len: usize) -> Result<MapGuard, String> {
    lock(ptr, len)
        .map_err(|why| format!("{why}; leave pin_memory out, or pass pin_memory=\"try\" to read the ring unlocked where the driver refuses"))
        .inspect_err(|why| refused(why.clone()))
}

/// `HostOptions::on_map` for `pin_memory="try"`: [`page_lock`]'s lock where the driver gives
/// it; where it refuses, a guard that holds nothing (the batches are read unlocked) and the
/// refusal kept for [`take_refusal`]. It never fails the attach.
pub(crate) fn page_lock_or_not(ptr: *const u8, len: usize) -> Result<MapGuard, String> {
    Ok(lock(ptr, len).unwrap_or_else(|why| {
        refused(why);
        Box::new(())
    }))
}

thread_local! {
    /// Why the page-lock failed on this thread, if it did since the last [`take_refusal`].
    /// The attach calls both on its own thread, where `HostOptions::on_map` ran.
    static REFUSAL: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

fn refused(why: String) {
    REFUSAL.with(|r| *r.borrow_mut() = Some(why));
}

/// Why the page-lock failed on this thread since the last call (which clears it): an attach
/// with `pin_memory=True` that failed raises `PinError` where this is `Some`, which a caller
/// can tell from every other attach error; one with `"try"` keeps it as the consumer's
/// `pin_refused`.
pub(crate) fn take_refusal() -> Option<String> {
    REFUSAL.with(|r| r.borrow_mut().take())
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
            "pin_memory: CUDA could not page-lock the ring's {} MiB on device {ordinal} ({e})",
            len >> 20
        )
    })?;
    drop(saved); // the thread's own context again
    Ok(Box::new(lock))
}
