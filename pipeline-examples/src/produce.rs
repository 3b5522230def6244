//! `gpipe produce`: a producer that publishes pattern batches until Ctrl-C (or `--batches`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pipeline_core::{
    Error, HeldBack, HostOptions, HostProducer, LagPolicy, Producer, ProducerBackend,
    ProducerConfig,
};
use pipeline_cuda::backend::CudaProducer;

use crate::args::{BackendArg, CudaArgs, RingArgs, resolve_backend};
use crate::work::{self, Fill};
use crate::{duration, gpu, signals};

/// Arguments of `gpipe produce`.
#[derive(clap::Args)]
#[command(
    after_help = "Ctrl-C (or SIGTERM) stops it at any point within about 0.1 s, waiting for \
    consumers included, and closes the ring cleanly: consumers receive every batch published, \
    then the end (one that has not taken them within 5 s is detached). gpipe then exits with \
    status 0; errors exit with status 2."
)]
pub struct ProduceCmd {
    /// Socket path consumers attach to. Its directory must exist; put it in one only you can
    /// write (`$XDG_RUNTIME_DIR`, or one made with `mkdir -m 700`), so that no other user can
    /// put a socket of theirs in its place.
    #[arg(long)]
    socket: PathBuf,
    /// Which backend.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
    #[command(flatten)]
    ring: RingArgs,
    #[command(flatten)]
    cuda: CudaArgs,
    /// Stop after this many batches (default: run until Ctrl-C).
    #[arg(long)]
    batches: Option<u64>,
    /// Publish at most this many batches per second, evenly spaced (decimals allowed: 0.5
    /// is one batch every 2 s; the slowest is one a day). Time lost to a stall (a stopped
    /// consumer, a stopped producer) is not made up in a burst. 0, or left out: as fast as
    /// consumers release.
    #[arg(long, value_parser = parse_rate)]
    rate: Option<f64>,
    /// Most consumers at once (at most 63).
    #[arg(long, default_value_t = 16)]
    max_consumers: u32,
    /// Also allow this uid to attach (repeatable). The socket is then made mode 0666 so
    /// that it can connect (its directory must let it in too), and the producer's uid check
    /// on every connection refuses every uid not allowed.
    #[arg(long)]
    allow_uid: Vec<u32>,
    /// Also allow peers whose (primary) group is this gid (repeatable; opens the socket as
    /// --allow-uid does).
    #[arg(long)]
    allow_gid: Vec<u32>,
    /// Detach a consumer that holds a needed slot, or whose GPU work on a batch the
    /// producer waits for, longer than this many ms (default: wait).
    #[arg(long)]
    detach_after_ms: Option<u64>,
    /// Publish nothing until this many consumers have attached (up to 5 minutes; at most
    /// --max-consumers).
    #[arg(long, default_value_t = 0)]
    wait_for_consumers: u32,
    /// Leave the process dumpable. By default the producer makes itself not dumpable, so
    /// that other processes of your uid cannot open its read-write fds through
    /// /proc/PID/fd; that also turns off its core dumps and keeps debuggers and profilers
    /// (gdb -p, perf, strace -p) of your uid out unless they run as root.
    #[arg(long)]
    keep_dumpable: bool,
}

