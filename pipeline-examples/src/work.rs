//! What `gpipe` does with each batch: fill it on the producer side, verify it on the consumer
//! side, and the loops around them. Generic over the backend so the host and CUDA paths share
//! one loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{
    Batch, Consumer, ConsumerBackend, Error, Mode, Producer, ProducerBackend, Slot,
    USER_HEADER_WORDS, pattern,
};

pub use pattern::{HEADER_CHECKSUM as H_CHECKSUM, HEADER_SEQ as H_SEQ};

/// Producer-side fill for one backend.
pub trait Fill<B: ProducerBackend> {
    /// Writes batch `seq` of `len` bytes into the slot; returns the user header.
    fn fill(
        &mut self,
        slot: &mut Slot<'_, B>,
        seq: u64,
        len: u64,
    ) -> Result<[u64; USER_HEADER_WORDS], String>;
    /// Blocks until the slot's previous holders' work is complete (round-trip measurement
    /// only; the host backend's is complete at release already).
    fn settle(&mut self, _backend: &B) -> Result<(), String> {
        Ok(())
    }
}

/// Consumer-side verification for one backend.
pub trait Check<B: ConsumerBackend> {
    /// Checks one batch (may defer the verdict, e.g. to the GPU).
    fn check(&mut self, batch: &Batch<B>) -> Result<(), String>;
    /// Sequence numbers whose verification failed, once all are known.
    fn finish(&mut self, consumer: &Consumer<B>) -> Result<Vec<u64>, String>;
    /// The GPU start and end (ns) of the recorded batches' work, after `finish` (None: not
    /// recorded).
    fn timeline(&mut self) -> Result<Option<Vec<[u64; 2]>>, String> {
        Ok(None)
    }
}

/// Host fill: the pattern, with its checksum in the header.
pub struct HostFill;

impl Fill<pipeline_core::HostProducer> for HostFill {
    fn fill(
        &mut self,
        slot: &mut Slot<'_, pipeline_core::HostProducer>,
        seq: u64,
        len: u64,
    ) -> Result<[u64; USER_HEADER_WORDS], String> {
        let sum = pattern::fill(&mut slot.memory()[..len as usize], seq);
        let mut h = [0u64; USER_HEADER_WORDS];
        h[H_CHECKSUM] = sum;
        h[H_SEQ] = seq;
        Ok(h)
    }
}

/// Host check: recompute the checksum over the batch in place.
#[derive(Default)]
pub struct HostCheck {
    bad: Vec<u64>,
    stamps: StampCheck,
    /// Extra reads of each batch after the verifying one (`gpipe consume --passes`).
    extra_passes: u32,
}

impl HostCheck {
    /// Reads each batch `passes` times (at least once); the first read's verdict counts.
    pub fn with_passes(passes: u32) -> Self {
        Self {
            extra_passes: passes.saturating_sub(1),
            ..Self::default()
        }
    }
}

/// Checks a batch's stamped sequence number (the header's: the number in the ring whose
/// producer filled the batch) against the batch's own. On a plain ring they are equal. Behind
/// a relay or a forwarder the stamp runs ahead by a fixed offset, which jumps forward where a
/// relay lost its sender and took another (what the upstream ring published meanwhile never
/// reached it). So: the offset seen first is kept; a different one is taken only when the
/// stamp is beyond every stamp seen so far (such a jump); otherwise the batch is repeated,
/// out of place, or not the one its header names. Batches may arrive out of order (a shared
/// ring requeues a dead consumer's claims), which a fixed offset does not mind.
#[derive(Debug, Default)]
pub struct StampCheck {
    offset: Option<u64>,
    max: Option<u64>,
}

impl StampCheck {
    /// Whether batch `seq` stamped `stamped` is consistent with those seen before.
    pub fn ok(&mut self, seq: u64, stamped: u64) -> bool {
        let offset = stamped.wrapping_sub(seq);
        let fine = match self.offset {
            None => true,
            Some(o) if o == offset => true,
            Some(_) => self.max.is_some_and(|m| stamped > m),
        };
        if fine {
            self.offset = Some(offset);
        }
        self.max = Some(self.max.map_or(stamped, |m| m.max(stamped)));
        fine
    }
}

