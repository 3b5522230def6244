//! The CUDA backend of the ring: slots in GPU memory shared on one of three memory paths
//! ([`MemoryPath`]: an exportable stream-ordered pool, VMM allocations, or legacy IPC), one
//! `ready` IPC event per slot (the producer's), and one `finished` timeline word per slot per
//! consumer.
//!
//! The producer picks the path and the handle kind ([`CudaOptions::memory`],
//! [`CudaOptions::handle`]); the export blob names them and consumers follow it. A consumer's
//! attach cost per step is in [`CudaConsumer::import_timings`] (and
//! [`last_import_timings`]).
//!
//! Ordering (docs/protocol.md): the producer's stream waits until the `finished[c][k]` words of
//! the consumers that had slot k's previous batch reach that batch's generation, runs the fill,
//! records `ready[k]`, and only then is the descriptor published. A consumer's stream waits
//! `ready[k]`, runs its kernels and writes `finished[c][k] = seq + 1` (cuStreamWriteValue64),
//! and only then is the slot released. No host synchronisation happens per batch.
//!
//! Why `finished` is a timeline word and not an IPC event: measured on an H100 (driver
//! 580.159.04, 2026-11-21), when a consumer is SIGKILLed after recording `finished` but before
//! its GPU work ran, a producer stream that waits that event never proceeds, and the producer
//! stalls for good. An event record cannot be completed by anyone else; a timeline word can:
//! on a consumer's death the producer stores a far-future value into its words, which releases
//! every wait on them. The words live in a sealed memfd both processes map and register with
//! the driver (stream memory operations reject memory from IPC-capable pools).
//!
//! ```no_run
//! use pipeline_core::{Consumer, Producer, ProducerConfig};
//! use pipeline_cuda::backend::{CudaConsumer, CudaOptions, CudaProducer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Process A: produce into GPU memory.
//! let mut producer: Producer<CudaProducer> =
//!     Producer::bind("/tmp/gpu.sock", ProducerConfig::default(), CudaOptions::default())?;
//! let mut slot = producer.acquire()?;      // the stream already waits for the consumers
//! let mem = slot.memory();                  // device pointer, capacity, the stream to use
//! // enqueue your fill kernel on mem.stream.raw() writing to mem.ptr ...
//! let _ = (mem.ptr, mem.capacity);
//! slot.publish(1 << 20)?;                   // records `ready`, then publishes
//!
//! // Process B: consume in place.
//! let mut consumer: Consumer<CudaConsumer> = Consumer::attach("/tmp/gpu.sock", CudaOptions::default())?;
//! while let Some(batch) = consumer.recv()? {
//!     let view = batch.data();              // its stream already waits `ready`
//!     // enqueue kernels on view.stream.raw() reading view.ptr .. view.ptr + view.len ...
//!     let _ = (view.ptr, view.len);
//! }                                          // dropping records `finished`, then releases
//! # Ok(()) }
//! ```

mod consumer;
mod options;
mod producer;
#[cfg(test)]
mod tests;
mod views;

pub use crate::memory::{HandleKind, ImportTimings, MAX_VMM_FD_SLOTS, MemoryPath};
pub use crate::sync::{SyncMode, TimelineMemory};
pub use consumer::{CudaConsumer, last_import_timings};
pub use options::CudaOptions;
pub use producer::CudaProducer;
pub use views::{CudaBatchRef, CudaSlotMut};
