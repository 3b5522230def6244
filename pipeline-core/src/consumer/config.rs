//! A consumer's settings.

use std::time::Duration;

use crate::wait::WaitPolicy;

/// Consumer settings.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// How long the whole attach may take, from connect to joined (however the producer
    /// slices its messages).
    pub handshake_timeout: Duration,
    /// Spin and liveness tick: a dead producer is noticed within about one tick.
    pub wait: WaitPolicy,
    /// Uids besides our own whose producers we attach to. A producer is identified by the
    /// uid that listens on the socket (`SO_PEERCRED`), not by the socket's path: anyone who
    /// can create a file there could otherwise feed us.
    pub allowed_producer_uids: Vec<u32>,
    /// Asked while the attach waits (at least every [`sys::INTERRUPT_TICK`], and at once
    /// when a signal arrives); `true` ends the attach with an error of kind
    /// [`std::io::ErrorKind::Interrupted`]. A binding runs its language's signal handlers
    /// here (Ctrl-C).
    pub interrupted: Option<fn() -> bool>,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(5),
            wait: WaitPolicy::default(),
            allowed_producer_uids: Vec::new(),
            interrupted: None,
        }
    }
}