impl Check<pipeline_core::HostConsumer> for HostCheck {
    fn check(&mut self, batch: &Batch<pipeline_core::HostConsumer>) -> Result<(), String> {
        let h = batch.header();
        let ok = self.stamps.ok(batch.seq(), h[H_SEQ])
            && pattern::checksum(batch.data()) == h[H_CHECKSUM];
        if !ok {
            self.bad.push(batch.seq());
        }
        for _ in 0..self.extra_passes {
            std::hint::black_box(pattern::checksum(batch.data()));
        }
        Ok(())
    }
    fn finish(&mut self, _: &Consumer<pipeline_core::HostConsumer>) -> Result<Vec<u64>, String> {
        Ok(std::mem::take(&mut self.bad))
    }
}

/// What a consumer reports at the end (one JSON line in bench mode).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ConsumerReport {
    /// Consumer index in the ring.
    pub index: u32,
    /// Process id.
    pub pid: u32,
    /// Batches received.
    pub received: u64,
    /// Bytes received.
    pub bytes: u64,
    /// Whether batches were verified.
    pub verified: bool,
    /// Batches whose checksum did not match.
    pub mismatches: u64,
    /// Batches the producer took back before this consumer released them (when it detached
    /// it): it may have rewritten them while they were read, so their checks do not count
    /// as mismatches.
    #[serde(default)]
    pub taken_back: u64,
    /// The first few mismatching sequence numbers.
    pub bad_seqs: Vec<u64>,
    /// First sequence number received.
    pub first_seq: Option<u64>,
    /// Last sequence number received.
    pub last_seq: Option<u64>,
    /// Broadcast: places where the sequence skipped (lost batches).
    pub gaps: u64,
    /// Seconds from attach to the end.
    pub elapsed_s: f64,
    /// Seconds spent inside `recv` (waiting for the producer, or validating).
    pub recv_wait_s: f64,
    /// Seconds spent in the check (enqueueing the verify kernel: the consumer's own work), over
    /// the `host_timed` batches from [`ConsumeOptions::timed_from`] on.
    #[serde(default)]
    pub check_s: f64,
    /// Seconds spent in `release` (signalling `finished`, handing the slot back), likewise.
    #[serde(default)]
    pub release_s: f64,
    /// Batches `check_s` and `release_s` cover (the warm-up, with its one-off setup such as
    /// loading the kernels, is left out).
    #[serde(default)]
    pub host_timed: u64,
    /// GPU (start, end) in ns of the recorded batches' verify (`gpipe bench --gpu-timeline`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_timeline: Option<Vec<[u64; 2]>>,
    /// It stopped because it reached `--max-batches` (not because the ring closed).
    #[serde(default)]
    pub reached_quota: bool,
    /// The backend's attach cost, per step (CUDA: import timings in µs).
    #[serde(default)]
    pub attach: Option<serde_json::Value>,
    /// The GPU it consumed on (CUDA).
    #[serde(default)]
    pub device: Option<u32>,
    /// "in-place" or "mirror".
    #[serde(default)]
    pub delivery: Option<String>,
    /// How the run ended, if not cleanly.
    pub error: Option<String>,
    /// It never joined the ring: the attach itself failed (see `error`).
    #[serde(default)]
    pub attach_failed: bool,
    /// Its number among a bench's consumers (`gpipe bench`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bench_index: Option<u32>,
    /// The forwarder that ran in this process and fed its ring (`--forward-from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarder: Option<pipeline_relay::RelayReport>,
}

