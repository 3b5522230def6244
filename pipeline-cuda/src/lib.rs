//! CUDA backend pieces for gpipe, on cudarc's raw driver bindings.
//!
//! - [`driver`]: a thin safe layer over the driver API (context, streams, events, IPC events,
//!   exportable stream-ordered memory pools, legacy IPC memory handles, copies, stream memory
//!   operations).
//! - [`vmm`]: virtual memory management (`cuMemCreate`, `cuMemMap`, shareable handles).
//! - [`memory`]: the backend's memory paths ([`memory::MemoryPath`]: pool, VMM, legacy IPC),
//!   handle kinds and attach-cost timings.
//! - [`probe`]: what each device supports, and which transport path gpipe takes on it.
//! - [`kernels`]: NVRTC-compiled fill and verify kernels used by the examples and benchmarks.
//!
//! Nothing here panics on a machine without a GPU: every entry point checks that `libcuda` (and,
//! for kernels, `libnvrtc`) can be loaded and returns [`driver::CudaError::NoDriver`] (or
//! [`driver::CudaError::NoNvrtc`]) when it cannot.

pub mod backend;
pub mod driver;
pub mod kernels;
pub mod memory;
pub mod probe;
pub mod vmm;
