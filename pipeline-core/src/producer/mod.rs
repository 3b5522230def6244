//! The producer: owns the ring, the attach socket and the supervisor thread that watches
//! consumers.

mod attach;
mod config;
mod depart;
mod handle;
mod reuse;
mod slot;
mod state;
mod supervisor;

pub use config::{HeldBack, Holder, LagPolicy, ProducerConfig, ProducerStats};
pub use slot::{Slot, SlotLoan};
pub use state::Producer;
