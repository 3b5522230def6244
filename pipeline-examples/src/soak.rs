//! `gpipe soak`: run a ring for a given time while consumers join, leave and are killed at
//! random; check every batch a surviving consumer received (verified, contiguous, nothing
//! lost or duplicated) and watch the producer's memory and open fds for growth.

use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pipeline_core::{HostOptions, HostProducer, Mode, Producer, ProducerBackend, ProducerConfig};
use pipeline_cuda::backend::CudaProducer;

use crate::args::{BackendArg, CudaArgs, RingArgs, resolve_backend};
use crate::duration::plural;
use crate::work::{self, ConsumerReport, Fill};
use crate::{duration, gpu};

/// Arguments of `gpipe soak`.
#[derive(clap::Args)]
pub struct SoakCmd {
    /// Which backend.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
    /// How long (30s, 10m, 1h, or seconds). Ctrl-C ends the run early: what ran is still
    /// checked, and the report says it stopped early (exit status 130 when nothing else was
    /// wrong, 1 when something was).
    #[arg(long, value_parser = duration::parse, default_value = "60s")]
    duration: Duration,
    /// Most consumer processes at once.
    #[arg(long, default_value_t = 6)]
    max_consumers: u32,
    #[command(flatten)]
    ring: RingArgs,
    #[command(flatten)]
    cuda: CudaArgs,
    /// Seed of the random schedule (replay a failing run with the same seed).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mean milliseconds between chaos actions (starting or killing a consumer).
    #[arg(long, default_value_t = 150)]
    tick_ms: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `gpipe soak`.
pub fn command(cmd: SoakCmd) -> Result<ExitCode, String> {
    crate::args::check_shape(
        cmd.ring.slots,
        cmd.ring.batch_bytes,
        cmd.max_consumers,
        "--max-consumers",
    )?;
    let mut args = SoakArgs {
        tick_ms: cmd.tick_ms,
        duration: cmd.duration,
        max_consumers: cmd.max_consumers,
        mode: cmd.ring.mode.into(),
        slots: cmd.ring.slots_or_default(),
        batch_bytes: cmd.ring.batch_bytes,
        max_lead: None,
        seed: cmd.seed,
        backend: "host",
    };
    let backend = resolve_backend(cmd.backend)?;
    args.slots = cmd.ring.depth(backend == BackendArg::Cuda)?.slots;
    crate::args::check_memory(backend, args.slots, args.batch_bytes)?;
    args.max_lead = cmd
        .ring
        .lead(backend == BackendArg::Cuda, args.slots)?
        .max_lead;
    let report = match backend {
        BackendArg::Host => {
            run::<HostProducer, _>(&args, HostOptions::default(), &mut work::HostFill)?
        }
        _ => {
            args.backend = "cuda";
            run::<CudaProducer, _>(&args, cmd.cuda.options()?, &mut gpu::CudaFill::default())?
        }
    };
    let code = crate::output::print_report(&report, cmd.json, report.problems.is_empty())?;
    // A problem in what ran fails the run (1); with none, a run cut short by Ctrl-C is not a
    // pass either: it says so (130, as a shell reports a process Ctrl-C stopped).
    Ok(if report.problems.is_empty() && report.interrupted {
        ExitCode::from(crate::signals::EXIT_INTERRUPTED)
    } else {
        code
    })
}

/// Pids of the consumers this process's soak SIGKILLed on purpose. The producer, not told,
/// logs each death as a warning; the terminal log drops those (see [`killed_on_purpose`])
/// and the report counts them.
static KILLED: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

/// Whether `pid` is a consumer the running soak killed on purpose: its death is expected,
/// not something to warn a user about.
pub fn killed_on_purpose(pid: u64) -> bool {
    u32::try_from(pid).is_ok_and(|pid| {
        KILLED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&pid)
    })
}

