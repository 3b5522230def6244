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

use std::sync::OnceLock;

use pipeline_cuda::policy::Facts;

pub use fill::{CudaCheck, CudaFill};

/// The driver and devices, probed once for the whole command (every `auto` of one `gpipe`
/// invocation resolves against this one probe), or why they could not be.
pub fn facts() -> &'static Result<Facts, String> {
    static FACTS: OnceLock<Result<Facts, String>> = OnceLock::new();
    FACTS.get_or_init(|| Facts::probe().map_err(|e| e.to_string()))
}
