//! Fan-out shape `auto`: how one producer's batches reach consumers on several GPUs of a
//! node (the shapes, and the planning of their rings, are in `pipeline-relay`'s `fanout`).
//!
//! * [`Fanout::Direct`]: every consumer reads the producer's ring (in place or mirrored).
//! * [`Fanout::Chain`]: one forwarder per other GPU, each copying from the ring before it.
//! * [`Fanout::Tree`]: a binary tree of forwarders rooted at the producer's GPU.
//! * [`Fanout::Auto`]: [`Fanout::resolve`] picks one (docs/multi-gpu.md gives the rule and
//!   what it rests on).
//!
//! And how a forwarder moves a batch through the shape ([`Chunking`], [`chunk_bytes`]): whole
//! batches (`auto`), or chunks whose progress the next hop waits for on its GPU when asked
//! (docs/multi-gpu.md, "Chunked forwarding").

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

impl Fanout {
    /// The shape `auto` stands for, given how many GPUs other than the producer's have
    /// consumers (the batch size does not change it); other shapes are returned as they are.
    ///
    /// * One other GPU (or none): `direct`. Measured on 2×H200 (docs/multi-gpu.md): a
    ///   forwarder to GPU 1 moved up to 10% more than reading GPU 0's ring directly at 64 MiB
    ///   and above, and less at 2 MiB; it costs a ring of its own, which one other GPU does
    ///   not need.
    /// * Two or more: `chain`. Measured on 4×H100 (2026-11-27, `scripts/gpu/fanout.sh`, 3
    ///   consumer GPUs, MPS off and on): the chain of whole-batch forwarders moved the most
    ///   per GPU at every size measured: 118-137 GB/s at 2 MiB (direct mirrored: 105), 350 at
    ///   64 MiB (direct: 119; the tree: 184) and 340 at 256 MiB (direct: 106), since each
    ///   GPU's egress carries a batch once instead of once per consumer GPU; in runs of about
    ///   a second (docs/experiments/2026-11-27-fanout-steady-state), 354 at 64 MiB and 357 at
    ///   256 MiB, 1.11x and 1.02x NCCL broadcast timed over as many bytes.
    pub fn resolve(self, other_gpus: usize, _batch_bytes: u64) -> Fanout {
        // The reasons say the same in a line each: `Fanout::why`.
        match self {
            Fanout::Auto if other_gpus <= 1 => Fanout::Direct,
            Fanout::Auto => Fanout::Chain,
            s => s,
        }
    }
}

impl Fanout {
    /// Why `auto` resolves as it does for `other_gpus` consumer GPUs besides the producer's,
    /// in a line (what `gpipe bench` prints beside the shape); None for a shape asked for.
    pub fn why(self, other_gpus: usize) -> Option<&'static str> {
        (self == Fanout::Auto).then_some(if other_gpus <= 1 {
            "auto: one other GPU reads the producer's ring directly (a forwarder moved at most \
             10% more on 2x H200, for a ring more)"
        } else {
            "auto: two or more other GPUs take a chain of whole-batch forwarders (the most per \
             GPU at 2, 64 and 256 MiB on 4x H100: 2.6-3.1x, 1.1x and 1.02x NCCL broadcast)"
        })
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

/// The most chunks one batch is cut into (the progress words hold a chunk count in 16 bits).
pub const MAX_CHUNKS: u64 = (1 << 16) - 1;

/// The environment variable that overrides [`Chunking::Auto`] for the benchmark and the
/// forwarders it starts: `off`, or a size (`8MiB`, or bytes).
pub const CHUNK_ENV: &str = "GPIPE_FANOUT_CHUNK";

/// The chunk size a forwarder uses for batches of `batch_bytes` (None: whole batches).
///
/// * [`Chunking::Auto`] and [`Chunking::Off`]: None, whole batches. Measured on 4×H100
///   (2026-11-27, a chain to 3 GPUs, MPS off and on): chunks of a quarter batch moved 300 GB/s
///   per GPU at 64 MiB against 350 for whole batches, and 326 against 340 at 256 MiB; 32 MiB
///   chunks at 64 MiB 322, 8 MiB chunks 268. A chain of whole batches already keeps every
///   link busy with the next batch, and each chunk adds stream operations and a wait.
/// * [`Chunking::Bytes`]: that size, raised so that a batch has at most [`MAX_CHUNKS`]
///   chunks; None when one chunk would hold the whole batch.
pub fn chunk_bytes(chunking: Chunking, batch_bytes: u64) -> Option<u64> {
    let c = match chunking {
        Chunking::Off | Chunking::Auto => return None,
        Chunking::Bytes(b) => b.max(batch_bytes.div_ceil(MAX_CHUNKS)).max(1),
    };
    (c < batch_bytes).then_some(c)
}

/// How batches cross a fan-out: what [`plan_chunk`] weighs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Flow {
    /// A steady stream of batches (a data feed, a benchmark): whole batches keep every link
    /// of a chain busy with the next one.
    #[default]
    Steady,
    /// One large batch at a time, each waited for end to end (a weight update): chunks let
    /// the next hop start before the batch has crossed the one before.
    OneAtATime,
}

