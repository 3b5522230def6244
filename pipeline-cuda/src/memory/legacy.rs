//! The legacy IPC path ([`MemoryPath::Legacy`](super::MemoryPath::Legacy)): one `cuMemAlloc`
//! allocation per slot, shared with its legacy IPC handle (`cuIpcGetMemHandle`); a consumer
//! opens each handle once (`cuIpcOpenMemHandle`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use pipeline_core::BackendError;

use super::{TWO_MIB, micros};
use crate::driver::{CUdeviceptr, Context, CudaError, DeviceBuffer, IpcMapping, IpcMemHandle};

/// The producer's slots on the legacy path: per slot an allocation and its IPC handle.
pub(crate) struct LegacySlots {
    bufs: Vec<DeviceBuffer>,
    pub(crate) handles: Vec<IpcMemHandle>,
}

impl LegacySlots {
    /// Allocates `n` slots of `slot_bytes`, one allocation each, and takes their IPC handles.
    pub(crate) fn create(
        ctx: &Arc<Context>,
        n: usize,
        slot_bytes: usize,
    ) -> Result<LegacySlots, CudaError> {
        let mut bufs = Vec::with_capacity(n);
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
            // One allocation per slot, of the slot's size (a multiple of 2 MiB): the
            // handle exposes this allocation and nothing else.
            let buf = DeviceBuffer::new(ctx, slot_bytes)?;
            if buf.ptr() % TWO_MIB != 0 {
                tracing::warn!(
                    ptr = buf.ptr(),
                    "cuMemAlloc returned a slot that is not 2 MiB aligned"
                );
            }
            handles.push(buf.ipc_handle()?);
            bufs.push(buf);
        }
        Ok(LegacySlots { bufs, handles })
    }

    /// Device memory the slots hold: `slot_bytes` per slot.
    pub(crate) fn device_bytes(&self, slot_bytes: u64) -> Option<u64> {
        Some(slot_bytes * self.bufs.len() as u64)
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        self.bufs[slot].ptr()
    }

    /// Frees every slot (see [`super::ProducerSlots::release`]).
    pub(crate) fn release(&mut self) {
        // cuMemFree each slot.
        self.bufs.clear();
    }
}

/// A consumer's imports on the legacy path: per slot an opened IPC handle.
pub(crate) struct LegacyImports {
    maps: Vec<IpcMapping>,
}

impl LegacyImports {
    /// Opens each slot's IPC handle once (one entry per slot in `slot_times`).
    pub(crate) fn import(
        ctx: &Arc<Context>,
        handles: Vec<IpcMemHandle>,
        slot_times: &mut Vec<f64>,
    ) -> Result<LegacyImports, BackendError> {
        let mut seen = HashSet::new();
        if !handles.iter().all(|h| seen.insert(*h)) {
            return Err("the producer exported one legacy IPC handle for two slots".into());
        }
        let mut ptrs = HashSet::new();
        let mut maps = Vec::with_capacity(handles.len());
        for h in &handles {
            let t = Instant::now();
            let map = IpcMapping::open(ctx, h)?;
            slot_times.push(micros(t));
            if !ptrs.insert(map.ptr()) {
                return Err(
                    "two legacy IPC handles of the producer opened to one allocation".into(),
                );
            }
            maps.push(map);
        }
        Ok(LegacyImports { maps })
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        self.maps[slot].ptr()
    }

    /// Number of slots.
    pub(crate) fn len(&self) -> usize {
        self.maps.len()
    }

    /// Closes every handle (see [`super::ConsumerSlots::release`]).
    pub(crate) fn release(&mut self) {
        self.maps.clear();
    }
}
