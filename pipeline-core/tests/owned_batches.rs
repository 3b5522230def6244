//! Owned batches (several held, released out of order, from other threads), the deadlock
//! check, and named tensors carried in the per-slot table.

use std::time::Duration;

use pipeline_core::{
    Consumer, DType, Error, HostConsumer, HostOptions, HostProducer, Mode, Producer,
    ProducerConfig, TensorPlan,
};

fn bind(name: &str, slots: u32, mode: Mode) -> (Producer<HostProducer>, std::path::PathBuf) {
    let sock = std::env::temp_dir().join(format!("gpipe-owned-{name}-{}.sock", std::process::id()));
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

fn publish_n(producer: &mut Producer<HostProducer>, n: u64) {
    for i in 0..n {
        let mut slot = producer
            .acquire_timeout(Duration::from_secs(5))
            .expect("free slot");
        slot.memory()[..8].copy_from_slice(&(i + 100).to_le_bytes());
        slot.publish(8).unwrap();
    }
}

#[test]
fn batches_are_held_together_and_released_out_of_order_from_other_threads() {
    for mode in [Mode::Broadcast, Mode::Shared] {
        let (mut producer, sock) = bind(&format!("ooo-{mode}"), 4, mode);
        let mut consumer: Consumer<HostConsumer> =
            Consumer::attach(&sock, HostOptions::default()).unwrap();
        producer
            .wait_for_consumers(1, Duration::from_secs(5))
            .unwrap();
        publish_n(&mut producer, 4);
        let mut held: Vec<_> = (0..4)
            .map(|_| {
                consumer
                    .recv_timeout(Duration::from_secs(5))
                    .unwrap()
                    .unwrap()
            })
            .collect();
        assert_eq!(consumer.held(), 4);
        for (i, b) in held.iter().enumerate() {
            assert_eq!(b.seq(), i as u64);
            assert_eq!(b.data()[..8], (i as u64 + 100).to_le_bytes());
        }
        // The ring is full: the producer cannot reuse slot 0 while batch 0 is held.
        assert!(matches!(
            producer.acquire_timeout(Duration::from_millis(50)),
            Err(Error::Timeout(_))
        ));
        // Release 2, then 0 from another thread, then 3 and 1.
        let b2 = held.remove(2);
        b2.release().unwrap();
        let b0 = held.remove(0);
        std::thread::spawn(move || b0.release().unwrap())
            .join()
            .unwrap();
        assert_eq!(consumer.held(), 2);
        // Slot 0 is free again: one more batch can go out.
        publish_n(&mut producer, 1);
        drop(held);
        assert_eq!(consumer.held(), 0);
        let b = consumer
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!(b.seq(), 4);
        drop(b);
        drop(consumer);
        producer.close();
    }
}

#[test]
fn asking_for_a_batch_whose_slot_we_hold_is_an_error_not_a_hang() {
    for mode in [Mode::Broadcast, Mode::Shared] {
        let (mut producer, sock) = bind(&format!("dl-{mode}"), 2, mode);
        let mut consumer: Consumer<HostConsumer> =
            Consumer::attach(&sock, HostOptions::default()).unwrap();
        producer
            .wait_for_consumers(1, Duration::from_secs(5))
            .unwrap();
        publish_n(&mut producer, 2);
        let a = consumer.recv().unwrap().unwrap();
        let b = consumer.recv().unwrap().unwrap();
        let started = std::time::Instant::now();
        match consumer.recv() {
            Err(Error::Deadlock { seq, slot, held }) => {
                assert_eq!((seq, slot, held), (0, 0, 2));
            }
            other => panic!("{mode}: expected Deadlock, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(1));
        // Releasing the batch in the slot the producer needs next makes waiting sensible.
        drop(a);
        assert!(matches!(
            consumer.recv_timeout(Duration::from_millis(30)),
            Err(Error::Timeout(_))
        ));
        drop(b);
        drop(consumer);
        producer.close();
    }
}

#[test]
fn named_tensors_reach_the_consumer_with_their_layout() {
    let (mut producer, sock) = bind("tensors", 2, Mode::Broadcast);
    let mut consumer: Consumer<HostConsumer> =
        Consumer::attach(&sock, HostOptions::default()).unwrap();
    producer
        .wait_for_consumers(1, Duration::from_secs(5))
        .unwrap();
    let mut slot = producer.acquire().unwrap();
    let cap = slot.capacity();
    let mut plan = TensorPlan::new();
    // NCHW = 2, 3, 4, 5 in channels_last order.
    plan.push(
        "images",
        DType::F32,
        &[2, 3, 4, 5],
        Some(&[60, 1, 15, 3]),
        cap,
    )
    .unwrap();
    plan.push("labels", DType::I64, &[2], None, cap).unwrap();
    let labels = *plan.get("labels").unwrap();
    slot.memory()[labels.offset as usize..labels.offset as usize + 16]
        .copy_from_slice(&[7u64.to_le_bytes(), 9u64.to_le_bytes()].concat());
    slot.publish_tensors(plan.tensors(), &[1, 2, 3, 4, 5, 6, 7, 8])
        .unwrap();
    // A batch without a table reads as its bytes.
    let slot = producer.acquire().unwrap();
    slot.publish(33).unwrap();

    let b = consumer.recv().unwrap().unwrap();
    assert_eq!(b.tensors(), plan.tensors());
    assert_eq!(b.len(), plan.len());
    assert_eq!(b.header(), &[1, 2, 3, 4, 5, 6, 7, 8]);
    let t = b.tensor("labels").unwrap();
    assert_eq!(
        b.data()[t.offset as usize..t.offset as usize + 16],
        [7u64.to_le_bytes(), 9u64.to_le_bytes()].concat()
    );
    assert_eq!(b.tensor("images").unwrap().strides(), &[60, 1, 15, 3]);
    let raw = consumer.recv().unwrap().unwrap();
    assert_eq!(raw.tensors().len(), 1);
    let t = raw.tensor("data").unwrap();
    assert_eq!((t.dtype, t.shape(), t.offset), (DType::U8, &[33u64][..], 0));
    drop((b, raw));
    drop(consumer);
    producer.close();
}

#[test]
fn publishing_tensors_beyond_the_length_is_refused() {
    let (mut producer, _sock) = bind("badpub", 2, Mode::Broadcast);
    let slot = producer.acquire().unwrap();
    let e = slot
        .publish_with(10, &[0; 8], &[pipeline_core::TensorInfo::bytes(11)])
        .unwrap_err();
    assert!(e.to_string().contains("beyond"), "{e}");
    // The slot returned to the ring: the next acquire gets batch 0 again.
    let slot = producer.acquire().unwrap();
    assert_eq!(slot.seq(), 0);
    // Offsets consumers would refuse are refused here: unaligned, or wrapping past u64.
    let mut t = pipeline_core::TensorInfo::bytes(10);
    t.offset = 3;
    let e = slot.publish_with(64, &[0; 8], &[t]).unwrap_err();
    assert!(e.to_string().contains("aligned"), "{e}");
    let slot = producer.acquire().unwrap();
    t.offset = u64::MAX - 255;
    assert!(slot.publish_with(64, &[0; 8], &[t]).is_err());
}

#[test]
fn a_loan_resumes_the_same_slot_once() {
    let (mut producer, _sock) = bind("loan", 2, Mode::Broadcast);
    let loan = producer.acquire().unwrap().into_loan();
    let slot = producer.resume(loan).unwrap();
    assert_eq!((slot.seq(), slot.index()), (0, 0));
    slot.publish(1).unwrap();
    assert!(producer.resume(loan).is_err());
}

fn _batches_are_send(b: pipeline_core::Batch<HostConsumer>) -> impl Send {
    b
}
