//! The look ahead a GPU backend uses to batch its stream operations: with a ready signal,
//! the producer may enqueue the next slot's finished waits; with a finished signal, the
//! consumer may enqueue the next batch's ready wait. The ring must name exactly the call it
//! would make next, and name nothing it cannot vouch for. Backends that record the calls
//! stand in for the CUDA backend, where a wrong wait stalls a stream.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pipeline_core::{
    BackendError, BackendKind, Consumer, ConsumerBackend, Export, HostConsumer, HostOptions,
    HostProducer, LagPolicy, Mode, Producer, ProducerBackend, ProducerConfig, RingLayout, ring,
};

/// What the producer's ring asked of its backend, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// `signal_ready_then_wait(slot, seq, next)`.
    Ready(u32, u64, Option<(u32, u64, u64)>),
    /// `wait_finished(slot, prev_seq, holders)`.
    Wait(u32, u64, u64),
    /// `wait_finished_all` with this many waits (its `wait_finished` calls follow).
    All(usize),
    /// `signal_ready(slot, seq)`: no look ahead asked for.
    Plain(u32, u64),
}

type Calls = Arc<Mutex<Vec<Call>>>;

/// The host backend, recording every ready signal (with its look ahead) and finished wait.
struct Looking {
    inner: HostProducer,
    calls: Calls,
}

impl ProducerBackend for Looking {
    type Options = Calls;
    type SlotMut<'a> = &'a mut [u8];
    const KIND: BackendKind = BackendKind::Host;

