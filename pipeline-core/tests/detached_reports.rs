//! A consumer the producer detached is told that it was detached, whatever it then finds in
//! the ring (issue 36, point 6): the ring going on without it is not corruption.

use std::sync::atomic::Ordering;
use std::time::Duration;

use pipeline_core::{
    Consumer, Error, HostConsumer, HostOptions, HostProducer, LagPolicy, Producer, ProducerConfig,
};

#[test]
fn a_detached_consumer_whose_index_went_to_a_later_one_is_told_it_was_detached() {
    let sock =
        std::env::temp_dir().join(format!("gpipe-detached-reuse-{}.sock", std::process::id()));
    let slots = 4;
    let config = ProducerConfig {
        slots,
        batch_bytes: 4096,
        // One index only: the next consumer to attach takes the detached one's.
        max_consumers: 1,
        lag: LagPolicy::DetachAfter(Duration::from_millis(100)),
        ..Default::default()
    };
    let mut producer: Producer<HostProducer> =
        Producer::bind(&sock, config, HostOptions::default()).unwrap();
    let mut old: Consumer<HostConsumer> = Consumer::attach(&sock, HostOptions::default()).unwrap();
    producer
        .wait_for_consumers(1, Duration::from_secs(10))
        .unwrap();
    // It receives nothing: the ring fills, and the next batch waits for it until the lag
    // policy detaches it.
    for _ in 0..=slots {
        producer
            .acquire_timeout(Duration::from_secs(10))
            .expect("a free slot, after the detach at the latest")
            .publish(8)
            .unwrap();
    }
    assert_eq!(producer.stats().detached, 1);
    // A later consumer is given its index: its record says active again, for the new one.
    let new: Consumer<HostConsumer> = Consumer::attach(&sock, HostOptions::default()).unwrap();
    assert_eq!(new.index(), old.index());
    // The head is now more than a ring past the old consumer's cursor.
    match old.recv_timeout(Duration::from_secs(2)) {
        Err(e @ Error::Detached(_)) => {
            assert!(!e.to_string().contains("corrupt"), "{e}");
        }
        Err(e) => panic!("the old consumer should be told it was detached, not: {e}"),
        Ok(b) => panic!(
            "the old consumer received batch {:?} after it was detached",
            b.map(|b| b.seq())
        ),
    }
    drop((old, new));
    producer.close();
}

#[test]
fn a_detached_consumer_releasing_late_leaves_the_batch_of_the_one_now_at_its_index_alone() {
    let sock =
        std::env::temp_dir().join(format!("gpipe-detached-late-{}.sock", std::process::id()));
    let slots = 4;
    let config = ProducerConfig {
        slots,
        batch_bytes: 4096,
        max_consumers: 1,
        lag: LagPolicy::DetachAfter(Duration::from_millis(100)),
        ..Default::default()
    };
    let mut producer: Producer<HostProducer> =
        Producer::bind(&sock, config, HostOptions::default()).unwrap();
    let mut old: Consumer<HostConsumer> = Consumer::attach(&sock, HostOptions::default()).unwrap();
    producer
        .wait_for_consumers(1, Duration::from_secs(10))
        .unwrap();
    for _ in 0..slots {
        producer.acquire().unwrap().publish(8).unwrap();
    }
    // It holds batch 0 (slot 0) past the lag policy: the producer needs slot 0 again, takes
    // it back and detaches it.
    let held = old.recv_timeout(Duration::from_secs(5)).unwrap().unwrap();
    assert_eq!((held.seq(), held.slot()), (0, 0));
    let slot = producer
        .acquire_timeout(Duration::from_secs(10))
        .expect("slot 0, after the detach");
    // A later consumer takes the index before batch 4 goes out in slot 0: it is addressed
    // to the new consumer, under the bit of the index the two share.
    let new: Consumer<HostConsumer> = Consumer::attach(&sock, HostOptions::default()).unwrap();
    assert_eq!(new.index(), old.index());
    assert_eq!(slot.publish(8).unwrap(), slots as u64);
    assert_eq!(producer.stats().detached, 1);
    let addressed = || new.segment().slot(0).addressed.load(Ordering::SeqCst);
    let bit = 1u64 << new.index();
    assert_ne!(addressed() & bit, 0);
    // What the producer reads of the new consumer: its own page, which the old one cannot
    // write (it has a page of its own, from its own attach).
    let progress = || new.page().slot(0).load(Ordering::SeqCst);
    assert_eq!(progress(), 0);
    // The old consumer wakes up and releases what it held: told it was detached, it must
    // not release the new consumer's batch.
    match held.release() {
        Err(e @ Error::Detached(_)) => assert!(e.to_string().contains("taken back"), "{e}"),
        other => panic!("a late release after the detach should fail as detached: {other:?}"),
    }
    assert_ne!(addressed() & bit, 0);
    assert_eq!(
        progress(),
        0,
        "the old consumer released the new consumer's batch"
    );
    drop((old, new));
    producer.close();
}
