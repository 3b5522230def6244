//! What both sides of the relay take.

use std::time::Duration;

/// Options of both sides.
#[derive(Clone, Debug)]
pub struct RelayOptions {
    /// Bounds the rendezvous (waiting for the peer included) and NCCL's setup.
    pub connect_timeout: Duration,
    /// How often the sides look at the peer while waiting.
    pub tick: Duration,
    /// CUDA device of this side (sender: default the producer's; receiver: default 0).
    pub device: Option<usize>,
    /// Receiver: after the sender is gone, wait for one to connect again (keeping the ring).
    pub rejoin: bool,
    /// Receiver: slots of its ring (default: the sender's ring's).
    pub slots: Option<u32>,
    /// CUDA: run the NCCL transfers on streams of the device's highest priority, so that
    /// their blocks start ahead of waiting blocks of the work beside them (the producer's on
    /// the sending GPU, the consumers' on the receiving one). Default: off. On 2×H200 with
    /// MPS and a verifying consumer beside the receiver it changed nothing (64 MiB: 288.8
    /// GB/s high, 287.0 normal; docs/relay.md).
    pub high_priority: bool,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            connect_timeout: Duration::from_secs(60),
            tick: Duration::from_millis(100),
            device: None,
            rejoin: false,
            slots: None,
            high_priority: false,
        }
    }
}