/// Options of the consume loop.
pub struct ConsumeOptions<'a> {
    /// Stop after this many batches.
    pub max_batches: Option<u64>,
    /// Set by Ctrl-C.
    pub stop: &'a AtomicBool,
    /// Record every sequence number (for exact loss/duplicate checks).
    pub keep_seqs: bool,
    /// Print a line per second.
    pub progress: bool,
    /// Host times per batch count from this sequence number on (the bench's warm-up before).
    pub timed_from: u64,
}

/// Receives until the producer closes (or `max_batches`, or Ctrl-C), verifying with `check`.
pub fn consume_loop<B: ConsumerBackend, C: Check<B>>(
    consumer: &mut Consumer<B>,
    mut check: Option<&mut C>,
    opts: &ConsumeOptions<'_>,
) -> (ConsumerReport, Vec<u64>) {
    let start = Instant::now();
    let mut rep = ConsumerReport {
        index: consumer.index(),
        pid: std::process::id(),
        verified: check.is_some(),
        ..Default::default()
    };
    let mut seqs = Vec::new();
    // Batches taken back before we released them (see `ConsumerReport::taken_back`).
    let mut taken_back = Vec::new();
    let broadcast = consumer.layout().mode == Mode::Broadcast;
    let mut last_print = Instant::now();
    loop {
        if opts.max_batches.is_some_and(|m| rep.received >= m) {
            rep.reached_quota = true;
            break;
        }
        if opts.stop.load(Ordering::Relaxed) {
            break;
        }
        let t_recv = Instant::now();
        let got = consumer.recv_timeout(crate::signals::SLICE);
        rep.recv_wait_s += t_recv.elapsed().as_secs_f64();
        let batch = match got {
            Ok(Some(b)) => b,
            Ok(None) => break,
            Err(Error::Timeout(_)) => continue,
            Err(e) => {
                rep.error = Some(e.to_string());
                break;
            }
        };
        let seq = batch.seq();
        let timed = seq >= opts.timed_from;
        let t_check = Instant::now();
        if let Some(c) = check.as_deref_mut() {
            if let Err(e) = c.check(&batch) {
                rep.error = Some(e);
                break;
            }
        }
        let checked = t_check.elapsed().as_secs_f64();
        if broadcast {
            if let Some(last) = rep.last_seq {
                if seq != last + 1 {
                    rep.gaps += 1;
                }
            }
        }
        rep.first_seq.get_or_insert(seq);
        rep.last_seq = Some(seq);
        rep.received += 1;
        rep.bytes += batch.len();
        if opts.keep_seqs {
            seqs.push(seq);
        }
        let t_release = Instant::now();
        let released = batch.release();
        if timed {
            rep.check_s += checked;
            rep.release_s += t_release.elapsed().as_secs_f64();
            rep.host_timed += 1;
        }
        if let Err(e) = released {
            // The only release a detach refuses: the producer took the batch back.
            if matches!(e, Error::Detached(_)) {
                taken_back.push(seq);
            }
            rep.error = Some(e.to_string());
            break;
        }
        if opts.progress && last_print.elapsed() >= Duration::from_secs(1) {
            last_print = Instant::now();
            eprintln!(
                "consumer #{}: {}, {}",
                rep.index,
                crate::duration::plural(rep.received, "batch", "batches"),
                gb(rep.bytes)
            );
        }
    }
    if let Some(c) = check {
        match c.finish(consumer) {
            Ok(mut bad) => {
                bad.retain(|s| !taken_back.contains(s));
                rep.mismatches = bad.len() as u64;
                rep.bad_seqs = bad.into_iter().take(10).collect();
            }
            Err(e) => {
                rep.error.get_or_insert(e);
            }
        }
        // Only after a clean run: reading waits for the whole context, and a stream may wait
        // forever on a dead producer's `ready`.
        if rep.error.is_none() {
            match c.timeline() {
                Ok(t) => rep.gpu_timeline = t,
                Err(e) => rep.error = Some(format!("reading the GPU timeline: {e}")),
            }
        }
    }
    rep.taken_back = taken_back.len() as u64;
    rep.elapsed_s = start.elapsed().as_secs_f64();
    (rep, seqs)
}

