//! A minimal gpipe consumer on the library API: the README's host-memory snippet, made
//! runnable.
//!
//! ```sh
//! cargo run -p pipeline-examples --example producer -- [SOCKET] [BATCHES]
//! cargo run -p pipeline-examples --example consumer -- [SOCKET] [BATCHES]   # another terminal
//! ```
//!
//! It attaches to the producer on `SOCKET` (default `/tmp/gpipe-example.sock`; it waits a
//! few seconds for one to appear), receives batches until the producer closes the ring,
//! checks each in place against the test pattern of [`pipeline_core::pattern`] and prints a
//! summary. With `BATCHES` it also checks that exactly that many arrived. It exits non-zero
//! if any batch was corrupt, missing or out of order.
//!
//! It reads the batches of the example producer and of `gpipe produce --backend host` alike.
//! A producer on the CUDA backend is refused at attach: that takes a `Consumer<CudaConsumer>`
//! (the README's CUDA snippet).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use pipeline_core::{Consumer, Error, HostConsumer, HostOptions, Mode, pattern};

/// Where to find the producer when no socket path is given.
const DEFAULT_SOCKET: &str = "/tmp/gpipe-example.sock";
/// How long to wait for a producer to start listening.
const PRODUCER_WAIT: Duration = Duration::from_secs(10);

const USAGE: &str = "usage: consumer [SOCKET] [BATCHES]
  SOCKET   the producer's Unix socket (default /tmp/gpipe-example.sock)
  BATCHES  fail unless exactly this many batches arrive (default: any number)";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("consumer: {e}");
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
    let expected = match args.next() {
        Some(n) => Some(
            n.parse::<u64>()
                .map_err(|_| format!("BATCHES must be a whole number, not {n:?}\n{USAGE}"))?,
        ),
        None => None,
    };
    if let Some(extra) = args.next() {
        return Err(format!("unexpected argument {extra:?}\n{USAGE}").into());
    }

    let mut consumer = attach(&socket)?;
    let broadcast = consumer.layout().mode == Mode::Broadcast;
    println!(
        "consumer: attached to {socket} as consumer #{}",
        consumer.index()
    );

    let (mut received, mut verified, mut bytes) = (0u64, 0u64, 0u64);
    let mut first_last: Option<(u64, u64)> = None;
    let mut problems = Vec::new();
    // `Ok(None)`: the producer closed the ring and everything it published has arrived.
    while let Some(batch) = consumer.recv()? {
        let (seq, len) = (batch.seq(), batch.len());
        // The batch is read in place, in the producer's shared memory: no copy.
        let data: &[u8] = batch.data();
        if pattern::checksum(data) == pattern::expected_checksum(seq, len) {
            verified += 1;
        } else {
            problems.push(format!("batch {seq}: contents do not match its pattern"));
        }
        // In broadcast mode every consumer sees every batch, in order.
        if let Some((_, last)) = first_last {
            if broadcast && seq != last + 1 {
                problems.push(format!("batch {seq} came after batch {last}"));
            }
        }
        first_last = Some((first_last.map_or(seq, |(first, _)| first), seq));
        received += 1;
        bytes += len;
        println!("batch {seq} of {len} bytes");
        // `batch` is dropped here, which releases its slot back to the producer.
    }

    let range = first_last.map_or_else(String::new, |(first, last)| {
        format!(" (seq {first}..={last})")
    });
    println!("consumer: {verified} of {received} batches verified{range}, {bytes} bytes in all");
    if let Some(n) = expected {
        if received != n {
            problems.push(format!("expected {n} batches, received {received}"));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        let shown = problems.len().min(10);
        let more = match problems.len() - shown {
            0 => String::new(),
            n => format!("\n  ... and {n} more"),
        };
        let list = problems[..shown].join("\n  ");
        Err(format!("{} problem(s):\n  {list}{more}", problems.len()).into())
    }
}

/// Attaches to the producer on `socket`, waiting up to [`PRODUCER_WAIT`] for it to start
/// listening, so the two examples can be started in either order.
fn attach(socket: &str) -> Result<Consumer<HostConsumer>, Error> {
    let deadline = Instant::now() + PRODUCER_WAIT;
    let mut told = false;
    loop {
        match Consumer::attach(socket, HostOptions::default()) {
            Err(Error::Connect { source, .. })
                if Instant::now() < deadline
                    && matches!(
                        source.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) =>
            {
                if !told {
                    println!("consumer: waiting for a producer on {socket}");
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}
