//! `gpipe relay`: carry a ring's batches to another host (issue #15), over NCCL for a CUDA
//! ring and inline on the authenticated TCP connection for a host ring.
//!
//! ```text
//! host A: gpipe relay send --socket /tmp/a.sock --listen 0.0.0.0:7000 --secret-file ~/.gpipe-secret
//! host B: gpipe relay recv --connect hostA:7000 --socket /tmp/b.sock --secret-file ~/.gpipe-secret
//! host B: gpipe consume --socket /tmp/b.sock --verify
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use pipeline_core::{LagPolicy, ProducerConfig};
use pipeline_relay::{BenchSide, Endpoint, RelayOptions, SharedSecret};

use crate::signals::STOP;
use crate::{duration, size};

/// Arguments of `gpipe relay`.
#[derive(clap::Args)]
pub struct RelayCmd {
    #[command(subcommand)]
    side: Side,
}

#[derive(clap::Subcommand)]
enum Side {
    /// Host A: consume the local ring at --socket and send every batch to the receiver that
    /// connects to --listen.
    Send {
        /// The local ring's socket.
        #[arg(long)]
        socket: PathBuf,
        /// ADDR:PORT to wait for the receiver on.
        #[arg(long)]
        listen: String,
        #[command(flatten)]
        common: Common,
    },
    /// Host B: connect to the sender at --connect and publish every batch in a ring of this
    /// host's at --socket, for plain gpipe consumers.
    Recv {
        /// ADDR:PORT of the sender.
        #[arg(long)]
        connect: String,
        /// The socket of the ring this side makes.
        #[arg(long)]
        socket: PathBuf,
        /// Slots of that ring (default: the sender's ring's).
        #[arg(long)]
        slots: Option<u32>,
        /// After the sender is gone, keep the ring and wait for a sender to connect again.
        #[arg(long)]
        rejoin: bool,
        /// Detach a local consumer that holds a slot longer than this many ms (default: wait).
        #[arg(long)]
        detach_after_ms: Option<u64>,
        #[command(flatten)]
        common: Common,
    },
    /// On this host: consume the ring at --upstream and re-publish every batch in a ring of
    /// this process's at --socket, on --device (e.g. GPU 0's ring forwarded to GPU 1, where
    /// consumers read it from their own memory; forwarders chain).
    Forward {
        /// The ring to consume.
        #[arg(long)]
        upstream: PathBuf,
        /// The socket of the ring this process makes.
        #[arg(long)]
        socket: PathBuf,
        /// CUDA device of the new ring (default: the upstream producer's).
        #[arg(long)]
        device: Option<usize>,
        /// Slots of the new ring (default 8).
        #[arg(long, default_value_t = 8)]
        slots: u32,
        /// Consumers the new ring can hold.
        #[arg(long, default_value_t = 16)]
        max_consumers: u32,
        /// Take no batch until this many consumers attached to the new ring (so that none
        /// misses the first batches).
        #[arg(long, default_value_t = 0)]
        wait_for_consumers: u32,
        /// CUDA: how the new ring signals `ready`: semaphore (timeline words, which its
        /// consumers release themselves if this forwarder dies mid-copy) or events.
        #[arg(long, default_value = "semaphore")]
        sync: String,
        /// Copy each batch in chunks of this size (`16MiB`, bytes) and publish the progress
        /// per chunk, so that a next forwarder that chunks copies each chunk once it landed
        /// (docs/multi-gpu.md, "Chunked forwarding"); `off`: whole batches. Batches are
        /// published whole either way.
        #[arg(long, default_value = "off", value_parser = parse_chunk)]
        chunk: ChunkSize,
        /// CUDA: copies in flight at once (default 3).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
        depth: Option<u32>,
        /// Print the final report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// NCCL's own send/recv bandwidth between two processes, with the relay's bindings (run
    /// one side with --listen, the other with --connect).
    NcclBench {
        /// ADDR:PORT to listen on (this side sends).
        #[arg(long, conflicts_with = "connect")]
        listen: Option<String>,
        /// ADDR:PORT to connect to (this side receives).
        #[arg(long)]
        connect: Option<String>,
        /// Bytes per message (units: KiB, MiB, GiB).
        #[arg(long, value_parser = size::parse, default_value = "64MiB")]
        bytes: u64,
        /// Messages timed.
        #[arg(long, default_value_t = 200)]
        iters: u64,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(clap::Args)]
struct Common {
    /// A file of the shared secret (both hosts have a copy; mode 0600, owned by you).
    #[arg(long)]
    secret_file: PathBuf,
    /// CUDA device of this side (send: default the producer's; recv: default 0).
    #[arg(long)]
    device: Option<usize>,
    /// How long to wait for the peer (30s, 10m, or seconds).
    #[arg(long, value_parser = duration::parse, default_value = "60s")]
    connect_timeout: Duration,
    /// Print the final report as JSON.
    #[arg(long)]
    json: bool,
    /// Priority of the streams the NCCL transfers run on: high lets their blocks start ahead
    /// of the work beside them on the same GPU (a producer, consumers). Measured on 2×H200
    /// with MPS: no difference (docs/relay.md). For send and recv; nccl-bench ignores it.
    #[arg(long, value_enum, default_value = "normal")]
    stream_priority: StreamPriority,
}

/// `--stream-priority`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum StreamPriority {
    High,
    Normal,
}

impl Common {
    fn secret(&self) -> Result<SharedSecret, String> {
        SharedSecret::from_file(&self.secret_file).map_err(|e| e.to_string())
    }

