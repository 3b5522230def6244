//! `gpipe consume`: attach to a producer and consume batches until it closes (or Ctrl-C);
//! also the consumer processes that `gpipe bench` and `gpipe soak` start.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use pipeline_core::{
    BackendKind, Batch, Consumer, ConsumerBackend, ConsumerConfig, Delivery, HostConsumer,
    HostOptions, PendingAttach,
};
use pipeline_cuda::backend::{CudaConsumer, CudaOptions};

use crate::args::SideSignalsArg;
use crate::duration::plural;
use crate::signals::STOP;
use crate::work::{self, Check, ConsumeOptions};
use crate::{bench, gpu};

/// Arguments of `gpipe consume`.
#[derive(clap::Args)]
pub struct ConsumeCmd {
    /// The producer's socket.
    #[arg(long)]
    socket: PathBuf,
    /// Also attach to a producer running as this uid (repeatable). By default only a
    /// producer of our own uid is trusted: the uid listening on the socket is checked, not
    /// the path.
    #[arg(long, value_name = "UID")]
    allow_producer_uid: Vec<u32>,
    /// Verify each batch's checksum.
    #[arg(long)]
    verify: bool,
    /// Stop after this many batches.
    #[arg(long)]
    max_batches: Option<u64>,
    /// Write every received sequence number here (u64 little-endian).
    #[arg(long)]
    seq_log: Option<PathBuf>,
    /// Print the final report as JSON.
    #[arg(long)]
    json: bool,
    /// Sleep this many microseconds per batch (simulates work).
    #[arg(long, default_value_t = 0)]
    work_us: u64,
    /// With --verify: read every batch this many times, on the GPU for a CUDA ring (the first
    /// pass's verdict counts). A stand-in for a model that reads its input more than once, to
    /// measure what a consumer elsewhere costs one that does real work on each batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000), requires = "verify")]
    passes: u32,
    /// Internal: run as a bench consumer (JSON report on stdout).
    #[arg(long, hide = true)]
    bench_child: bool,
    /// Internal (`gpipe bench --gpu-timeline`): FROM:COUNT, record the GPU start and end of
    /// the verify of batches FROM..FROM+COUNT (CUDA, with --verify).
    #[arg(long, hide = true, value_parser = parse_window)]
    gpu_timeline: Option<(u64, u64)>,
    /// Internal (`gpipe bench`): this consumer's number in the bench (in its report).
    #[arg(long, hide = true)]
    bench_index: Option<u32>,
    /// Internal (`gpipe bench`): host times per batch count from this sequence number on.
    #[arg(long, hide = true, default_value_t = 0)]
    timed_from: u64,
    /// CUDA device to consume on (default: the producer's). Another device reaches the slots
    /// by peer access; the attach fails, naming both devices, where there is none.
    #[arg(long)]
    device: Option<usize>,
    /// in-place: read the producer's slots; mirror: copy each batch into buffers of this
    /// consumer's own (on its GPU) and free the producer's slot at once; auto: in place on
    /// the producer's GPU, mirrored on another (measured: docs/multi-gpu.md).
    #[arg(long, default_value = "auto")]
    delivery: Delivery,
    /// With mirror delivery: batches this consumer may hold at once (its own buffers; default:
    /// the ring's slot count).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    mirror_buffers: Option<u32>,
    /// CUDA, in place: wait for `ready` and write `finished` on streams of this consumer's
    /// own, joined to the batch's stream by in-process events (on), or on the batch's stream
    /// (off). Saves the batch's stream GPU time between kernels, costs the host more driver
    /// calls; auto: on for slots of 16 MiB and more (measured: docs/benchmarks.md).
    #[arg(long, value_enum, default_value = "auto")]
    side_signals: SideSignalsArg,
    /// Also forward the ring at this socket into a ring of this process's at --socket, on
    /// --device, and consume that one: the forwarder of a chain or tree in the consumer's
    /// own process, so that the GPU is not time-sliced between two processes without MPS
    /// (`gpipe relay forward` in-process; `gpipe bench --forwarders in-consumer`).
    #[arg(long, value_name = "UPSTREAM")]
    forward_from: Option<PathBuf>,
    /// With --forward-from: the new ring's slots.
    #[arg(long, default_value_t = 8, requires = "forward_from")]
    forward_slots: u32,
    /// With --forward-from: take no batch until this many consumers (this one included)
    /// attached to the new ring.
    #[arg(long, default_value_t = 1, requires = "forward_from")]
    forward_wait: u32,
    /// With --forward-from: chunked forwarding, as `gpipe relay forward --chunk`.
    #[arg(long, default_value = "off", value_parser = crate::relay::parse_chunk, requires = "forward_from")]
    forward_chunk: crate::relay::ChunkSize,
    /// With --forward-from, CUDA: the new ring's memory path (pool, vmm, legacy). This
    /// process imports the memory it exports itself: legacy IPC handles cannot be opened by
    /// their exporter; VMM (the default) shares each slot as an fd, which any process may
    /// import (not yet run on a GPU in one process: `scripts/gpu/fanout.sh` tries pool too).
    #[arg(long, default_value = "vmm", requires = "forward_from")]
    forward_memory: pipeline_cuda::memory::MemoryPath,
    /// With --forward-from: CUDA copies in flight at once (default 3).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64), requires = "forward_from")]
    forward_depth: Option<u32>,
}

