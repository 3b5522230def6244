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
//! | `mod.rs` | [`CudaError`], [`check`], loading and initialising the driver |
//! | `context.rs` | [`Device`], [`Context`], [`Stream`] |
//! | `event.rs` | [`Event`]: ordering, timing and IPC events |
//! | `pool.rs` | [`MemPool`], [`PoolHandleType`], pointer exports, fabric handles |
//! | `vmm.rs` | [`PhysicalAllocation`], [`VmmMapping`] (`cuMemCreate` / `cuMemMap`) |
//! | `ipc.rs` | legacy IPC memory handles: [`IpcMemHandle`], [`IpcMapping`] |
//! | `buffer.rs` | [`PinnedBuffer`], [`DeviceBuffer`], [`HostRegistration`] |
//! | `memops.rs` | copies, memset, [`stream_write_value64`] / [`stream_wait_value64`], and batches of them ([`stream_mem_ops_raw`]) |
//! | `nvrtc.rs` | NVRTC: [`ensure_nvrtc`], [`nvrtc_version`], [`nvrtc_check`] |

use std::ffi::{CStr, c_char, c_int};
use std::fmt;
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::sys;

pub use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUevent, CUresult, CUstream};

mod buffer;
mod context;
mod event;
mod ipc;
mod memops;
mod nvrtc;
mod pool;
mod vmm;

pub use buffer::{DeviceBuffer, HostRegistration, PinnedBuffer};
pub(crate) use context::device_location;
pub use context::{Context, Device, Stream};
pub use event::Event;
pub use ipc::{IpcMapping, IpcMemHandle};
pub use memops::{
    MemOp, WaitCondition, memcpy_async, memcpy_dtoh_async, memcpy_htod_async, memset_d8_async,
    stream_mem_ops_raw, stream_wait_value64, stream_wait_value64_raw, stream_write_value64,
    stream_write_value64_raw,
};
pub use nvrtc::{ensure_nvrtc, nvrtc_check, nvrtc_version};
pub use pool::{FabricHandle, MemPool, PointerExport, PoolHandleType};
pub use vmm::{PhysicalAllocation, VmmMapping, allocation_granularity};

/// Errors from the CUDA driver, NVRTC, or an unsupported configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// `libcuda` could not be loaded; the text says what was tried.
    NoDriver(String),
    /// `libnvrtc` could not be loaded; the text says what was tried.
    NoNvrtc(String),
    /// A driver call returned an error.
    Driver {
        /// The driver function that failed, e.g. `"cuMemPoolCreate"`.
        call: &'static str,
        /// The result code.
        code: CUresult,
        /// The code's name, e.g. `"CUDA_ERROR_INVALID_VALUE"`.
        name: String,
        /// The driver's description of the code (`cuGetErrorString`).
        message: String,
    },
    /// NVRTC failed to compile the kernels.
    Nvrtc {
        /// What failed, e.g. `"compiling gpipe kernels for compute_90"`.
        what: String,
        /// NVRTC's error and, for a compile error, its log.
        message: String,
    },
    /// The device, driver or object cannot do what was asked.
    Unsupported {
        /// What is missing.
        what: String,
        /// What to do about it.
        hint: String,
    },
    /// An argument was rejected before calling the driver.
    InvalidArgument(String),
}

impl CudaError {
    fn driver(call: &'static str, code: CUresult) -> Self {
        let message = if driver_present() {
            let mut text: *const c_char = ptr::null();
            // SAFETY: the library is loaded (checked above); cuGetErrorString writes a pointer to a
            // static NUL-terminated string, or leaves `text` null for an unknown code.
            let r = unsafe { sys::cuGetErrorString(code, &mut text) };
            if r == CUresult::CUDA_SUCCESS && !text.is_null() {
                // SAFETY: non-null results of cuGetErrorString point to static C strings.
                unsafe { CStr::from_ptr(text) }
                    .to_string_lossy()
                    .into_owned()
            } else {
                String::from("unknown error")
            }
        } else {
            String::from("(driver not loaded)")
        };
        CudaError::Driver {
            call,
            code,
            // The enum's variant names are the driver's names (what cuGetErrorName returns).
            name: format!("{code:?}"),
            message,
        }
    }