/// SIGKILLs a consumer, first recording it as killed on purpose.
fn kill_on_purpose(child: &mut Child) -> bool {
    let pid = child.id();
    KILLED.lock().unwrap_or_else(|e| e.into_inner()).insert(pid);
    tracing::debug!(pid, "soak: killing a consumer on purpose");
    child.kill().is_ok()
}

/// Soak settings.
#[derive(Clone, Debug)]
pub struct SoakArgs {
    /// How long to run.
    pub duration: Duration,
    /// Most consumers alive at once.
    pub max_consumers: u32,
    /// Delivery mode.
    pub mode: Mode,
    /// Slots.
    pub slots: u32,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// The producer-lead bound (None: the ring's own).
    pub max_lead: Option<u32>,
    /// Seed of the random schedule.
    pub seed: u64,
    /// Mean time between chaos actions (start, kill) in milliseconds.
    pub tick_ms: u64,
    /// Backend name for the report.
    pub backend: &'static str,
}

/// What a soak found.
#[derive(Debug, Default, serde::Serialize)]
pub struct SoakReport {
    /// Backend.
    pub backend: String,
    /// Mode.
    pub mode: String,
    /// Seconds run.
    pub duration_s: f64,
    /// Seconds asked for (`--duration`).
    pub requested_s: f64,
    /// Ctrl-C (or SIGTERM) ended the run before `requested_s`: the checks cover what ran.
    pub interrupted: bool,
    /// Batches published.
    pub published: u64,
    /// Consumers started.
    pub consumers_started: u64,
    /// Consumers SIGKILLed on purpose.
    pub consumers_killed: u64,
    /// Consumer deaths the producer handled (those of the killed consumers that had joined
    /// the ring: expected, not warned about).
    pub consumers_died: u64,
    /// Consumers that left cleanly (after a random number of batches, or at the end).
    pub consumers_left: u64,
    /// Batches delivered to consumers that left cleanly (whose logs are checked).
    pub delivered: u64,
    /// Of those, verified by checksum.
    pub verified: u64,
    /// Checksum mismatches.
    pub mismatches: u64,
    /// Batches missing from a clean consumer's contiguous range (broadcast), or delivered to
    /// no one where they should have been.
    pub lost: u64,
    /// Batches delivered twice to one consumer, or to two consumers in shared mode.
    pub duplicated: u64,
    /// Producer resident memory after warm-up and at the end, KiB.
    pub rss_kib_after_warmup: u64,
    /// Producer resident memory at the end, KiB.
    pub rss_kib_end: u64,
    /// Peak resident memory, KiB.
    pub rss_kib_peak: u64,
    /// Resident memory at each tenth of the run (the first at 10 %), KiB: tells a warm-up
    /// curve that levels off from steady growth.
    pub rss_kib_series: Vec<u64>,
    /// Growth of resident memory over the second half of the run, KiB per 1000 consumers
    /// started in that half (0 when too few started to tell).
    pub rss_kib_per_1000_consumers_late: f64,
    /// Open fds after warm-up.
    pub fds_after_warmup: u64,
    /// Open fds at the end (before close).
    pub fds_end: u64,
    /// Peak open fds.
    pub fds_peak: u64,
    /// Open fds before the run, no consumer attached.
    pub fds_idle_start: u64,
    /// Open fds after the run and the close, no consumer attached.
    pub fds_idle_end: u64,
    /// Memory the backend holds for the ring at the start and at the end (CUDA: the pool's
    /// reserved device memory), bytes.
    pub backend_bytes_start: Option<u64>,
    /// As above, at the end.
    pub backend_bytes_end: Option<u64>,
    /// Problems, in words.
    pub problems: Vec<String>,
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Resident-memory growth from the middle of the run to its end, per 1000 consumers started
/// in between. `series` holds (RSS KiB, consumers started so far) at each tenth of the run.
fn late_growth(series: &[(u64, u64)]) -> f64 {
    let (Some(mid), Some(end)) = (
        series.get(series.len().saturating_sub(1) / 2),
        series.last(),
    ) else {
        return 0.0;
    };
    let consumers = end.1.saturating_sub(mid.1);
    if series.len() < 4 || consumers < 20 {
        return 0.0;
    }
    (end.0 as f64 - mid.0 as f64) * 1000.0 / consumers as f64
}

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

/// A tiny deterministic generator (xorshift64*), so a failing schedule can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

struct Live {
    child: Child,
    /// Its number: its report goes to `c{n}.out`, its sequence log to `c{n}.seq`.
    n: u64,
}

/// Where consumer `n` writes its report and its sequence log.
fn outputs(dir: &Path, n: u64) -> (PathBuf, PathBuf) {
    (dir.join(format!("c{n}.out")), dir.join(format!("c{n}.seq")))
}

/// Where consumer `n` writes its error output (read only when it ends without a report).
fn errors(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("c{n}.err"))
}

