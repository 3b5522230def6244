//! Exportable stream-ordered memory pools (`cuMemPoolCreate`), their pointer exports, and the
//! handle types pools and VMM allocations are shared with.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{
    CUdeviceptr, CUresult, Context, CudaError, Device, Stream, check, device_location,
    log_drop_error,
};

/// How a pool is shared with other processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PoolHandleType {
    /// A POSIX file descriptor, passed over a Unix socket (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    PosixFd,
    /// A fabric handle (`CU_MEM_HANDLE_TYPE_FABRIC`), for multi-node NVLink systems.
    Fabric,
}

impl PoolHandleType {
    /// The driver's handle type.
    pub(crate) fn raw(self) -> sys::CUmemAllocationHandleType {
        match self {
            PoolHandleType::PosixFd => {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            }
            PoolHandleType::Fabric => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        }
    }
}

/// The opaque data that names one pool allocation to an importer (`CUmemPoolPtrExportData`).
pub type PointerExport = [u8; 64];

/// A fabric handle (`CUmemFabricHandle`): 64 opaque bytes that name a pool or a VMM
/// allocation to an importer on any node of the NVLink fabric (through IMEX).
pub type FabricHandle = [u8; 64];

/// An exportable stream-ordered memory pool, created here or imported from another process.
/// Destroyed on drop.
#[derive(Debug)]
pub struct MemPool {
    raw: sys::CUmemoryPool,
    handle_type: PoolHandleType,
    imported: bool,
    ctx: Arc<Context>,
}

// SAFETY: a CUmemoryPool handle may be used from any thread; the driver serialises access.
unsafe impl Send for MemPool {}
// SAFETY: all methods take `&self` and only pass the handle to thread-safe driver calls.
unsafe impl Sync for MemPool {}

