//! # pipeline-core: gpipe's cross-process batch ring
//!
//! A [`Producer`] owns a ring of N slots (each rounded up to 2 MiB) and a control segment in
//! shared memory (a sealed memfd). Consumers attach over a Unix socket, receive batch
//! descriptors, use each batch in place and release it; the slot is recycled when every
//! consumer that got it has released it ([`Mode::Broadcast`]) or when its one consumer has
//! ([`Mode::Shared`]). Where slot memory lives and how "ready"/"finished" are signalled is the
//! [`ProducerBackend`]/[`ConsumerBackend`] seam: this crate ships the host backend, and
//! `pipeline-cuda` the CUDA one.
//!
//! ```no_run
//! use pipeline_core::{Consumer, HostConsumer, HostOptions, HostProducer, Producer, ProducerConfig};
//!
//! # fn main() -> Result<(), pipeline_core::Error> {
//! // Process A: the producer.
//! let mut producer: Producer<HostProducer> =
//!     Producer::bind("/tmp/demo.sock", ProducerConfig::default(), HostOptions::default())?;
//! let mut slot = producer.acquire()?;          // waits until the slot is free
//! slot.memory()[..5].copy_from_slice(b"hello");
//! slot.publish(5)?;                            // ready, then visible to consumers
//!
//! // Process B: a consumer.
//! let mut consumer: Consumer<HostConsumer> = Consumer::attach("/tmp/demo.sock", HostOptions::default())?;
//! while let Some(batch) = consumer.recv()? {   // Ok(None): the producer closed the ring
//!     assert_eq!(&batch.data()[..5], b"hello");
//! }                                             // each batch is released when dropped
//! # Ok(()) }
//! ```
//!
//! Liveness: each consumer keeps its socket open for its life, so the kernel tells the
//! producer at once when it dies; its claims are taken back and the run goes on. Consumers
//! check the producer's socket whenever they wait, so a dead producer gives
//! [`Error::ProducerDied`] within one wait tick (100 ms by default).

pub mod ring;

#[cfg(not(loom))]
pub mod backend;
#[cfg(not(loom))]
pub mod consumer;
#[cfg(not(loom))]
pub mod delivery;
#[cfg(not(loom))]
pub mod error;
#[cfg(not(loom))]
pub mod fault;
#[cfg(not(loom))]
pub mod inspect;
#[cfg(not(loom))]
pub mod layout;
#[cfg(not(loom))]
pub mod limits;
#[cfg(not(loom))]
pub mod page;
#[cfg(not(loom))]
pub mod pattern;
#[cfg(not(loom))]
pub mod producer;
#[cfg(not(loom))]
mod socket_file;
#[cfg(not(loom))]
pub mod sys;
#[cfg(not(loom))]
pub mod tensor;
#[cfg(not(loom))]
pub mod wait;
#[cfg(not(loom))]
pub mod wire;

#[cfg(not(loom))]
pub use backend::{
    BackendKind, ConsumerBackend, Export, HostConsumer, HostOptions, HostProducer, MapGuard, OnMap,
    ProducerBackend,
};
#[cfg(not(loom))]
pub use consumer::{Batch, Consumer, ConsumerConfig, PendingAttach, observe};
#[cfg(not(loom))]
pub use delivery::{Delivery, MirrorTable, Placement};
#[cfg(not(loom))]
pub use error::{BackendError, Error, ProtocolError};
#[cfg(not(loom))]
pub use layout::{Mode, RingLayout, USER_HEADER_WORDS, round_slot_bytes};
#[cfg(not(loom))]
pub use producer::{
    HeldBack, Holder, LagPolicy, Producer, ProducerConfig, ProducerStats, Slot, SlotLoan,
};
#[cfg(not(loom))]
pub use tensor::{DType, TensorInfo, TensorPlan};
#[cfg(not(loom))]
pub use wait::WaitPolicy;
