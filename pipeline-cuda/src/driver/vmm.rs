//! Virtual memory management (`cuMemCreate` / `cuMemMap`), in the style of the other wrappers
//! here: a [`PhysicalAllocation`] owns a generic allocation handle (created here or imported from
//! another process), and a [`VmmMapping`] owns a reserved address range with that allocation
//! mapped into it and made accessible to the context's device.
//!
//! Teardown order, which [`VmmMapping`]'s drop follows: `cuMemUnmap` → `cuMemRelease` →
//! `cuMemAddressFree`. The physical memory lives until every process that created or imported
//! it has released its handle and unmapped every mapping of it.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{
    CUdeviceptr, Context, CudaError, Device, FabricHandle, PoolHandleType, check, device_location,
};

fn allocation_prop(device: &Device, handle_type: PoolHandleType) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handle_type.raw(),
        location: device_location(device),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The recommended granularity (`CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`) of pinned allocations on
/// `device` exportable as `handle_type`: sizes and mapping addresses are multiples of it.
pub fn allocation_granularity(
    device: &Device,
    handle_type: PoolHandleType,
) -> Result<usize, CudaError> {
    let prop = allocation_prop(device, handle_type);
    let mut granularity: usize = 0;
    // SAFETY: a Device exists only after init(); `prop` is fully initialised and outlives the
    // call; the out-pointer is a valid local.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    if granularity == 0 || !granularity.is_power_of_two() {
        return Err(CudaError::InvalidArgument(format!(
            "cuMemGetAllocationGranularity returned {granularity}"
        )));
    }
    Ok(granularity)
}

/// Physical device memory behind a generic allocation handle (`CUmemGenericAllocationHandle`),
/// created with `cuMemCreate` or imported from another process. Released on drop
/// (`cuMemRelease`); memory still mapped stays alive until it is unmapped.
#[derive(Debug)]
pub struct PhysicalAllocation {
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    handle_type: PoolHandleType,
    imported: bool,
    ctx: Arc<Context>,
}

// SAFETY: a generic allocation handle is a driver-side value usable from any thread; the driver
// serialises access.
unsafe impl Send for PhysicalAllocation {}
// SAFETY: all methods take `&self` and only pass the handle to thread-safe driver calls.
unsafe impl Sync for PhysicalAllocation {}

