//! What can go wrong: [`CudaError`], and [`check`], which turns a driver result into a `Result`
//! (cudarc's `result` layer).

use std::ffi::{CStr, c_char};
use std::fmt;
use std::ptr;

use cudarc::driver::sys::{self, CUresult};

use super::library::driver_present;

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
    pub(super) fn driver(call: &'static str, code: CUresult) -> Self {
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

/// Logs a failure inside `Drop`, where it cannot be returned.
pub(super) fn log_drop_error(what: &str, call: &'static str, r: CUresult) {
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
}
