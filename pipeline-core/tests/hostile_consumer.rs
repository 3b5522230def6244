//! A consumer cannot change what another consumer reads, nor another consumer's state, through
//! the control segment (issue 36, point 2; docs/protocol.md, version 4; docs/security.md).
//!
//! The hostile consumer attaches with the real handshake and gets every fd a consumer gets. It
//! tries to write the control segment (descriptors, lengths, metadata, tensor tables, consumer
//! records) every way it can, scribbles on the one segment all consumers may write (claim
//! words and the producer's wake word), forges claims in an honest consumer's name, reopens
//! claims the honest consumer made, and claims to hold every slot in its own page. Meanwhile an
//! honest consumer receives and verifies every batch, and must never be detached or stalled.

mod support;

use std::collections::BTreeSet;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pipeline_core::layout::PROTOCOL_VERSION;
use pipeline_core::wire::Message;
use pipeline_core::{
    Consumer, Error, HostConsumer, HostOptions, HostProducer, LagPolicy, Mode, Producer,
    ProducerConfig, pattern, ring,
};
use rustix::fs::{Mode as FileMode, OFlags};
use rustix::mm::{MprotectFlags, ProtFlags};

const WAIT: Duration = Duration::from_secs(5);
const LEN: u64 = 64 << 10;

fn watchdog(limit: Duration) {
    support::watchdog("hostile_consumer", limit);
}

fn socket(name: &str) -> PathBuf {
    support::socket("hostile", name)
}

fn bind(name: &str, mode: Mode, lag: LagPolicy) -> (Producer<HostProducer>, PathBuf) {
    let sock = socket(name);
    let config = ProducerConfig {
        slots: 4,
        batch_bytes: LEN,
        mode,
        lag,
        keep_dumpable: true,
        ..Default::default()
    };
    (
        Producer::bind(&sock, config, HostOptions::default()).expect("bind the producer"),
        sock,
    )
}

/// The Welcome's fds, from a handshake done by hand (the control segment comes first).
fn welcome_fds(sock: &Path) -> (UnixStream, Vec<OwnedFd>) {
    let (conn, msg, fds) = support::hello(sock, PROTOCOL_VERSION);
    assert!(matches!(msg, Message::Welcome { .. }), "{}", msg.name());
    (conn, fds)
}

#[test]
fn no_way_of_writing_the_control_segment_is_allowed() {
    watchdog(Duration::from_secs(60));
    let (producer, sock) = bind("control", Mode::Broadcast, LagPolicy::Block);
    let (conn, fds) = welcome_fds(&sock);
    let fd = fds[0].as_fd();
    let len = 4096;
    let mut allowed = Vec::new();
    // write(): descriptors at 1024 + 256 k (seq, len at +8, metadata at +16 ...).
    for off in [0u64, 128, 1024, 1024 + 8, 1024 + 16] {
        match rustix::io::pwrite(fd, b"EVILEVIL", off) {
            Ok(_) => allowed.push(format!("pwrite at {off}")),
            Err(e) => assert_eq!(e, rustix::io::Errno::PERM, "pwrite at {off}"),
        }
    }
    // A writable shared mapping: EPERM.
    let rw = support::map_shared(fd, len, ProtFlags::READ | ProtFlags::WRITE);
    match rw {
        Ok(p) => {
            allowed.push("mmap(PROT_WRITE, MAP_SHARED)".into());
            // SAFETY: our own mapping of `len` bytes, unused after this.
            unsafe { rustix::mm::munmap(p, len).unwrap() };
        }
        Err(e) => assert_eq!(e, rustix::io::Errno::PERM, "mmap(PROT_WRITE)"),
    }
    // A read-only mapping made writable.
    let ro = support::map_shared(fd, len, ProtFlags::READ)
        .expect("a consumer maps the control segment read-only");
    // SAFETY: our own mapping of `len` bytes; nothing else refers to it.
    if unsafe { rustix::mm::mprotect(ro, len, MprotectFlags::READ | MprotectFlags::WRITE) }.is_ok()
    {
        allowed.push("mprotect(PROT_WRITE) of a read-only mapping".into());
    }
    // SAFETY: our mapping, no longer used.
    unsafe { rustix::mm::munmap(ro, len).unwrap() };
    // /proc/self/fd reopened read-write.
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    if let Ok(again) = rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, FileMode::empty()) {
        if rustix::io::pwrite(&again, b"EVILEVIL", 1024).is_ok() {
            allowed.push(format!("pwrite through {path} reopened read-write"));
        }
    }
    assert!(allowed.is_empty(), "the kernel allowed {allowed:#?}");
    drop((conn, fds));

    // An attached consumer's own mapping cannot be made writable either.
    let c: Consumer<HostConsumer> = Consumer::attach(&sock, HostOptions::default()).unwrap();
    let (base, _) = c.segment().as_raw();
    // SAFETY: changes only the protection of the consumer's mapping's first page; nothing
    // writes through it, and it is made read-only again if the call succeeded.
    let flipped = unsafe {
        rustix::mm::mprotect(
            base.cast(),
            4096,
            MprotectFlags::READ | MprotectFlags::WRITE,
        )
    };
    if flipped.is_ok() {
        // SAFETY: as above.
        unsafe { rustix::mm::mprotect(base.cast(), 4096, MprotectFlags::READ).unwrap() };
        panic!("mprotect(PROT_WRITE) of an attached consumer's control-segment mapping worked");
    }
    drop(c);
    producer.close();
}