/// The chunk a one-at-a-time batch crosses a chain in.
pub const ONE_AT_A_TIME_CHUNK: u64 = 64 << 20;

/// The chunk size `auto` gives the forwarders of a plan (None: whole batches), for batches of
/// `batch_bytes` crossing `depth` forwarders one after the other.
///
/// * [`Flow::Steady`]: [`chunk_bytes`] with [`Chunking::Auto`]: whole batches.
/// * [`Flow::OneAtATime`], two or more forwarders in a row and a batch of two chunks or more:
///   [`ONE_AT_A_TIME_CHUNK`]. Measured on 4×H100 (2026-11-27, `apps/weights`, a 3.2 GB state
///   dict to 3 other GPUs through a chain): 64 MiB chunks took an update across in 14.7 ms
///   (read in place) where whole-batch forwarders took 35.0 ms, three copies one after the
///   other. One forwarder copies a batch once either way.
pub fn plan_chunk(flow: Flow, batch_bytes: u64, depth: usize) -> Option<u64> {
    match flow {
        Flow::Steady => chunk_bytes(Chunking::Auto, batch_bytes),
        Flow::OneAtATime => {
            (depth >= 2 && batch_bytes >= 2 * ONE_AT_A_TIME_CHUNK).then_some(ONE_AT_A_TIME_CHUNK)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_only_when_asked_and_never_more_than_max_chunks() {
        for b in [2 << 20, 64 << 20, 1 << 30] {
            assert_eq!(chunk_bytes(Chunking::Auto, b), None, "{b}");
            assert_eq!(chunk_bytes(Chunking::Off, b), None, "{b}");
        }
        assert_eq!(
            chunk_bytes(Chunking::Bytes(1 << 20), 2 << 20),
            Some(1 << 20)
        );
        // One chunk for the whole batch is no chunking; never more than MAX_CHUNKS chunks.
        assert_eq!(chunk_bytes(Chunking::Bytes(8 << 20), 8 << 20), None);
        assert_eq!(
            chunk_bytes(Chunking::Bytes(1), 1 << 30),
            Some((1u64 << 30).div_ceil(MAX_CHUNKS))
        );
    }

    #[test]
    fn one_batch_at_a_time_crosses_a_chain_in_chunks() {
        assert_eq!(plan_chunk(Flow::Steady, 4 << 30, 3), None);
        assert_eq!(
            plan_chunk(Flow::OneAtATime, 4 << 30, 3),
            Some(ONE_AT_A_TIME_CHUNK)
        );
        assert_eq!(plan_chunk(Flow::OneAtATime, 4 << 30, 1), None, "one hop");
        assert_eq!(
            plan_chunk(Flow::OneAtATime, ONE_AT_A_TIME_CHUNK, 3),
            None,
            "one chunk"
        );
    }

    #[test]
    fn auto_is_direct_for_one_other_gpu_else_chain_at_every_size() {
        assert_eq!(Fanout::Auto.resolve(1, 256 << 20), Fanout::Direct);
        assert_eq!(Fanout::Auto.resolve(0, 2 << 20), Fanout::Direct);
        assert_eq!(Fanout::Auto.resolve(2, 2 << 20), Fanout::Chain);
        assert_eq!(Fanout::Auto.resolve(7, 256 << 20), Fanout::Chain);
        assert_eq!(Fanout::Tree.resolve(1, 0), Fanout::Tree);
        assert!(Fanout::Auto.why(3).unwrap().contains("chain"));
        assert!(Fanout::Auto.why(1).unwrap().contains("directly"));
        assert_eq!(Fanout::Chain.why(3), None);
    }
}
