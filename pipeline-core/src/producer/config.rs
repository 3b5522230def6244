//! A producer's settings, and what it reports: its counters and who holds it back.

use std::time::{Duration, Instant};

use crate::layout::{self, Mode, RingLayout};
use crate::wait::WaitPolicy;

/// What the producer does when a live consumer stops releasing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LagPolicy {
    /// Wait for it (back-pressure): the ring runs at the pace of the slowest consumer.
    #[default]
    Block,
    /// Detach a consumer that holds a slot the producer needs for longer than this, or whose
    /// work on a released batch the backend has waited on for longer than this (CUDA: its
    /// `finished` signal, which a consumer may never give, e.g. when a peer forged its claim).
    DetachAfter(Duration),
}

/// Producer settings.
#[derive(Clone, Debug)]
pub struct ProducerConfig {
    /// Slots in the ring.
    pub slots: u32,
    /// Largest batch in bytes; slot capacity is this rounded up to 2 MiB.
    pub batch_bytes: u64,
    /// Delivery mode.
    pub mode: Mode,
    /// Most consumers at once (at most 63).
    pub max_consumers: u32,
    /// Spin and liveness tick for waits. A dead consumer is detected when its socket closes
    /// (at once); `wait.tick` bounds how late a waiting producer notices.
    pub wait: WaitPolicy,
    /// Per-message timeout of the attach handshake.
    pub handshake_timeout: Duration,
    /// Uids besides our own allowed to attach.
    pub allowed_uids: Vec<u32>,
    /// Gids whose members may attach.
    pub allowed_gids: Vec<u32>,
    /// What to do with a consumer that stops releasing.
    pub lag: LagPolicy,
    /// On close, how long to wait for consumers to drain and detach.
    pub drain_timeout: Duration,
    /// The producer never writes batch `s` before every consumer that got batch
    /// `s - max_lead` has released it (and, on the GPU, finished with it): at most `max_lead`
    /// batches are in flight, written but not yet consumed. `None` (the default) or a value
    /// of at least `slots`: the ring's own bound, `slots`. A bound below `slots` keeps the
    /// data in flight small enough to stay in a GPU's L2 cache while the ring keeps its other
    /// slots for consumers that hold batches a while.
    pub max_lead: Option<u32>,
    /// Leave the process dumpable. By default [`Producer::bind`] makes it not dumpable
    /// (`prctl(PR_SET_DUMPABLE, 0)`), so that another process of the same uid cannot open
    /// the producer's read-write fds through `/proc/<pid>/fd` (docs/security.md). That also
    /// means no core dumps and no debugger, profiler or `/proc/<pid>/mem` access by the same
    /// uid without `CAP_SYS_PTRACE`, for the whole process, until it ends or `exec`s. Set this
    /// to keep those (while debugging, say).
    pub keep_dumpable: bool,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        Self {
            slots: 8,
            batch_bytes: 8 << 20,
            mode: Mode::Broadcast,
            max_consumers: 16,
            wait: WaitPolicy::default(),
            handshake_timeout: Duration::from_secs(2),
            allowed_uids: Vec::new(),
            allowed_gids: Vec::new(),
            lag: LagPolicy::Block,
            drain_timeout: Duration::from_secs(5),
            max_lead: None,
            keep_dumpable: false,
        }
    }
}

impl ProducerConfig {
    /// The ring layout these settings give.
    pub fn layout(&self) -> RingLayout {
        RingLayout {
            slot_count: self.slots,
            slot_bytes: layout::round_slot_bytes(self.batch_bytes),
            consumer_capacity: self.max_consumers,
            mode: self.mode,
        }
    }
}

/// Counters of the producer's life, for reports.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct ProducerStats {
    /// Batches published.
    pub published: u64,
    /// Consumers that completed the handshake.
    pub attached: u64,
    /// Consumers that left cleanly.
    pub left: u64,
    /// Consumers that died.
    pub died: u64,
    /// Consumers detached by the lag policy or for protocol violations.
    pub detached: u64,
    /// Attach attempts refused (uid, version, capacity, garbage).
    pub refused: u64,
    /// Shared mode: batches put back for other consumers after their claimer died.
    pub requeued: u64,
}

/// What holds the producer back ([`Producer::held_back`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldBack {
    /// The batch the producer waits to write.
    pub seq: u64,
    /// The slot it waits for.
    pub slot: u32,
    /// When the producer began to wait for it.
    pub since: Instant,
    /// The consumers holding that slot.
    pub holders: Vec<Holder>,
}

/// A consumer holding a slot the producer waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    /// Its index in the ring.
    pub index: u32,
    /// Its process id, where the producer can see it (`None`: another pid namespace).
    pub pid: Option<u32>,
}
