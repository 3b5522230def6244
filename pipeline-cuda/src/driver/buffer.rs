//! Plain memory: pinned host buffers, `cuMemAlloc` device buffers, and host memory registered
//! with the driver.

use std::ffi::{c_uint, c_void};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CUdeviceptr, Context, CudaError, SavedContext, check, log_drop_error};

/// Page-locked host memory (`cuMemHostAlloc`, portable across contexts), zeroed at creation.
/// Freed on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: the buffer is plain host memory owned by this value; it hands out only raw pointers
// and `unsafe` slices whose callers take on the aliasing rules.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as for Send; `&self` methods give out no safe mutable access.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes (must be non-zero) of pinned host memory.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<PinnedBuffer, CudaError> {
        if len == 0 {
            return Err(CudaError::InvalidArgument(
                "pinned buffer of 0 bytes".into(),
            ));
        }
        ctx.make_current()?;
        let mut raw: *mut c_void = ptr::null_mut();
        // SAFETY: the context is current; the out-pointer is a valid local.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut raw, len, sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| {
            CudaError::InvalidArgument("cuMemHostAlloc returned a null pointer".into())
        })?;
        // SAFETY: the driver just allocated `len` writable bytes at `ptr`; nothing else uses them.
        unsafe { ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            ptr,
            len,
            ctx: Arc::clone(ctx),
        })
    }

    /// The start of the buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false` (empty buffers are refused); present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for the host to read.
    ///
    /// # Safety
    /// No GPU work that writes the buffer may be in flight while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid and initialised for `len` bytes for the life of `self`; the
        // caller guarantees the GPU does not write it meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, for the host to write.
    ///
    /// # Safety
    /// No GPU work that reads or writes the buffer may be in flight while the slice lives.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; `&mut self` rules out other host borrows.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("dropping pinned buffer: {e}");
        }
        // SAFETY: we allocated this pointer with cuMemHostAlloc and free it once.
        let r = unsafe { sys::cuMemFreeHost(self.ptr.as_ptr().cast::<c_void>()) };
        log_drop_error("pinned buffer", "cuMemFreeHost", r);
    }
}

/// Plain device memory (`cuMemAlloc`), not from a pool. Freed on drop (`cuMemFree`, which waits
/// for work using it on the device).
#[derive(Debug)]
pub struct DeviceBuffer {
    // `ptr` and `ctx` are read by the legacy IPC export next door (`ipc.rs`).
    pub(super) ptr: CUdeviceptr,
    len: usize,
    pub(super) ctx: Arc<Context>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (must be non-zero); the contents are undefined.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<DeviceBuffer, CudaError> {
        if len == 0 {
            return Err(CudaError::InvalidArgument(
                "device buffer of 0 bytes".into(),
            ));
        }
        ctx.make_current()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the context is current; the out-pointer is a valid local.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len)
        })?;
        Ok(DeviceBuffer {
            ptr,
            len,
            ctx: Arc::clone(ctx),
        })
    }

    /// The device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false` (empty buffers are refused); present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("dropping device buffer: {e}");
        }
        // SAFETY: we allocated this pointer with cuMemAlloc and free it once.
        let r = unsafe { sys::cuMemFree_v2(self.ptr) };
        log_drop_error("device buffer", "cuMemFree_v2", r);
    }
}

/// Host memory registered with the driver (`cuMemHostRegister`, portable): device-mapped
/// ([`HostRegistration::new`]), so that GPU stream memory operations can read and write it,
/// or read-only ([`HostRegistration::read_only`]), so that copies from it are DMA.
/// Unregistered on drop; the memory itself stays owned by the caller and must outlive this
/// registration.
#[derive(Debug)]
pub struct HostRegistration {
    host: *mut c_void,
    device_ptr: CUdeviceptr,
    ctx: Arc<Context>,
}

// SAFETY: the registration is a driver-side record usable from any thread; we only keep the
// address to unregister it.
unsafe impl Send for HostRegistration {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `len` bytes at `host` (page-aligned, `len` a multiple of the page size).
    ///
    /// # Safety
    /// `host..host + len` is a live mapping that stays mapped until this value is dropped.
    pub unsafe fn new(ctx: &Arc<Context>, host: *mut u8, len: usize) -> Result<Self, CudaError> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller's guarantee, passed on.
        let mut reg = unsafe { Self::register(ctx, host.cast_const(), len, flags) }?;
        ctx.make_current()?; // as before `register` put the caller's context back
        let mut dptr: CUdeviceptr = 0;
        // SAFETY: the range was just registered; the out-pointer is a valid local.
        check("cuMemHostGetDevicePointer_v2", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, reg.host, 0)
        })?;
        reg.device_ptr = dptr;
        Ok(reg)
    }

    /// Page-locks `len` bytes at `host`, which may be mapped read-only, for copies to any GPU
    /// (portable; the GPU only reads it): a copy from it is a DMA that does not block the
    /// host. No device address ([`Self::device_ptr`] is 0).
    ///
    /// # Safety
    /// As for [`Self::new`].
    pub unsafe fn read_only(
        ctx: &Arc<Context>,
        host: *const u8,
        len: usize,
    ) -> Result<Self, CudaError> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_READ_ONLY;
        // SAFETY: the caller's guarantee, passed on.
        unsafe { Self::register(ctx, host, len, flags) }
    }

    /// # Safety
    /// As for [`Self::new`].
    unsafe fn register(
        ctx: &Arc<Context>,
        host: *const u8,
        len: usize,
        flags: u32,
    ) -> Result<Self, CudaError> {
        let _saved = SavedContext::save()?; // the caller's current context, put back
        ctx.make_current()?;
        // SAFETY: the caller guarantees the range is mapped for the registration's life; the
        // call itself writes nothing there.
        check("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(host.cast_mut().cast::<c_void>(), len, flags as c_uint)
        })?;
        Ok(HostRegistration {
            host: host.cast_mut().cast::<c_void>(),
            device_ptr: 0,
            ctx: Arc::clone(ctx),
        })
    }

    /// The device address of the registered memory's first byte.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device_ptr
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // The last holder may be any thread (a Python caller's): its current context goes
        // back once this is done.
        let _saved = SavedContext::save();
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!(
                "host registration: cannot make its context current ({e}); the memory stays page-locked"
            );
            return;
        }
        // SAFETY: registered in `register`, unregistered once, here, while still mapped.
        let r = unsafe { sys::cuMemHostUnregister(self.host) };
        log_drop_error("host registration", "cuMemHostUnregister", r);
    }
}