    fn create(layout: &RingLayout, calls: Calls) -> Result<Self, BackendError> {
        Ok(Self {
            inner: HostProducer::create(layout, HostOptions::default())?,
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
        self.calls
            .lock()
            .unwrap()
            .push(Call::Wait(slot, prev, holders));
        Ok(())
    }
    fn wait_finished_all(&self, waits: &[(u32, u64, u64)]) -> Result<(), BackendError> {
        self.calls.lock().unwrap().push(Call::All(waits.len()));
        for &(slot, prev, holders) in waits {
            self.wait_finished(slot, prev, holders)?;
        }
        Ok(())
    }
    unsafe fn slot_mut(&self, slot: u32) -> &mut [u8] {
        // SAFETY: forwarded under the same contract the ring upholds for us.
        unsafe { self.inner.slot_mut(slot) }
    }
    fn signal_ready(&self, slot: u32, seq: u64) -> Result<(), BackendError> {
        self.calls.lock().unwrap().push(Call::Plain(slot, seq));
        Ok(())
    }
    fn signal_ready_then_wait(
        &self,
        slot: u32,
        seq: u64,
        next: Option<(u32, u64, u64)>,
    ) -> Result<(), BackendError> {
        self.calls
            .lock()
            .unwrap()
            .push(Call::Ready(slot, seq, next));
        Ok(())
    }
    fn looks_ahead(&self) -> bool {
        true
    }
}

fn sock(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("gpipe-look-{}-{name}.sock", std::process::id()))
}

/// Every look ahead names the wait the ring makes next for that slot, with the same
/// arguments; one is made whenever the next slot is already free, and none when it is not.
#[test]
fn the_producer_looks_ahead_only_at_a_free_slot_and_names_the_wait_it_then_makes() {
    for (mode, slots) in [
        (Mode::Broadcast, 4),
        (Mode::Shared, 4),
        (Mode::Broadcast, 1),
    ] {
        let path = sock(&format!("p-{mode}-{slots}"));
        let calls = Calls::default();
        let config = ProducerConfig {
            slots,
            batch_bytes: 4096,
            mode,
            max_consumers: 2,
            ..Default::default()
        };
        let mut producer: Producer<Looking> = Producer::bind(&path, config, calls.clone()).unwrap();
        // One slot cannot take batch 12 while 11 is held.
        let hold = slots > 1;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let released = Arc::new(AtomicU64::new(0));
        let r2 = released.clone();
        let p2 = path.clone();
        // The consumer releases each batch at once, but holds batch 11 until told: batch 14
        // is then published while the slot of batch 15 still holds batch 11.
        let c = std::thread::spawn(move || {
            let mut c: Consumer<HostConsumer> =
                Consumer::attach(&p2, HostOptions::default()).unwrap();
            let mut n = 0;
            while let Some(b) = c.recv().unwrap() {
                if hold && b.seq() == 11 {
                    rx.recv_timeout(Duration::from_secs(10)).unwrap();
                }
                b.release().unwrap();
                r2.fetch_add(1, Ordering::SeqCst);
                n += 1;
            }
            n
        });
        producer
            .wait_for_consumers(1, Duration::from_secs(10))
            .unwrap();
        for seq in 0..24u64 {
            let released_all = |want: u64| {
                let end = std::time::Instant::now() + Duration::from_secs(10);
                while released.load(Ordering::SeqCst) < want {
                    assert!(std::time::Instant::now() < end, "consumer stalled");
                    std::thread::sleep(Duration::from_millis(1));
                }
            };
            if hold && seq == 15 {
                tx.send(()).unwrap();
                released_all(15);
            }
            let slot = producer.acquire().unwrap();
            slot.publish(8).unwrap();
            if !hold || !(11..15).contains(&seq) {
                // Let the consumer release before the next publish.
                released_all(seq + 1);
            }
        }
        producer.close();
        assert_eq!(c.join().unwrap(), 24);
        let calls = calls.lock().unwrap().clone();
        let mut looked = 0;
        for (i, call) in calls.iter().enumerate() {
            let Call::Ready(_, seq, next) = *call else {
                continue;
            };
            let Some((k, prev, holders)) = next else {
                continue;
            };
            looked += 1;
            assert!(slots > 1, "one slot: the next batch's previous is this one");
            assert_eq!(k, ring::slot_of(seq + 1, slots));
            assert_eq!(prev + u64::from(slots), seq + 1);
            if seq == 23 {
                // The last batch: the next is never acquired (a wait enqueued for a slot
                // already released passes; nothing else follows it).
                continue;
            }
            // The ring's next wait for slot `k` is the one the look ahead named.
            let later = calls[i + 1..]
                .iter()
                .find(|c| matches!(c, Call::Wait(s, ..) if *s == k));
            assert_eq!(
                later,
                Some(&Call::Wait(k, prev, holders)),
                "{mode}: look ahead at batch {seq}"
            );
            assert_ne!(holders, 0, "{mode}: batch {prev} had a holder");
        }
        if slots > 1 {
            // Batches 3..24 have a next batch with a previous one in its slot; all but batch
            // 14's was released when they were published.
            assert_eq!(looked, 24 - 3 - 1, "{mode}: {calls:?}");
            let r = calls.iter().find(|c| matches!(c, Call::Ready(_, 14, _)));
            assert!(
                matches!(r, Some(Call::Ready(_, _, None))),
                "{mode}: batch 14 was published with the next slot held: {r:?}"
            );
        } else {
            assert_eq!(looked, 0);
        }
    }
}

/// Runs a ring of `config` with one consumer that receives every batch in order and releases
/// it at once, publishes `batches`, closes, and returns the producer backend's calls.
fn run_releasing(name: &str, config: ProducerConfig, batches: u64) -> Vec<Call> {
    let path = sock(name);
    let calls = Calls::default();
    let mut producer: Producer<Looking> = Producer::bind(&path, config, calls.clone()).unwrap();
    let p2 = path.clone();
    let c = std::thread::spawn(move || {
        let mut c: Consumer<HostConsumer> = Consumer::attach(&p2, HostOptions::default()).unwrap();
        let mut n = 0u64;
        while let Some(b) = c.recv().unwrap() {
            assert_eq!(b.seq(), n);
            b.release().unwrap();
            n += 1;
        }
        n
    });
    producer
        .wait_for_consumers(1, Duration::from_secs(10))
        .unwrap();
    for _ in 0..batches {
        producer.acquire().unwrap().publish(8).unwrap();
    }
    producer.close();
    assert_eq!(c.join().unwrap(), batches);
    calls.lock().unwrap().clone()
}

/// Under a lead bound the ring orders each batch after two (the batch `max_lead` back and its
/// slot's previous one) in one `wait_finished_all`, and never looks ahead (the next batch's
/// earlier batch is the one just published).
#[test]
fn under_a_lead_bound_both_waits_go_in_one_call_and_nothing_is_looked_ahead() {
    let config = ProducerConfig {
        slots: 4,
        batch_bytes: 4096,
        max_lead: Some(2),
        ..Default::default()
    };
    let calls = run_releasing("lead", config, 12);
    for s in 2..12u64 {
        // The calls made for batch `s`: after batch s - 1's ready signal.
        let at = calls
            .iter()
            .position(|c| matches!(c, Call::Ready(_, r, _) if *r + 1 == s))
            .unwrap();
        let Call::Ready(_, _, next) = calls[at] else {
            unreachable!()
        };
        assert_eq!(next, None, "batch {s}: looked ahead under a lead bound");
        let mut want = vec![Call::Wait(ring::slot_of(s - 2, 4), s - 2, 1)];
        if s >= 4 {
            want.push(Call::Wait(ring::slot_of(s, 4), s - 4, 1));
        }
        let mut expect = vec![Call::All(want.len())];
        expect.extend(want);
        assert_eq!(
            calls[at + 1..at + 1 + expect.len()],
            expect[..],
            "batch {s}: {calls:?}"
        );
    }
}

/// Under the lag policy `detach-after` the ring asks for no look ahead: the backend's watch
/// of its waits must see each as the acquire makes it.
#[test]
fn under_detach_after_nothing_is_looked_ahead() {
    let config = ProducerConfig {
        slots: 4,
        batch_bytes: 4096,
        lag: LagPolicy::DetachAfter(Duration::from_secs(30)),
        ..Default::default()
    };
    let calls = run_releasing("detach-after", config, 10);
    let plain = calls
        .iter()
        .filter(|c| matches!(c, Call::Plain(..)))
        .count();
    assert_eq!(plain, 10, "{calls:?}");
    assert!(
        !calls.iter().any(|c| matches!(c, Call::Ready(..))),
        "{calls:?}"
    );
}

/// What the consumer's ring handed `signal_finished_then_wait`: (released seq, next).
type Releases = Arc<Mutex<Vec<(u64, Option<(u32, u64)>)>>>;

/// The host consumer, recording each release's look ahead.
struct Peeking {
    inner: HostConsumer,
    releases: Releases,
}

impl ConsumerBackend for Peeking {
    type Options = Releases;
    type BatchRef<'a> = &'a [u8];
    const KIND: BackendKind = BackendKind::Host;

