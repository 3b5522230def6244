//! Loading and initialising the driver, and what it reports before any device is opened.

use std::ffi::c_int;
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::error::{CudaError, check};
use super::library::driver_present;

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
