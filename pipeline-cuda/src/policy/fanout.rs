//! Fan-out shape `auto`: how one producer's batches reach consumers on several GPUs of a
//! node (the shapes, and the planning of their rings, are in `pipeline-relay`'s `fanout`).
//!
//! * [`Fanout::Direct`]: every consumer reads the producer's ring (in place or mirrored).
//! * [`Fanout::Chain`]: one forwarder per other GPU, each copying from the ring before it.
//! * [`Fanout::Tree`]: a binary tree of forwarders rooted at the producer's GPU.
//! * [`Fanout::Auto`]: [`Fanout::resolve`] picks one (docs/multi-gpu.md gives the rule and
//!   what it rests on).
//!
//! And how a forwarder pipelines a batch through the shape ([`Chunking`], [`chunk_bytes`]):
//! whole batches, or chunks whose progress the next hop waits for on its GPU (docs/multi-gpu.md,
//! "Chunked forwarding").

use std::fmt;
use std::str::FromStr;

/// A fan-out shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fanout {
    /// Every consumer reads the producer's ring.
    #[default]
    Direct,
    /// A chain of forwarders, one per other GPU.
    Chain,
    /// A binary tree of forwarders.
    Tree,
    /// Chosen by [`Fanout::resolve`].
    Auto,
}

impl fmt::Display for Fanout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fanout::Direct => "direct",
            Fanout::Chain => "chain",
            Fanout::Tree => "tree",
            Fanout::Auto => "auto",
        })
    }
}

impl FromStr for Fanout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "direct" => Ok(Fanout::Direct),
            "chain" => Ok(Fanout::Chain),
            "tree" => Ok(Fanout::Tree),
            "auto" => Ok(Fanout::Auto),
            other => Err(format!(
                "unknown fan-out {other:?}: use direct, chain, tree or auto"
            )),
        }
    }
}

/// Slots of at least this many bytes count as large for [`Fanout::resolve`].
pub const LARGE_BATCH: u64 = 8 << 20;

impl Fanout {
    /// The shape `auto` stands for, given how many GPUs other than the producer's have
    /// consumers and the batch size; other shapes are returned as they are.
    ///
    /// * One other GPU (or none): `direct`. Measured on 2×H200 (docs/multi-gpu.md): a
    ///   forwarder to GPU 1 moved up to 10% more than reading GPU 0's ring directly at 64 MiB
    ///   and above, and less at 2 MiB; it costs a process and a ring of its own, which one
    ///   other GPU does not need.
    /// * Two or more, small batches (< [`LARGE_BATCH`]): `direct`. Measured on 4×H100
    ///   (issue #34, 2026-11-27, whole-batch forwarders): at 2 MiB direct mirrored moved
    ///   106 GB/s per GPU against 54 for the tree and 44 for the chain (about 2× NCCL
    ///   broadcast), with MPS and without; every hop of a forwarder costs a batch's host
    ///   round trip, which a small batch's copy does not hide.
    /// * Two or more, large batches (≥ [`LARGE_BATCH`]): `chain`, so that no GPU's egress is
    ///   split more than once; its forwarders copy in chunks from [`CHUNKED_FROM`] on
    ///   ([`chunk_bytes`]), so that a hop's latency is a chunk's copy. TODO-MEASURE: the
    ///   boundaries (8 and 16 MiB) lie between the sizes measured (2 and 64 MiB).
    pub fn resolve(self, other_gpus: usize, batch_bytes: u64) -> Fanout {
        match self {
            Fanout::Auto if other_gpus <= 1 || batch_bytes < LARGE_BATCH => Fanout::Direct,
            Fanout::Auto => Fanout::Chain,
            s => s,
        }
    }
}

/// How a forwarder of a chain or tree moves a batch to its GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Chunking {
    /// [`chunk_bytes`] decides from the batch size and the links.
    #[default]
    Auto,
    /// Whole batches: the next hop starts its copy once the batch is published.
    Off,
    /// Chunks of this many bytes: the next hop copies chunk i once chunk i has landed.
    Bytes(u64),
}

impl fmt::Display for Chunking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Chunking::Auto => f.write_str("auto"),
            Chunking::Off => f.write_str("off"),
            Chunking::Bytes(b) => write!(f, "{b}"),
        }
    }
}

