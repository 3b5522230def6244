//! Fan-out shapes (issue #20): how one producer's batches reach consumers on several GPUs of
//! a node.
//!
//! * [`Fanout::Direct`]: every consumer reads the producer's ring (in place or mirrored), so
//!   the consumers on other GPUs share the producer GPU's link egress.
//! * [`Fanout::Chain`]: one [forwarder](crate::run_forwarder) per other GPU; the first copies
//!   the producer's batches into a ring on its GPU, the next copies from that ring into one on
//!   its GPU, and so on. Every GPU receives each batch once, over one link, and sends it at
//!   most once: each link carries the batch once, and the pipeline's depth adds latency, not
//!   a per-GPU share of one GPU's egress.
//! * [`Fanout::Tree`]: a binary tree of forwarders rooted at the producer's GPU: every GPU sends
//!   each batch at most twice, and the depth is log2 of the GPUs.
//! * [`Fanout::Auto`]: [`Fanout::resolve`] picks one (docs/multi-gpu.md gives the rule and
//!   what it rests on). The shape and its `auto` rule live with gpipe's other `auto` rules,
//!   in `pipeline_cuda::policy`.
//!
//! [`plan`] turns a shape and the consumers' devices into rings (one per GPU that has
//! consumers, each fed by its parent's ring) and says which ring each consumer reads.

use pipeline_cuda::policy::fanout::plan_chunk;
pub use pipeline_cuda::policy::fanout::{Chunking, Fanout, Flow};

/// One ring of a fan-out.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RingNode {
    /// The GPU the ring's slots live on.
    pub device: usize,
    /// The ring it is forwarded from (an index into [`FanoutPlan::rings`]); None for the
    /// producer's own ring (index 0).
    pub parent: Option<usize>,
}

/// Where every ring lives and which ring every consumer reads.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FanoutPlan {
    /// The shape planned (never `auto`).
    pub shape: Fanout,
    /// Ring 0 is the producer's; every other is fed by a forwarder on its device.
    pub rings: Vec<RingNode>,
    /// For each consumer, the ring it reads.
    pub consumer_ring: Vec<usize>,
    /// Chain or tree: the chunk size `auto` gives the forwarders (`ForwardOptions::chunk_bytes`;
    /// None: whole batches, which `auto` gives since they moved the most), from
    /// `pipeline_cuda::policy::fanout::chunk_bytes`.
    pub chunk_bytes: Option<u64>,
}

impl FanoutPlan {
    /// The rings forwarded from ring `r`.
    pub fn children(&self, r: usize) -> impl Iterator<Item = usize> + '_ {
        self.rings
            .iter()
            .enumerate()
            .filter(move |(_, n)| n.parent == Some(r))
            .map(|(i, _)| i)
    }

    /// How many consumers ring `r` has: its own consumers and the forwarders it feeds.
    pub fn attachments(&self, r: usize) -> u32 {
        let own = self.consumer_ring.iter().filter(|&&c| c == r).count();
        (own + self.children(r).count()) as u32
    }

    /// How many batches cross from one ring to another for each batch published (the
    /// forwarders' copies).
    pub fn hops(&self) -> usize {
        self.rings.len() - 1
    }

    /// The most forwarders between the producer and a consumer.
    pub fn depth(&self) -> usize {
        (0..self.rings.len())
            .map(|mut r| {
                let mut d = 0;
                while let Some(p) = self.rings[r].parent {
                    r = p;
                    d += 1;
                }
                d
            })
            .max()
            .unwrap_or(0)
    }
}

/// Plans `shape` for a producer on `producer_device` and one consumer per entry of
/// `consumer_devices` (its GPU), for a steady stream of batches ([`plan_for`]).
pub fn plan(
    shape: Fanout,
    producer_device: usize,
    consumer_devices: &[usize],
    batch_bytes: u64,
) -> FanoutPlan {
    plan_for(
        shape,
        producer_device,
        consumer_devices,
        batch_bytes,
        Flow::Steady,
    )
}

