//! Chunked forwarding on the host backend (issue #34): a forwarder copies a batch chunk by
//! chunk as its upstream writer's progress board says each chunk landed, and still publishes
//! only whole batches, so a batch whose upstream died mid-batch never reaches a consumer.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{
    Consumer, ConsumerConfig, HostConsumer, HostOptions, HostProducer, PendingAttach, Producer,
    ProducerConfig,
};
use pipeline_relay::chunks::{Board, progress};
use pipeline_relay::{ForwardOptions, run_forwarder};

const SLOT: u64 = 2 << 20;
const CHUNK: u64 = 512 << 10;
const SLOTS: u32 = 4;

/// Runs `body` on a thread of its own; fails the test if it takes longer than `secs`.
fn watchdog(secs: u64, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        body();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => t.join().unwrap(),
        Err(_) if t.is_finished() => {
            if let Err(e) = t.join() {
                std::panic::resume_unwind(e);
            }
        }
        Err(_) => panic!("the test did not end within {secs} s"),
    }
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Batch `seq`'s bytes: every byte says which batch it belongs to.
/// The first ring of a test: SLOTS slots of SLOT bytes, for one consumer (a forwarder).
fn upstream(sock: &Path) -> Producer<HostProducer> {
    let config = ProducerConfig {
        slots: SLOTS,
        batch_bytes: SLOT,
        max_consumers: 1,
        ..ProducerConfig::default()
    };
    Producer::bind(sock, config, HostOptions::default()).unwrap()
}

fn byte_of(seq: u64) -> u8 {
    (seq as u8).wrapping_mul(37).wrapping_add(1)
}

/// Writes chunks `from..to` of batch `seq` into `slot` and the progress after each, as an
/// upstream forwarder that chunks would.
fn write_chunks(mem: &mut [u8], board: &Board, k: u32, seq: u64, from: u32, to: u32) {
    for c in from..to {
        let (a, b) = (
            (c as u64 * CHUNK) as usize,
            ((c as u64 + 1) * CHUNK) as usize,
        );
        mem[a..b].fill(byte_of(seq));
        board.store(k, progress(seq, c + 1));
    }
}

fn connectable(p: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(p).is_ok()
}

/// The upstream ring's writer (playing a forwarder that chunks) publishes batch 0 whole, then
/// writes half of batch 1 and dies. The chunked forwarder copies batch 1's landed chunks
/// ahead (its own board shows them), yet its consumer gets batch 0, intact, and then the
/// producer's death: never batch 1.
#[test]
fn an_upstream_that_dies_mid_batch_never_gets_that_batch_published_downstream() {
    watchdog(60, || {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
        let mut up = upstream(&a);
        // The board of a ring of the ring's own shape (its slots as the ring rounded them).
        assert_eq!(up.layout().slot_bytes, SLOT);
        let up_board = Board::create(&a, SLOTS, SLOT, CHUNK).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (a2, b2, s2) = (a.clone(), b.clone(), stop.clone());
        let fwd = std::thread::spawn(move || {
            let opts = ForwardOptions {
                wait_for_consumers: 1,
                chunk_bytes: Some(CHUNK),
                ..ForwardOptions::default()
            };
            run_forwarder(
                &a2,
                &b2,
                ProducerConfig {
                    slots: SLOTS,
                    ..ProducerConfig::default()
                },
                &opts,
                &s2,
            )
        });
        until("the forwarded ring", || connectable(&b));
        let mut down: Consumer<HostConsumer> =
            PendingAttach::connect(&b, ConsumerConfig::default())
                .unwrap()
                .finish(HostOptions::default())
                .unwrap();
        until("the forwarder to attach upstream", || up.consumers() == 1);
        let layout = down.layout();
        let down_board = Board::open(&b, layout.slot_count, layout.slot_bytes)
            .expect("the forwarder's own board");

        // Batch 0, whole.
        let mut slot = up.acquire().unwrap();
        let k0 = slot.index();
        up_board.store(k0, progress(0, 0));
        write_chunks(slot.memory(), &up_board, k0, 0, 0, 4);
        slot.publish(SLOT).unwrap();
        let batch = down
            .recv_timeout(Duration::from_secs(10))
            .unwrap()
            .expect("batch 0");
        assert_eq!(batch.seq(), 0);
        assert!(
            batch.data().iter().all(|&x| x == byte_of(0)),
            "batch 0 arrived intact"
        );
        drop(batch);

        // Batch 1: begun, two of its four chunks landed, then the writer dies.
        let mut slot = up.acquire().unwrap();
        let k1 = slot.index();
        up_board.store(k1, progress(1, 0));
        write_chunks(slot.memory(), &up_board, k1, 1, 0, 2);
        // The forwarder copies what landed before the batch is published...
        until("the forwarder's copy of the first two chunks", || {
            down_board.load(1) >= progress(1, 2)
        });
        assert!(
            down_board.load(1) < progress(1, 4),
            "it copied chunks that never landed"
        );
        // The writer dies with batch 1 unpublished (the slot is never published).
        let _ = slot;
        up.abandon();

        // ...and never publishes it: its consumer sees the producer die.
        let t0 = Instant::now();
        loop {
            match down.recv_timeout(Duration::from_millis(100)) {
                Ok(Some(b)) => panic!("batch {} was published downstream", b.seq()),
                Ok(None) => panic!("a clean end downstream hides the batch that never came"),
                Err(pipeline_core::Error::Timeout(_)) => {
                    assert!(t0.elapsed() < Duration::from_secs(10), "no end downstream");
                }
                Err(e) => {
                    assert!(matches!(e, pipeline_core::Error::ProducerDied), "{e}");
                    break;
                }
            }
        }
        let r = fwd.join().unwrap();
        let e = r.expect_err("the forwarder ends with an error");
        assert!(e.to_string().contains("upstream"), "{e}");
        drop(up_board);
    });
}

