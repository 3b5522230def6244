//! The benchmark's GPU work, kept out of the library a user links: the NVRTC kernels that
//! fill and verify gpipe's test pattern, their use as `work::Fill` / `work::Check`, GPU
//! timeline stamps, the single-process ceilings `gpipe bench` compares a run with, and what
//! `gpipe probe --call-costs --gpu-gaps` times.
//!
//! | file | holds |
//! | --- | --- |
//! | `kernels.rs` | the CUDA C++ source, its compilation (NVRTC) and [`kernels::Kernels`] |
//! | `fill.rs` | [`CudaFill`] (producer) and [`CudaCheck`] (consumer) |
//! | `stamps.rs` | the GPU timeline stamps of chosen batches |
//! | `ceilings.rs` | the single-process ceilings (one stream, two streams, lagged, pool memory, the run's own work, peer copy and remote read) |
//! | `call_costs.rs` | the host cost of each hot-path driver call |
//! | `gaps.rs` | the GPU's idle time between two kernels around each hot-path stream operation |

pub mod call_costs;
pub mod ceilings;
mod fill;
pub mod gaps;
pub mod kernels;
mod stamps;

use pipeline_cuda::backend::{SyncMode, TimelineMemory};
use pipeline_cuda::driver;

pub use fill::{CudaCheck, CudaFill};

/// Why the CUDA backend cannot be used here, if it cannot.
pub fn usable() -> Result<(), String> {
    if !driver::driver_present() {
        return Err("no CUDA driver (libcuda.so.1) could be loaded".into());
    }
    let report = pipeline_cuda::probe::probe().map_err(|e| e.to_string())?;
    if report.devices.is_empty() {
        return Err("the CUDA driver sees no device".into());
    }
    report
        .auto_memory_path_for(0, pipeline_cuda::backend::HandleKind::PosixFd)
        .map_err(|e| e.to_string())?;
    driver::ensure_nvrtc().map_err(|e| e.to_string())?;
    Ok(())
}

/// The sync mode `auto` picks for timeline words in `words`. Measured on an H100
/// (docs/benchmarks.md): with the words in host memory, which the GPU polls over PCIe, IPC
/// events were as fast as or faster than semaphores; with the words in device memory,
/// semaphores were the faster (2 MiB, MPS, 1 consumer: 0.86x of the fair ceiling against
/// 0.84x; 4 consumers: 0.80x against 0.70x).
pub fn auto_sync(words: TimelineMemory) -> SyncMode {
    match words {
        TimelineMemory::Device => SyncMode::Semaphore,
        TimelineMemory::Host => SyncMode::Events,
    }
}
