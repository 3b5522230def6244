//! A snapshot of a ring's live state, read from its control segment (for `gpipe inspect`).

use std::sync::atomic::Ordering;

use crate::delivery::Placement;
use crate::layout::{ControlSegment, Mode, consumer_state, producer_state};
use crate::ring;
use crate::sys;

/// One slot as seen now.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlotView {
    /// Index.
    pub index: u32,
    /// Sequence number of the batch in it (None: never used).
    pub seq: Option<u64>,
    /// Length of that batch.
    pub len: u64,
    /// Broadcast: the consumers the batch went to that are still attached (whether each has
    /// released it is in its own page, which an observer does not get). Shared: empty.
    pub held_by: Vec<u32>,
    /// Shared mode: published and not yet claimed. Always false since protocol version 4:
    /// claims live in the claim segment, which observers do not get (kept for the JSON's
    /// readers).
    pub unclaimed: bool,
}

/// One consumer record as seen now.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConsumerView {
    /// Index.
    pub index: u32,
    /// State name.
    pub state: &'static str,
    /// Pid (from SO_PEERCRED).
    pub pid: u32,
    /// Whether that pid exists now (informational).
    pub pid_alive: bool,
    /// First sequence number it was given.
    pub join_seq: u64,
    /// Next sequence number it will read.
    pub cursor: u64,
    /// Head minus cursor (broadcast).
    pub lag: u64,
    /// Batches received.
    pub received: u64,
    /// Batches released.
    pub released: u64,
    /// The GPU it uses its batches on (as its process numbers devices); `None` on the host
    /// or when not recorded.
    pub device: Option<u32>,
    /// "in-place" or "mirror"; `None` when the consumer did not record it.
    pub delivery: Option<&'static str>,
}

/// The whole ring.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    /// Backend name.
    pub backend: String,
    /// Delivery mode.
    pub mode: Mode,
    /// Slots.
    pub slot_count: u32,
    /// Slot capacity.
    pub slot_bytes: u64,
    /// Producer pid.
    pub producer_pid: u32,
    /// "running" or "closed".
    pub producer_state: &'static str,
    /// Batches published.
    pub head: u64,
    /// Slots.
    pub slots: Vec<SlotView>,
    /// Consumer records that were ever used.
    pub consumers: Vec<ConsumerView>,
}

impl Snapshot {
    /// Reads a snapshot (racy by nature: each word is read once, atomically).
    pub fn read(seg: &ControlSegment, backend: &str) -> Self {
        let l = seg.layout();
        let h = seg.header();
        let head = h.head.value.load(Ordering::Acquire);
        let slots = (0..l.slot_count)
            .map(|k| {
                let d = seg.slot(k);
                let seq = d.seq.load(Ordering::Acquire);
                // Broadcast: the consumers the batch was published to and that are still
                // attached (whether each released it is in its own page, which observers do
                // not get). Shared mode: claims live in the claim segment, not shown.
                let p = d.addressed.load(Ordering::Acquire);
                SlotView {
                    index: k,
                    seq: (seq != u64::MAX).then_some(seq),
                    len: d.len.load(Ordering::Relaxed),
                    held_by: (0..l.consumer_capacity)
                        .filter(|&c| p & ring::bit(c) != 0)
                        .collect(),
                    unclaimed: false,
                }
            })
            .collect();
        let consumers = (0..l.consumer_capacity)
            .filter_map(|c| {
                let r = seg.consumer(c);
                let state = r.state.load(Ordering::Acquire);
                if state == consumer_state::FREE {
                    return None;
                }
                let pid = r.pid.load(Ordering::Relaxed);
                let cursor = r.cursor.load(Ordering::Relaxed);
                let placement = Placement::decode(r.placement.load(Ordering::Acquire));
                Some(ConsumerView {
                    index: c,
                    state: consumer_state::name(state),
                    pid,
                    pid_alive: pid != 0 && sys::pid_exists(pid),
                    join_seq: r.join_seq.load(Ordering::Relaxed),
                    cursor,
                    lag: if l.mode == Mode::Broadcast && state == consumer_state::ACTIVE {
                        head.saturating_sub(cursor)
                    } else {
                        0
                    },
                    received: r.received.load(Ordering::Relaxed),
                    released: r.released.load(Ordering::Relaxed),
                    device: placement.and_then(|p| p.device),
                    delivery: placement.map(Placement::delivery_name),
                })
            })
            .collect();
        Snapshot {
            backend: backend.to_string(),
            mode: l.mode,
            slot_count: l.slot_count,
            slot_bytes: l.slot_bytes,
            producer_pid: h.constants.producer_pid.load(Ordering::Relaxed),
            producer_state: match h.constants.producer_state.load(Ordering::Acquire) {
                producer_state::RUNNING => "running",
                producer_state::CLOSED => "closed",
                _ => "invalid",
            },
            head,
            slots,
            consumers,
        }
    }
}

impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "ring: backend {} | mode {} | {} slots x {} MiB | producer pid {} ({}) | head {}",
            self.backend,
            self.mode,
            self.slot_count,
            self.slot_bytes >> 20,
            self.producer_pid,
            self.producer_state,
            self.head
        )?;
        writeln!(f, "slots:")?;
        for s in &self.slots {
            let seq = s.seq.map(|q| q.to_string()).unwrap_or_else(|| "-".into());
            let who = if s.unclaimed {
                "unclaimed".to_string()
            } else if s.held_by.is_empty() {
                "free".to_string()
            } else {
                format!("held by {:?}", s.held_by)
            };
            writeln!(
                f,
                "  [{:>3}] seq {:>10} len {:>10}  {}",
                s.index, seq, s.len, who
            )?;
        }
        writeln!(f, "consumers:")?;
        if self.consumers.is_empty() {
            writeln!(f, "  (none yet)")?;
        }
        for c in &self.consumers {
            let place = match (c.delivery, c.device) {
                (None, _) => String::new(),
                (Some(d), None) => format!("  {d}"),
                (Some(d), Some(g)) => format!("  {d} on GPU {g}"),
            };
            writeln!(
                f,
                "  #{:<2} {:<9} pid {:>7}{} cursor {:>10} lag {:>4} received {:>10} released {:>10}{}",
                c.index,
                c.state,
                c.pid,
                if c.pid_alive { " " } else { "†" },
                c.cursor,
                c.lag,
                c.received,
                c.released,
                place
            )?;
        }
        Ok(())
    }
}
