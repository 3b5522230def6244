//! The producer a `gpipe.Producer` and its slots share, on whichever backend it has.

use std::sync::atomic::AtomicU64;

use parking_lot::Mutex;
use pipeline_core::{HostProducer, Producer};
use pipeline_cuda::backend::CudaProducer;

/// A producer on one of the backends.
pub(crate) enum AnyProducer {
    Host(Producer<HostProducer>),
    Cuda(Producer<CudaProducer>),
}

/// Runs `$e` with `$p` bound to the producer, whichever backend it has.
macro_rules! with_producer {
    ($any:expr, $p:ident => $e:expr) => {
        match $any {
            AnyProducer::Host($p) => $e,
            AnyProducer::Cuda($p) => $e,
        }
    };
}
pub(crate) use with_producer;

/// The producer and what it shares with its slots' tensors: the slot memory lives until the
/// last of them is gone, even after `close()`.
pub(crate) struct ProducerCell {
    pub(crate) producer: Mutex<AnyProducer>,
    /// Sequence number + 1 of the slot handed out and not yet published or abandoned.
    pub(crate) open: AtomicU64,
}

impl Drop for ProducerCell {
    fn drop(&mut self) {
        // The application's streams may still be writing slots: wait for them before the
        // slots are freed with the producer.
        if let AnyProducer::Cuda(p) = self.producer.get_mut() {
            if let Err(e) = p.backend().synchronize_all() {
                eprintln!("gpipe: synchronising before freeing the CUDA ring failed: {e}");
            }
        }
    }
}