/// The forwarder running in this process (`--forward-from`), on a thread of its own.
type Forwarder =
    std::thread::JoinHandle<Result<pipeline_relay::RelayReport, pipeline_relay::RelayError>>;

/// Starts the in-process forwarder of `--forward-from` and waits until its ring is up (or it
/// failed).
fn start_forwarder(cmd: &ConsumeCmd, upstream: &std::path::Path) -> Result<Forwarder, String> {
    pipeline_core::limits::check_slots(cmd.forward_slots)
        .and_then(|()| pipeline_core::limits::check_max_consumers(cmd.forward_wait.max(1)))
        .map_err(|e| crate::args::shape_error(&e, "--forward-slots"))?;
    let config = pipeline_core::ProducerConfig {
        slots: cmd.forward_slots,
        max_consumers: cmd.forward_wait.max(1),
        ..pipeline_core::ProducerConfig::default()
    };
    let opts = pipeline_relay::ForwardOptions {
        device: cmd.device,
        wait_for_consumers: cmd.forward_wait,
        wait_timeout: None,
        sync: None,
        chunk_bytes: cmd.forward_chunk.0,
        depth: cmd.forward_depth.map(|d| d as usize),
        memory: Some(cmd.forward_memory),
    };
    let (up, down) = (upstream.to_path_buf(), cmd.socket.clone());
    let handle = std::thread::Builder::new()
        .name("forwarder".into())
        .spawn(move || pipeline_relay::run_forwarder(&up, &down, config, &opts, &STOP))
        .map_err(|e| format!("cannot start the forwarder thread: {e}"))?;
    let t0 = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&cmd.socket).is_err() {
        if handle.is_finished() {
            return Err(match handle.join() {
                Ok(Err(e)) => format!("the forwarder from {}: {e}", upstream.display()),
                _ => format!(
                    "the forwarder from {} ended before its ring was up",
                    upstream.display()
                ),
            });
        }
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "the forwarder from {} did not make its ring at {} within 60 s",
                upstream.display(),
                cmd.socket.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(handle)
}

/// `FROM:COUNT`, two integers.
fn parse_window(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("expected FROM:COUNT, got {s:?}"))?;
    let num = |x: &str| {
        x.trim()
            .parse::<u64>()
            .map_err(|e| format!("{x:?} in {s:?}: {e}"))
    };
    Ok((num(a)?, num(b)?))
}

