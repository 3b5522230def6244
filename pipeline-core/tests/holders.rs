//! Which consumers the producer orders its next write of a slot after (`wait_finished`'s
//! `holders`). A backend that records the calls stands in for the CUDA backend, where waiting
//! on the wrong consumer's `finished` signal deadlocks the GPU streams.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pipeline_core::{
    BackendError, BackendKind, Consumer, ConsumerBackend, Export, HostConsumer, HostOptions,
    HostProducer, Mode, Producer, ProducerBackend, ProducerConfig, RingLayout, ring,
};
use std::sync::atomic::{AtomicUsize, Ordering};

type Calls = Arc<Mutex<Vec<(u32, u64, u64)>>>;
/// The consumer the test says the backend has waited on too long.
type Overdue = Arc<Mutex<Option<u32>>>;

/// The host backend, recording every `wait_finished(slot, prev_seq, holders)` and reporting
/// whatever consumer the test says is overdue.
struct Recording {
    inner: HostProducer,
    calls: Calls,
    overdue: Overdue,
}

impl ProducerBackend for Recording {
    type Options = (Calls, Overdue);
    type SlotMut<'a> = &'a mut [u8];
    const KIND: BackendKind = BackendKind::Host;

    fn create(layout: &RingLayout, (calls, overdue): Self::Options) -> Result<Self, BackendError> {
        Ok(Self {
            inner: HostProducer::create(layout, HostOptions::default())?,
            calls,
            overdue,
        })
    }
    fn export(&self, c: u32) -> Result<Export, BackendError> {
        self.inner.export(c)
    }
    fn attach(&self, c: u32, reply: &[u8], fds: Vec<OwnedFd>) -> Result<(), BackendError> {
        self.inner.attach(c, reply, fds)
    }
    fn detach(&self, c: u32, died: bool) {
        // As the CUDA backend: a departed consumer's waits pass.
        let mut o = self.overdue.lock().unwrap();
        if *o == Some(c) {
            *o = None;
        }
        self.inner.detach(c, died)
    }
    fn wait_finished(&self, slot: u32, prev: u64, holders: u64) -> Result<(), BackendError> {
        self.calls.lock().unwrap().push((slot, prev, holders));
        Ok(())
    }
    fn overdue(&self, _limit: Duration) -> Option<u32> {
        *self.overdue.lock().unwrap()
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
            Producer::bind(&sock, config, (calls.clone(), Overdue::default())).unwrap();
        // Consumer A (index 0) takes batches 0 and 1, then leaves.
        let s2 = sock.clone();
        let a = std::thread::spawn(move || {
            let mut c: Consumer<HostConsumer> =
                Consumer::attach(&s2, HostOptions::default()).unwrap();
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
            let mut c: Consumer<HostConsumer> =
                Consumer::attach(&s3, HostOptions::default()).unwrap();
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

/// A shared-mode ring of two slots on a recording backend, with batches 0 and 1 published
/// before anyone attached.
fn shared_ring_with_two_early_batches(
    name: &str,
) -> (Producer<Recording>, Calls, std::path::PathBuf) {
    let sock =
        std::env::temp_dir().join(format!("gpipe-holders-{name}-{}.sock", std::process::id()));
    let calls = Calls::default();
    let config = ProducerConfig {
        slots: 2,
        batch_bytes: 4096,
        mode: Mode::Shared,
        max_consumers: 2,
        ..Default::default()
    };
    let mut producer: Producer<Recording> =
        Producer::bind(&sock, config, (calls.clone(), Overdue::default())).unwrap();
    for _ in 0..2 {
        producer.acquire().unwrap().publish(8).unwrap();
    }
    (producer, calls, sock)
}

#[test]
fn a_shared_consumer_is_a_holder_of_batches_published_before_it_joined() {
    // Shared mode hands out whatever is published and unclaimed, including batches from
    // before a consumer joined. Its GPU work on such a batch must still finish before the
    // producer refills the slot (on CUDA, skipping this wait let the refill overwrite data the
    // consumer's kernels had yet to read: found on an H100, 2026-11-21).
    let (mut producer, calls, sock) = shared_ring_with_two_early_batches("early");
    let (got_tx, got_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let s2 = sock.clone();
    let c = std::thread::spawn(move || {
        let mut c: Consumer<HostConsumer> = Consumer::attach(&s2, HostOptions::default()).unwrap();
        let mut seqs = Vec::new();
        for _ in 0..2 {
            let b = c.recv().unwrap().unwrap();
            seqs.push(b.seq());
            b.release().unwrap();
        }
        got_tx.send((c.index(), seqs)).unwrap();
        // Stay attached until the producer has chosen whom to wait for.
        let _ = done_rx.recv_timeout(Duration::from_secs(10));
    });
    let (index, mut seqs) = got_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    seqs.sort_unstable();
    assert_eq!(
        seqs,
        [0, 1],
        "it joined at 2 and may claim both earlier batches"
    );
    // Refill both slots: each refill must wait for the consumer.
    for _ in 0..2 {
        producer.acquire().unwrap().publish(8).unwrap();
    }
    let calls = calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        [(0, 0, 1 << index), (1, 1, 1 << index)],
        "the producer must wait for the consumer that had each batch"
    );
    done_tx.send(()).unwrap();
    c.join().unwrap();
    drop(producer);
}

/// The host consumer, counting `complete_now` calls.
struct Completing {
    inner: HostConsumer,
    completions: Arc<AtomicUsize>,
}

impl ConsumerBackend for Completing {
    type Options = Arc<AtomicUsize>;
    type BatchRef<'a> = &'a [u8];
    const KIND: BackendKind = BackendKind::Host;

    fn import(
        layout: &RingLayout,
        consumer: u32,
        completions: Arc<AtomicUsize>,
        blob: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<(Self, Export), BackendError> {
        let (inner, export) =
            HostConsumer::import(layout, consumer, HostOptions::default(), blob, fds)?;
        Ok((Self { inner, completions }, export))
    }
    fn joined(&self) -> Result<(), BackendError> {
        self.inner.joined()
    }
    fn wait_ready(&self, slot: u32, seq: u64) -> Result<(), BackendError> {
        self.inner.wait_ready(slot, seq)
    }
    unsafe fn batch_ref(&self, slot: u32, seq: u64, len: u64) -> &[u8] {
        // SAFETY: forwarded under the same contract the ring upholds for us.
        unsafe { self.inner.batch_ref(slot, seq, len) }
    }
    fn signal_finished(&self, slot: u32, seq: u64) -> Result<(), BackendError> {
        self.inner.signal_finished(slot, seq)
    }
    fn complete_now(&self) -> Result<(), BackendError> {
        self.completions.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn a_claim_made_in_a_consumers_name_is_taken_by_it_and_waited_for() {
    // A peer writes batch 0's claim word in this consumer's name (the claim word is the one
    // thing every consumer may write). The producer does not believe it, since the consumer's
    // page does not back it; the consumer, seeing its own name, takes the batch as its own and
    // records that in its page, and from then on the producer waits for its work as for any
    // claim. Nothing needs completing on the host: every claim is recorded.
    let (mut producer, calls, sock) = shared_ring_with_two_early_batches("late");
    let completions = Arc::new(AtomicUsize::new(0));
    let (got_tx, got_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (s2, done2) = (sock.clone(), completions.clone());
    let c = std::thread::spawn(move || {
        let mut c: Consumer<Completing> = Consumer::attach(&s2, done2.clone()).unwrap();
        let forged = ring::claim_word(0, Some(c.index()));
        c.claims().claim(0).store(forged, Ordering::SeqCst);
        let mut seen = Vec::new();
        for _ in 0..2 {
            let b = c.recv().unwrap().unwrap();
            let seq = b.seq();
            b.release().unwrap();
            seen.push((seq, done2.load(Ordering::SeqCst)));
        }
        assert_eq!(c.page().slot(0).load(Ordering::SeqCst), ring::released(0));
        got_tx.send((c.index(), seen)).unwrap();
        let _ = done_rx.recv_timeout(Duration::from_secs(10));
    });
    let (index, seen) = got_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(
        seen,
        [(0, 0), (1, 0)],
        "both batches delivered, nothing to complete"
    );
    for _ in 0..2 {
        producer.acquire().unwrap().publish(8).unwrap();
    }
    assert_eq!(
        calls.lock().unwrap().clone(),
        [(0, 0, 1 << index), (1, 1, 1 << index)],
        "the producer waits for the adopted claim as for any other"
    );
    done_tx.send(()).unwrap();
    c.join().unwrap();
    drop(producer);
}

#[test]
fn a_consumer_whose_work_the_backend_waits_on_too_long_is_detached_under_detach_after() {
    for lag in [
        pipeline_core::LagPolicy::Block,
        pipeline_core::LagPolicy::DetachAfter(Duration::from_millis(100)),
    ] {
        let sock = std::env::temp_dir().join(format!(
            "gpipe-holders-overdue-{}-{}.sock",
            std::process::id(),
            lag == pipeline_core::LagPolicy::Block
        ));
        let overdue = Arc::new(Mutex::new(None));
        let config = ProducerConfig {
            slots: 2,
            batch_bytes: 4096,
            mode: Mode::Shared,
            max_consumers: 2,
            lag,
            ..Default::default()
        };
        let mut producer: Producer<Recording> =
            Producer::bind(&sock, config, (Calls::default(), overdue.clone())).unwrap();
        let mut c: Consumer<HostConsumer> =
            Consumer::attach(&sock, HostOptions::default()).unwrap();
        producer
            .wait_for_consumers(1, Duration::from_secs(10))
            .unwrap();
        // The backend now reports that the consumer's work on a batch is long overdue.
        *overdue.lock().unwrap() = Some(c.index());
        if lag == pipeline_core::LagPolicy::Block {
            // Blocking is the user's choice: the supervisor does not even ask. Give it many
            // of its ticks to (wrongly) act.
            std::thread::sleep(Duration::from_millis(300));
            assert_eq!(producer.stats().detached, 0, "detached under Block");
            assert_eq!(producer.consumers(), 1);
        } else {
            wait_until("the overdue consumer to be detached", || {
                producer.stats().detached == 1
            });
            assert_eq!(producer.consumers(), 0);
            assert!(overdue.lock().unwrap().is_none(), "the backend was told");
            // With a batch ready it never waits, yet it learns at once, and takes nothing.
            let seq = producer.acquire().unwrap().publish(8).unwrap();
            match c.recv() {
                Err(pipeline_core::Error::Detached(_)) => {}
                Err(e) => panic!("expected Detached, got {e}"),
                Ok(b) => panic!("a detached consumer received {:?}", b.map(|b| b.seq())),
            }
            let k = ring::slot_of(seq, 2);
            assert_eq!(
                c.claims().claim(k).load(Ordering::SeqCst),
                ring::claim_word(seq, None),
                "the batch stays for the others"
            );
        }
        drop(c);
        drop(producer);
    }
}
