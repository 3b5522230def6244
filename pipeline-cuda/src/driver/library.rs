//! Whether the driver library can be loaded: the one check every entry point makes before a
//! raw `sys` call (which panics when `libcuda` is missing).

use std::sync::OnceLock;

use cudarc::driver::sys;

/// Whether `libcuda` can be loaded (checked once per process).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: is_culib_present only tries to dlopen the library names cudarc knows; loading
        // the NVIDIA driver library has no preconditions on our side.
        unsafe { sys::is_culib_present() }
    })
}