#[derive(Default)]
struct Tally {
    started: u64,
    killed: u64,
    /// Consumers that ended without SIGKILL: (number, ended after the close, how it exited,
    /// for a problem report). Their reports and logs stay on disk until the run's last memory
    /// sample is taken, so the producer's RSS measures the producer and not this bookkeeping
    /// (a log holds every batch seen).
    ended: Vec<(u64, bool, String)>,
    problems: Vec<String>,
}

fn reap(dir: &Path, live: &mut Vec<Live>, tally: &mut Tally, at_end: bool) {
    let mut i = 0;
    while i < live.len() {
        let done = match live[i].child.try_wait() {
            Ok(Some(_)) => true,
            Ok(None) => false,
            Err(_) => true,
        };
        if !done {
            i += 1;
            continue;
        }
        let mut l = live.swap_remove(i);
        let status = l.child.wait().ok();
        let killed = {
            use std::os::unix::process::ExitStatusExt;
            status.and_then(|s| s.signal()) == Some(libc::SIGKILL)
        };
        if killed {
            let (out, seq) = outputs(dir, l.n);
            let _ = (std::fs::remove_file(out), std::fs::remove_file(seq));
            let _ = std::fs::remove_file(errors(dir, l.n));
            continue;
        }
        let how = match status {
            Some(s) => s.to_string(),
            None => "its exit status unknown".to_string(),
        };
        tally.ended.push((l.n, at_end, how));
    }
}

/// Reads the report and the sequence log of a consumer that ended without SIGKILL.
fn read_ended(
    dir: &Path,
    (n, at_end, how): (u64, bool, &str),
    problems: &mut Vec<String>,
) -> Option<(ConsumerReport, Vec<u64>)> {
    let (out, seq) = outputs(dir, n);
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let Some(r) = text
        .lines()
        .rev()
        .find_map(|x| serde_json::from_str::<ConsumerReport>(x).ok())
    else {
        let said = std::fs::read_to_string(errors(dir, n)).unwrap_or_default();
        let said = said.trim();
        problems.push(if said.is_empty() {
            format!("consumer {n} exited without a report ({how})")
        } else {
            let tail: Vec<&str> = said.lines().rev().take(3).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            format!(
                "consumer {n} exited without a report ({how}); it said: {}",
                tail.join(" / ")
            )
        });
        return None;
    };
    if let Some(e) = &r.error {
        // One still attaching when the ring closed is refused (or finds the socket gone):
        // it never joined, so it has nothing to lose. Not a failure.
        let late = at_end && r.received == 0 && (r.attach_failed || e.contains("shut down"));
        if !late {
            problems.push(format!("consumer pid {} ended with: {e}", r.pid));
        }
    }
    Some((r, crate::bench::read_seq_log(&seq)))
}

