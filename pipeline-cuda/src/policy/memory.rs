//! `memory = "auto"` (which CUDA memory path the slots take) and `backend = "auto"` (CUDA
//! when a GPU can run the ring, else host memory).

use super::{Choice, FrontEnd};
use crate::memory::{HandleKind, MemoryPath};
use crate::probe::{Capabilities, ProbeReport};
use pipeline_core::Mode;

/// The device `ordinal` of `report`, or why there is none.
pub(super) fn device(report: &ProbeReport, ordinal: usize) -> Result<&Capabilities, String> {
    if report.devices.is_empty() {
        return Err("the CUDA driver sees no device".into());
    }
    report
        .devices
        .iter()
        .find(|d| d.ordinal == ordinal)
        .ok_or_else(|| {
            format!(
                "no CUDA device {ordinal} ({} visible)",
                report.devices.len()
            )
        })
}

/// Why a ring cannot run on device `ordinal`, if it cannot: no such device, no memory path
/// with POSIX fds, or (for a front-end whose kernels NVRTC compiles) no NVRTC.
pub(super) fn cuda_usable(
    report: &ProbeReport,
    ordinal: usize,
    front_end: FrontEnd,
) -> Result<(), String> {
    let caps = device(report, ordinal)?;
    caps.auto_memory_path(HandleKind::PosixFd)
        .map_err(|e| e.to_string())?;
    if front_end.needs_nvrtc && report.nvrtc_version.is_none() {
        return Err(format!(
            "the benchmark kernels need NVRTC: {}",
            report.nvrtc_error.as_deref().unwrap_or("it did not load")
        ));
    }
    Ok(())
}

/// `memory`: the path given (checked against the device), or `auto`: with
/// [`FrontEnd::read_only_broadcast`] in broadcast mode the VMM path where the device has it
/// (consumers then map the slots read-only), else the first usable of pool, vmm, legacy.
pub(super) fn resolve(
    given: Option<MemoryPath>,
    handle: HandleKind,
    mode: Mode,
    front_end: FrontEnd,
    caps: &Capabilities,
) -> Result<Choice<MemoryPath>, String> {
    if let Some(m) = given {
        caps.check_path(m, handle).map_err(|e| e.to_string())?;
        return Ok(Choice::given(m));
    }
    if front_end.read_only_broadcast
        && mode == Mode::Broadcast
        && caps.check_path(MemoryPath::Vmm, handle).is_ok()
    {
        return Ok(Choice::auto(
            MemoryPath::Vmm,
            "a broadcast ring: VMM lets consumers map the slots read-only",
        ));
    }
    let m = caps.auto_memory_path(handle).map_err(|e| e.to_string())?;
    Ok(Choice::auto(
        m,
        format!(
            "the first of pool, vmm, legacy that device {} supports",
            caps.ordinal
        ),
    ))
}
