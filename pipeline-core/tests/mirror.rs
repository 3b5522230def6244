//! Mirror delivery on the host backend: each batch is copied into the consumer's own memory
//! and the producer's slot is released at once, so a consumer may hold more batches than the
//! ring has slots; the copies stay intact while the slots are rewritten; a consumer whose own
//! buffers are all held gets a clear error and loses nothing; `inspect` shows the choice.

use std::time::{Duration, Instant};

use pipeline_core::inspect::Snapshot;
use pipeline_core::{
    Consumer, ConsumerConfig, Delivery, Error, HostConsumer, HostOptions, HostProducer, Mode,
    Producer, ProducerConfig, observe,
};

const WAIT: Duration = Duration::from_secs(5);

fn bind(name: &str, slots: u32, mode: Mode) -> (Producer<HostProducer>, std::path::PathBuf) {
    let sock =
        std::env::temp_dir().join(format!("gpipe-mirror-{name}-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots,
        batch_bytes: 1 << 20,
        mode,
        ..Default::default()
    };
    (
        Producer::bind(&sock, config, HostOptions::default()).unwrap(),
        sock,
    )
}

/// Publishes batch i as 4096 bytes of (i + 1) * 3, with i in the first 8 bytes.
fn publish(producer: &mut Producer<HostProducer>, i: u64) {
    let mut slot = producer.acquire_timeout(WAIT).expect("a free slot");
    let m = slot.memory();
    m[..4096].fill(((i + 1) * 3) as u8);
    m[..8].copy_from_slice(&i.to_le_bytes());
    slot.publish(4096).unwrap();
}

fn intact(data: &[u8], i: u64) -> bool {
    data.len() == 4096
        && data[..8] == i.to_le_bytes()
        && data[8..].iter().all(|&b| b == ((i + 1) * 3) as u8)
}

#[test]
fn a_mirroring_consumer_holds_more_batches_than_the_ring_has_slots() {
    for mode in [Mode::Broadcast, Mode::Shared] {
        let (mut producer, sock) = bind(&format!("hold-{mode}"), 2, mode);
        let options = HostOptions {
            delivery: Delivery::Mirror,
            mirror_buffers: Some(6),
            ..HostOptions::default()
        };
        let mut consumer: Consumer<HostConsumer> = Consumer::attach(&sock, options).unwrap();
        producer.wait_for_consumers(1, WAIT).unwrap();
        let mut held = Vec::new();
        // Six batches through two slots, all held: each slot is rewritten twice more while
        // the earlier batches in it are still held by the consumer.
        for i in 0..6 {
            publish(&mut producer, i);
            let b = consumer.recv_timeout(WAIT).unwrap().unwrap();
            assert!(b.is_mirrored(), "{mode}");
            assert_eq!(b.seq(), i);
            held.push(b);
        }
        assert_eq!(consumer.held(), 6);
        for (i, b) in held.iter().enumerate() {
            assert!(intact(b.data(), i as u64), "{mode}: batch {i} changed");
        }
        // Every slot was released as it was copied.
        let stats = producer.stats();
        assert_eq!(stats.published, 6, "{mode}");
        let c = consumer.page().header();
        assert_eq!(
            c.released.load(std::sync::atomic::Ordering::Relaxed),
            6,
            "{mode}"
        );
        held.clear();
        assert_eq!(consumer.held(), 0);
        drop(consumer);
        producer.close();
    }
}

#[test]
fn a_consumer_whose_buffers_are_all_held_is_told_and_loses_nothing() {
    let (mut producer, sock) = bind("full", 4, Mode::Broadcast);
    let options = HostOptions {
        delivery: Delivery::Mirror,
        mirror_buffers: Some(2),
        ..HostOptions::default()
    };
    let mut consumer: Consumer<HostConsumer> = Consumer::attach(&sock, options).unwrap();
    producer.wait_for_consumers(1, WAIT).unwrap();
    for i in 0..3 {
        publish(&mut producer, i);
    }
    let b0 = consumer.recv_timeout(WAIT).unwrap().unwrap();
    let b1 = consumer.recv_timeout(WAIT).unwrap().unwrap();
    match consumer.recv_timeout(WAIT) {
        Err(Error::MirrorFull { buffers, held }) => {
            assert_eq!((buffers, held), (2, 2));
            let msg = Error::MirrorFull { buffers, held }.to_string();
            assert!(msg.contains("release batches"), "{msg}");
        }
        other => panic!("expected MirrorFull, got {other:?}"),
    }
    // Released from another thread: the next recv gets batch 2, the one refused before.
    std::thread::spawn(move || b0.release().unwrap())
        .join()
        .unwrap();
    let b2 = consumer.recv_timeout(WAIT).unwrap().unwrap();
    assert_eq!(b2.seq(), 2);
    assert!(intact(b1.data(), 1) && intact(b2.data(), 2));
    drop((b1, b2));
    drop(consumer);
    producer.close();
}

#[test]
fn in_place_and_mirrored_consumers_share_a_ring_and_inspect_tells_them_apart() {
    let (mut producer, sock) = bind("mixed", 3, Mode::Broadcast);
    let mut in_place: Consumer<HostConsumer> =
        Consumer::attach(&sock, HostOptions::default()).unwrap();
    // Three kept, one at a time besides: four buffers for a ring of three slots.
    let options = HostOptions {
        mirror_buffers: Some(4),
        ..HostOptions::mirror()
    };
    let mut mirror: Consumer<HostConsumer> = Consumer::attach(&sock, options).unwrap();
    producer.wait_for_consumers(2, WAIT).unwrap();
    let (seg, backend) = observe(&sock, ConsumerConfig::default()).unwrap();
    // A consumer writes its placement into its own page once joined; the producer's
    // supervisor copies it into the record that inspect reads on its next round.
    let deadline = Instant::now() + WAIT;
    let snap = loop {
        let snap = Snapshot::read(&seg, &backend.to_string());
        let delivery: Vec<_> = snap.consumers.iter().map(|c| c.delivery).collect();
        if delivery == [Some("in-place"), Some("mirror")] {
            break snap;
        }
        assert!(
            Instant::now() < deadline,
            "placements not folded in {WAIT:?}: {delivery:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(snap.consumers.iter().all(|c| c.device.is_none()));
    let text = snap.to_string();
    assert!(text.contains("  mirror\n"), "{text}");
    // The mirror holds every batch it gets; the in-place consumer releases each at once. The
    // producer is never held back by the mirror's batches.
    let mut kept = Vec::new();
    for i in 0..9 {
        publish(&mut producer, i);
        let b = in_place.recv_timeout(WAIT).unwrap().unwrap();
        assert!(!b.is_mirrored() && intact(b.data(), i));
        drop(b);
        if kept.len() < 3 {
            kept.push(mirror.recv_timeout(WAIT).unwrap().unwrap());
        } else {
            let b = mirror.recv_timeout(WAIT).unwrap().unwrap();
            assert!(intact(b.data(), i));
        }
    }
    for (i, b) in kept.iter().enumerate() {
        assert!(intact(b.data(), i as u64), "kept batch {i} changed");
    }
    drop(kept);
    drop((in_place, mirror));
    producer.close();
}

#[test]
fn shared_mode_mirrors_deliver_every_batch_exactly_once() {
    let (mut producer, sock) = bind("shared", 4, Mode::Shared);
    let path = sock.clone();
    let consumers: Vec<_> = (0..3)
        .map(|_| {
            let path = path.clone();
            let mut c: Consumer<HostConsumer> =
                Consumer::attach(&path, HostOptions::mirror()).unwrap();
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                while let Some(b) = c.recv_timeout(Duration::from_secs(20)).unwrap() {
                    assert!(intact(b.data(), b.seq()));
                    seen.push(b.seq());
                }
                seen
            })
        })
        .collect();
    producer.wait_for_consumers(3, WAIT).unwrap();
    for i in 0..300 {
        publish(&mut producer, i);
    }
    producer.close();
    let mut all: Vec<u64> = consumers
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    all.sort_unstable();
    assert_eq!(all, (0..300).collect::<Vec<_>>());
}