/// Runs `gpipe produce`.
pub fn command(cmd: ProduceCmd) -> Result<ExitCode, String> {
    let mut config = ProducerConfig {
        slots: cmd.ring.slots_or_default(),
        batch_bytes: cmd.ring.batch_bytes,
        mode: cmd.ring.mode.into(),
        max_lead: None,
        max_consumers: cmd.max_consumers,
        allowed_uids: cmd.allow_uid,
        allowed_gids: cmd.allow_gid,
        lag: cmd
            .detach_after_ms
            .map(|ms| LagPolicy::DetachAfter(Duration::from_millis(ms)))
            .unwrap_or_default(),
        keep_dumpable: cmd.keep_dumpable,
        ..Default::default()
    };
    crate::args::check_shape(
        cmd.ring.slots,
        cmd.ring.batch_bytes,
        cmd.max_consumers,
        "--max-consumers",
    )?;
    crate::args::check_pattern_bytes(cmd.ring.batch_bytes)?;
    if cmd.wait_for_consumers > cmd.max_consumers {
        return Err(format!(
            "--wait-for-consumers {} can never be met: the ring takes at most --max-consumers \
             {} consumers at once; raise --max-consumers (up to {}) or wait for fewer",
            cmd.wait_for_consumers,
            cmd.max_consumers,
            pipeline_core::limits::MAX_CONSUMERS
        ));
    }
    check_socket_path(&cmd.socket)?;
    let backend = resolve_backend(cmd.backend)?;
    if backend == BackendArg::Cuda {
        for (k, v) in CUDA_ENV.get().into_iter().flatten() {
            eprintln!("gpipe: running with {k}={v} (batches large enough for side signals)");
        }
    }
    let depth = cmd.ring.depth(backend == BackendArg::Cuda)?;
    if let Some(why) = &depth.why {
        eprintln!("gpipe: --slots auto: {} slots ({why})", depth.slots);
    }
    config.slots = depth.slots;
    crate::args::check_memory(backend, depth.slots, cmd.ring.batch_bytes)?;
    config.max_lead = cmd
        .ring
        .lead(backend == BackendArg::Cuda, depth.slots)?
        .max_lead;
    let run = Run {
        socket: &cmd.socket,
        batches: cmd.batches,
        pacer: cmd.rate.and_then(Pacer::new),
        len: cmd.ring.batch_bytes,
        wait_for: cmd.wait_for_consumers,
        detach_after_ms: cmd.detach_after_ms,
    };
    match backend {
        BackendArg::Host => {
            produce::<HostProducer, _>(run, config, HostOptions::default(), &mut work::HostFill)
        }
        _ => produce::<CudaProducer, _>(
            run,
            config,
            cmd.cuda.options()?,
            &mut gpu::CudaFill::default(),
        ),
    }
}

/// What `produce` publishes, how fast, and when it starts.
struct Run<'a> {
    socket: &'a Path,
    /// Stop after this many (None: until Ctrl-C).
    batches: Option<u64>,
    /// `--rate`.
    pacer: Option<Pacer>,
    /// Bytes per batch.
    len: u64,
    /// Consumers to wait for before the first batch.
    wait_for: u32,
    /// `--detach-after-ms`, for the stuck-consumer notice.
    detach_after_ms: Option<u64>,
}

/// `--rate`: batches per second, a number; 0 means no limit. A rate so low that its period
/// runs past a day (or that is not a number) is refused.
fn parse_rate(s: &str) -> Result<f64, String> {
    let rate: f64 = s.trim().parse().map_err(|_| {
        format!("{s:?} is not a number of batches per second (examples: 200, 0.5; 0: no limit)")
    })?;
    if !rate.is_finite() || rate < 0.0 {
        return Err(format!(
            "{s:?} batches per second: give a finite number, 0 or more (0: no limit)"
        ));
    }
    if rate > 0.0 && rate < SLOWEST_RATE {
        return Err(format!(
            "{s} batches per second is one batch every {:.1e} days; the slowest rate is one a \
             day ({SLOWEST_RATE:.2e} per second); 0 means no limit",
            1.0 / rate / 86_400.0
        ));
    }
    Ok(rate)
}

/// The slowest `--rate`: one batch a day.
const SLOWEST_RATE: f64 = 1.0 / 86_400.0;

/// Paces publishes to `--rate`: batch n+1 is due one period after batch n was due, so the
/// average is the rate asked for. A publish may come late: by timer jitter, which the next
/// ones make up for, or by a stall (a consumer held the ring back, the producer itself was
/// stopped), which they do not: a publish later than half a period starts the schedule again
/// from its own time, so no burst follows. Any one second holds at most the rate's worth of
/// publishes plus one (the same as evenly spaced ones).
#[derive(Debug)]
struct Pacer {
    period: Duration,
    due: Option<Instant>,
}

impl Pacer {
    /// A pacer for `rate` batches per second (checked by [`parse_rate`]); None for 0, no
    /// limit.
    fn new(rate: f64) -> Option<Self> {
        (rate > 0.0).then(|| Self {
            period: Duration::from_secs_f64(1.0 / rate),
            due: None,
        })
    }

    /// Waits until the next batch may be published; false if Ctrl-C came first.
    fn wait(&self) -> bool {
        self.due.is_none_or(signals::sleep_until)
    }

    /// Records a publish at `at` (when its wait ended, at or after it was due).
    fn published(&mut self, at: Instant) {
        // Lateness beyond half a period is not made up for.
        let forgiven = at.checked_sub(self.period / 2).unwrap_or(at);
        let from = self.due.map_or(at, |due| due.max(forgiven));
        self.due = Some(from + self.period);
    }
}

/// How long the producer waits on the same consumers before it says so.
const STALL_NOTICE_AFTER: Duration = Duration::from_secs(3);