/// Plans `shape` for a producer on `producer_device` and one consumer per entry of
/// `consumer_devices` (its GPU), for batches that cross it as `flow` says. `auto` is resolved
/// with [`Fanout::resolve`], the chunk with [`plan_chunk`]. The GPUs other than the
/// producer's are taken in the order they first appear.
pub fn plan_for(
    shape: Fanout,
    producer_device: usize,
    consumer_devices: &[usize],
    batch_bytes: u64,
    flow: Flow,
) -> FanoutPlan {
    let mut others: Vec<usize> = Vec::new();
    for &d in consumer_devices {
        if d != producer_device && !others.contains(&d) {
            others.push(d);
        }
    }
    let shape = shape.resolve(others.len(), batch_bytes);
    let mut rings = vec![RingNode {
        device: producer_device,
        parent: None,
    }];
    if shape != Fanout::Direct {
        for (i, &d) in others.iter().enumerate() {
            // Ring i + 1: in a chain, fed by the ring before it; in a tree, node j's parent is
            // (j - 1) / 2 (the producer's ring being node 0).
            let j = i + 1;
            let parent = match shape {
                Fanout::Chain => j - 1,
                _ => (j - 1) / 2,
            };
            rings.push(RingNode {
                device: d,
                parent: Some(parent),
            });
        }
    }
    let consumer_ring = consumer_devices
        .iter()
        .map(|d| rings.iter().position(|r| r.device == *d).unwrap_or(0))
        .collect();
    let mut plan = FanoutPlan {
        shape,
        rings,
        consumer_ring,
        chunk_bytes: None,
    };
    if shape != Fanout::Direct {
        plan.chunk_bytes = plan_chunk(flow, batch_bytes, plan.depth());
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_puts_every_consumer_on_the_producers_ring() {
        let p = plan(Fanout::Direct, 0, &[0, 1, 2, 2], 64 << 20);
        assert_eq!(p.rings.len(), 1);
        assert_eq!(p.consumer_ring, vec![0, 0, 0, 0]);
        assert_eq!(p.attachments(0), 4);
        assert_eq!((p.hops(), p.depth()), (0, 0));
    }

    #[test]
    fn a_chain_links_each_gpu_to_the_one_before() {
        let p = plan(Fanout::Chain, 0, &[0, 1, 2, 3, 3], 64 << 20);
        let parents: Vec<_> = p.rings.iter().map(|r| (r.device, r.parent)).collect();
        assert_eq!(
            parents,
            vec![(0, None), (1, Some(0)), (2, Some(1)), (3, Some(2))]
        );
        assert_eq!(p.consumer_ring, vec![0, 1, 2, 3, 3]);
        // Ring 0: its consumer and the forwarder to GPU 1; ring 3: two consumers.
        assert_eq!(p.attachments(0), 2);
        assert_eq!(p.attachments(1), 2);
        assert_eq!(p.attachments(3), 2);
        assert_eq!((p.hops(), p.depth()), (3, 3));
    }

    #[test]
    fn a_tree_gives_each_ring_at_most_two_children() {
        let devs: Vec<usize> = (0..8).collect();
        let p = plan(Fanout::Tree, 0, &devs, 64 << 20);
        for r in 0..p.rings.len() {
            assert!(p.children(r).count() <= 2, "ring {r}");
        }
        let parents: Vec<_> = p.rings.iter().map(|r| r.parent).collect();
        assert_eq!(
            parents,
            vec![
                None,
                Some(0),
                Some(0),
                Some(1),
                Some(1),
                Some(2),
                Some(2),
                Some(3)
            ]
        );
        assert_eq!(p.depth(), 3);
        assert_eq!(p.consumer_ring, devs);
    }

    #[test]
    fn the_producers_gpu_needs_no_consumer_and_order_of_appearance_counts() {
        let p = plan(Fanout::Chain, 0, &[2, 1], 64 << 20);
        let devices: Vec<_> = p.rings.iter().map(|r| r.device).collect();
        assert_eq!(devices, vec![0, 2, 1]);
        assert_eq!(p.consumer_ring, vec![1, 2]);
        assert_eq!(p.attachments(0), 1);
    }

    #[test]
    fn auto_is_direct_for_one_other_gpu_else_chain() {
        assert_eq!(
            plan(Fanout::Auto, 0, &[0, 1], 256 << 20).shape,
            Fanout::Direct
        );
        assert_eq!(
            plan(Fanout::Auto, 0, &[0, 0], 2 << 20).shape,
            Fanout::Direct
        );
        assert_eq!(
            plan(Fanout::Auto, 0, &[1, 2, 3], 64 << 20).shape,
            Fanout::Chain
        );
        assert_eq!(
            plan(Fanout::Auto, 0, &[1, 2, 3], 2 << 20).shape,
            Fanout::Chain
        );
    }

    #[test]
    fn auto_forwards_whole_batches() {
        assert_eq!(
            plan(Fanout::Auto, 0, &[1, 2, 3], 64 << 20).chunk_bytes,
            None
        );
        assert_eq!(
            plan(Fanout::Chain, 0, &[1, 2, 3], 2 << 20).chunk_bytes,
            None
        );
        assert_eq!(
            plan(Fanout::Direct, 0, &[1, 2, 3], 256 << 20).chunk_bytes,
            None
        );
    }

    #[test]
    fn shapes_parse_and_print() {
        for s in ["direct", "chain", "tree", "auto"] {
            assert_eq!(s.parse::<Fanout>().unwrap().to_string(), s);
        }
        assert!(
            "ring"
                .parse::<Fanout>()
                .unwrap_err()
                .contains("direct, chain")
        );
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the devices and shape: ring 0 is the producer's; every other ring is fed
        /// by an earlier one (so forwarders can start in ring order) and sits on a GPU no
        /// other ring has; every consumer reads the ring of its own GPU (direct: ring 0);
        /// a chain's depth is its hops, a tree gives no ring more than two children.
        #[test]
        fn plans_are_well_formed(
            devices in proptest::collection::vec(0usize..8, 0..24),
            producer in 0usize..8,
            shape in prop_oneof![
                Just(Fanout::Direct),
                Just(Fanout::Chain),
                Just(Fanout::Tree),
                Just(Fanout::Auto)
            ],
            mib in 1u64..512,
        ) {
            let p = plan(shape, producer, &devices, mib << 20);
            prop_assert_ne!(p.shape, Fanout::Auto);
            prop_assert_eq!(p.rings[0].device, producer);
            prop_assert_eq!(p.rings[0].parent, None);
            for (i, r) in p.rings.iter().enumerate().skip(1) {
                let parent = r.parent.unwrap();
                prop_assert!(parent < i);
                prop_assert!(p.rings.iter().filter(|x| x.device == r.device).count() == 1);
            }
            prop_assert_eq!(p.consumer_ring.len(), devices.len());
            for (c, &d) in devices.iter().enumerate() {
                let ring = &p.rings[p.consumer_ring[c]];
                if p.shape == Fanout::Direct {
                    prop_assert_eq!(p.consumer_ring[c], 0);
                } else {
                    prop_assert_eq!(ring.device, d);
                }
            }
            match p.shape {
                Fanout::Chain => prop_assert_eq!(p.depth(), p.hops()),
                Fanout::Tree => {
                    for r in 0..p.rings.len() {
                        prop_assert!(p.children(r).count() <= 2);
                    }
                }
                _ => prop_assert_eq!(p.rings.len(), 1),
            }
            // Every ring is read by someone: a consumer or a forwarder.
            for r in 1..p.rings.len() {
                prop_assert!(p.attachments(r) >= 1);
            }
        }
    }
}