/// Runs `gpipe consume`.
pub fn command(cmd: ConsumeCmd) -> Result<ExitCode, String> {
    let json = cmd.json || cmd.bench_child;
    // A refused or failed attach still ends with a report when one is asked for,
    // so that a harness (bench, soak) learns why rather than seeing silence.
    let failed = |e: String| {
        if json {
            let r = work::ConsumerReport {
                pid: std::process::id(),
                error: Some(e.clone()),
                attach_failed: true,
                ..Default::default()
            };
            if let Ok(line) = serde_json::to_string(&r) {
                println!("{line}");
            }
        }
        e
    };
    let forwarder = match &cmd.forward_from {
        Some(up) => Some(start_forwarder(&cmd, up).map_err(&failed)?),
        None => None,
    };
    let config = ConsumerConfig {
        allowed_producer_uids: cmd.allow_producer_uid.clone(),
        interrupted: Some(crate::signals::requested),
        ..ConsumerConfig::default()
    };
    let pending = match PendingAttach::connect(&cmd.socket, config) {
        Ok(pending) => pending,
        // Ctrl-C cut the handshake short: not a failure to report.
        Err(_) if crate::signals::requested() => {
            return Ok(crate::signals::interrupted("attaching"));
        }
        Err(e) => return Err(failed(e.to_string())),
    };
    let opts = Settings {
        verify: cmd.verify,
        max_batches: cmd.max_batches,
        seq_log: cmd.seq_log,
        json,
        quiet: cmd.bench_child,
        work_us: cmd.work_us,
        timed_from: cmd.timed_from,
        bench_index: cmd.bench_index,
        forwarder: std::cell::Cell::new(forwarder),
    };
    match pending.backend() {
        BackendKind::Host if cmd.device.is_some() => Err(failed(
            "--device applies to a CUDA ring; this producer's ring is in host memory".into(),
        )),
        BackendKind::Host => {
            let c: Consumer<HostConsumer> = pending
                .finish(HostOptions {
                    delivery: cmd.delivery,
                    mirror_buffers: cmd.mirror_buffers,
                    ..HostOptions::default()
                })
                .map_err(|e| failed(e.to_string()))?;
            consume(
                c,
                &mut work::HostCheck::with_passes(cmd.passes),
                &opts,
                None,
            )
        }
        BackendKind::Cuda => {
            let (from, count) = cmd.gpu_timeline.unwrap_or((0, 0));
            let c: Consumer<CudaConsumer> = pending
                .finish(CudaOptions {
                    device: cmd.device,
                    delivery: cmd.delivery,
                    mirror_buffers: cmd.mirror_buffers,
                    side_signals: cmd.side_signals.option(),
                    ..CudaOptions::default()
                })
                .map_err(|e| failed(e.to_string()))?;
            if c.backend().side_signals() && !cmd.bench_child {
                if let Err(why) = pipeline_cuda::policy::signals::side_signals_connections() {
                    eprintln!("gpipe: side signals on; {why}");
                }
            }
            let mut attach = serde_json::to_value(c.backend().import_timings()).ok();
            if let Some(serde_json::Value::Object(a)) = attach.as_mut() {
                a.insert("side_signals".into(), c.backend().side_signals().into());
            }
            consume(
                c,
                &mut gpu::CudaCheck::with_passes(cmd.passes).with_timeline(from, count),
                &opts,
                attach,
            )
        }
    }
}

/// What a consumer does with each batch and with its report.
struct Settings {
    verify: bool,
    max_batches: Option<u64>,
    seq_log: Option<PathBuf>,
    json: bool,
    quiet: bool,
    work_us: u64,
    timed_from: u64,
    bench_index: Option<u32>,
    /// The in-process forwarder feeding our ring (`--forward-from`): joined after the ring
    /// closed, its report added to ours.
    forwarder: std::cell::Cell<Option<Forwarder>>,
}

