//! The host backend's hot path on one thread, for counting instructions per batch.
//!
//! A producer and a consumer in this process (the consumer attaches through the producer's
//! socket like any other), then `N` times: `acquire`, `publish(64)`, `recv`, drop the batch.
//! With 4 slots nothing ever waits, so every instruction is the ring's own bookkeeping, and a
//! count taken under valgrind is the same from run to run, which wall time on a shared
//! 2-vCPU VM is not. `benches/hot_path.sh` runs it twice under cachegrind (N and 11·N batches)
//! and reports the difference per batch, so setup and teardown cancel out:
//!
//! ```sh
//! bash benches/hot_path.sh            # this tree
//! bash benches/hot_path.sh 2331253    # this tree against another commit
//! ```
//!
//! Usage: `hot_path N` (default 10 000).

use std::time::Duration;

use pipeline_core::{
    Consumer, HostConsumer, HostOptions, HostProducer, Mode, Producer, ProducerConfig,
};

fn main() {
    let n: u64 = match std::env::args().nth(1).map(|s| s.parse()) {
        None => 10_000,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("hot_path: the batch count must be a number: {e}");
            std::process::exit(2);
        }
    };
    let path = std::env::temp_dir().join(format!("gpipe-hot-path-{}.sock", std::process::id()));
    let config = ProducerConfig {
        slots: 4,
        batch_bytes: 64,
        mode: Mode::Broadcast,
        ..Default::default()
    };
    let mut producer = Producer::<HostProducer>::bind(&path, config, HostOptions::default())
        .unwrap_or_else(|e| fail("bind", e));
    let mut consumer = Consumer::<HostConsumer>::attach(&path, HostOptions::default())
        .unwrap_or_else(|e| fail("attach", e));
    producer
        .wait_for_consumers(1, Duration::from_secs(30))
        .unwrap_or_else(|e| fail("wait for the consumer", e));
    for i in 0..n {
        let slot = producer.acquire().unwrap_or_else(|e| fail("acquire", e));
        slot.publish(64).unwrap_or_else(|e| fail("publish", e));
        match consumer.recv() {
            Ok(Some(batch)) => drop(batch),
            Ok(None) => fail("recv", format!("the ring closed at batch {i}")),
            Err(e) => fail("recv", e),
        }
    }
    drop(consumer);
    producer.close();
    let _ = std::fs::remove_file(&path);
    println!("{n} batches");
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("hot_path: {what} failed: {e}");
    std::process::exit(1);
}