/// Publishes batch after batch (each filled with its pattern) until `stop`, returning how many.
fn publish_until(producer: &mut Producer<HostProducer>, stop: &AtomicBool) -> u64 {
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        match producer.acquire_timeout(Duration::from_millis(50)) {
            Ok(mut slot) => {
                let seq = slot.seq();
                pattern::fill(&mut slot.memory()[..LEN as usize], seq);
                slot.publish_with_header(LEN, &[seq; 8]).unwrap();
                n += 1;
            }
            Err(Error::Timeout(_)) => {}
            Err(e) => panic!("producer: {e}"),
        }
    }
    n
}

/// A producer of `mode` and `lag` with two consumers attached: an honest one on its own thread
/// and the hostile one, for the test to drive.
struct Scene {
    producer: Producer<HostProducer>,
    honest: JoinHandle<Result<Vec<u64>, String>>,
    honest_index: u32,
    hostile: Consumer<HostConsumer>,
}

fn honest_and_hostile(name: &str, mode: Mode, lag: LagPolicy) -> Scene {
    let (producer, sock) = bind(name, mode, lag);
    let (tx, rx) = mpsc::channel();
    let s2 = sock.clone();
    let honest_thread = std::thread::spawn(move || honest(s2, tx));
    let honest_index = rx.recv_timeout(WAIT).unwrap();
    let hostile: Consumer<HostConsumer> = Consumer::attach(&sock, HostOptions::default()).unwrap();
    producer.wait_for_consumers(2, WAIT).unwrap();
    Scene {
        producer,
        honest: honest_thread,
        honest_index,
        hostile,
    }
}

/// The honest consumer: receives until the ring closes, checks every batch's data and
/// metadata, and returns the sequence numbers it got.
fn honest(sock: PathBuf, ready: mpsc::Sender<u32>) -> Result<Vec<u64>, String> {
    let mut c: Consumer<HostConsumer> =
        Consumer::attach(&sock, HostOptions::default()).map_err(|e| e.to_string())?;
    ready.send(c.index()).unwrap();
    let mut got = Vec::new();
    loop {
        match c.recv_timeout(Duration::from_secs(10)) {
            Ok(Some(b)) => {
                let seq = b.seq();
                if b.len() != LEN || b.header() != &[seq; 8] {
                    return Err(format!("batch {seq}: length or metadata changed"));
                }
                if pattern::checksum(b.data()) != pattern::expected_checksum(seq, LEN) {
                    return Err(format!("batch {seq}: data changed"));
                }
                got.push(seq);
            }
            Ok(None) => return Ok(got),
            Err(e) => return Err(format!("after {} batches: {e}", got.len())),
        }
    }
}

#[test]
fn broadcast_a_hostile_consumer_breaks_only_its_own_stream() {
    watchdog(Duration::from_secs(60));
    let Scene {
        mut producer,
        honest: h,
        honest_index,
        hostile,
    } = honest_and_hostile(
        "broadcast",
        Mode::Broadcast,
        LagPolicy::DetachAfter(Duration::from_millis(300)),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let n = hostile.layout().slot_count;
    let attack = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let end = Instant::now() + Duration::from_millis(1500);
            let mut pokes = 0u64;
            while Instant::now() < end {
                // Its own page: it holds every slot forever (only its own stream suffers:
                // the lag policy detaches it, and only it).
                for k in 0..n {
                    hostile
                        .page()
                        .slot(k)
                        .store(ring::holding(0), Ordering::SeqCst);
                }
                // The words every consumer may write: garbage claims, and wake-ups.
                for k in 0..n {
                    hostile
                        .claims()
                        .claim(k)
                        .store(u64::MAX - 7, Ordering::SeqCst);
                }
                hostile.claims().space_wake().fetch_add(1, Ordering::SeqCst);
                pokes += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
            stop.store(true, Ordering::Relaxed);
            (hostile, pokes)
        })
    };
    let published = publish_until(&mut producer, &stop);
    let (hostile, pokes) = attack.join().unwrap();
    assert!(pokes > 10);
    let stats = producer.close();
    let got = h
        .join()
        .unwrap()
        .expect("the honest consumer verifies every batch");
    assert_eq!(
        got,
        (0..published).collect::<Vec<_>>(),
        "every batch, once, in order"
    );
    assert!(published > 20, "the ring went on: {published} batches");
    assert_eq!(
        stats.detached, 1,
        "the hostile consumer, and only it, detached"
    );
    assert_ne!(hostile.index(), honest_index);
}