/// Says, once per stall, which consumers hold the producer back and what to do about it.
struct StallNotice {
    detach_after_ms: Option<u64>,
    /// The stall last reported (by its start).
    reported: Option<Instant>,
}

impl StallNotice {
    /// Looks at what holds the producer back now; prints one line when a stall has lasted
    /// [`STALL_NOTICE_AFTER`] and was not reported yet.
    fn check(&mut self, held: Option<HeldBack>) {
        let Some(held) = held else { return };
        if held.holders.is_empty()
            || held.since.elapsed() < STALL_NOTICE_AFTER
            || self.reported == Some(held.since)
        {
            return;
        }
        self.reported = Some(held.since);
        eprintln!(
            "gpipe: {}",
            stall_message(&held, held.since.elapsed(), self.detach_after_ms)
        );
    }
}

/// "consumer #1 (pid 4242)", "consumers #1 (pid 4242), #3 (pid 77)".
fn holders(held: &HeldBack) -> String {
    let who: Vec<String> = held
        .holders
        .iter()
        .map(|h| match h.pid {
            Some(pid) => format!("#{} (pid {pid})", h.index),
            None => format!("#{} (pid not visible from here)", h.index),
        })
        .collect();
    let them = if who.len() == 1 {
        "consumer"
    } else {
        "consumers"
    };
    format!("{them} {}", who.join(", "))
}

/// The stuck-consumer notice: who, for how long, and the options.
fn stall_message(held: &HeldBack, waited: Duration, detach_after_ms: Option<u64>) -> String {
    let (has, it) = if held.holders.len() == 1 {
        ("has", "it")
    } else {
        ("have", "they")
    };
    let options = match detach_after_ms {
        Some(ms) => {
            format!("a consumer that holds a slot {ms} ms is detached (--detach-after-ms)")
        }
        None => "the producer waits (back-pressure): end or resume the consumer, or restart \
                 the producer with --detach-after-ms N to detach a consumer that holds a slot \
                 longer than N ms"
            .to_string(),
    };
    format!(
        "{} {has} held the ring back for {:.0} s: batch {} waits for slot {}, which {it} \
         did not release (stopped? stuck?); {options}",
        holders(held),
        waited.as_secs_f64(),
        held.seq,
        held.slot
    )
}

/// Before the ring is made (the bind would fail only after the ring's memory was allocated,
/// and say less): the socket's directory must exist, and no producer may be listening on the
/// path already.
fn check_socket_path(socket: &Path) -> Result<(), String> {
    let dir = socket_dir(socket);
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return Err(format!(
                    "cannot make the socket {}: it is in use, another producer is already \
                     listening on it (`gpipe inspect --socket {}` shows it); stop that one or \
                     give another --socket",
                    socket.display(),
                    socket.display()
                ));
            }
            Ok(())
        }
        Ok(_) => Err(format!(
            "cannot make the socket {}: {} is not a directory; give a --socket path in a \
             directory",
            socket.display(),
            dir.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(format!(
            "cannot make the socket {}: the directory {} does not exist; create it first \
             (a private one: mkdir -p -m 700 {}) or give another --socket",
            socket.display(),
            dir.display(),
            dir.display()
        )),
        Err(e) => Err(format!(
            "cannot make the socket {}: cannot look at its directory {}: {e}",
            socket.display(),
            dir.display()
        )),
    }
}

