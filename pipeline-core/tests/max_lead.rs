//! The producer-lead bound (`ProducerConfig::max_lead`): the producer writes batch `s` only
//! after batch `s - max_lead` was released by everyone who got it, whatever the ring's size.

use std::time::Duration;

use pipeline_core::{
    Consumer, Error, HostConsumer, HostOptions, HostProducer, Mode, Producer, ProducerConfig,
};

fn bind(
    name: &str,
    slots: u32,
    mode: Mode,
    max_lead: Option<u32>,
) -> Result<(Producer<HostProducer>, std::path::PathBuf), Error> {
    let sock = std::env::temp_dir().join(format!("gpipe-lead-{name}-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots,
        batch_bytes: 1 << 20,
        mode,
        max_lead,
        ..Default::default()
    };
    Producer::bind(&sock, config, HostOptions::default()).map(|p| (p, sock))
}

fn publish(producer: &mut Producer<HostProducer>) -> Result<u64, Error> {
    let mut slot = producer.acquire_timeout(Duration::from_millis(150))?;
    let seq = slot.seq();
    slot.memory()[..8].copy_from_slice(&seq.to_le_bytes());
    slot.publish(8)?;
    Ok(seq)
}

fn timed_out(r: Result<u64, Error>) -> bool {
    matches!(r, Err(Error::Timeout(_)))
}

#[test]
fn the_producer_waits_for_the_batch_max_lead_back_not_for_the_ring() {
    for mode in [Mode::Broadcast, Mode::Shared] {
        let (mut producer, sock) = bind(&format!("two-{mode}"), 6, mode, Some(2)).unwrap();
        let mut consumer: Consumer<HostConsumer> =
            Consumer::attach(&sock, HostOptions::default()).unwrap();
        producer
            .wait_for_consumers(1, Duration::from_secs(5))
            .unwrap();
        assert_eq!(publish(&mut producer).unwrap(), 0);
        assert_eq!(publish(&mut producer).unwrap(), 1);
        let recv = |c: &mut Consumer<HostConsumer>| {
            c.recv_timeout(Duration::from_secs(5)).unwrap().unwrap()
        };
        let b0 = recv(&mut consumer);
        let b1 = recv(&mut consumer);
        // Four slots are free, but batch 0 (two back) is still held: batch 2 must wait.
        assert!(
            timed_out(publish(&mut producer)),
            "{mode}: ran ahead of max_lead"
        );
        b0.release().unwrap();
        // Batch 0 is done; batch 1 is still held, which a lead of 2 allows.
        assert_eq!(publish(&mut producer).unwrap(), 2, "{mode}");
        assert!(timed_out(publish(&mut producer)), "{mode}: batch 1 is held");
        drop(b1);
        assert_eq!(publish(&mut producer).unwrap(), 3, "{mode}");
        // Every batch arrives, in order, with its contents.
        for want in 2..4u64 {
            let b = recv(&mut consumer);
            assert_eq!((b.seq(), &b.data()[..8]), (want, &want.to_le_bytes()[..]));
        }
        drop(consumer);
        producer.close();
    }
}

#[test]
fn a_lead_of_the_ring_size_or_more_changes_nothing() {
    for lead in [None, Some(3), Some(10)] {
        let (mut producer, sock) =
            bind(&format!("ring-{lead:?}"), 3, Mode::Broadcast, lead).unwrap();
        let mut consumer: Consumer<HostConsumer> =
            Consumer::attach(&sock, HostOptions::default()).unwrap();
        producer
            .wait_for_consumers(1, Duration::from_secs(5))
            .unwrap();
        let held: Vec<_> = (0..3)
            .map(|_| {
                publish(&mut producer).unwrap();
                consumer
                    .recv_timeout(Duration::from_secs(5))
                    .unwrap()
                    .unwrap()
            })
            .collect();
        // Three batches held in a ring of three: only the ring itself stops the producer.
        assert!(timed_out(publish(&mut producer)), "{lead:?}");
        drop(held);
        assert_eq!(publish(&mut producer).unwrap(), 3, "{lead:?}");
        drop(consumer);
        producer.close();
    }
}

#[test]
fn a_lead_of_zero_is_refused() {
    let Err(e) = bind("zero", 4, Mode::Broadcast, Some(0)) else {
        panic!("max_lead 0 accepted");
    };
    assert!(e.to_string().contains("max_lead must be at least 1"), "{e}");
}
