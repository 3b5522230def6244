//! The host consumer's `on_map` hook (what gpipe-py's `pin_memory` page-locks with): it is
//! given the memory batches are read from, in place and mirrored; its guard lives while a
//! batch does, even after the consumer is dropped, and goes before that memory is unmapped;
//! it runs after the handshake, so a slow one is not cut off by the producer's handshake
//! timeout; a hook's error fails the attach with its message.

use std::sync::Mutex;
use std::time::Duration;

use pipeline_core::{
    Consumer, Delivery, HostConsumer, HostOptions, HostProducer, MapGuard, Producer, ProducerConfig,
};

#[allow(dead_code)] // the socket path and the watchdog only
mod support;

const WAIT: Duration = Duration::from_secs(5);

/// What the hook saw, per test (by the first byte of the memory it was given): the length it
/// was given, and whether its guard is still alive. Tests run on threads of one process.
static SEEN: Mutex<Vec<(usize, usize, bool)>> = Mutex::new(Vec::new());

struct Guard(usize);

impl Drop for Guard {
    fn drop(&mut self) {
        // The memory is still mapped: its first byte can be read.
        // SAFETY: `self.0` is the first byte of a mapping that is unmapped only after this
        // guard is dropped (what the test checks); reading one byte of it is sound then.
        let _ = unsafe { std::ptr::read_volatile(self.0 as *const u8) };
        // the latest record of this address: an earlier mapping may have been there too
        if let Some(s) = SEEN
            .lock()
            .unwrap()
            .iter_mut()
            .rev()
            .find(|s| s.0 == self.0)
        {
            s.2 = false;
        }
    }
}

fn record(ptr: *const u8, len: usize) -> Result<MapGuard, String> {
    SEEN.lock().unwrap().push((ptr as usize, len, true));
    Ok(Box::new(Guard(ptr as usize)))
}

fn refuse(_: *const u8, _: usize) -> Result<MapGuard, String> {
    Err("refused by the test's hook".into())
}

fn alive(ptr: usize) -> Option<(usize, bool)> {
    // the latest record of this address, as the guard's drop marks it
    let seen = SEEN.lock().unwrap();
    seen.iter().rev().find(|s| s.0 == ptr).map(|s| (s.1, s.2))
}

/// Longer than the producer's handshake timeout in `slow_hook_attaches`.
const SLOW_HOOK: Duration = Duration::from_secs(3);

fn slow(ptr: *const u8, len: usize) -> Result<MapGuard, String> {
    // as a page-lock of a large ring on a busy machine can
    std::thread::sleep(SLOW_HOOK);
    record(ptr, len)
}

fn bind(name: &str) -> (Producer<HostProducer>, std::path::PathBuf) {
    bind_with(name, ProducerConfig::default().handshake_timeout)
}

fn bind_with(
    name: &str,
    handshake_timeout: Duration,
) -> (Producer<HostProducer>, std::path::PathBuf) {
    support::watchdog("on_map", Duration::from_secs(60));
    let sock = support::socket("on-map", name);
    let config = ProducerConfig {
        slots: 3,
        batch_bytes: 1 << 20,
        handshake_timeout,
        ..Default::default()
    };
    let producer = Producer::bind(&sock, config, HostOptions::default()).unwrap();
    (producer, sock)
}

fn publish(producer: &mut Producer<HostProducer>, byte: u8) {
    let mut slot = producer.acquire_timeout(WAIT).expect("a free slot");
    slot.memory()[..4096].fill(byte);
    slot.publish(4096).unwrap();
}

#[test]
fn the_hook_gets_the_memory_batches_are_read_from_and_its_guard_outlives_them() {
    for delivery in [Delivery::InPlace, Delivery::Mirror] {
        let (mut producer, sock) = bind(&format!("{delivery:?}"));
        let options = HostOptions {
            delivery,
            on_map: Some(record),
            ..HostOptions::default()
        };
        let mut consumer: Consumer<HostConsumer> = Consumer::attach(&sock, options).unwrap();
        publish(&mut producer, 7);
        let batch = consumer.recv_timeout(WAIT).unwrap().expect("a batch");
        let data: &[u8] = batch.data();
        assert!(data.iter().all(|&b| b == 7));
        let at = data.as_ptr() as usize;
        // The batch lies in the memory the hook was given.
        let (first, len, _) = *SEEN
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|s| s.0 <= at && at < s.0 + s.1)
            .unwrap_or_else(|| panic!("{delivery:?}: the hook never saw the batch's memory"));
        assert!(at + data.len() <= first + len);
        assert!(
            len >= 3 << 20,
            "{delivery:?}: the hook got {len} bytes, less than three slots"
        );
        drop(consumer);
        assert_eq!(
            alive(first),
            Some((len, true)),
            "{delivery:?}: a held batch keeps the guard"
        );
        drop(batch);
        assert_eq!(
            alive(first),
            Some((len, false)),
            "{delivery:?}: the last batch drops it"
        );
        drop(producer);
        let _ = std::fs::remove_file(&sock);
    }
}

#[test]
fn a_hook_that_fails_fails_the_attach_with_its_message() {
    let (producer, sock) = bind("refuse");
    let options = HostOptions {
        on_map: Some(refuse),
        ..HostOptions::default()
    };
    match Consumer::<HostConsumer>::attach(&sock, options) {
        Err(e) => assert!(e.to_string().contains("refused by the test's hook"), "{e}"),
        Ok(_) => panic!("the attach succeeded"),
    }
    drop(producer);
    let _ = std::fs::remove_file(&sock);
}

#[test]
fn a_hook_slower_than_the_producers_handshake_timeout_still_attaches() {
    let (mut producer, sock) = bind_with("slow", SLOW_HOOK / 3);
    let options = HostOptions {
        on_map: Some(slow),
        ..HostOptions::default()
    };
    let mut consumer: Consumer<HostConsumer> = Consumer::attach(&sock, options)
        .expect("the hook runs after the handshake: the producer's deadline does not bound it");
    publish(&mut producer, 9);
    let batch = consumer.recv_timeout(WAIT).unwrap().expect("a batch");
    assert!(batch.data().iter().all(|&b| b == 9));
    let (first, _, alive_now) = *SEEN
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|s| {
            s.0 <= batch.data().as_ptr() as usize && (batch.data().as_ptr() as usize) < s.0 + s.1
        })
        .expect("the hook saw the batch's memory");
    assert!(alive_now, "the guard lives while the consumer does");
    drop(batch);
    drop(consumer);
    assert_eq!(
        alive(first).map(|a| a.1),
        Some(false),
        "the guard went with the consumer"
    );
    drop(producer);
    let _ = std::fs::remove_file(&sock);
}