/// Consumes until the ring closes, `max_batches`, Ctrl-C or an error, then reports.
fn consume<B: ConsumerBackend, C: Check<B>>(
    mut consumer: Consumer<B>,
    check: &mut C,
    opts: &Settings,
    attach: Option<serde_json::Value>,
) -> Result<ExitCode, String> {
    let placement = consumer.backend().placement();
    if !opts.quiet {
        eprintln!(
            "gpipe: attached as consumer #{} ({} mode, {} slots, {}{}); Ctrl-C stops",
            consumer.index(),
            consumer.layout().mode,
            consumer.layout().slot_count,
            placement.delivery_name(),
            placement
                .device
                .map(|d| format!(" on GPU {d}"))
                .unwrap_or_default()
        );
    }
    let mut slow;
    let check: Option<&mut C> = if opts.verify { Some(check) } else { None };
    let (report, seqs) = if opts.work_us > 0 {
        slow = Slow {
            inner: check,
            us: opts.work_us,
        };
        work::consume_loop(
            &mut consumer,
            Some(&mut slow),
            &ConsumeOptions {
                max_batches: opts.max_batches,
                stop: &STOP,
                keep_seqs: opts.seq_log.is_some(),
                progress: !opts.quiet,
                timed_from: opts.timed_from,
            },
        )
    } else {
        work::consume_loop(
            &mut consumer,
            check,
            &ConsumeOptions {
                max_batches: opts.max_batches,
                stop: &STOP,
                keep_seqs: opts.seq_log.is_some(),
                progress: !opts.quiet,
                timed_from: opts.timed_from,
            },
        )
    };
    drop(consumer);
    let mut report = report;
    report.bench_index = opts.bench_index;
    if let Some(f) = opts.forwarder.take() {
        // Our ring closed (or we stopped): the forwarder ends once its upstream closes.
        report.forwarder = Some(match f.join() {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => pipeline_relay::RelayReport {
                error: Some(e.to_string()),
                ..Default::default()
            },
            Err(_) => pipeline_relay::RelayReport {
                error: Some("the forwarder thread panicked".into()),
                ..Default::default()
            },
        });
    }
    report.attach = attach;
    report.device = placement.device;
    report.delivery = Some(placement.delivery_name().to_string());
    if let Some(p) = &opts.seq_log {
        bench::write_seq_log(p, &seqs).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    if opts.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!("{}", summary(&report));
    }
    Ok(if report.error.is_none() && report.mismatches == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The final line of a consumer's text report: what it received, what its checks found,
/// what the producer took back, and how it ended.
fn summary(r: &work::ConsumerReport) -> String {
    let checked = match (r.verified, r.mismatches) {
        (false, _) => "not verified".to_string(),
        (true, 0) => "no checksum mismatches".to_string(),
        (true, n) => plural(n, "checksum mismatch", "checksum mismatches"),
    };
    let taken_back = match r.taken_back {
        0 => String::new(),
        n => format!(
            ", {} taken back by the producer when it detached this consumer",
            plural(n, "batch", "batches")
        ),
    };
    format!(
        "consumer #{}: {}, {}, {checked}{taken_back}{}",
        r.index,
        plural(r.received, "batch", "batches"),
        work::gb(r.bytes),
        r.error
            .as_ref()
            .map(|e| format!("; ended with: {e}"))
            .unwrap_or_default()
    )
}

/// Wraps a check with a per-batch sleep (simulated work).
struct Slow<'a, C> {
    inner: Option<&'a mut C>,
    us: u64,
}

impl<B: ConsumerBackend, C: Check<B>> Check<B> for Slow<'_, C> {
    fn check(&mut self, batch: &Batch<B>) -> Result<(), String> {
        std::thread::sleep(Duration::from_micros(self.us));
        match self.inner.as_deref_mut() {
            Some(c) => c.check(batch),
            None => Ok(()),
        }
    }
    fn finish(&mut self, consumer: &Consumer<B>) -> Result<Vec<u64>, String> {
        match self.inner.as_deref_mut() {
            Some(c) => c.finish(consumer),
            None => Ok(Vec::new()),
        }
    }
    fn timeline(&mut self) -> Result<Option<Vec<[u64; 2]>>, String> {
        match self.inner.as_deref_mut() {
            Some(c) => c.timeline(),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::summary;
    use crate::work::ConsumerReport;

    #[test]
    fn the_final_line_counts_in_words_and_tells_a_take_back_from_a_mismatch() {
        let one = ConsumerReport {
            received: 1,
            bytes: 1_500_000,
            verified: true,
            mismatches: 1,
            ..Default::default()
        };
        assert_eq!(
            summary(&one),
            "consumer #0: 1 batch, 0.002 GB, 1 checksum mismatch"
        );
        let detached = ConsumerReport {
            index: 2,
            received: 58,
            bytes: 60_817_408,
            verified: true,
            taken_back: 1,
            error: Some("this consumer was detached by the producer: …".into()),
            ..Default::default()
        };
        assert_eq!(
            summary(&detached),
            "consumer #2: 58 batches, 0.061 GB, no checksum mismatches, 1 batch taken back by \
             the producer when it detached this consumer; ended with: this consumer was \
             detached by the producer: …"
        );
        let unverified = ConsumerReport {
            received: 3,
            ..Default::default()
        };
        assert!(summary(&unverified).ends_with("3 batches, 0.000 GB, not verified"));
    }
}
