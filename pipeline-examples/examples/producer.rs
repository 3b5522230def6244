//! A minimal gpipe producer on the library API: the README's host-memory snippet, made
//! runnable.
//!
//! ```sh
//! cargo run -p pipeline-examples --example producer -- [SOCKET] [BATCHES]
//! cargo run -p pipeline-examples --example consumer -- [SOCKET] [BATCHES]   # another terminal
//! ```
//!
//! It listens on `SOCKET` (default `/tmp/gpipe-example.sock`), waits for a consumer, publishes
//! `BATCHES` batches (default 100) of 1 MiB, and closes the ring cleanly. Each batch holds the
//! test pattern of [`pipeline_core::pattern`] for its sequence number, so a consumer can check
//! every byte; its checksum goes in the user header as well, the way `gpipe produce` does it,
//! so `gpipe consume --verify` accepts these batches too.
//!
//! Slots live in host shared memory. On a GPU the same calls take `CudaProducer` and
//! `CudaOptions` (the README's CUDA snippet); filling device memory needs a kernel launch or
//! a copy on the slot's stream, which `gpipe produce --backend cuda` shows.

use std::process::ExitCode;
use std::time::Duration;

use pipeline_core::{
    HostOptions, HostProducer, Mode, Producer, ProducerConfig, USER_HEADER_WORDS, pattern,
};

/// Where the producer listens when no socket path is given.
const DEFAULT_SOCKET: &str = "/tmp/gpipe-example.sock";
/// Batches published when no count is given.
const DEFAULT_BATCHES: u64 = 100;
/// Bytes in each batch.
const BATCH_BYTES: u64 = 1 << 20;
/// How long to wait for the first consumer before giving up.
const CONSUMER_WAIT: Duration = Duration::from_secs(60);

const USAGE: &str = "usage: producer [SOCKET] [BATCHES]
  SOCKET   Unix socket to listen on (default /tmp/gpipe-example.sock)
  BATCHES  how many batches to publish (default 100)";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("producer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let socket = args.next().unwrap_or_else(|| DEFAULT_SOCKET.to_owned());
    if socket == "-h" || socket == "--help" {
        println!("{USAGE}");
        return Ok(());
    }
    let batches = match args.next() {
        Some(n) => n
            .parse::<u64>()
            .map_err(|_| format!("BATCHES must be a whole number, not {n:?}\n{USAGE}"))?,
        None => DEFAULT_BATCHES,
    };
    if let Some(extra) = args.next() {
        return Err(format!("unexpected argument {extra:?}\n{USAGE}").into());
    }

    // Create the ring (8 slots, each big enough for a batch) and listen on the socket.
    let config = ProducerConfig {
        slots: 8,
        batch_bytes: BATCH_BYTES,
        mode: Mode::Broadcast,
        ..Default::default()
    };
    let mut producer: Producer<HostProducer> =
        Producer::bind(&socket, config, HostOptions::default())?;
    println!("producer: listening on {socket}, waiting for a consumer");

    // A consumer that attaches later starts at the batch being published then, so wait for
    // one first: it gets every batch, from the first.
    producer.wait_for_consumers(1, CONSUMER_WAIT).map_err(|_| {
        format!(
            "no consumer attached within {} s; start one with \
             `cargo run -p pipeline-examples --example consumer -- {socket}`",
            CONSUMER_WAIT.as_secs()
        )
    })?;

    for _ in 0..batches {
        // Waits until every consumer has released what this slot held before.
        let mut slot = producer.acquire()?;
        let seq = slot.seq();
        // Write in place: the slot is shared memory that consumers map.
        let checksum = pattern::fill(&mut slot.memory()[..BATCH_BYTES as usize], seq);
        let mut header = [0u64; USER_HEADER_WORDS];
        header[pattern::HEADER_CHECKSUM] = checksum;
        header[pattern::HEADER_SEQ] = seq;
        // Publishing hands the batch to consumers; dropping an unpublished slot returns it.
        slot.publish_with_header(BATCH_BYTES, &header)?;
    }

    // Closing lets consumers receive everything published (their `recv` then returns
    // `Ok(None)`) and waits a moment for them to detach.
    let stats = producer.close();
    println!(
        "producer: published {} batches of {} bytes; consumers attached {}, left {}, died {}",
        stats.published, BATCH_BYTES, stats.attached, stats.left, stats.died
    );
    Ok(())
}
