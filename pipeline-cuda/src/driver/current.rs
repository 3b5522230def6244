//! The calling thread's current context, when gpipe works on a thread it does not own: a
//! Python caller's, whose current context is torch's `current_device`. What gpipe makes
//! current there for its own calls is put back afterwards.

use std::ptr;

use cudarc::driver::sys;

use super::{CudaError, Device, check, device_count, init};

/// The thread's current context when it was saved, made current again on drop.
#[derive(Debug)]
pub struct SavedContext {
    saved: sys::CUcontext,
}

impl SavedContext {
    /// Saves the calling thread's current context (none is fine).
    pub fn save() -> Result<SavedContext, CudaError> {
        init()?;
        let mut saved: sys::CUcontext = ptr::null_mut();
        // SAFETY: the driver is initialised; the out-pointer is a valid local.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut saved)
        })?;
        Ok(SavedContext { saved })
    }
}

/// The ordinal of the device of the calling thread's current context, or None when the
/// thread has none.
pub fn current_device() -> Result<Option<usize>, CudaError> {
    init()?;
    let mut current: sys::CUcontext = ptr::null_mut();
    // SAFETY: the driver is initialised; the out-pointer is a valid local.
    check("cuCtxGetCurrent", unsafe {
        sys::cuCtxGetCurrent(&mut current)
    })?;
    if current.is_null() {
        return Ok(None);
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: a context is current on this thread; the out-pointer is a valid local.
    check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
    for ordinal in 0..device_count()? {
        if Device::get(ordinal)?.raw() == dev {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

impl Drop for SavedContext {
    fn drop(&mut self) {
        // SAFETY: `saved` was the thread's current context (or null: none); setting it back
        // binds it to this thread again. A context destroyed since is the owner's doing, and
        // the driver reports it as an error, which is all this can do.
        let r = unsafe { sys::cuCtxSetCurrent(self.saved) };
        super::log_drop_error("saved context", "cuCtxSetCurrent", r);
    }
}
