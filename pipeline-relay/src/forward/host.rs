//! The host backend's forwarding loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{Consumer, HostConsumer, HostProducer, Producer, Slot};

use crate::chunks::{self, Board, chunks, progress};
use crate::relay::{RelayError, RelayReport, acquire_loan};

use super::options::ForwardOptions;
use super::steps::{Boards, abandon, check_expected, err, finish, wait_downstream};

/// The host backend's forwarding loop. With chunking, a batch whose upstream copy has begun
/// (its progress board says so) is copied chunk by chunk as each chunk lands, then published
/// once the upstream published it whole; without, each batch is copied once received.
pub(super) fn forward_host(
    mut consumer: Consumer<HostConsumer>,
    mut producer: Producer<HostProducer>,
    boards: &Boards,
    opts: &ForwardOptions,
    stop: &AtomicBool,
    report: &mut RelayReport,
) -> Result<(), RelayError> {
    let tick = Duration::from_millis(100);
    if let Err(e) = wait_downstream(&producer, opts, stop) {
        return Err(abandon(producer, e));
    }
    let up_slots = consumer.layout().slot_count;
    let slot_bytes = consumer.layout().slot_bytes;
    let mut started: Option<Instant> = None;
    // The upstream batch expected next, once one came.
    let mut next: Option<u64> = None;
    let outcome = (|| -> Result<(), RelayError> {
        while !stop.load(Ordering::Relaxed) {
            // Chunked: the next upstream batch, if its copy began upstream.
            if let (Some(up), Some(x)) = (&boards.up, next) {
                let k = (x % u64::from(up_slots)) as u32;
                if up.load(k) >= progress(x, 0) {
                    let Some(mut slot) = next_slot(&mut producer, &consumer, stop, tick)? else {
                        return Ok(());
                    };
                    let seq_out = slot.seq();
                    let k_out = slot.index();
                    let src = consumer.backend().slot_ptr(k);
                    let out = boards.out.as_ref();
                    if let Some(o) = out {
                        o.store(k_out, progress(seq_out, 0));
                    }
                    for (c, (off, n)) in chunks(slot_bytes, up.chunk_bytes()).enumerate() {
                        if !wait_progress(up, k, progress(x, c as u32 + 1), &consumer, stop)? {
                            return Ok(());
                        }
                        let dst = &mut slot.memory()[off as usize..(off + n) as usize];
                        // `src` is upstream slot `k` (slot_bytes, mapped while the consumer
                        // lives); chunk c landed (acquire-load of its progress above).
                        // SAFETY: so it is in bounds, written, and unchanged until we release x.
                        let from = unsafe {
                            std::slice::from_raw_parts(src.add(off as usize), n as usize)
                        };
                        dst.copy_from_slice(from);
                        if let Some(o) = out {
                            o.store(k_out, progress(seq_out, c as u32 + 1));
                        }
                    }
                    // Published only once the upstream published batch x whole.
                    let batch = loop {
                        if stop.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        match consumer.recv_timeout(tick) {
                            Ok(Some(b)) => break b,
                            Ok(None) => return Ok(()),
                            Err(pipeline_core::Error::Timeout(_)) => continue,
                            Err(e) => return Err(err(e)),
                        }
                    };
                    check_expected(batch.seq(), x)?;
                    started.get_or_insert_with(Instant::now);
                    slot.publish_with(batch.len(), batch.header(), batch.tensors())
                        .map_err(err)?;
                    report.batches += 1;
                    report.bytes += batch.len();
                    report.copied_ahead += 1;
                    next = Some(x + 1);
                    continue;
                }
            }
            let wait = if boards.up.is_some() && next.is_some() {
                Duration::from_micros(50)
            } else {
                tick
            };
            let batch = match consumer.recv_timeout(wait) {
                Ok(Some(b)) => b,
                Ok(None) => return Ok(()),
                Err(pipeline_core::Error::Timeout(_)) => continue,
                Err(e) => return Err(err(e)),
            };
            started.get_or_insert_with(Instant::now);
            next = Some(batch.seq() + 1);
            // While we wait for room downstream, the upstream producer may die: then our
            // consumers' GPU work waits on batches that never come, and so would we.
            let Some(mut slot) = next_slot(&mut producer, &consumer, stop, tick)? else {
                return Ok(());
            };
            let (seq_out, k_out) = (slot.seq(), slot.index());
            let n = batch.len();
            match &boards.out {
                Some(o) => {
                    o.store(k_out, progress(seq_out, 0));
                    for (c, (off, len)) in chunks(n, o.chunk_bytes()).enumerate() {
                        let (a, b) = (off as usize, (off + len) as usize);
                        slot.memory()[a..b].copy_from_slice(&batch.data()[a..b]);
                        o.store(k_out, progress(seq_out, c as u32 + 1));
                    }
                    // A short batch: every chunk of the slot counts as landed.
                    o.store(k_out, progress(seq_out, o.chunk_count()));
                }
                None => slot.memory()[..n as usize].copy_from_slice(batch.data()),
            }
            slot.publish_with(n, batch.header(), batch.tensors())
                .map_err(err)?;
            report.batches += 1;
            report.bytes += n;
        }
        Ok(())
    })();
    if let Some(t) = started {
        report.elapsed_s = t.elapsed().as_secs_f64();
    }
    match outcome {
        Ok(()) => {
            finish(producer, stop, report);
            Ok(())
        }
        Err(e) => Err(abandon(producer, e)),
    }
}

/// Waits on the host until `slot` of the upstream board reaches `target` (`Ok(true)`), `stop`
/// is set (`Ok(false)`), or the upstream producer died (an error: the batch is never
/// published downstream).
fn wait_progress(
    board: &Board,
    slot: u32,
    target: u64,
    consumer: &Consumer<HostConsumer>,
    stop: &AtomicBool,
) -> Result<bool, RelayError> {
    let t0 = Instant::now();
    let mut checked = t0;
    loop {
        let v = board.load(slot);
        if v >= target && v != chunks::RELEASED {
            return Ok(true);
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let now = Instant::now();
        if v == chunks::RELEASED || now.duration_since(checked) >= Duration::from_millis(1) {
            consumer.check_producer().map_err(err)?;
            if v == chunks::RELEASED {
                return Err(RelayError(
                    "the upstream ring's chunk progress was released: its writer died".into(),
                ));
            }
            checked = now;
        }
        if now.duration_since(t0) < Duration::from_micros(200) {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// The next free downstream slot, or `None` once `stop` is set; an error if the upstream
/// producer died while we waited for room.
fn next_slot<'p>(
    producer: &'p mut Producer<HostProducer>,
    consumer: &Consumer<HostConsumer>,
    stop: &AtomicBool,
    tick: Duration,
) -> Result<Option<Slot<'p, HostProducer>>, RelayError> {
    let Some(loan) = acquire_loan(producer, stop, tick, || {
        consumer.check_producer().map_err(err)
    })?
    else {
        return Ok(None);
    };
    producer.resume(loan).map(Some).map_err(err)
}
