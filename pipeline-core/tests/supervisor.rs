//! The producer's supervisor thread must stay responsive whatever an attached peer sends:
//! a peer that trickles bytes after attaching cannot delay other consumers' handling.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use pipeline_core::wire::{self, Message, Role};
use pipeline_core::{HostOptions, HostProducer, Producer, ProducerConfig};

/// Connects and says Hello as a consumer; returns once the Welcome (an index) came.
fn hello_to_welcome(sock: &std::path::Path) -> UnixStream {
    let s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Message::Hello {
        version: pipeline_core::layout::PROTOCOL_VERSION,
        role: Role::Consumer,
        backend: 0,
    };
    wire::send(&s, &hello, &[]).unwrap();
    let (welcome, _fds) = wire::recv(&s).unwrap();
    assert!(matches!(welcome, Message::Welcome { .. }));
    s
}

fn raw_attach(sock: &std::path::Path) -> UnixStream {
    let s = hello_to_welcome(sock);
    let ready = Message::Ready {
        fd_count: 0,
        blob: Vec::new(),
    };
    wire::send(&s, &ready, &[]).unwrap();
    let (joined, _) = wire::recv(&s).unwrap();
    assert!(matches!(joined, Message::Joined { .. }));
    s
}

#[test]
fn a_trickling_peer_does_not_hold_up_the_supervisor() {
    let sock = std::env::temp_dir().join(format!("gpipe-trickle-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots: 2,
        batch_bytes: 4096,
        ..Default::default()
    };
    let producer: Producer<HostProducer> =
        Producer::bind(&sock, config, HostOptions::default()).unwrap();
    let mut trickler = raw_attach(&sock);
    let victim = raw_attach(&sock);
    producer
        .wait_for_consumers(2, Duration::from_secs(5))
        .unwrap();
    // The trickler sends the first bytes of a frame, one at a time.
    trickler.write_all(b"GP").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    trickler.write_all(b"W").unwrap();
    // The other consumer dies: the producer must notice at once.
    let t = Instant::now();
    drop(victim);
    while producer.consumers() != 1 {
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "the death went unnoticed for {:?}",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // Finishing the frame with anything but Goodbye detaches the trickler.
    trickler
        .write_all(b"1\x01\x00\x00\x00\x00\x00\x00\x00")
        .unwrap();
    let t = Instant::now();
    while producer.consumers() != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the garbage was not acted on"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(producer.stats().detached, 1);
    assert_eq!(producer.stats().died, 1);
}

fn reject_reason(s: &UnixStream) -> String {
    match wire::recv(s) {
        Ok((Message::Reject { reason }, _)) => reason,
        other => panic!("expected a Reject, got {other:?}"),
    }
}

/// `close` does not wait out the handshake timeout for peers that stall mid-handshake, and
/// tells them why they were refused; no handshake thread outlives it.
#[test]
fn close_cuts_stalled_handshakes_short() {
    let sock = std::env::temp_dir().join(format!("gpipe-stall-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots: 2,
        batch_bytes: 4096,
        handshake_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let producer: Producer<HostProducer> =
        Producer::bind(&sock, config, HostOptions::default()).unwrap();
    // One peer connects and says nothing.
    let silent = UnixStream::connect(&sock).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    // Another holds an index: Hello, Welcome, then no Ready.
    let stalled = hello_to_welcome(&sock);
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    let stats = producer.close();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "close waited {:?} for stalled handshakes",
        t.elapsed()
    );
    assert_eq!(stats.refused, 2, "{stats:?}");
    assert_eq!(stats.attached, 0, "{stats:?}");
    for (name, peer) in [("silent", &silent), ("stalled", &stalled)] {
        let reason = reject_reason(peer);
        assert!(reason.contains("shut down"), "{name}: {reason}");
    }
}
