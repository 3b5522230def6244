//! Legacy IPC memory handles: a `cuMemAlloc` allocation shared with `cuIpcGetMemHandle` and
//! opened in another process with `cuIpcOpenMemHandle`.

use std::ffi::{c_char, c_uint};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CUdeviceptr, Context, CudaError, DeviceBuffer, check, log_drop_error};

/// The legacy IPC handle of a `cuMemAlloc` allocation (`CUipcMemHandle`).
pub type IpcMemHandle = [u8; 64];

impl DeviceBuffer {
    /// The legacy IPC handle of this allocation (`cuIpcGetMemHandle`), which another process
    /// opens with [`IpcMapping::open`]. The handle names the whole allocation, so allocate
    /// exactly what may be shared.
    pub fn ipc_handle(&self) -> Result<IpcMemHandle, CudaError> {
        self.ctx.make_current()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `ptr` is our live cuMemAlloc allocation; the out-pointer is a valid local.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, self.ptr)
        })?;
        Ok(handle.reserved.map(|c| c.to_ne_bytes()[0]))
    }
}

/// Another process's `cuMemAlloc` allocation, opened from its legacy IPC handle
/// (`cuIpcOpenMemHandle_v2` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`). Closed on drop
/// (`cuIpcCloseMemHandle`).
///
/// Drop it only after the work that uses it finished (synchronise the streams first), and
/// before the exporter frees the allocation.
#[derive(Debug)]
pub struct IpcMapping {
    ptr: CUdeviceptr,
    ctx: Arc<Context>,
}

// SAFETY: the mapping is a driver-side record usable from any thread; we only keep the
// address to close it.
unsafe impl Send for IpcMapping {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens a handle made by [`DeviceBuffer::ipc_handle`] in another process. The driver
    /// refuses handles of the calling process. Open each handle once per process.
    pub fn open(ctx: &Arc<Context>, handle: &IpcMemHandle) -> Result<IpcMapping, CudaError> {
        ctx.make_current()?;
        let handle = sys::CUipcMemHandle {
            reserved: handle.map(|b| c_char::from_ne_bytes([b])),
        };
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the context is current; the handle is passed by value; out-pointer is a local.
        check("cuIpcOpenMemHandle_v2", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags)
        })?;
        Ok(IpcMapping {
            ptr,
            ctx: Arc::clone(ctx),
        })
    }

    /// The device address of the allocation's first byte in this process.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("dropping IPC mapping: {e}");
        }
        // SAFETY: opened in `open`, closed once, here; the owner guarantees no work uses it.
        let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        log_drop_error("IPC mapping", "cuIpcCloseMemHandle", r);
    }
}

#[cfg(test)]
mod tests {
    mod gpu {
        use super::super::*;

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn legacy_ipc_handle_exports_but_does_not_open_in_its_own_process() {
            let ctx = Context::new(0).unwrap();
            let buf = DeviceBuffer::new(&ctx, 2 << 20).unwrap();
            let handle = buf.ipc_handle().unwrap();
            assert_ne!(handle, [0u8; 64]);
            // The driver refuses to open a memory handle in the process that made it; the
            // cross-process integration tests open it.
            assert!(IpcMapping::open(&ctx, &handle).is_err());
        }
    }
}
