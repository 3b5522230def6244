//! What a side of the relay did, and why it stopped.

/// What a side did.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RelayReport {
    /// "cuda" or "host".
    pub backend: String,
    /// Batches carried.
    pub batches: u64,
    /// Bytes carried.
    pub bytes: u64,
    /// Seconds from the first batch to the last.
    pub elapsed_s: f64,
    /// The NCCL library used (CUDA).
    pub nccl: Option<String>,
    /// Sessions the receiver served (more than 1 after a rejoin).
    pub sessions: u32,
    /// Why it stopped, if not because the ring closed.
    pub error: Option<String>,
    /// Forwarder: when its consumers were done with the last batch (seconds since the Unix
    /// epoch), if it got that far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drained_at_unix_s: Option<f64>,
    /// Chunked forwarder: batches whose copy began before the upstream published them (from
    /// the upstream ring's chunk progress).
    #[serde(default)]
    pub copied_ahead: u64,
}

impl RelayReport {
    /// GB/s over the run.
    pub fn gb_per_s(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            self.bytes as f64 / self.elapsed_s / 1e9
        } else {
            0.0
        }
    }
}

/// Why the relay stopped.
#[derive(Debug)]
pub struct RelayError(pub String);

impl std::fmt::Display for RelayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RelayError {}

pub(super) fn err(e: impl std::fmt::Display) -> RelayError {
    RelayError(e.to_string())
}
