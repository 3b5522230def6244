//! What the backend hands out: a slot as the producer writes it, a batch as a consumer
//! reads it.

use crate::driver::{CUdeviceptr, Stream};

/// A slot as the producer writes it: device memory and the stream to order work on.
pub struct CudaSlotMut<'a> {
    /// Device pointer of the slot (2 MiB aligned).
    pub ptr: CUdeviceptr,
    /// Capacity in bytes.
    pub capacity: u64,
    /// The producer's stream: it already waits for the slot's previous consumers. Enqueue the
    /// fill here (or make your own stream wait an event recorded here, and this stream wait
    /// yours before publish).
    pub stream: &'a Stream,
}

/// A batch as a consumer sees it.
pub struct CudaBatchRef<'a> {
    /// Device pointer of the batch.
    pub ptr: CUdeviceptr,
    /// Length in bytes.
    pub len: u64,
    /// The consumer's stream, already ordered after the producer's `ready`. Enqueue your work
    /// here; the release records `finished` on it.
    pub stream: &'a Stream,
}
