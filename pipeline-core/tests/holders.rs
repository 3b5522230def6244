//! Which consumers the producer orders its next write of a slot after (`wait_finished`'s
//! `holders`). A backend that records the calls stands in for the CUDA backend, where waiting
//! on the wrong consumer's `finished` signal deadlocks the GPU streams.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pipeline_core::{
    BackendError, BackendKind, Consumer, Export, HostConsumer, HostOptions, HostProducer, Mode,
    Producer, ProducerBackend, ProducerConfig, RingLayout,
};

type Calls = Arc<Mutex<Vec<(u32, u64, u64)>>>;

/// The host backend, recording every `wait_finished(slot, prev_seq, holders)`.
struct Recording {
    inner: HostProducer,
    calls: Calls,
}

impl ProducerBackend for Recording {
    type Options = Calls;
    type SlotMut<'a> = &'a mut [u8];
    const KIND: BackendKind = BackendKind::Host;

    fn create(layout: &RingLayout, calls: Calls) -> Result<Self, BackendError> {
        Ok(Self {
            inner: HostProducer::create(layout, HostOptions)?,
            calls,
        })
    }
    fn export(&self, c: u32) -> Result<Export, BackendError> {
        self.inner.export(c)
    }
    fn attach(&self, c: u32, reply: &[u8], fds: Vec<OwnedFd>) -> Result<(), BackendError> {
        self.inner.attach(c, reply, fds)
    }
    fn detach(&self, c: u32, died: bool) {
        self.inner.detach(c, died)
    }
    fn wait_finished(&self, slot: u32, prev: u64, holders: u64) -> Result<(), BackendError> {
        self.calls.lock().unwrap().push((slot, prev, holders));
        Ok(())
    }
    unsafe fn slot_mut(&self, slot: u32) -> &mut [u8] {
        // SAFETY: forwarded under the same contract the ring upholds for us.
        unsafe { self.inner.slot_mut(slot) }
    }
    fn signal_ready(&self, slot: u32, seq: u64) -> Result<(), BackendError> {
        self.inner.signal_ready(slot, seq)
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_reused_consumer_index_is_not_a_holder_of_batches_before_it_joined() {
    for mode in [Mode::Broadcast, Mode::Shared] {
        let sock =
            std::env::temp_dir().join(format!("gpipe-holders-{}-{mode}.sock", std::process::id()));
        let calls = Calls::default();
        let config = ProducerConfig {
            slots: 2,
            batch_bytes: 4096,
            mode,
            max_consumers: 1,
            ..Default::default()
        };
        let mut producer: Producer<Recording> =
            Producer::bind(&sock, config, calls.clone()).unwrap();
        // Consumer A (index 0) takes batches 0 and 1, then leaves.
        let s2 = sock.clone();
        let a = std::thread::spawn(move || {
            let mut c: Consumer<HostConsumer> = Consumer::attach(&s2, HostOptions).unwrap();
            for _ in 0..2 {
                let b = c.recv().unwrap().unwrap();
                b.release().unwrap();
            }
        });
        producer
            .wait_for_consumers(1, Duration::from_secs(10))
            .unwrap();
        for _ in 0..2 {
            producer.acquire().unwrap().publish(8).unwrap();
        }
        a.join().unwrap();
        wait_until("A to leave", || producer.consumers() == 0);
        // Consumer B takes the same index, joining at batch 2.
        let s3 = sock.clone();
        let b = std::thread::spawn(move || {
            let mut c: Consumer<HostConsumer> = Consumer::attach(&s3, HostOptions).unwrap();
            let b = c.recv().unwrap().unwrap();
            assert_eq!(b.seq(), 2);
        });
        producer
            .wait_for_consumers(1, Duration::from_secs(10))
            .unwrap();
        // Batch 2 reuses slot 0, last held by A with batch 0: B must not be waited on.
        producer.acquire().unwrap().publish(8).unwrap();
        let last = *calls.lock().unwrap().last().unwrap();
        assert_eq!(
            last,
            (0, 0, 0),
            "{mode}: the producer waited on the new consumer for a batch it never had"
        );
        b.join().unwrap();
        drop(producer);
    }
}