impl PhysicalAllocation {
    /// Creates `size` bytes of pinned memory on the context's device, exportable as
    /// `handle_type`. `size` must be a non-zero multiple of [`allocation_granularity`].
    pub fn create(
        ctx: &Arc<Context>,
        size: usize,
        handle_type: PoolHandleType,
    ) -> Result<PhysicalAllocation, CudaError> {
        let granularity = allocation_granularity(ctx.device(), handle_type)?;
        if size == 0 || size % granularity != 0 {
            return Err(CudaError::InvalidArgument(format!(
                "VMM allocation of {size} bytes is not a non-zero multiple of the granularity \
                 {granularity}"
            )));
        }
        ctx.make_current()?;
        let prop = allocation_prop(ctx.device(), handle_type);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the context is current; `prop` is fully initialised and outlives the call;
        // the out-pointer is a valid local.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &prop, 0)
        })?;
        Ok(PhysicalAllocation {
            handle,
            size,
            handle_type,
            imported: false,
            ctx: Arc::clone(ctx),
        })
    }

    /// Imports an allocation of `size` bytes from a file descriptor made by
    /// [`PhysicalAllocation::export_fd`] in another process. The descriptor stays owned by the
    /// caller (close it once imported). `size` is what the exporter says; mapping fails if the
    /// allocation is smaller.
    pub fn import_fd(
        ctx: &Arc<Context>,
        fd: BorrowedFd<'_>,
        size: usize,
    ) -> Result<PhysicalAllocation, CudaError> {
        ctx.make_current()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // For POSIX fds the "handle" is the descriptor's value itself, cast to a pointer.
        let os_handle = fd.as_raw_fd() as usize as *mut c_void;
        // SAFETY: the fd is open for the duration of the call (borrowed); the out-pointer is a
        // valid local.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                os_handle,
                PoolHandleType::PosixFd.raw(),
            )
        })?;
        Ok(PhysicalAllocation {
            handle,
            size,
            handle_type: PoolHandleType::PosixFd,
            imported: true,
            ctx: Arc::clone(ctx),
        })
    }

    /// Imports an allocation of `size` bytes from a fabric handle made by
    /// [`PhysicalAllocation::export_fabric`] (needs an IMEX channel).
    pub fn import_fabric(
        ctx: &Arc<Context>,
        fabric: &FabricHandle,
        size: usize,
    ) -> Result<PhysicalAllocation, CudaError> {
        ctx.make_current()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let mut data = sys::CUmemFabricHandle { data: *fabric };
        // SAFETY: for fabric handles the driver reads a CUmemFabricHandle through the pointer,
        // which points to a valid local; the out-pointer is a valid local.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                (&mut data as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                PoolHandleType::Fabric.raw(),
            )
        })?;
        Ok(PhysicalAllocation {
            handle,
            size,
            handle_type: PoolHandleType::Fabric,
            imported: true,
            ctx: Arc::clone(ctx),
        })
    }

    /// Exports the allocation as a new file descriptor, to send to another process
    /// (`SCM_RIGHTS`). Only for allocations created here with [`PoolHandleType::PosixFd`].
    pub fn export_fd(&self) -> Result<OwnedFd, CudaError> {
        if self.handle_type != PoolHandleType::PosixFd || self.imported {
            return Err(CudaError::Unsupported {
                what: "export_fd on a VMM allocation that is imported or not created with \
                       PosixFd"
                    .into(),
                hint: "create it with PhysicalAllocation::create(.., PoolHandleType::PosixFd)"
                    .into(),
            });
        }
        let mut fd: c_int = -1;
        // SAFETY: the handle is live; for POSIX fds the driver writes an int through the
        // pointer, which points to a valid local.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                self.handle,
                self.handle_type.raw(),
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError::InvalidArgument(format!(
                "cuMemExportToShareableHandle returned fd {fd}"
            )));
        }
        // SAFETY: the driver just created this descriptor for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports the allocation as a fabric handle (64 bytes), to send to another process. Only
    /// for allocations created here with [`PoolHandleType::Fabric`].
    pub fn export_fabric(&self) -> Result<FabricHandle, CudaError> {
        if self.handle_type != PoolHandleType::Fabric || self.imported {
            return Err(CudaError::Unsupported {
                what: "export_fabric on a VMM allocation that is imported or not created with \
                       Fabric"
                    .into(),
                hint: "create it with PhysicalAllocation::create(.., PoolHandleType::Fabric)"
                    .into(),
            });
        }
        let mut data = sys::CUmemFabricHandle { data: [0; 64] };
        // SAFETY: the handle is live; for fabric handles the driver writes a
        // CUmemFabricHandle through the pointer, which points to a valid local.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut data as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                self.handle,
                self.handle_type.raw(),
                0,
            )
        })?;
        Ok(data.data)
    }

    /// The raw generic allocation handle (distinct per import, even of one allocation).
    pub fn raw(&self) -> sys::CUmemGenericAllocationHandle {
        self.handle
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether this allocation was imported from another process.
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// The handle type it was created or imported with.
    pub fn handle_type(&self) -> PoolHandleType {
        self.handle_type
    }
}

impl Drop for PhysicalAllocation {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("dropping VMM allocation: {e}");
        }
        // SAFETY: we own the handle (created or imported) and release it once. Mappings of it
        // keep the memory alive until they are unmapped.
        let r = unsafe { sys::cuMemRelease(self.handle) };
        if let Err(e) = check("cuMemRelease", r) {
            tracing::warn!("dropping VMM allocation: {e}");
        }
    }
}