/// Runs the soak with backend `B`.
pub fn run<B: ProducerBackend, F: Fill<B>>(
    args: &SoakArgs,
    options: B::Options,
    fill: &mut F,
) -> Result<SoakReport, String> {
    crate::args::check_pattern_bytes(args.batch_bytes)?;
    let dir = std::env::temp_dir().join(format!("gpipe-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let sock = dir.join("ring.sock");
    let config = ProducerConfig {
        slots: args.slots,
        batch_bytes: args.batch_bytes,
        mode: args.mode,
        max_consumers: args.max_consumers.max(1),
        drain_timeout: Duration::from_secs(30),
        max_lead: args.max_lead,
        ..Default::default()
    };
    let mut producer: Producer<B> =
        Producer::bind(&sock, config, options).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let backend_bytes_start = producer.backend().memory_in_use();
    // Open fds with no consumer attached, before and after the run: a leak shows as a
    // difference (samples in between vary with how many consumers are attached).
    let fds_idle_start = open_fds();
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let live: Arc<Mutex<Vec<Live>>> = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(AtomicBool::new(false));
    // The chaos thread: starts, ends and kills consumers at random, and ends the run.
    let chaos = {
        let (stop, tally, live, sock, dir) = (
            stop.clone(),
            tally.clone(),
            live.clone(),
            sock.clone(),
            dir.clone(),
        );
        let (max, seed, duration, tick) = (
            args.max_consumers,
            args.seed,
            args.duration,
            args.tick_ms.max(2),
        );
        let done = done.clone();
        std::thread::spawn(move || {
            let mut rng = Rng(seed | 1);
            let mut n = 0u64;
            let began = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if began.elapsed() >= duration || crate::signals::STOP.load(Ordering::Relaxed) {
                    // Tell the producer to finish; keep reaping until it stops us.
                    done.store(true, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(tick / 2 + rng.below(tick)));
                let mut lv = live.lock().unwrap_or_else(|e| e.into_inner());
                let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
                reap(&dir, &mut lv, &mut t, false);
                // Once the run is over, neither start (it would race the close) nor kill.
                // (Ctrl-C during this tick's sleep counts too: a consumer started now would
                // race the close.)
                if crate::signals::STOP.load(Ordering::Relaxed) {
                    done.store(true, Ordering::Relaxed);
                }
                let ending = done.load(Ordering::Relaxed);
                let roll = if ending { 100 } else { rng.below(100) };
                if !ending && (lv.len() as u32) < max && (roll < 45 || lv.is_empty()) {
                    n += 1;
                    let (out, log) = outputs(&dir, n);
                    let quota = 100 + rng.below(40_000);
                    let spawned = Command::new(&exe)
                        // A group of its own: a terminal's Ctrl-C reaches the soak only,
                        // which then ends the run as it would at the end of its time (the
                        // ring closes, the consumers drain, their batches are checked).
                        .process_group(0)
                        .args(["consume", "--socket"])
                        .arg(&sock)
                        .args(["--verify", "--bench-child", "--max-batches"])
                        .arg(quota.to_string())
                        .arg("--seq-log")
                        .arg(&log)
                        .stdin(Stdio::null())
                        .stdout(match std::fs::File::create(&out) {
                            Ok(f) => Stdio::from(f),
                            Err(_) => Stdio::null(),
                        })
                        .stderr(match std::fs::File::create(errors(&dir, n)) {
                            Ok(f) => Stdio::from(f),
                            Err(_) => Stdio::null(),
                        })
                        .spawn();
                    match spawned {
                        Ok(child) => {
                            t.started += 1;
                            lv.push(Live { child, n });
                        }
                        Err(e) => t.problems.push(format!("cannot start a consumer: {e}")),
                    }
                } else if roll < 65 && !lv.is_empty() {
                    let i = rng.below(lv.len() as u64) as usize;
                    if kill_on_purpose(&mut lv[i].child) {
                        t.killed += 1;
                    }
                }
            }
        })
    };
    let start = Instant::now();
    let warmup = args.duration / 5;
    let mut warm = (0u64, 0u64);
    let (mut rss_peak, mut fds_peak) = (0u64, 0u64);
    let mut last_sample = Instant::now();
    let mut series: Vec<(u64, u64)> = Vec::with_capacity(10);
    let tenth = args.duration / 10;
    let started_now = {
        let tally = tally.clone();
        move || tally.lock().unwrap_or_else(|e| e.into_inner()).started
    };
    let mut last_print = Instant::now();
    let mut timing = work::ProduceTiming::default();
    let published = work::produce_loop(
        &mut producer,
        fill,
        None,
        args.batch_bytes,
        &done,
        &mut timing,
        |n, consumers| {
            if last_sample.elapsed() >= Duration::from_millis(250) {
                last_sample = Instant::now();
                let (r, f) = (rss_kib(), open_fds());
                rss_peak = rss_peak.max(r);
                fds_peak = fds_peak.max(f);
                if warm == (0, 0) && start.elapsed() >= warmup {
                    warm = (r, f);
                }
                while series.len() < 9 && start.elapsed() >= tenth * (series.len() as u32 + 1) {
                    series.push((r, started_now()));
                }
            }
            if last_print.elapsed() >= Duration::from_secs(10) {
                last_print = Instant::now();
                eprintln!(
                    "gpipe soak: {:>5.0} s, {}, {} attached",
                    start.elapsed().as_secs_f64(),
                    plural(n, "batch", "batches"),
                    plural(consumers, "consumer", "consumers")
                );
            }
        },
    );
    let interrupted =
        crate::signals::STOP.load(Ordering::Relaxed) && start.elapsed() < args.duration;
    let (rss_end, fds_end) = (rss_kib(), open_fds());
    series.push((rss_end, started_now()));
    let backend_bytes_end = producer.backend().memory_in_use();
    stop.store(true, Ordering::Relaxed);
    let _ = chaos.join();
    let stats = producer.close();
    let fds_idle_end = open_fds();
    let published = published?;
    // Everyone left now ends cleanly (the ring is closed): collect their reports.
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let mut lv = live.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
        reap(&dir, &mut lv, &mut t, true);
        if lv.is_empty() {
            break;
        }
        if Instant::now() >= end {
            for l in lv.iter_mut() {
                let _ = kill_on_purpose(&mut l.child);
            }
            t.problems
                .push("consumers did not end after the ring closed".into());
            break;
        }
        drop((lv, t));
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut t = std::mem::take(&mut *tally.lock().unwrap_or_else(|e| e.into_inner()));
    let mut reports = Vec::with_capacity(t.ended.len());
    for (n, at_end, how) in &t.ended {
        if let Some((r, log)) = read_ended(&dir, (*n, *at_end, how), &mut t.problems) {
            reports.push((r, log, *at_end));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut rep = SoakReport {
        backend: args.backend.to_string(),
        mode: args.mode.to_string(),
        duration_s: start.elapsed().as_secs_f64(),
        requested_s: args.duration.as_secs_f64(),
        interrupted,
        published,
        consumers_started: t.started,
        consumers_killed: t.killed,
        consumers_died: stats.died,
        consumers_left: reports.len() as u64,
        rss_kib_after_warmup: warm.0,
        rss_kib_end: rss_end,
        rss_kib_peak: rss_peak,
        rss_kib_series: series.iter().map(|s| s.0).collect(),
        rss_kib_per_1000_consumers_late: late_growth(&series),
        fds_after_warmup: warm.1,
        fds_end,
        fds_peak,
        backend_bytes_start,
        backend_bytes_end,
        ..Default::default()
    };
    if let (Some(a), Some(b)) = (backend_bytes_start, backend_bytes_end) {
        if b > a {
            t.problems
                .push(format!("the backend's memory grew from {a} to {b} bytes"));
        }
    }
    let mut shared_seen = std::collections::HashSet::new();
    for (r, log, at_end) in &reports {
        rep.delivered += r.received;
        rep.mismatches += r.mismatches;
        if r.verified {
            rep.verified += r.received - r.mismatches - r.taken_back;
        }
        if log.len() as u64 != r.received {
            t.problems.push(format!(
                "consumer pid {} logged {} batches but reported {}",
                r.pid,
                log.len(),
                r.received
            ));
        }
        match args.mode {
            Mode::Broadcast => {
                let before = rep.lost;
                for w in log.windows(2) {
                    if w[1] <= w[0] {
                        rep.duplicated += 1;
                    } else {
                        rep.lost += w[1] - w[0] - 1;
                    }
                }
                // Alive at the close (not stopped by its quota just before): it must have
                // drained to the last batch.
                if *at_end && r.error.is_none() && !r.reached_quota && !log.is_empty() {
                    let last = *log.last().unwrap_or(&0);
                    if last + 1 < published {
                        rep.lost += published - 1 - last;
                    }
                }
                if rep.lost > before {
                    t.problems.push(format!(
                        "consumer pid {} (batches {:?}..={:?}, {} received, quota reached: {}) misses {}",
                        r.pid,
                        r.first_seq,
                        r.last_seq,
                        r.received,
                        r.reached_quota,
                        rep.lost - before
                    ));
                }
            }
            Mode::Shared => {
                for s in log {
                    if !shared_seen.insert(*s) {
                        rep.duplicated += 1;
                    }
                }
            }
        }
    }
    if rep.lost > 0 {
        t.problems
            .push(format!("{} lost", plural(rep.lost, "batch", "batches")));
    }
    if rep.duplicated > 0 {
        t.problems.push(format!(
            "{} duplicated",
            plural(rep.duplicated, "batch", "batches")
        ));
    }
    if rep.mismatches > 0 {
        t.problems.push(plural(
            rep.mismatches,
            "checksum mismatch",
            "checksum mismatches",
        ));
    }
    rep.fds_idle_start = fds_idle_start;
    rep.fds_idle_end = fds_idle_end;
    if fds_idle_end > fds_idle_start {
        t.problems.push(format!(
            "producer fds grew from {fds_idle_start} before the run to {fds_idle_end} after it (no consumer attached either time)"
        ));
    }
    if rep.rss_kib_after_warmup > 0 && rep.rss_kib_end > rep.rss_kib_after_warmup * 5 / 4 + 4096 {
        t.problems.push(format!(
            "producer RSS grew from {} KiB after warm-up to {} KiB at the end",
            rep.rss_kib_after_warmup, rep.rss_kib_end
        ));
    }
    // Steady growth shows in the second half, after any warm-up has settled.
    let mid = series.len().saturating_sub(1) / 2;
    if let (Some(m), Some(e)) = (series.get(mid), series.last()) {
        if series.len() >= 4 && e.0 > m.0 + 1024 + m.0 / 50 {
            t.problems.push(format!(
                "producer RSS grew from {} KiB at mid-run to {} KiB at the end while {} consumers started",
                m.0,
                e.0,
                e.1.saturating_sub(m.1)
            ));
        }
    }
    if stats.died < t.killed.saturating_sub(stats.left + stats.detached) / 2 {
        // Informational cross-check only; kills of consumers still attaching are not deaths.
        tracing::info!(
            died = stats.died,
            killed = t.killed,
            "soak: death accounting"
        );
    }
    rep.problems = t.problems;
    Ok(rep)
}

impl std::fmt::Display for SoakReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ran = if self.interrupted {
            format!(
                "{:.0} s of {:.0} s, stopped early by Ctrl-C",
                self.duration_s, self.requested_s
            )
        } else {
            format!("{:.0} s", self.duration_s)
        };
        writeln!(
            f,
            "gpipe soak: backend {} | mode {} | {ran} | {} published",
            self.backend,
            self.mode,
            plural(self.published, "batch", "batches")
        )?;
        writeln!(
            f,
            "  consumers: {} started, {} killed on purpose ({} of them after joining, cleaned up by the producer), {} left cleanly",
            self.consumers_started, self.consumers_killed, self.consumers_died, self.consumers_left
        )?;
        writeln!(
            f,
            "  batches delivered to clean consumers {}, verified {}, lost {}, duplicated {}, mismatches {}",
            self.delivered, self.verified, self.lost, self.duplicated, self.mismatches
        )?;
        writeln!(
            f,
            "  producer RSS {} after warm-up, {} KiB at the end (peak {}); open fds {} before the run, {} after it (peak {} with consumers attached)",
            match self.rss_kib_after_warmup {
                0 => "not measured (the run ended before its warm-up did)".to_string(),
                k => format!("{k} KiB"),
            },
            self.rss_kib_end,
            self.rss_kib_peak,
            self.fds_idle_start,
            self.fds_idle_end,
            self.fds_peak
        )?;
        if !self.rss_kib_series.is_empty() {
            let mib: Vec<String> = self
                .rss_kib_series
                .iter()
                .map(|k| format!("{:.1}", *k as f64 / 1024.0))
                .collect();
            writeln!(
                f,
                "  producer RSS at each tenth of the run, MiB: {}; second half: {:+.0} KiB per 1000 consumers",
                mib.join(" "),
                self.rss_kib_per_1000_consumers_late
            )?;
        }
        if let (Some(a), Some(b)) = (self.backend_bytes_start, self.backend_bytes_end) {
            writeln!(f, "  backend memory {a} bytes at the start, {b} at the end")?;
        }
        for p in &self.problems {
            writeln!(f, "  PROBLEM: {p}")?;
        }
        match (self.interrupted, self.problems.is_empty()) {
            (false, true) => writeln!(f, "  OK: nothing lost, nothing duplicated, no growth"),
            (false, false) => Ok(()),
            (true, clean) => writeln!(
                f,
                "  STOPPED EARLY: interrupted after {:.0} s of the {:.0} s asked for{}",
                self.duration_s,
                self.requested_s,
                if clean {
                    "; in what ran: nothing lost, nothing duplicated, no growth"
                } else {
                    ""
                }
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{SoakReport, late_growth};

    #[test]
    fn an_interrupted_run_says_how_far_it_got_and_not_ok() {
        let r = SoakReport {
            duration_s: 8.2,
            requested_s: 20.0,
            interrupted: true,
            published: 1,
            consumers_killed: 3,
            consumers_died: 1,
            ..Default::default()
        };
        let text = r.to_string();
        assert!(
            text.contains("| 8 s of 20 s, stopped early by Ctrl-C |"),
            "{text}"
        );
        assert!(text.contains("1 batch published"), "{text}");
        assert!(
            text.contains("3 killed on purpose (1 of them after joining"),
            "{text}"
        );
        assert!(
            text.contains(
                "STOPPED EARLY: interrupted after 8 s of the 20 s asked for; in what ran"
            ),
            "{text}"
        );
        assert!(!text.contains("OK:"), "{text}");
        let done = SoakReport {
            duration_s: 20.0,
            requested_s: 20.0,
            ..Default::default()
        };
        assert!(done.to_string().contains("| 20 s |"));
        assert!(done.to_string().contains("  OK: nothing lost"));
    }

    #[test]
    fn late_growth_is_per_1000_consumers_over_the_second_half() {
        // Flat after warm-up: nothing.
        let flat: Vec<(u64, u64)> = (0..10)
            .map(|i| (if i == 0 { 900 } else { 1000 }, i * 100))
            .collect();
        assert_eq!(late_growth(&flat), 0.0);
        // 5 KiB per consumer from the middle (index 4) to the end (index 9).
        let leak: Vec<(u64, u64)> = (0..10).map(|i| (1000 + 500 * i, 100 * i)).collect();
        assert_eq!(late_growth(&leak), 5000.0);
        // Too few consumers or samples to tell.
        assert_eq!(late_growth(&[(1, 0), (9, 5), (20, 10), (40, 15)]), 0.0);
        assert_eq!(late_growth(&[(1, 0), (900, 500)]), 0.0);
    }
}
