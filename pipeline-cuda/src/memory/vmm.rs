//! The VMM path ([`MemoryPath::Vmm`](super::MemoryPath::Vmm)): one `cuMemCreate` allocation per
//! slot, exported as one shareable handle per slot (an fd or a fabric handle); a consumer imports
//! each and maps it into its own address space, read-only where asked.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Instant;

use pipeline_core::{BackendError, RingLayout};

use super::{HandleKind, ProducerShare, Share, TWO_MIB, fabric_failure, fabric_or, micros};
use crate::driver::{
    CUdeviceptr, Context, CudaError, PhysicalAllocation, VmmMapping, allocation_granularity,
};

/// The most slots the VMM path with POSIX fds shares: one fd per slot, plus the ring's three
/// (control segment, claim segment, the consumer's page) and the backend's two (its
/// `finished` words and `ready` signals), must fit one `SCM_RIGHTS` message (at most 253 fds).
pub const MAX_VMM_FD_SLOTS: u32 = 248;

/// The producer's slots on the VMM path: per slot a mapped allocation and its share.
pub(crate) struct VmmSlots {
    pub(crate) alloc_bytes: u64,
    maps: Vec<VmmMapping>,
    pub(crate) shares: Vec<ProducerShare>,
}

impl ProducerShare {
    fn of_allocation(
        alloc: &PhysicalAllocation,
        handle: HandleKind,
    ) -> Result<ProducerShare, CudaError> {
        Ok(match handle {
            HandleKind::PosixFd => ProducerShare::Fd(alloc.export_fd()?),
            HandleKind::Fabric => ProducerShare::Fabric(
                alloc
                    .export_fabric()
                    .map_err(|e| fabric_failure("exporting a VMM allocation", e))?,
            ),
        })
    }
}

impl VmmSlots {
    /// Creates, maps and exports `n` allocations of `slot_bytes` rounded up to the granularity.
    pub(crate) fn create(
        ctx: &Arc<Context>,
        layout: &RingLayout,
        n: usize,
        slot_bytes: usize,
        handle: HandleKind,
    ) -> Result<VmmSlots, CudaError> {
        if handle == HandleKind::PosixFd && layout.slot_count > MAX_VMM_FD_SLOTS {
            return Err(CudaError::InvalidArgument(format!(
                "the vmm memory path with POSIX fds sends one fd per slot, and one \
                 message carries at most 253 fds: use at most {MAX_VMM_FD_SLOTS} slots \
                 (this ring has {}), or the pool or legacy path",
                layout.slot_count
            )));
        }
        let granularity = allocation_granularity(ctx.device(), handle.pool_handle_type())
            .map_err(|e| fabric_or(handle, "querying the fabric granularity", e))?;
        let alloc_bytes = slot_bytes.next_multiple_of(granularity);
        let align = granularity.max(TWO_MIB as usize);
        let mut maps = Vec::with_capacity(n);
        let mut shares = Vec::with_capacity(n);
        for _ in 0..n {
            let alloc = PhysicalAllocation::create(ctx, alloc_bytes, handle.pool_handle_type())
                .map_err(|e| fabric_or(handle, "creating a fabric-exportable allocation", e))?;
            shares.push(ProducerShare::of_allocation(&alloc, handle)?);
            maps.push(VmmMapping::new(ctx, alloc, align)?);
        }
        Ok(VmmSlots {
            alloc_bytes: alloc_bytes as u64,
            maps,
            shares,
        })
    }

    /// Device memory the allocations hold.
    pub(crate) fn device_bytes(&self) -> Option<u64> {
        Some(self.alloc_bytes * self.maps.len() as u64)
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        self.maps[slot].ptr()
    }

    /// Frees every slot (see [`super::ProducerSlots::release`]).
    pub(crate) fn release(&mut self) {
        // Unmap, release, free the address range; close the exported fds.
        self.maps.clear();
        self.shares.clear();
    }
}

/// A consumer's imports on the VMM path: per slot an imported allocation, mapped.
pub(crate) struct VmmImports {
    maps: Vec<VmmMapping>,
}

impl VmmImports {
    /// Imports and maps each slot's allocation of `alloc_bytes` once (one entry per slot in
    /// `slot_times`), read-only when `read_only` is set.
    pub(crate) fn import(
        ctx: &Arc<Context>,
        alloc_bytes: u64,
        allocations: Vec<Share>,
        read_only: bool,
        slot_times: &mut Vec<f64>,
    ) -> Result<VmmImports, BackendError> {
        let handle = match allocations.first() {
            Some(Share::Fabric(_)) => HandleKind::Fabric,
            _ => HandleKind::PosixFd,
        };
        let granularity = allocation_granularity(ctx.device(), handle.pool_handle_type())?;
        let size = usize::try_from(alloc_bytes)?;
        if size % granularity != 0 {
            return Err(format!(
                "CUDA vmm export: allocation size {alloc_bytes} is not a multiple of \
                 this device's granularity {granularity}"
            )
            .into());
        }
        let align = granularity.max(TWO_MIB as usize);
        // Fabric handles name their allocation: refuse one named twice. (Fds cannot be
        // compared; a VMM allocation mapped twice is two independent mappings, so an
        // aliasing producer harms only its own data, never our teardown.)
        let mut seen = HashSet::new();
        let fabric_unique = allocations.iter().all(|s| match s {
            Share::Fabric(f) => seen.insert(*f),
            Share::Fd(_) => true,
        });
        if !fabric_unique {
            return Err("the producer exported one VMM allocation for two slots".into());
        }
        let mut maps = Vec::with_capacity(allocations.len());
        for share in allocations {
            let t = Instant::now();
            let alloc = match share {
                Share::Fd(fd) => PhysicalAllocation::import_fd(ctx, fd.as_fd(), size)?,
                Share::Fabric(f) => PhysicalAllocation::import_fabric(ctx, &f, size)
                    .map_err(|e| fabric_failure("importing a VMM allocation", e))?,
            };
            maps.push(VmmMapping::with_access(ctx, alloc, align, read_only)?);
            slot_times.push(micros(t));
        }
        Ok(VmmImports { maps })
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        self.maps[slot].ptr()
    }

    /// Number of slots.
    pub(crate) fn len(&self) -> usize {
        self.maps.len()
    }

    /// Unmaps and releases every import (see [`super::ConsumerSlots::release`]).
    pub(crate) fn release(&mut self) {
        self.maps.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmm_fd_slot_limit_leaves_room_for_the_other_fds() {
        // The control segment, the claim segment and the consumer's page (protocol version
        // 4), the slots, the ready words and the finished words fit one SCM_RIGHTS message.
        const { assert!(MAX_VMM_FD_SLOTS as usize + 5 <= pipeline_core::sys::MAX_FDS_PER_MESSAGE) };
    }
}
