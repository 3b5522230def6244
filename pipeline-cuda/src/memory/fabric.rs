//! Fabric handles: whether this machine has the IMEX channel they need, and the error that
//! says so when a fabric-handle step fails.

use super::path::HandleKind;
use crate::driver::CudaError;

/// Where the IMEX channel device nodes live.
pub const IMEX_CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";

/// Whether an IMEX channel device node (`/dev/nvidia-caps-imex-channels/channel*`) exists:
/// fabric handles need one.
pub fn imex_channel_present() -> bool {
    std::fs::read_dir(IMEX_CHANNEL_DIR).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("channel"))
    })
}

/// What to do when fabric handles cannot be used.
pub const FABRIC_HINT: &str = "fabric handles need an IMEX channel \
     (/dev/nvidia-caps-imex-channels) and multi-node NVLink with the IMEX daemon running; on a \
     single host use POSIX fd handles instead";

/// Wraps a driver failure of a fabric-handle step into a [`CudaError::Unsupported`] that says
/// what is missing.
pub(crate) fn fabric_failure(step: &str, e: CudaError) -> CudaError {
    let channel = if imex_channel_present() {
        "an IMEX channel is present"
    } else {
        "no IMEX channel is present"
    };
    CudaError::Unsupported {
        what: format!("fabric handles are not usable here ({step}: {e}; {channel})"),
        hint: FABRIC_HINT.into(),
    }
}

/// Maps a fabric-handle creation failure to a clear error; other failures pass unchanged.
pub(super) fn fabric_or(handle: HandleKind, step: &str, e: CudaError) -> CudaError {
    if handle == HandleKind::Fabric && matches!(e, CudaError::Driver { .. }) {
        fabric_failure(step, e)
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fabric_failures_name_the_imex_channel() {
        let e = fabric_failure(
            "creating",
            CudaError::InvalidArgument("driver said no".into()),
        );
        let text = e.to_string();
        assert!(text.contains("/dev/nvidia-caps-imex-channels"), "{text}");
        assert!(text.contains("multi-node NVLink"), "{text}");
        assert!(text.contains("driver said no"), "{text}");
    }
}
