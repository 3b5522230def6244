//! Slots taken ahead (`Producer::acquire_ahead`): several batches written at once and
//! published in order, each only once whole; a consumer gets them in order, intact; the
//! bounds (the ring's slots, max_lead), out-of-order publishing and cancelling.

use std::time::Duration;

use pipeline_core::{
    Consumer, ConsumerConfig, Error, HostConsumer, HostOptions, HostProducer, Mode, Producer,
    ProducerConfig,
};

const WAIT: Duration = Duration::from_secs(5);

fn ring(
    name: &str,
    slots: u32,
    max_lead: Option<u32>,
) -> (Producer<HostProducer>, Consumer<HostConsumer>) {
    let sock = std::env::temp_dir().join(format!("gpipe-ahead-{name}-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots,
        batch_bytes: 1 << 20,
        mode: Mode::Broadcast,
        max_lead,
        ..Default::default()
    };
    let p = Producer::bind(&sock, config, HostOptions::default()).unwrap();
    let c =
        Consumer::attach_with(&sock, ConsumerConfig::default(), HostOptions::default()).unwrap();
    p.wait_for_consumers(1, WAIT).unwrap();
    (p, c)
}

fn fill(p: &mut Producer<HostProducer>, loan: &pipeline_core::SlotLoan, v: u8) {
    p.loan_memory(loan).unwrap()[..4096].fill(v);
}

#[test]
fn batches_taken_ahead_are_published_in_order_and_arrive_intact() {
    let (mut p, mut c) = ring("order", 4, None);
    for round in 0..5u8 {
        // Take three slots, fill them in reverse order, publish in order.
        let loans: Vec<_> = (0..3).map(|_| p.acquire_ahead(WAIT).unwrap()).collect();
        assert_eq!(p.taken_ahead(), 3);
        for (i, l) in loans.iter().enumerate().rev() {
            fill(&mut p, l, round * 10 + i as u8);
        }
        for l in loans {
            let seq = l.seq();
            p.resume(l).unwrap().publish(4096).unwrap();
            let b = c.recv_timeout(WAIT).unwrap().unwrap();
            assert_eq!(b.seq(), seq);
            let want = round * 10 + (seq % 3) as u8;
            assert!(b.data()[..4096].iter().all(|&x| x == want), "batch {seq}");
            b.release().unwrap();
        }
        assert_eq!(p.taken_ahead(), 0);
    }
}

#[test]
fn no_more_than_the_slots_or_the_lead_and_only_in_order() {
    let (mut p, _c) = ring("bounds", 4, None);
    let loans: Vec<_> = (0..4).map(|_| p.acquire_ahead(WAIT).unwrap()).collect();
    let e = p.acquire_ahead(WAIT).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("at most 4")),
        "{e}"
    );
    // Out of order: the second batch cannot be published before the first.
    let e = p.resume(loans[1]).err().unwrap();
    assert!(e.to_string().contains("stale"), "{e}");
    // acquire() hands out the oldest taken slot again.
    assert_eq!(p.acquire_timeout(WAIT).unwrap().seq(), 0);
    // Cancelled: the next one taken is the next to publish again, and old loans are refused.
    p.cancel_ahead();
    assert_eq!(p.taken_ahead(), 0);
    assert!(p.loan_memory(&loans[2]).is_err());
    // Even the head batch's old loan: its slot may hold what a cancelled write left.
    let e = p.resume(loans[0]).err().unwrap();
    assert!(e.to_string().contains("cancelled"), "{e}");
    let fresh = p.acquire_ahead(WAIT).unwrap();
    assert_eq!(fresh.seq(), 0);
    assert!(p.loan_memory(&loans[0]).is_err());
    assert!(p.loan_memory(&fresh).is_ok());

    let (mut q, _d) = ring("lead", 8, Some(2));
    q.acquire_ahead(WAIT).unwrap();
    q.acquire_ahead(WAIT).unwrap();
    let e = q.acquire_ahead(WAIT).unwrap_err();
    assert!(e.to_string().contains("max_lead"), "{e}");
}