    /// The driver result code, for a [`CudaError::Driver`].
    pub fn driver_code(&self) -> Option<CUresult> {
        match self {
            CudaError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// What to do about a driver error, where something useful can be said.
fn driver_hint(call: &str, code: CUresult) -> Option<&'static str> {
    use CUresult::*;
    Some(match code {
        CUDA_ERROR_NO_DEVICE => {
            "no CUDA GPU is visible to this process: check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
        }
        CUDA_ERROR_OUT_OF_MEMORY => "GPU memory is exhausted: use fewer or smaller slots",
        CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            "NVRTC produced PTX newer than this driver accepts: use an NVRTC no newer than the \
             driver's CUDA version (`gpipe probe` shows both)"
        }
        CUDA_ERROR_MPS_CONNECTION_FAILED => {
            "the MPS control daemon is not reachable: start it with `nvidia-cuda-mps-control -d` \
             or unset CUDA_MPS_PIPE_DIRECTORY"
        }
        CUDA_ERROR_NOT_SUPPORTED => "this device or driver lacks the feature: run `gpipe probe`",
        CUDA_ERROR_INVALID_CONTEXT if call.starts_with("cuIpcOpen") => {
            "an IPC handle opens only in another process than the one that created it"
        }
        CUDA_ERROR_INVALID_VALUE if call.starts_with("cuStreamW") => {
            "stream memory operations reject memory from IPC-capable pools: put timeline words \
             in plain cuMemAlloc memory"
        }
        _ => return None,
    })
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::NoDriver(detail) => write!(
                f,
                "no CUDA driver found (libcuda.so.1 could not be loaded): {detail}"
            ),
            CudaError::NoNvrtc(detail) => {
                write!(
                    f,
                    "NVRTC not found (libnvrtc could not be loaded): {detail}"
                )
            }
            CudaError::Driver {
                call,
                code,
                name,
                message,
            } => {
                write!(f, "{call} failed: {name} ({}): {message}", *code as i32)?;
                if let Some(hint) = driver_hint(call, *code) {
                    write!(f, "; {hint}")?;
                }
                Ok(())
            }
            CudaError::Nvrtc { what, message } => write!(f, "NVRTC failed {what}: {message}"),
            CudaError::Unsupported { what, hint } => write!(f, "{what}: {hint}"),
            CudaError::InvalidArgument(what) => write!(f, "invalid argument: {what}"),
        }
    }
}

impl std::error::Error for CudaError {}

/// Turns a driver result into a `Result`, naming the call that produced it.
pub fn check(call: &'static str, result: CUresult) -> Result<(), CudaError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::driver(call, result))
    }
}

/// Whether `libcuda` can be loaded (checked once per process).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: is_culib_present only tries to dlopen the library names cudarc knows; loading
        // the NVIDIA driver library has no preconditions on our side.
        unsafe { sys::is_culib_present() }
    })
}

/// `Ok` when `libcuda` can be loaded, else [`CudaError::NoDriver`].
pub fn ensure_driver() -> Result<(), CudaError> {
    if driver_present() {
        Ok(())
    } else {
        Err(CudaError::NoDriver(
            "tried libcuda.so, libcuda.so.1 and the other names cudarc knows; install the NVIDIA \
             driver or put its library directory on LD_LIBRARY_PATH (use the host backend on \
             machines without a GPU)"
                .into(),
        ))
    }
}

/// Loads the driver and calls `cuInit(0)`, once per process; later calls return the first result.
pub fn init() -> Result<(), CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    INIT.get_or_init(|| {
        ensure_driver()?;
        // SAFETY: the library is loaded; cuInit has no other preconditions.
        check("cuInit", unsafe { sys::cuInit(0) })
    })
    .clone()
}

/// The driver's CUDA version as `1000 * major + 10 * minor` (e.g. 13000 for 13.0).
pub fn driver_version() -> Result<i32, CudaError> {
    ensure_driver()?;
    let mut version: c_int = 0;
    // SAFETY: the library is loaded; the out-pointer is a valid local.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    })?;
    Ok(version)
}

/// The number of CUDA devices visible to this process.
pub fn device_count() -> Result<usize, CudaError> {
    init()?;
    let mut count: c_int = 0;
    // SAFETY: the driver is initialised; the out-pointer is a valid local.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Logs a failure inside `Drop`, where it cannot be returned.
fn log_drop_error(what: &str, call: &'static str, r: CUresult) {
    if let Err(e) = check(call, r) {
        tracing::warn!("dropping {what}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_the_call_and_code() {
        assert!(check("cuInit", CUresult::CUDA_SUCCESS).is_ok());
        let e = check("cuMemPoolCreate", CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert_eq!(e.driver_code(), Some(CUresult::CUDA_ERROR_INVALID_VALUE));
        let text = e.to_string();
        assert!(text.contains("cuMemPoolCreate"), "{text}");
        assert!(text.contains("CUDA_ERROR_INVALID_VALUE (1)"), "{text}");
    }

    #[test]
    fn stream_mem_op_errors_carry_a_hint() {
        let e = check("cuStreamWaitValue64_v2", CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert!(e.to_string().contains("cuMemAlloc memory"), "{e}");
    }

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