impl MemPool {
    /// Creates a pool of pinned memory on the context's device, exportable as `handle_type`,
    /// holding at most `max_size_bytes` (0: the driver's default). Freed memory stays in the
    /// pool (release threshold `u64::MAX`) instead of going back to the OS at each sync.
    pub fn new_exportable(
        ctx: &Arc<Context>,
        max_size_bytes: usize,
        handle_type: PoolHandleType,
    ) -> Result<MemPool, CudaError> {
        ctx.make_current()?;
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: handle_type.raw(),
            location: device_location(ctx.device()),
            win32SecurityAttributes: ptr::null_mut(),
            maxSize: max_size_bytes,
            usage: 0,
            reserved: [0; 54],
        };
        let mut raw: sys::CUmemoryPool = ptr::null_mut();
        // SAFETY: `props` is fully initialised and outlives the call; out-pointer is a local.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(&mut raw, &props)
        })?;
        let pool = MemPool {
            raw,
            handle_type,
            imported: false,
            ctx: Arc::clone(ctx),
        };
        let mut threshold: u64 = u64::MAX;
        // SAFETY: the pool is live; RELEASE_THRESHOLD takes a pointer to a cuuint64_t.
        check("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                pool.raw,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast::<c_void>(),
            )
        })?;
        Ok(pool)
    }

    /// Imports a pool from a file descriptor made by [`MemPool::export_fd`] in another process.
    /// The descriptor stays owned by the caller (close it once imported).
    pub fn import_fd(ctx: &Arc<Context>, fd: BorrowedFd<'_>) -> Result<MemPool, CudaError> {
        ctx.make_current()?;
        let mut raw: sys::CUmemoryPool = ptr::null_mut();
        // For POSIX fds the "handle" is the descriptor's value itself, cast to a pointer.
        let handle = fd.as_raw_fd() as usize as *mut c_void;
        // SAFETY: the fd is open for the duration of the call (borrowed); out-pointer is a local.
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &mut raw,
                handle,
                PoolHandleType::PosixFd.raw(),
                0,
            )
        })?;
        Ok(MemPool {
            raw,
            handle_type: PoolHandleType::PosixFd,
            imported: true,
            ctx: Arc::clone(ctx),
        })
    }

    /// Imports a pool from a fabric handle made by [`MemPool::export_fabric`] in another
    /// process (needs an IMEX channel on both sides).
    pub fn import_fabric(ctx: &Arc<Context>, handle: &FabricHandle) -> Result<MemPool, CudaError> {
        ctx.make_current()?;
        let mut raw: sys::CUmemoryPool = ptr::null_mut();
        let mut fabric = sys::CUmemFabricHandle { data: *handle };
        // SAFETY: for fabric handles the driver reads a CUmemFabricHandle through the pointer,
        // which points to a valid local; the out-pointer is a local.
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &mut raw,
                (&mut fabric as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                PoolHandleType::Fabric.raw(),
                0,
            )
        })?;
        Ok(MemPool {
            raw,
            handle_type: PoolHandleType::Fabric,
            imported: true,
            ctx: Arc::clone(ctx),
        })
    }

    /// Exports the pool as a fabric handle, to send to another process as bytes. The pool must
    /// have been created with [`PoolHandleType::Fabric`].
    pub fn export_fabric(&self) -> Result<FabricHandle, CudaError> {
        if self.handle_type != PoolHandleType::Fabric || self.imported {
            return Err(CudaError::Unsupported {
                what: "export_fabric on a pool that is imported or not created with Fabric".into(),
                hint: "create the pool with MemPool::new_exportable(.., PoolHandleType::Fabric)"
                    .into(),
            });
        }
        let mut fabric = sys::CUmemFabricHandle { data: [0; 64] };
        // SAFETY: the pool is live; for fabric handles the driver writes a CUmemFabricHandle
        // through the pointer, which points to a valid local.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&mut fabric as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                self.raw,
                self.handle_type.raw(),
                0,
            )
        })?;
        Ok(fabric.data)
    }

    /// The handle type the pool was created (or imported) with.
    pub fn handle_type(&self) -> PoolHandleType {
        self.handle_type
    }

    /// The context the pool belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw pool handle.
    pub fn raw(&self) -> sys::CUmemoryPool {
        self.raw
    }

    /// Whether this pool was imported from another process.
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// Bytes of device memory the pool holds now (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub fn reserved_bytes(&self) -> Result<u64, CudaError> {
        let mut v: u64 = 0;
        // SAFETY: the pool is live; RESERVED_MEM_CURRENT writes one cuuint64_t to `v`.
        check("cuMemPoolGetAttribute", unsafe {
            sys::cuMemPoolGetAttribute(
                self.raw,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&mut v as *mut u64).cast::<c_void>(),
            )
        })?;
        Ok(v)
    }

    /// Exports the pool as a new file descriptor, to send to another process (SCM_RIGHTS).
    pub fn export_fd(&self) -> Result<OwnedFd, CudaError> {
        if self.handle_type != PoolHandleType::PosixFd || self.imported {
            return Err(CudaError::Unsupported {
                what: "export_fd on a pool that is imported or not created with PosixFd".into(),
                hint: "create the pool with MemPool::new_exportable(.., PoolHandleType::PosixFd)"
                    .into(),
            });
        }
        let mut fd: c_int = -1;
        // SAFETY: the pool is live; for POSIX fds the driver writes an int through the pointer.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                self.raw,
                self.handle_type.raw(),
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError::InvalidArgument(format!(
                "cuMemPoolExportToShareableHandle returned fd {fd}"
            )));
        }
        // SAFETY: the driver just created this descriptor for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Grants `device` read-write (or read-only) access to the pool's memory. Needed by an
    /// importer before it touches imported pointers; a no-op when the access is already there.
    pub fn set_access(&self, device: &Device, read_write: bool) -> Result<(), CudaError> {
        let wanted = if read_write {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
        };
        let mut location = device_location(device);
        let mut current = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: the pool is live; both pointers are valid locals.
        let r = unsafe { sys::cuMemPoolGetAccess(&mut current, self.raw, &mut location) };
        if r == CUresult::CUDA_SUCCESS && current == wanted {
            return Ok(());
        }
        let desc = sys::CUmemAccessDesc {
            location,
            flags: wanted,
        };
        // SAFETY: the pool is live; `desc` is one valid descriptor.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(self.raw, &desc, 1)
        })
    }

    /// Allocates `bytes` from the pool, ordered on `stream`: the memory may be used by work
    /// enqueued on `stream` after this call (or work ordered after it by events).
    pub fn alloc_async(&self, bytes: usize, stream: &Stream) -> Result<CUdeviceptr, CudaError> {
        if self.imported {
            return Err(CudaError::Unsupported {
                what: "allocating from an imported pool".into(),
                hint: "only the exporting process allocates; import pointers instead".into(),
            });
        }
        if bytes == 0 {
            return Err(CudaError::InvalidArgument("alloc_async of 0 bytes".into()));
        }
        self.ctx.make_current()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: pool and stream are live; the out-pointer is a valid local.
        check("cuMemAllocFromPoolAsync", unsafe {
            sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, self.raw, stream.raw)
        })?;
        Ok(ptr)
    }

    /// Frees `ptr`, ordered on `stream`. For an imported pointer this drops the import only.
    ///
    /// # Safety
    /// `ptr` came from [`MemPool::alloc_async`] or [`MemPool::import_pointer`] on this pool, is
    /// not freed yet, and no work that runs after the free (in stream order) uses it. An exporter
    /// frees only after every importer has freed its import.
    pub unsafe fn free_async(&self, ptr: CUdeviceptr, stream: &Stream) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        // SAFETY: the caller guarantees `ptr` is a live allocation of this pool; stream is live.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr, stream.raw)
        })
    }

    /// The data another process passes to [`MemPool::import_pointer`] to name `ptr`.
    pub fn export_pointer(&self, ptr: CUdeviceptr) -> Result<PointerExport, CudaError> {
        let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
        // SAFETY: the out-pointer is a valid local; the driver validates `ptr` itself.
        check("cuMemPoolExportPointer", unsafe {
            sys::cuMemPoolExportPointer(&mut data, ptr)
        })?;
        Ok(data.reserved)
    }

    /// Maps an allocation exported by [`MemPool::export_pointer`] into this process. Import
    /// each pointer once per process: two imports of one allocation share a mapping, and the
    /// first free unmaps both.
    pub fn import_pointer(&self, export: &PointerExport) -> Result<CUdeviceptr, CudaError> {
        self.ctx.make_current()?;
        let mut data = sys::CUmemPoolPtrExportData { reserved: *export };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the pool is live; `data` is a valid local the driver only reads.
        check("cuMemPoolImportPointer", unsafe {
            sys::cuMemPoolImportPointer(&mut ptr, self.raw, &mut data)
        })?;
        Ok(ptr)
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        // SAFETY: we own the pool handle and destroy it once. Outstanding allocations keep the
        // driver's resources alive until they are freed.
        let r = unsafe { sys::cuMemPoolDestroy(self.raw) };
        log_drop_error("memory pool", "cuMemPoolDestroy", r);
    }
}

#[cfg(test)]
mod tests {
    mod gpu {
        use super::super::*;

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn pool_export_fabric_needs_a_fabric_pool() {
            let ctx = Context::new(0).unwrap();
            let pool = MemPool::new_exportable(&ctx, 64 << 20, PoolHandleType::PosixFd).unwrap();
            assert!(matches!(
                pool.export_fabric(),
                Err(CudaError::Unsupported { .. })
            ));
            assert_eq!(pool.handle_type(), PoolHandleType::PosixFd);
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn pool_exports_an_fd_and_pointers() {
            let ctx = Context::new(0).unwrap();
            let s = Stream::new(&ctx).unwrap();
            let pool = MemPool::new_exportable(&ctx, 64 << 20, PoolHandleType::PosixFd).unwrap();
            let ptr = pool.alloc_async(2 << 20, &s).unwrap();
            let fd = pool.export_fd().unwrap();
            assert!(fd.as_raw_fd() >= 0);
            let export = pool.export_pointer(ptr).unwrap();
            assert_ne!(export, [0u8; 64]);
            // SAFETY: `ptr` came from this pool and nothing uses it after the free.
            unsafe { pool.free_async(ptr, &s) }.unwrap();
            s.synchronize().unwrap();
        }
    }
}
