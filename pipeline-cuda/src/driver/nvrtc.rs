//! NVRTC, the runtime compiler: whether it loads, its version, and its result codes.
//!
//! The library compiles nothing itself; `gpipe probe` reports NVRTC because the benchmark's
//! kernels (in the `gpipe` CLI) are compiled with it.

use std::ffi::c_int;
use std::sync::OnceLock;

use cudarc::nvrtc;

use super::CudaError;

/// `Ok` when `libnvrtc` can be loaded, else [`CudaError::NoNvrtc`].
pub fn ensure_nvrtc() -> Result<(), CudaError> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the NVRTC library names cudarc knows.
    if *PRESENT.get_or_init(|| unsafe { nvrtc::sys::is_culib_present() }) {
        Ok(())
    } else {
        Err(CudaError::NoNvrtc(
            "tried libnvrtc.so, libnvrtc.so.13 and the other names cudarc knows; install \
             NVRTC from the CUDA toolkit and put its lib directory on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// Turns an NVRTC result into a `Result`; `what` says what was being done ("reading its
/// version").
pub fn nvrtc_check(what: &str, r: nvrtc::sys::nvrtcResult) -> Result<(), CudaError> {
    r.result().map_err(|e| CudaError::Nvrtc {
        what: what.into(),
        message: format!("{e:?}"),
    })
}

/// NVRTC's version as `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    ensure_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is loaded; both out-pointers are valid locals.
    let r = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    nvrtc_check("reading its version", r)?;
    Ok((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_absence_is_an_error_not_a_panic() {
        // SAFETY: only probes whether the library can be loaded.
        if unsafe { nvrtc::sys::is_culib_present() } {
            assert!(nvrtc_version().is_ok());
        } else {
            assert!(matches!(nvrtc_version(), Err(CudaError::NoNvrtc(_))));
        }
    }
}
