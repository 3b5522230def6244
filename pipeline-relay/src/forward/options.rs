//! How a forwarder runs: its ring's shape, chunking, copies in flight.

use std::time::Duration;

use pipeline_cuda::sync::SyncMode;

/// How a forwarder runs, beyond its downstream ring's [`ProducerConfig`].
#[derive(Clone, Debug, Default)]
pub struct ForwardOptions {
    /// CUDA device of the downstream ring (default: the upstream producer's).
    pub device: Option<usize>,
    /// Take no batch from upstream until this many consumers attached downstream, so that
    /// in broadcast none of them misses the first batches (upstream waits meanwhile: the
    /// forwarder is attached there and holds its producer back).
    pub wait_for_consumers: u32,
    /// How long to wait for them (default 60 s).
    pub wait_timeout: Option<Duration>,
    /// CUDA: how the downstream ring signals `ready` (default: timeline words,
    /// [`SyncMode::Semaphore`], which the downstream consumers release themselves if this
    /// forwarder dies with copies in flight; with IPC events, their streams could wait forever).
    pub sync: Option<SyncMode>,
    /// Chunked forwarding (docs/multi-gpu.md, "Chunked forwarding"): copy each batch in
    /// chunks of this many bytes and publish the progress per chunk on a board next to the
    /// ring ([`crate::chunks`]), and, where the upstream ring is a forwarder's that chunks
    /// with the same size, start copying a batch chunk by chunk as it lands upstream. Batches
    /// are still published whole. None: whole batches (`pipeline_cuda::policy::fanout::chunk_bytes`
    /// gives the size `auto` uses).
    pub chunk_bytes: Option<u64>,
    /// CUDA: copies in flight at once (default 3, at most the ring's slots and lead).
    pub depth: Option<usize>,
    /// CUDA: the downstream ring's memory path (default: the pool). A forwarder whose
    /// downstream ring is read by a consumer in its own process needs a path that the process
    /// that exported the memory can import too: legacy IPC handles cannot be opened by their
    /// exporter; `gpipe consume --forward-from` uses VMM.
    pub memory: Option<pipeline_cuda::memory::MemoryPath>,
}
