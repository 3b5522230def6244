//! Fan-out shape `auto`: how one producer's batches reach consumers on several GPUs of a
//! node (the shapes, and the planning of their rings, are in `pipeline-relay`'s `fanout`).
//!
//! * [`Fanout::Direct`]: every consumer reads the producer's ring (in place or mirrored).
//! * [`Fanout::Chain`]: one forwarder per other GPU, each copying from the ring before it.
//! * [`Fanout::Tree`]: a binary tree of forwarders rooted at the producer's GPU.
//! * [`Fanout::Auto`]: [`Fanout::resolve`] picks one (docs/multi-gpu.md gives the rule and
//!   what it rests on).

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
    /// * Two or more, large batches (≥ [`LARGE_BATCH`]): `chain`, so that no GPU's egress is
    ///   split more than once; the per-hop latency is small next to a large batch's transfer.
    /// * Two or more, small batches: `tree`, so that a batch crosses log2 of the GPUs rather
    ///   than all of them before the last consumer has it.
    ///
    /// The rule for more than one other GPU rests on the link arithmetic, not on a
    /// measurement: no machine with more than 2 GPUs was available to us.
    pub fn resolve(self, other_gpus: usize, batch_bytes: u64) -> Fanout {
        match self {
            Fanout::Auto if other_gpus <= 1 => Fanout::Direct,
            Fanout::Auto if batch_bytes >= LARGE_BATCH => Fanout::Chain,
            Fanout::Auto => Fanout::Tree,
            s => s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_direct_for_one_other_gpu_then_chain_or_tree_by_batch_size() {
        assert_eq!(Fanout::Auto.resolve(1, LARGE_BATCH), Fanout::Direct);
        assert_eq!(Fanout::Auto.resolve(2, LARGE_BATCH), Fanout::Chain);
        assert_eq!(Fanout::Auto.resolve(2, LARGE_BATCH - 1), Fanout::Tree);
        assert_eq!(Fanout::Tree.resolve(1, 0), Fanout::Tree);
    }
}