#[test]
fn shared_forged_and_reopened_claims_lose_repeat_and_detach_nothing() {
    watchdog(Duration::from_secs(60));
    // The lag limit is long enough that a loaded CI machine's scheduling alone never trips it.
    let Scene {
        mut producer,
        honest: h,
        honest_index: victim,
        hostile,
    } = honest_and_hostile(
        "shared",
        Mode::Shared,
        LagPolicy::DetachAfter(Duration::from_millis(1000)),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let n = hostile.layout().slot_count;
    let attack = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let seg = hostile.segment();
            let claims = hostile.claims();
            let end = Instant::now() + Duration::from_millis(1500);
            let (mut forged, mut reopened) = (0u64, 0u64);
            while Instant::now() < end {
                let head = seg.header().head.value.load(Ordering::Acquire);
                for s in ring::live_window(head, n) {
                    let w = claims.claim(ring::slot_of(s, n));
                    let now = w.load(Ordering::Acquire);
                    if now == ring::claim_word(s, None) {
                        // Claim it in the victim's name (the old attack froze the ring).
                        if w.compare_exchange(
                            now,
                            ring::claim_word(s, Some(victim)),
                            Ordering::AcqRel,
                            Ordering::Relaxed,
                        )
                        .is_ok()
                        {
                            forged += 1;
                        }
                    } else if ring::claim_owner(now) == Some(victim) && s % 3 == 0 {
                        // Clear the victim's claim (the old attack let its batch be rewritten
                        // while it held it).
                        w.store(ring::claim_word(s, None), Ordering::SeqCst);
                        reopened += 1;
                    }
                }
                hostile.claims().space_wake().fetch_add(1, Ordering::SeqCst);
            }
            stop.store(true, Ordering::Relaxed);
            (hostile, forged, reopened)
        })
    };
    let published = publish_until(&mut producer, &stop);
    let (hostile, forged, reopened) = attack.join().unwrap();
    // It leaves before the close, so that the close does not detach it for not draining.
    drop(hostile);
    let stats = producer.close();
    let got = h
        .join()
        .unwrap()
        .expect("the honest consumer verifies every batch and is never detached");
    assert!(forged > 0, "no claim was forged");
    let distinct: BTreeSet<u64> = got.iter().copied().collect();
    assert_eq!(
        distinct,
        (0..published).collect::<BTreeSet<_>>(),
        "every batch reached the honest consumer ({forged} forged, {reopened} reopened)"
    );
    assert_eq!(
        got.len(),
        distinct.len(),
        "no batch twice: a reopened claim word never hands a consumer a batch it released \
         ({reopened} reopened)"
    );
    assert!(published > 20, "the ring went on: {published} batches");
    assert_eq!(stats.detached, 0, "nobody was detached: {stats:?}");
}

#[test]
fn an_old_peer_is_refused_naming_both_versions() {
    let (producer, sock) = bind("old", Mode::Broadcast, LagPolicy::Block);
    let (_conn, msg, _) = support::hello(&sock, 3);
    let Message::Reject { reason } = msg else {
        panic!("expected a Reject, got {}", msg.name());
    };
    assert!(
        reason.contains('3') && reason.contains(&PROTOCOL_VERSION.to_string()),
        "{reason}"
    );
    producer.close();
}

/// A process that can reach a consumer's fds (one of its uid, through `/proc/<pid>/fd`) can
/// write that consumer's page: release in its name the batch it holds and the ones it has not
/// received. Only that consumer's stream breaks, and it says so, instead of blaming the
/// producer for overwriting batches it had not released.
#[test]
fn a_consumer_whose_page_was_written_by_another_process_says_so() {
    watchdog(Duration::from_secs(30));
    let (mut producer, sock) = bind("page", Mode::Broadcast, LagPolicy::Block);
    let mut c: Consumer<HostConsumer> = Consumer::attach(&sock, HostOptions::default()).unwrap();
    producer.wait_for_consumers(1, WAIT).unwrap();
    let n = c.layout().slot_count as u64;
    let mut publish = |count: u64| {
        for _ in 0..count {
            let mut slot = producer.acquire_timeout(WAIT).expect("a free slot");
            let seq = slot.seq();
            pattern::fill(&mut slot.memory()[..LEN as usize], seq);
            slot.publish_with_header(LEN, &[seq; 8]).unwrap();
        }
    };
    publish(n);
    let held = c.recv_timeout(WAIT).unwrap().expect("batch 0");
    assert_eq!(held.seq(), 0);
    // The forger: every slot's batch released in the consumer's name, the held one included.
    for s in 0..n {
        c.page()
            .slot(ring::slot_of(s, n as u32))
            .store(ring::released(s), Ordering::SeqCst);
    }
    publish(n);
    let err = c
        .recv_timeout(WAIT)
        .expect_err("batches it had not released were overwritten")
        .to_string();
    assert!(
        err.contains("another process wrote our page") && err.contains("batch 0 (slot 0)"),
        "{err}"
    );
    drop(held);
    drop(c);
    producer.close();
}
