//! The relay: a ring's batches carried to another host.
//!
//! **Sender** (host A, [`run_sender`]): an ordinary consumer of the local ring. For each batch
//! it sends the batch's description (sequence number, length, user header, tensor table) as a
//! session message, then the bytes: over NCCL (`ncclSend` on the consumer's stream, which
//! already waits for `ready`; the release writes `finished` after it, so the slot frees once
//! the send is complete on the GPU) for a CUDA ring, inline in the message for a host ring.
//!
//! **Receiver** (host B, [`run_receiver`]): an ordinary producer of a ring of its own, with
//! the sender's shape. A CUDA batch is received with `ncclRecv` straight into a slot taken
//! ahead (`Producer::acquire_ahead`; up to four receives in flight), and only once the receive
//! has completed without an NCCL error is it published: a sender that dies mid-batch can never
//! hand B's consumers half a batch. A completed receive is published when the next batch's
//! description arrives, when B waits for room, or when four are in flight; a sender that
//! pauses leaves its last batch unpublished until it sends again or ends.
//! B's consumers are plain gpipe consumers.
//!
//! Back-pressure carries across: B acquires a slot only when B's consumers have released one,
//! it posts no receive meanwhile, so A's sends wait, so A's releases wait, so A's producer waits
//! (under its lag policy, as for any consumer).
//!
//! Faults: each side watches the other (the TCP connection's end, and NCCL's asynchronous
//! error) and aborts the communicator at the first sign, so no stream waits for ever on a peer
//! that is gone. The sender then exits with an error (its own ring goes on without it: a
//! departed consumer); the receiver keeps its ring and, with `rejoin`, waits for a sender to
//! connect again.
//!
//! The files: `options.rs` and `report.rs` (what a side takes and gives), `messages.rs` (the
//! bytes of the messages after the rendezvous, and the receiver's one dispatch of them),
//! `fault.rs` (the watch on the peer), `comm.rs` (joining the NCCL communicator, bounded),
//! `send.rs` and `recv.rs` (the two sides), and `nccl_bench.rs` (NCCL's own bandwidth, for
//! comparison).

mod comm;
mod fault;
mod messages;
mod nccl_bench;
mod options;
mod recv;
mod report;
mod send;

pub use messages::BatchMeta;
pub use nccl_bench::{BenchSide, nccl_bench};
pub use options::RelayOptions;
pub(crate) use recv::acquire_loan;
pub use recv::run_receiver;
pub use report::{RelayError, RelayReport};
pub use send::run_sender;