    fn import(
        layout: &RingLayout,
        consumer: u32,
        releases: Releases,
        blob: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<(Self, Export), BackendError> {
        let (inner, export) =
            HostConsumer::import(layout, consumer, HostOptions::default(), blob, fds)?;
        Ok((Self { inner, releases }, export))
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
    fn signal_finished(&self, _: u32, _: u64) -> Result<(), BackendError> {
        panic!("a backend that looks ahead gets signal_finished_then_wait");
    }
    fn signal_finished_then_wait(
        &self,
        _slot: u32,
        seq: u64,
        next: Option<(u32, u64)>,
    ) -> Result<(), BackendError> {
        self.releases.lock().unwrap().push((seq, next));
        Ok(())
    }
    fn looks_ahead(&self) -> bool {
        true
    }
}

/// Broadcast: a release names the batch the consumer receives next, once it is published;
/// shared mode never names one (the next batch is whichever the consumer claims).
#[test]
fn the_consumer_looks_ahead_at_the_batch_it_receives_next_once_published() {
    for mode in [Mode::Broadcast, Mode::Shared] {
        let path = sock(&format!("c-{mode}"));
        let config = ProducerConfig {
            slots: 8,
            batch_bytes: 4096,
            mode,
            ..Default::default()
        };
        let mut producer: Producer<HostProducer> =
            Producer::bind(&path, config, HostOptions::default()).unwrap();
        let releases = Releases::default();
        let mut c: Consumer<Peeking> = {
            let p2 = path.clone();
            let r2 = releases.clone();
            let t = std::thread::spawn(move || Consumer::attach(&p2, r2).unwrap());
            producer
                .wait_for_consumers(1, Duration::from_secs(10))
                .unwrap();
            t.join().unwrap()
        };
        for _ in 0..5 {
            producer.acquire().unwrap().publish(8).unwrap();
        }
        let mut got = Vec::new();
        for _ in 0..5 {
            let b = c.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
            got.push(b.seq());
            b.release().unwrap();
        }
        // Two held at once, released newest first: each names batch 7, received next.
        producer.acquire().unwrap().publish(8).unwrap();
        producer.acquire().unwrap().publish(8).unwrap();
        producer.acquire().unwrap().publish(8).unwrap();
        let b5 = c.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        let b6 = c.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        b6.release().unwrap();
        b5.release().unwrap();
        let b7 = c.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        assert_eq!(b7.seq(), 7);
        b7.release().unwrap();
        let r = releases.lock().unwrap().clone();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        let expect: Vec<(u64, Option<(u32, u64)>)> = match mode {
            Mode::Broadcast => vec![
                (0, Some((1, 1))),
                (1, Some((2, 2))),
                (2, Some((3, 3))),
                (3, Some((4, 4))),
                (4, None),
                (6, Some((7, 7))),
                (5, Some((7, 7))),
                (7, None),
            ],
            Mode::Shared => [0, 1, 2, 3, 4, 6, 5, 7].map(|s| (s, None)).to_vec(),
        };
        assert_eq!(r, expect, "{mode}");
        drop(c);
        producer.close();
    }
}