/// A reserved virtual address range with a [`PhysicalAllocation`] mapped into it, readable and
/// writable by the context's device. On drop: `cuMemUnmap`, then `cuMemRelease` (the
/// allocation), then `cuMemAddressFree`.
///
/// Drop it only after the work that uses it finished (synchronise the streams first).
#[derive(Debug)]
pub struct VmmMapping {
    ptr: CUdeviceptr,
    size: usize,
    mapped: bool,
    allocation: Option<PhysicalAllocation>,
    ctx: Arc<Context>,
}

// SAFETY: the mapping is address-space state of the process, usable from any thread; we keep
// only the address and the owned allocation (itself Send).
unsafe impl Send for VmmMapping {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for VmmMapping {}

impl VmmMapping {
    /// Reserves `allocation.size()` bytes of address space aligned to `alignment` (a power of
    /// two; 0: the granularity), maps the whole allocation there and grants the context's
    /// device read-write access. Undoes what it did when a step fails.
    pub fn new(
        ctx: &Arc<Context>,
        allocation: PhysicalAllocation,
        alignment: usize,
    ) -> Result<VmmMapping, CudaError> {
        Self::with_access(ctx, allocation, alignment, false)
    }

    /// As [`VmmMapping::new`], mapped read-only for this device when `read_only` is set
    /// (`CU_MEM_ACCESS_FLAGS_PROT_READ`): kernels of this process that write it fault with an
    /// illegal-address error, and the memory is left as it was.
    pub fn with_access(
        ctx: &Arc<Context>,
        allocation: PhysicalAllocation,
        alignment: usize,
        read_only: bool,
    ) -> Result<VmmMapping, CudaError> {
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(CudaError::InvalidArgument(format!(
                "VMM mapping alignment {alignment} is not a power of two"
            )));
        }
        let size = allocation.size();
        if size == 0 {
            return Err(CudaError::InvalidArgument("VMM mapping of 0 bytes".into()));
        }
        ctx.make_current()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the context is current; no fixed address is requested (0); the out-pointer
        // is a valid local.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, alignment, 0, 0)
        })?;
        // From here on, dropping `mapping` undoes whatever succeeded.
        let mut mapping = VmmMapping {
            ptr,
            size,
            mapped: false,
            allocation: None,
            ctx: Arc::clone(ctx),
        };
        // SAFETY: `ptr..ptr + size` was just reserved by us and nothing is mapped there; the
        // allocation is live and at least `size` bytes (the driver checks).
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, allocation.raw(), 0)
        })?;
        mapping.mapped = true;
        mapping.allocation = Some(allocation);
        let desc = sys::CUmemAccessDesc {
            location: device_location(ctx.device()),
            flags: if read_only {
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
            } else {
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            },
        };
        // SAFETY: the whole range is mapped by us; `desc` is one valid descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &desc, 1)
        })?;
        Ok(mapping)
    }

    /// The device address of the mapping's first byte.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The mapped allocation.
    pub fn allocation(&self) -> &PhysicalAllocation {
        self.allocation
            .as_ref()
            .expect("a constructed VmmMapping always holds its allocation")
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("dropping VMM mapping: {e}");
        }
        if self.mapped {
            // SAFETY: we mapped exactly this range in `new` and unmap it once; the owner
            // guarantees no work uses it any more.
            let r = unsafe { sys::cuMemUnmap(self.ptr, self.size) };
            if let Err(e) = check("cuMemUnmap", r) {
                tracing::warn!("dropping VMM mapping: {e}");
            }
        }
        // cuMemRelease, between the unmap and the address free.
        drop(self.allocation.take());
        // SAFETY: we reserved exactly this range in `new` and free it once, after unmapping.
        let r = unsafe { sys::cuMemAddressFree(self.ptr, self.size) };
        if let Err(e) = check("cuMemAddressFree", r) {
            tracing::warn!("dropping VMM mapping: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmm_handles_are_thread_safe() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<PhysicalAllocation>();
        assert_send_sync::<VmmMapping>();
    }

    mod gpu {
        use super::super::*;
        use std::os::fd::AsFd;

        use crate::driver::{PinnedBuffer, Stream, memcpy_dtoh_async, memset_d8_async};

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn vmm_allocation_maps_exports_and_holds_data() {
            let ctx = Context::new(0).unwrap();
            let granularity =
                allocation_granularity(ctx.device(), PoolHandleType::PosixFd).unwrap();
            assert!(granularity.is_power_of_two());
            let size = (2usize << 20).next_multiple_of(granularity);
            let alloc = PhysicalAllocation::create(&ctx, size, PoolHandleType::PosixFd).unwrap();
            let fd = alloc.export_fd().unwrap();
            assert!(fd.as_raw_fd() >= 0);
            assert!(alloc.export_fabric().is_err());
            let map = VmmMapping::new(&ctx, alloc, 2 << 20).unwrap();
            assert_eq!(map.ptr() % (2 << 20), 0);
            assert_eq!(map.size(), size);
            let s = Stream::new(&ctx).unwrap();
            let host = PinnedBuffer::new(&ctx, 16).unwrap();
            // SAFETY: the mapping is live, read-write for this device and used only by `s`;
            // the host reads `host` only after synchronize.
            unsafe {
                memset_d8_async(map.ptr(), 0x5a, size, &s).unwrap();
                memcpy_dtoh_async(host.as_ptr(), map.ptr() + size as u64 - 16, 16, &s).unwrap();
            }
            s.synchronize().unwrap();
            // SAFETY: the stream is idle.
            assert_eq!(unsafe { host.as_slice() }, &[0x5a; 16]);
            drop(map);
            // The exported fd keeps naming the allocation after the exporter let go of it.
            drop(fd);
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn vmm_fd_import_maps_the_same_memory_twice() {
            // Importing one's own export is not what gpipe does (consumers are other
            // processes), but when the driver allows it, it shows the import path maps the
            // exporter's memory. When it refuses, the cross-process tests cover the import.
            let ctx = Context::new(0).unwrap();
            let granularity =
                allocation_granularity(ctx.device(), PoolHandleType::PosixFd).unwrap();
            let size = (2usize << 20).next_multiple_of(granularity);
            let alloc = PhysicalAllocation::create(&ctx, size, PoolHandleType::PosixFd).unwrap();
            let fd = alloc.export_fd().unwrap();
            let exporter = VmmMapping::new(&ctx, alloc, 0).unwrap();
            let imported = match PhysicalAllocation::import_fd(&ctx, fd.as_fd(), size) {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("the driver refuses a same-process VMM import: {e}");
                    return;
                }
            };
            drop(fd);
            assert!(imported.is_imported());
            let importer = VmmMapping::new(&ctx, imported, 0).unwrap();
            assert_ne!(importer.ptr(), exporter.ptr());
            let s = Stream::new(&ctx).unwrap();
            let host = PinnedBuffer::new(&ctx, 8).unwrap();
            // SAFETY: both mappings are live and read-write for this device, used only by
            // `s`; the host reads `host` only after synchronize.
            unsafe {
                memset_d8_async(exporter.ptr(), 0xc3, size, &s).unwrap();
                memcpy_dtoh_async(host.as_ptr(), importer.ptr(), 8, &s).unwrap();
            }
            s.synchronize().unwrap();
            // SAFETY: the stream is idle.
            assert_eq!(unsafe { host.as_slice() }, &[0xc3; 8]);
            drop(importer);
            drop(exporter);
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn vmm_rejects_sizes_off_the_granularity() {
            let ctx = Context::new(0).unwrap();
            let e =
                PhysicalAllocation::create(&ctx, 4096 + 1, PoolHandleType::PosixFd).unwrap_err();
            assert!(matches!(e, CudaError::InvalidArgument(_)), "{e}");
        }
    }
}
