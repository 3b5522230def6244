//! CUDA backend pieces for gpipe, on cudarc's raw driver bindings.
//!
//! - [`driver`]: a thin safe layer over the driver API, one file per topic (context and streams,
//!   events, exportable stream-ordered memory pools, virtual memory management, legacy IPC
//!   memory handles, plain buffers, copies and stream memory operations).
//! - [`memory`]: the backend's memory paths ([`memory::MemoryPath`]: pool, VMM, legacy IPC), one
//!   file per path behind one interface, handle kinds and attach-cost timings.
//! - [`sync`]: how `ready` and `finished` are signalled ([`sync::SyncMode`]: IPC events or
//!   timeline words).
//! - `export` (crate-private): the export blob a producer sends each consumer.
//! - [`backend`]: the producer's and the consumer's halves of the CUDA backend.
//! - [`ordering`]: publishing after, and releasing after, work on the caller's own streams
//!   (extension traits on the core's `Slot` and `Batch`).
//! - [`probe`]: what each device supports, and which transport path gpipe takes on it.
//! - [`policy`]: every `auto` rule (slots, lead, backend and memory path, sync, timeline
//!   memory, side signals, delivery, fan-out shape) and the one resolver the command line and
//!   the Python package share.
//!
//! Nothing here panics on a machine without a GPU: every entry point checks that `libcuda` (and,
//! for NVRTC's version, `libnvrtc`) can be loaded and returns [`driver::CudaError::NoDriver`] (or
//! [`driver::CudaError::NoNvrtc`]) when it cannot. The benchmark's kernels live with the
//! benchmark, in the `gpipe` CLI.

pub mod backend;
pub mod driver;
mod error;
mod export;
pub mod memory;
pub mod mirror;
mod names;
pub mod nccl;
pub mod ordering;
pub mod policy;
pub mod probe;
pub mod sync;
