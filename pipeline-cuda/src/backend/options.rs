//! The CUDA backend's options, and the check of the chosen memory path against the device.

use std::sync::Arc;

use pipeline_core::{BackendError, Delivery};

use crate::driver::Context;
use crate::error::be;
use crate::memory::{HandleKind, MemoryPath};
use crate::probe::Capabilities;
use crate::sync::{SyncMode, TimelineMemory};

/// Options of the CUDA backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaOptions {
    /// Device ordinal. A consumer uses the device whose UUID matches the producer's when
    /// `None`; set it to use another device (peer access).
    pub device: Option<usize>,
    /// Producer: where the slots live and how they are shared (default: [`MemoryPath::Pool`]).
    /// Consumers ignore it and follow the path the producer's export names.
    pub memory: MemoryPath,
    /// Producer: how the pool and VMM paths share their handles (default:
    /// [`HandleKind::PosixFd`]; the legacy path refuses [`HandleKind::Fabric`]). Consumers
    /// ignore it and follow the export.
    pub handle: HandleKind,
    /// Producer: how `ready` is signalled (default [`SyncMode::Events`]). Consumers ignore it
    /// and follow the export.
    pub sync: SyncMode,
    /// Consumer of a broadcast ring on the VMM path: map the slots writable. By default such a
    /// consumer maps them read-only, so a kernel of its that writes a batch faults in that
    /// consumer alone and the batch other consumers read stays intact. The pool and legacy
    /// paths cannot map read-only (the driver refuses `PROT_READ` on an imported pool): there
    /// a consumer's writes reach everyone. Shared-mode consumers own their batches and map
    /// read-write.
    pub writable: bool,
    /// Consumer: do not make the consumer's own stream wait for `ready` on each batch; the
    /// caller makes the streams it uses wait, with
    /// [`ReleaseAfter::order_reads_on`](crate::ordering::ReleaseAfter::order_reads_on), and
    /// releases after them with
    /// [`ReleaseAfter::release_after`](crate::ordering::ReleaseAfter::release_after) (the
    /// Python package does this for the streams DLPack names). Without a wait, nothing may
    /// read the batch.
    pub defer_ready: bool,
    /// Consumer: read the producer's slots in place, or mirror each batch into buffers of its
    /// own on its GPU (see [`crate::mirror`]). Default [`Delivery::Auto`]: in place on the
    /// producer's GPU, mirrored on another (measured faster there from 2 to 256 MiB over
    /// NVLink; PCIe unmeasured).
    pub delivery: Delivery,
    /// Consumer, mirror delivery: how many batches it may hold at once (buffers of
    /// `slot_bytes` each on its GPU); default: the ring's slot count.
    pub mirror_buffers: Option<u32>,
    /// Consumer: create its stream with the device's highest priority, so that the blocks of
    /// its kernels start ahead of other streams' waiting ones. The NCCL relay's sender uses it
    /// for its sends (which run as SM kernels beside the producer's work) when asked to
    /// (`RelayOptions::high_priority`, off by default).
    pub high_priority: bool,
    /// Producer: where the timeline words (`finished`, and `ready` under semaphore sync) live
    /// (default [`TimelineMemory::Host`]). Consumers ignore it and follow the export.
    pub timeline_memory: TimelineMemory,
    /// Consumer, in place: wait for `ready` and write `finished` on streams of its own, joined
    /// to the stream that uses the batch by in-process events, instead of on that stream
    /// (see `SideSignals` in the sync module). Saves that stream a few µs of GPU time per
    /// batch between its kernels and costs the host a few more driver calls. `None` (the
    /// default): on for slots of [`crate::policy::signals::SIDE_SIGNALS_AUTO_BYTES`] and more,
    /// where that was measured faster. Mirror delivery ignores it.
    pub side_signals: Option<bool>,
}

impl CudaOptions {
    /// These options with `memory` as the memory path.
    pub fn with_memory(mut self, memory: MemoryPath) -> Self {
        self.memory = memory;
        self
    }

    /// These options with `sync` as the ready signal.
    pub fn with_sync(mut self, sync: SyncMode) -> Self {
        self.sync = sync;
        self
    }

    /// These options with the timeline words in `memory`.
    pub fn with_timeline_memory(mut self, memory: TimelineMemory) -> Self {
        self.timeline_memory = memory;
        self
    }

    /// These options with `handle` as the handle kind.
    pub fn with_handle(mut self, handle: HandleKind) -> Self {
        self.handle = handle;
        self
    }

    /// These options with `delivery` as the consumer's delivery.
    pub fn with_delivery(mut self, delivery: Delivery) -> Self {
        self.delivery = delivery;
        self
    }

    /// These options with `device` as the consumer's (or producer's) device.
    pub fn on_device(mut self, device: usize) -> Self {
        self.device = Some(device);
        self
    }
}

pub(super) fn check_capabilities(
    ctx: &Arc<Context>,
    memory: MemoryPath,
    handle: HandleKind,
) -> Result<(), BackendError> {
    let caps = Capabilities::of(ctx.device()).map_err(be)?;
    caps.check_path(memory, handle).map_err(be)?;
    Ok(())
}