/// Bytes as every consumer line of the CLI shows them, progress and final alike: decimal
/// GB with three decimals.
pub fn gb(bytes: u64) -> String {
    format!("{:.3} GB", bytes as f64 / 1e9)
}

/// What the produce loop measures as it goes.
#[derive(Default)]
pub struct ProduceTiming {
    /// Time spent in `acquire` waiting for free slots.
    pub acquire_wait: Duration,
    /// Time spent filling (enqueueing the fill kernel: the producer's own work), over the
    /// `timed` batches from `timed_from` on.
    pub fill: Duration,
    /// Time spent in `publish` (signalling `ready`, handing the batch to the ring), likewise.
    pub publish: Duration,
    /// Fill and publish times count from this sequence number on (the warm-up before, with
    /// its one-off setup such as loading the kernels, is left out).
    pub timed_from: u64,
    /// Batches `fill` and `publish` cover.
    pub timed: u64,
    /// When set, each batch's round trip in seconds (meaningful with one slot).
    pub round_trips: Option<Vec<f64>>,
}

/// Publishes `batches` batches (None: until `stop`) of `len` bytes filled by `fill`.
/// `on_batch` is called after each publish (progress). Returns how many were published.
pub fn produce_loop<B: ProducerBackend, F: Fill<B>>(
    producer: &mut Producer<B>,
    fill: &mut F,
    batches: Option<u64>,
    len: u64,
    stop: &AtomicBool,
    timing: &mut ProduceTiming,
    mut on_batch: impl FnMut(u64, u32),
) -> Result<u64, String> {
    let mut n = 0u64;
    let mut last_publish: Option<Instant> = None;
    while batches.is_none_or(|b| n < b) && !stop.load(Ordering::Relaxed) {
        let t_acq = Instant::now();
        let got = producer.acquire_timeout(crate::signals::SLICE);
        timing.acquire_wait += t_acq.elapsed();
        let mut slot = match got {
            Ok(s) => s,
            Err(Error::Timeout(_)) => continue,
            Err(e) => return Err(e.to_string()),
        };
        if let Some(r) = timing.round_trips.as_mut() {
            // With one slot, acquire returned once the consumer released the previous batch;
            // settle waits for its GPU work too: publish -> consumer done -> slot free.
            fill.settle(slot.backend())?;
            if let Some(t0) = last_publish {
                r.push(t0.elapsed().as_secs_f64());
            }
        }
        let seq = slot.seq();
        let t_fill = Instant::now();
        let header = fill.fill(&mut slot, seq, len)?;
        let t_publish = Instant::now();
        slot.publish_with_header(len, &header)
            .map_err(|e| e.to_string())?;
        let now = Instant::now();
        if seq >= timing.timed_from {
            timing.fill += t_publish - t_fill;
            timing.publish += now - t_publish;
            timing.timed += 1;
        }
        last_publish = Some(now);
        n += 1;
        on_batch(n, producer.consumers());
    }
    Ok(n)
}

#[cfg(test)]
mod stamp_tests {
    use super::StampCheck;

    #[test]
    fn stamps_allow_requeues_and_forward_jumps_but_not_repeats() {
        // A plain ring, a shared-mode requeue arriving late: fine.
        let mut c = StampCheck::default();
        assert!(
            [(0, 0), (1, 1), (3, 3), (2, 2)]
                .iter()
                .all(|&(s, t)| c.ok(s, t))
        );
        // Behind a relay: a fixed offset, then a jump forward after a rejoin.
        let mut c = StampCheck::default();
        assert!(c.ok(0, 100) && c.ok(1, 101) && c.ok(2, 500) && c.ok(3, 501));
        // A repeated stamp, or one from before, is refused.
        assert!(!c.ok(4, 501));
        assert!(!c.ok(5, 102));
        // A header that does not match its batch on a plain ring.
        let mut c = StampCheck::default();
        assert!(c.ok(0, 0) && !c.ok(1, 0));
    }
}
