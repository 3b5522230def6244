//! Shared mode: claims racing publishes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pipeline_core::{
    Consumer, Error, HostConsumer, HostOptions, HostProducer, Mode, Producer, ProducerConfig,
};

fn bind(name: &str, slots: u32) -> (Producer<HostProducer>, std::path::PathBuf) {
    let sock = std::env::temp_dir().join(format!("gpipe-{name}-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots,
        batch_bytes: 4096,
        mode: Mode::Shared,
        ..Default::default()
    };
    (
        Producer::bind(&sock, config, HostOptions::default()).unwrap(),
        sock,
    )
}

/// A scan from the window start can claim the batch being published before the head moves
/// (the producer marks it claimable first). That is a valid claim, not a corrupted segment.
#[test]
fn whole_window_scans_racing_publishes_see_no_corruption() {
    let (mut producer, sock) = bind("wide", 4);
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let received = Arc::new(AtomicU64::new(0));
    let consumers: Vec<_> = (0..2)
        .map(|i| {
            let (sock, stop, errors, received) =
                (sock.clone(), stop.clone(), errors.clone(), received.clone());
            std::thread::spawn(move || {
                let mut c: Consumer<HostConsumer> =
                    Consumer::attach(&sock, HostOptions::default()).unwrap();
                loop {
                    match c.recv_timeout(Duration::from_millis(50)) {
                        Ok(Some(b)) => {
                            received.fetch_add(1, Ordering::Relaxed);
                            b.release().unwrap();
                        }
                        Ok(None) => break,
                        Err(Error::Timeout(_)) if stop.load(Ordering::Relaxed) => break,
                        Err(Error::Timeout(_)) => {}
                        Err(e) => {
                            eprintln!("consumer {i}: {e}");
                            if errors.fetch_add(1, Ordering::Relaxed) > 20 {
                                break;
                            }
                        }
                    }
                }
            })
        })
        .collect();
    producer
        .wait_for_consumers(2, Duration::from_secs(5))
        .unwrap();
    let end = Instant::now() + Duration::from_secs(3);
    let mut published = 0u64;
    while Instant::now() < end && errors.load(Ordering::Relaxed) == 0 {
        match producer.acquire_timeout(Duration::from_millis(100)) {
            Ok(s) => {
                s.publish(8).unwrap();
                published += 1;
            }
            Err(Error::Timeout(_)) => {}
            Err(e) => panic!("{e}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    drop(producer);
    for c in consumers {
        c.join().unwrap();
    }
    assert_eq!(errors.load(Ordering::Relaxed), 0, "consumers saw errors");
    assert!(published > 1000, "only {published} batches published");
    assert_eq!(received.load(Ordering::Relaxed), published);
}
