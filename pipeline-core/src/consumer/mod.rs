//! The consuming side: attach over the socket, receive batches in place, release them.

mod attach;
mod batch;
mod config;
mod handle;
mod link;
mod verdict;

pub use attach::{PendingAttach, observe};
pub use batch::Batch;
pub use config::ConsumerConfig;
pub use handle::Consumer;