/// Three chunked forwarders in a chain (A → B → C → D), each copying ahead from the one
/// before: the far consumer gets every batch, whole and in order, and the later hops copied
/// batches ahead (the chunk progress was used, not only written).
#[test]
fn a_chain_of_chunked_forwarders_hands_over_every_batch_whole() {
    watchdog(120, || {
        let dir = tempfile::tempdir().unwrap();
        let socks: Vec<_> = ["a", "b", "c", "d"]
            .iter()
            .map(|n| dir.path().join(format!("{n}.sock")))
            .collect();
        let mut up = upstream(&socks[0]);
        let stop = Arc::new(AtomicBool::new(false));
        let mut fwds = Vec::new();
        for h in 0..3 {
            let (from, to, s) = (socks[h].clone(), socks[h + 1].clone(), stop.clone());
            fwds.push(std::thread::spawn(move || {
                let opts = ForwardOptions {
                    wait_for_consumers: 1,
                    chunk_bytes: Some(CHUNK),
                    ..ForwardOptions::default()
                };
                run_forwarder(
                    &from,
                    &to,
                    ProducerConfig {
                        slots: SLOTS,
                        ..ProducerConfig::default()
                    },
                    &opts,
                    &s,
                )
            }));
            until("the next ring", || connectable(&socks[h + 1]));
        }
        let mut far: Consumer<HostConsumer> =
            PendingAttach::connect(&socks[3], ConsumerConfig::default())
                .unwrap()
                .finish(HostOptions::default())
                .unwrap();
        until("the first forwarder", || up.consumers() == 1);
        const N: u64 = 400;
        let reader = std::thread::spawn(move || {
            let mut seqs = Vec::new();
            while let Some(b) = far.recv_timeout(Duration::from_secs(20)).unwrap() {
                let want = byte_of(b.seq());
                assert!(
                    b.data().iter().all(|&x| x == want),
                    "batch {} is not whole",
                    b.seq()
                );
                seqs.push(b.seq());
            }
            seqs
        });
        for seq in 0..N {
            let mut slot = up.acquire().unwrap();
            slot.memory().fill(byte_of(seq));
            slot.publish(SLOT).unwrap();
        }
        up.flush(Duration::from_secs(30)).unwrap();
        up.close();
        let seqs = reader.join().unwrap();
        assert_eq!(seqs, (0..N).collect::<Vec<_>>());
        let reports: Vec<_> = fwds
            .into_iter()
            .map(|f| f.join().unwrap().unwrap())
            .collect();
        for r in &reports {
            assert_eq!(r.batches, N);
        }
        assert_eq!(
            reports[0].copied_ahead, 0,
            "ring A has no board: whole batches"
        );
        assert!(
            reports[1].copied_ahead + reports[2].copied_ahead > 0,
            "no batch was copied ahead: {reports:?}"
        );
        stop.store(true, Ordering::Relaxed);
    });
}
