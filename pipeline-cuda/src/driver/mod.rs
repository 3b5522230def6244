//! A thin, safe layer over the CUDA driver API (`cudarc::driver::sys`).
//!
//! cudarc's safe API covers neither stream-ordered memory pools nor IPC, so this module wraps the
//! raw calls itself, in cudarc's style: `sys` call → [`check`] → small RAII types that destroy what
//! they own on drop.
//!
//! Every entry point checks first that `libcuda` can be loaded (a raw `sys` call panics when it
//! cannot) and returns [`CudaError::NoDriver`] instead. Constructors go through [`init`]; the other
//! methods need a [`Context`], [`Stream`] or [`Device`], which only exist once the driver is loaded.
//!
//! Raw device addresses (`CUdeviceptr`) are plain integers: functions that make the GPU write or
//! read through one are `unsafe`, since nothing here can check that the address is live and that
//! no other work uses it at the same time.
//!
//! One file per topic, every item re-exported here:
//!
//! | file | holds |
//! | --- | --- |
//! | `library.rs` | [`driver_present`]: whether `libcuda` loads |
//! | `error.rs` | [`CudaError`], [`check`] |
//! | `init.rs` | loading and initialising the driver: [`init`], [`driver_version`], [`device_count`] |
//! | `context.rs` | [`Device`], [`Context`], [`Stream`] |
//! | `event.rs` | [`Event`]: ordering, timing and IPC events; a [`Stream`] waiting on one |
//! | `pool.rs` | [`MemPool`], [`PoolHandleType`], pointer exports, fabric handles |
//! | `vmm.rs` | [`PhysicalAllocation`], [`VmmMapping`] (`cuMemCreate` / `cuMemMap`) |
//! | `ipc.rs` | legacy IPC memory handles: [`IpcMemHandle`], [`IpcMapping`] |
//! | `buffer.rs` | [`PinnedBuffer`], [`DeviceBuffer`], [`HostRegistration`] |
//! | `memops.rs` | copies, memset, [`stream_write_value64`] / [`stream_wait_value64`], and batches of them ([`stream_mem_ops_raw`]) |
//! | `nvrtc.rs` | NVRTC: [`ensure_nvrtc`], [`nvrtc_version`], [`nvrtc_check`] |

pub use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUevent, CUresult, CUstream};

mod buffer;
mod context;
mod current;
mod error;
mod event;
mod init;
mod ipc;
mod library;
mod memops;
mod nvrtc;
mod pool;
mod vmm;

pub use buffer::{DeviceBuffer, HostRegistration, PinnedBuffer};
pub(crate) use context::device_location;
pub use context::{Context, Device, Stream};
pub use current::{SavedContext, current_device};
use error::log_drop_error;
pub use error::{CudaError, check};
pub use event::Event;
pub use init::{device_count, driver_version, ensure_driver, init};
pub use ipc::{IpcMapping, IpcMemHandle};
pub use library::driver_present;
pub use memops::{
    MemOp, WaitCondition, memcpy_async, memcpy_dtoh_async, memcpy_htod_async, memset_d8_async,
    stream_mem_ops_raw, stream_wait_value64, stream_wait_value64_raw, stream_write_value64,
    stream_write_value64_raw,
};
pub use nvrtc::{ensure_nvrtc, nvrtc_check, nvrtc_version};
pub use pool::{FabricHandle, MemPool, PointerExport, PoolHandleType};
pub use vmm::{PhysicalAllocation, VmmMapping, allocation_granularity};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_report_a_missing_driver_without_panicking() {
        if driver_present() {
            return; // covered by the GPU tests
        }
        let is_no_driver = |e: CudaError| {
            assert!(
                e.to_string()
                    .starts_with("no CUDA driver found (libcuda.so.1 could not be loaded): "),
                "{e}"
            );
            matches!(e, CudaError::NoDriver(_))
        };
        assert!(is_no_driver(init().unwrap_err()));
        assert!(is_no_driver(driver_version().unwrap_err()));
        assert!(is_no_driver(device_count().unwrap_err()));
        assert!(is_no_driver(Device::get(0).unwrap_err()));
        assert!(is_no_driver(Context::new(0).unwrap_err()));
    }

    #[test]
    fn device_handles_are_thread_safe() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Context>();
        assert_send_sync::<Stream>();
        assert_send_sync::<Event>();
        assert_send_sync::<MemPool>();
        assert_send_sync::<PinnedBuffer>();
        assert_send_sync::<DeviceBuffer>();
        assert_send_sync::<IpcMapping>();
    }
}