    /// The relay options both sides take from the command line.
    fn options(&self) -> RelayOptions {
        RelayOptions {
            connect_timeout: self.connect_timeout,
            device: self.device,
            high_priority: self.stream_priority == StreamPriority::High,
            ..RelayOptions::default()
        }
    }
}

fn endpoint(s: &str) -> Result<Endpoint, String> {
    s.parse::<Endpoint>().map_err(|e| e.to_string())
}

/// Runs `gpipe relay`.
pub fn command(cmd: RelayCmd) -> Result<ExitCode, String> {
    match cmd.side {
        Side::Send {
            socket,
            listen,
            common,
        } => {
            let secret = common.secret()?;
            let opts = common.options();
            eprintln!(
                "gpipe relay: sending the ring at {} to the receiver that connects to {listen}",
                socket.display()
            );
            let r = pipeline_relay::run_sender(&socket, &endpoint(&listen)?, &secret, &opts, &STOP);
            finish(r, common.json)
        }
        Side::Recv {
            connect,
            socket,
            slots,
            rejoin,
            detach_after_ms,
            common,
        } => {
            if let Some(n) = slots {
                pipeline_core::limits::check_slots(n)
                    .map_err(|e| crate::args::shape_error(&e, "--max-consumers"))?;
            }
            let secret = common.secret()?;
            let opts = RelayOptions {
                rejoin,
                slots,
                ..common.options()
            };
            let config = ProducerConfig {
                lag: detach_after_ms
                    .map(|ms| LagPolicy::DetachAfter(Duration::from_millis(ms)))
                    .unwrap_or_default(),
                ..ProducerConfig::default()
            };
            eprintln!(
                "gpipe relay: receiving from {connect} into a ring at {}",
                socket.display()
            );
            let r = pipeline_relay::run_receiver(
                &endpoint(&connect)?,
                &socket,
                &secret,
                config,
                &opts,
                &STOP,
            );
            finish(r, common.json)
        }
        Side::Forward {
            upstream,
            socket,
            device,
            slots,
            max_consumers,
            wait_for_consumers,
            sync,
            chunk,
            depth,
            json,
        } => {
            // The new ring's slot size is the upstream ring's, checked when it is made.
            let consumers_flag = if wait_for_consumers > max_consumers {
                "--wait-for-consumers"
            } else {
                "--max-consumers"
            };
            pipeline_core::limits::check_slots(slots)
                .and_then(|()| {
                    pipeline_core::limits::check_max_consumers(
                        max_consumers.max(wait_for_consumers),
                    )
                })
                .map_err(|e| crate::args::shape_error(&e, consumers_flag))?;
            if !json {
                eprintln!(
                    "gpipe relay: forwarding the ring at {} into a ring at {}",
                    upstream.display(),
                    socket.display()
                );
            }
            let config = ProducerConfig {
                slots,
                max_consumers: max_consumers.max(wait_for_consumers),
                ..ProducerConfig::default()
            };
            let sync = match sync.as_str() {
                "semaphore" => pipeline_cuda::sync::SyncMode::Semaphore,
                "events" => pipeline_cuda::sync::SyncMode::Events,
                other => return Err(format!("--sync {other}: use semaphore or events")),
            };
            let opts = pipeline_relay::ForwardOptions {
                device,
                wait_for_consumers,
                wait_timeout: None,
                sync: Some(sync),
                chunk_bytes: chunk.0,
                depth: depth.map(|d| d as usize),
                memory: None,
            };
            let r = pipeline_relay::run_forwarder(&upstream, &socket, config, &opts, &STOP);
            finish(r, json)
        }
        Side::NcclBench {
            listen,
            connect,
            bytes,
            iters,
            common,
        } => {
            let secret = common.secret()?;
            let side = match (listen, connect) {
                (Some(l), None) => BenchSide::Send(endpoint(&l)?),
                (None, Some(c)) => BenchSide::Recv(endpoint(&c)?),
                _ => {
                    return Err(
                        "give --listen (the sending side) or --connect (the receiving side)".into(),
                    );
                }
            };
            let gbs = pipeline_relay::nccl_bench(
                &side,
                &secret,
                bytes,
                iters,
                common.device.unwrap_or(0),
                common.connect_timeout,
            )
            .map_err(|e| e.to_string())?;
            if common.json {
                println!(
                    "{}",
                    serde_json::json!({"bytes": bytes, "iters": iters, "gb_per_s": gbs})
                );
            } else {
                println!(
                    "nccl send/recv: {} x {}: {gbs:.1} GB/s",
                    iters,
                    size::format(bytes)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn finish(
    r: Result<pipeline_relay::RelayReport, pipeline_relay::RelayError>,
    json: bool,
) -> Result<ExitCode, String> {
    match r {
        Ok(report) => {
            if json {
                let mut v = serde_json::to_value(&report).map_err(|e| e.to_string())?;
                v["gb_per_s"] = serde_json::json!(report.gb_per_s());
                println!("{v}");
            } else {
                println!(
                    "gpipe relay ({}): {}, {} in {:.3} s, {:.2} GB/s{}",
                    report.backend,
                    duration::plural(report.batches, "batch", "batches"),
                    crate::work::gb(report.bytes),
                    report.elapsed_s,
                    report.gb_per_s(),
                    report
                        .error
                        .as_ref()
                        .map(|e| format!("; a session ended with: {e}"))
                        .unwrap_or_default()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            if json {
                println!("{}", serde_json::json!({"error": e.0}));
            }
            Err(format!("relay: {e}"))
        }
    }
}

/// A forwarder's `--chunk`: a size, or None for `off`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkSize(pub(crate) Option<u64>);

/// `--chunk`: `off` or a size.
pub(crate) fn parse_chunk(s: &str) -> Result<ChunkSize, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(ChunkSize(None));
    }
    match crate::size::parse(s)? {
        0 => Err("--chunk 0: give a size of at least 1 byte, or off".into()),
        n => Ok(ChunkSize(Some(n))),
    }
}