#[test]
fn a_slot_taken_ahead_waits_for_its_previous_batch_to_be_released() {
    let (mut p, mut c) = ring("held", 2, None);
    for i in 0..2u8 {
        let l = p.acquire_ahead(WAIT).unwrap();
        fill(&mut p, &l, i);
        p.resume(l).unwrap().publish(4096).unwrap();
    }
    let held = c.recv_timeout(WAIT).unwrap().unwrap();
    assert_eq!(held.seq(), 0);
    // Batch 2 goes into batch 0's slot, which the consumer holds.
    let e = p.acquire_ahead(Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert_eq!(p.taken_ahead(), 0);
    held.release().unwrap();
    let l = p.acquire_ahead(WAIT).unwrap();
    assert_eq!(l.seq(), 2);
}

/// `Producer::abandon`: the consumers see the producer die (not a clean end) while this
/// process goes on, and the socket is free for a new producer.
#[test]
fn an_abandoned_ring_looks_to_its_consumers_like_a_dead_producer() {
    let sock =
        std::env::temp_dir().join(format!("gpipe-ahead-abandon-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots: 4,
        batch_bytes: 1 << 20,
        ..Default::default()
    };
    let mut p =
        Producer::<HostProducer>::bind(&sock, config.clone(), HostOptions::default()).unwrap();
    let mut c = Consumer::<HostConsumer>::attach_with(
        &sock,
        ConsumerConfig::default(),
        HostOptions::default(),
    )
    .unwrap();
    p.wait_for_consumers(1, WAIT).unwrap();
    let l = p.acquire_ahead(WAIT).unwrap();
    fill(&mut p, &l, 7);
    p.resume(l).unwrap().publish(4096).unwrap();
    // A batch taken ahead and never published is lost with the ring.
    let _never = p.acquire_ahead(WAIT).unwrap();
    let t = std::time::Instant::now();
    p.abandon();
    let b = c.recv_timeout(WAIT).unwrap().unwrap();
    assert_eq!(b.seq(), 0, "what was published is still delivered");
    b.release().unwrap();
    match c.recv_timeout(WAIT) {
        Err(Error::ProducerDied) => {}
        other => panic!(
            "expected ProducerDied, got {:?}",
            other.map(|b| b.map(|b| b.seq()))
        ),
    }
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert!(!sock.exists(), "the socket is removed");
    let again = Producer::<HostProducer>::bind(&sock, config, HostOptions::default());
    assert!(again.is_ok(), "a new producer can take the path");
}

/// A short timeout is kept even when the producer's sleep tick is long: a pipeline polls
/// with short waits and publishes between them.
#[test]
fn a_short_acquire_timeout_returns_on_time_with_a_long_tick() {
    let sock = std::env::temp_dir().join(format!("gpipe-ahead-tick-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots: 2,
        batch_bytes: 1 << 20,
        wait: pipeline_core::WaitPolicy {
            spin: Duration::ZERO,
            tick: Duration::from_secs(5),
        },
        ..Default::default()
    };
    let mut p = Producer::<HostProducer>::bind(&sock, config, HostOptions::default()).unwrap();
    let mut c = Consumer::<HostConsumer>::attach_with(
        &sock,
        ConsumerConfig::default(),
        HostOptions::default(),
    )
    .unwrap();
    p.wait_for_consumers(1, WAIT).unwrap();
    for i in 0..2u8 {
        let l = p.acquire_ahead(WAIT).unwrap();
        fill(&mut p, &l, i);
        p.resume(l).unwrap().publish(4096).unwrap();
    }
    let _held = c.recv_timeout(WAIT).unwrap().unwrap();
    let t = std::time::Instant::now();
    let e = p.acquire_ahead(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "a 20 ms wait took {:?} with a 5 s tick",
        t.elapsed()
    );
}