/// The directory a socket path is in (`.` for a bare name).
fn socket_dir(socket: &Path) -> &Path {
    socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// A failed [`Producer::bind`] in words that name the socket and what to do.
fn bind_error(socket: &Path, e: Error) -> String {
    let Error::Os { what, source } = &e else {
        return e.to_string();
    };
    if !what.contains("socket") {
        return e.to_string();
    }
    let dir = socket_dir(socket);
    let path = socket.display();
    match source.kind() {
        std::io::ErrorKind::NotFound => format!(
            "cannot make the socket {path}: the directory {} does not exist; create it first \
             (mkdir -p -m 700 {}) or give another --socket",
            dir.display(),
            dir.display()
        ),
        std::io::ErrorKind::PermissionDenied => format!(
            "cannot make the socket {path}: permission denied in {} (this user cannot create \
             files there); give a --socket in a directory of your own, e.g. \
             $XDG_RUNTIME_DIR or one made with mkdir -p -m 700",
            dir.display()
        ),
        std::io::ErrorKind::AddrInUse => format!(
            "cannot make the socket {path}: the address is in use; stop the process that \
             listens there or give another --socket"
        ),
        _ => format!("cannot make the socket {path} ({what}): {source}"),
    }
}

/// Binds a producer on `run.socket` and publishes `run.len`-byte batches, paced by `--rate`,
/// until `run.batches` are out, Ctrl-C or an error; then closes the ring.
fn produce<B: ProducerBackend, F: Fill<B>>(
    mut run: Run<'_>,
    config: ProducerConfig,
    options: B::Options,
    fill: &mut F,
) -> Result<ExitCode, String> {
    let socket = run.socket;
    let drain = config.drain_timeout;
    let mut producer: Producer<B> =
        Producer::bind(socket, config, options).map_err(|e| bind_error(socket, e))?;
    eprintln!(
        "gpipe: producing on {} ({} backend); Ctrl-C stops",
        socket.display(),
        B::KIND
    );
    let mut result = Ok(0);
    if run.wait_for > 0 {
        eprintln!(
            "gpipe: waiting for {} to attach",
            duration::plural(run.wait_for, "consumer", "consumers")
        );
        result = match producer.wait_for_consumers_or_stop(
            run.wait_for,
            Duration::from_secs(300),
            &signals::requested,
        ) {
            Ok(true) => Ok(0),
            Ok(false) => {
                eprintln!(
                    "gpipe: interrupted while waiting for consumers ({} of {} attached)",
                    producer.consumers(),
                    run.wait_for
                );
                Ok(0)
            }
            Err(e) => Err(format!(
                "waiting for {}: {e}",
                duration::plural(run.wait_for, "consumer", "consumers")
            )),
        };
    }
    if result.is_ok() && !signals::requested() {
        result = publish(&mut producer, fill, &mut run);
    }
    if let Some(held) = producer.held_back().filter(|h| !h.holders.is_empty()) {
        eprintln!(
            "gpipe: closing the ring; {} holding slot {} {} up to {:.0} s to take the batches \
             published, then {} detached",
            holders(&held),
            held.slot,
            if held.holders.len() == 1 {
                "has"
            } else {
                "have"
            },
            drain.as_secs_f64(),
            if held.holders.len() == 1 { "is" } else { "are" },
        );
    }
    let stats = producer.close();
    eprintln!(
        "gpipe: producer stopped after {}; consumers attached {}, left {}, died {}, detached {}, requeued batches {}",
        duration::plural(stats.published, "batch", "batches"),
        stats.attached,
        stats.left,
        stats.died,
        stats.detached,
        stats.requeued
    );
    result.map(|_| ExitCode::SUCCESS)
}

/// The publishing loop of [`produce`]: returns how many batches it published. Every wait
/// (a slot, the `--rate` pacing) looks at Ctrl-C at least every [`signals::SLICE`].
fn publish<B: ProducerBackend, F: Fill<B>>(
    producer: &mut Producer<B>,
    fill: &mut F,
    run: &mut Run<'_>,
) -> Result<u64, String> {
    let mut n = 0u64;
    let mut last = Instant::now();
    let mut last_n = 0u64;
    let mut stall = StallNotice {
        detach_after_ms: run.detach_after_ms,
        reported: None,
    };
    while run.batches.is_none_or(|b| n < b) && !signals::requested() {
        let got = producer.acquire_timeout(signals::SLICE);
        let mut slot = match got {
            Ok(slot) => slot,
            Err(Error::Timeout(_)) => {
                stall.check(producer.held_back());
                continue;
            }
            Err(e) => return Err(e.to_string()),
        };
        let seq = slot.seq();
        let header = fill.fill(&mut slot, seq, run.len)?;
        if let Some(pacer) = &mut run.pacer {
            if !pacer.wait() {
                // Ctrl-C: the filled slot goes back unpublished.
                break;
            }
            pacer.published(Instant::now());
        }
        slot.publish_with_header(run.len, &header)
            .map_err(|e| e.to_string())?;
        n += 1;
        if last.elapsed() >= Duration::from_secs(1) {
            let dt = last.elapsed().as_secs_f64();
            eprintln!(
                "gpipe: {} published ({:.0}/s), {}",
                duration::plural(n, "batch", "batches"),
                (n - last_n) as f64 / dt,
                duration::plural(producer.consumers(), "consumer", "consumers")
            );
            last = Instant::now();
            last_n = n;
        }
    }
    Ok(n)
}

/// `CUDA_DEVICE_MAX_CONNECTIONS` and the like, as [`set_process_env`] set them: said once the
/// backend is known to be CUDA.
static CUDA_ENV: OnceLock<Vec<(String, String)>> = OnceLock::new();

/// Under MPS a producer of slots large enough for its consumers to take side signals wants
/// its streams on hardware queues of their own, so this sets `CUDA_DEVICE_MAX_CONNECTIONS=8`
/// where it is unset (measured: docs/benchmarks.md). It must come before CUDA starts, so
/// before the backend is chosen; [`command`] says so once the backend turns out to be CUDA
/// (on the host backend the variable is set but unused).
///
/// # Safety
/// As for [`crate::bench::set_process_env`]: first thing in `main`, the only thread.
pub unsafe fn set_process_env(cmd: &ProduceCmd) {
    // SAFETY: the caller guarantees that this is the only thread.
    let vars = unsafe {
        crate::bench::set_cuda_env(
            cmd.backend,
            crate::args::SideSignalsArg::Auto,
            cmd.ring.batch_bytes,
        )
    };
    let _ = CUDA_ENV.set(vars);
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeline_core::Holder;

    #[test]
    fn rates_are_numbers_within_reason() {
        assert_eq!(parse_rate("200"), Ok(200.0));
        assert_eq!(parse_rate("0.5"), Ok(0.5));
        assert_eq!(parse_rate("0"), Ok(0.0));
        assert!(Pacer::new(0.0).is_none(), "0 is no limit");
        assert!(parse_rate("1e-300").unwrap_err().contains("one a day"));
        assert!(parse_rate(&(SLOWEST_RATE / 2.0).to_string()).is_err());
        assert_eq!(parse_rate(&SLOWEST_RATE.to_string()), Ok(SLOWEST_RATE));
        for bad in ["-1", "inf", "NaN", "fast", ""] {
            assert!(parse_rate(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_pacer_keeps_the_rate_through_jitter_and_forgets_a_stall() {
        let mut p = Pacer::new(100.0).unwrap();
        let period = p.period;
        let t0 = Instant::now();
        assert!(p.wait(), "the first batch is due at once");
        p.published(t0);
        assert_eq!(p.due, Some(t0 + period));
        // A little late (timer jitter): the schedule holds, the average stays at the rate.
        p.published(t0 + period + period / 10);
        assert_eq!(p.due, Some(t0 + 2 * period));
        // A stall: this batch comes 5 s late; the next is due well after it, not at once
        // (no catch-up), and at least half a period after it.
        let late = t0 + Duration::from_secs(5);
        p.published(late);
        let due = p.due.unwrap();
        assert!(
            due >= late + period / 2 && due <= late + period,
            "{:?}",
            due - late
        );
    }

    #[test]
    fn the_stall_notice_names_the_consumers_and_the_options() {
        let held = HeldBack {
            seq: 57,
            slot: 1,
            since: Instant::now(),
            holders: vec![
                Holder {
                    index: 2,
                    pid: Some(4242),
                },
                Holder {
                    index: 5,
                    pid: None,
                },
            ],
        };
        let m = stall_message(&held, Duration::from_secs(4), None);
        assert!(
            m.starts_with("consumers #2 (pid 4242), #5 (pid not visible"),
            "{m}"
        );
        assert!(
            m.contains("for 4 s") && m.contains("batch 57") && m.contains("slot 1"),
            "{m}"
        );
        assert!(m.contains("--detach-after-ms N"), "{m}");
        let one = HeldBack {
            holders: held.holders[..1].to_vec(),
            ..held
        };
        let m = stall_message(&one, Duration::from_secs(4), Some(10_000));
        assert!(m.starts_with("consumer #2 (pid 4242) has held"), "{m}");
        assert!(m.contains("holds a slot 10000 ms is detached"), "{m}");
    }

    #[test]
    fn socket_errors_name_the_path_and_what_to_do() {
        let sock = Path::new("/srv/rings/feed.sock");
        let os = |kind| Error::Os {
            what: "bind the attach socket",
            source: std::io::Error::from(kind),
        };
        let denied = bind_error(sock, os(std::io::ErrorKind::PermissionDenied));
        assert!(
            denied.contains("/srv/rings/feed.sock")
                && denied.contains("permission denied in /srv/rings"),
            "{denied}"
        );
        let missing = bind_error(sock, os(std::io::ErrorKind::NotFound));
        assert!(
            missing.contains("the directory /srv/rings does not exist"),
            "{missing}"
        );
        let in_use = bind_error(sock, os(std::io::ErrorKind::AddrInUse));
        assert!(
            in_use.contains("/srv/rings/feed.sock") && in_use.contains("in use"),
            "{in_use}"
        );
        // Not about the socket: the library's own words.
        let other = || Error::InvalidArgument("max_lead must be at least 1 batch".into());
        assert_eq!(bind_error(sock, other()), other().to_string());
    }
}