/// Batches of at least this many bytes are forwarded in chunks by `auto` on NVLink.
/// TODO-MEASURE: the threshold comes from `scripts/gpu/fanout.sh` on 4 GPUs (chain vs chunked
/// chain at 2, 64 and 256 MiB); until then it is link arithmetic: below it a batch's copy
/// takes a few tens of µs, as long as the per-chunk stream operations would cost.
pub const CHUNKED_FROM: u64 = 16 << 20;

/// The chunk size `auto` uses: a quarter of the batch, between [`MIN_CHUNK`] and
/// [`MAX_CHUNK`], so that a hop's latency is a quarter of a batch's copy while each chunk is
/// still large enough to move near a link's full rate (TODO-MEASURE: the chunk-size variants
/// of `scripts/gpu/fanout.sh`).
pub const MIN_CHUNK: u64 = 8 << 20;
/// See [`MIN_CHUNK`].
pub const MAX_CHUNK: u64 = 64 << 20;

/// The most chunks one batch is cut into (the progress words hold a chunk count in 16 bits).
pub const MAX_CHUNKS: u64 = (1 << 16) - 1;

/// The environment variable that overrides [`Chunking::Auto`] for the benchmark and the
/// forwarders it starts: `off`, or a size (`8MiB`, or bytes).
pub const CHUNK_ENV: &str = "GPIPE_FANOUT_CHUNK";

/// The chunk size a forwarder uses for batches of `batch_bytes` (None: whole batches).
///
/// * [`Chunking::Off`]: None. [`Chunking::Bytes`]: that size, raised so that a batch has at
///   most [`MAX_CHUNKS`] chunks; None when one chunk would hold the whole batch.
/// * [`Chunking::Auto`]: None below [`CHUNKED_FROM`] or when the hops are not all NVLink
///   (`nvlink` false; unknown counts as NVLink, the only kind measured); else a quarter of
///   the batch, clamped to [`MIN_CHUNK`]..=[`MAX_CHUNK`].
pub fn chunk_bytes(chunking: Chunking, batch_bytes: u64, nvlink: bool) -> Option<u64> {
    let c = match chunking {
        Chunking::Off => return None,
        Chunking::Bytes(b) => b.max(batch_bytes.div_ceil(MAX_CHUNKS)).max(1),
        Chunking::Auto if batch_bytes < CHUNKED_FROM || !nvlink => return None,
        Chunking::Auto => (batch_bytes / 4).clamp(MIN_CHUNK, MAX_CHUNK),
    };
    (c < batch_bytes).then_some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_off_for_small_batches_and_pcie_and_a_quarter_clamped_above() {
        assert_eq!(chunk_bytes(Chunking::Auto, CHUNKED_FROM - 1, true), None);
        assert_eq!(chunk_bytes(Chunking::Auto, 256 << 20, false), None);
        assert_eq!(chunk_bytes(Chunking::Auto, 64 << 20, true), Some(16 << 20));
        assert_eq!(chunk_bytes(Chunking::Auto, 1 << 30, true), Some(MAX_CHUNK));
        assert_eq!(chunk_bytes(Chunking::Auto, 16 << 20, true), Some(MIN_CHUNK));
        assert_eq!(chunk_bytes(Chunking::Off, 1 << 30, true), None);
        assert_eq!(
            chunk_bytes(Chunking::Bytes(1 << 20), 2 << 20, false),
            Some(1 << 20)
        );
        // One chunk for the whole batch is no chunking; never more than MAX_CHUNKS chunks.
        assert_eq!(chunk_bytes(Chunking::Bytes(8 << 20), 8 << 20, true), None);
        assert_eq!(
            chunk_bytes(Chunking::Bytes(1), 1 << 30, true),
            Some((1u64 << 30).div_ceil(MAX_CHUNKS))
        );
    }

    #[test]
    fn auto_is_direct_for_one_other_gpu_or_small_batches_else_chain() {
        assert_eq!(Fanout::Auto.resolve(1, LARGE_BATCH), Fanout::Direct);
        assert_eq!(Fanout::Auto.resolve(2, LARGE_BATCH), Fanout::Chain);
        assert_eq!(Fanout::Auto.resolve(7, LARGE_BATCH - 1), Fanout::Direct);
        assert_eq!(Fanout::Tree.resolve(1, 0), Fanout::Tree);
    }
}
