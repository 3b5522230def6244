//! CUDA backend pieces for gpipe, on cudarc's raw driver bindings.
//!
//! - [`driver`]: a thin safe layer over the driver API (context, streams, events, IPC events,
//!   exportable stream-ordered memory pools, copies, stream memory operations).
//! - [`probe`]: what each device supports, and which transport path gpipe takes on it.
//! - [`kernels`]: NVRTC-compiled fill and verify kernels used by the examples and benchmarks.
//!
//! Nothing here panics on a machine without a GPU: every entry point checks that `libcuda` (and,
//! for kernels, `libnvrtc`) can be loaded and returns [`driver::CudaError::NoDriver`] (or
//! [`driver::CudaError::NoNvrtc`]) when it cannot.

pub mod backend;
pub mod driver;
pub mod kernels;
pub mod probe;
