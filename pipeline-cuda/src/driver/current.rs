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
    ordinal: Option<usize>,
}

impl SavedContext {
    /// Saves the calling thread's current context (none is fine) and notes its device.
    pub fn save() -> Result<SavedContext, CudaError> {
        init()?;
        let mut saved: sys::CUcontext = ptr::null_mut();
        // SAFETY: the driver is initialised; the out-pointer is a valid local.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut saved)
        })?;
        let mut ordinal = None;
        if !saved.is_null() {
            let mut dev: sys::CUdevice = 0;
            // SAFETY: `saved` is current on this thread; the out-pointer is a valid local.
            check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
            for k in 0..device_count()? {
                if Device::get(k)?.raw() == dev {
                    ordinal = Some(k);
                    break;
                }
            }
        }
        Ok(SavedContext { saved, ordinal })
    }

    /// The ordinal of the saved context's device, or None when the thread had no context.
    pub fn device_ordinal(&self) -> Option<usize> {
        self.ordinal
    }
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
