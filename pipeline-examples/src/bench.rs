//! `gpipe bench`: one producer (this process) and N consumer processes (this binary's
//! `consume` command), every batch verified, results checked for loss and duplication.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use pipeline_core::{Mode, Producer, ProducerBackend, ProducerConfig};

use crate::work::{self, ConsumerReport, Fill};

/// Settings of one bench run (from the command line).
#[derive(Clone, Debug)]
pub struct BenchArgs {
    /// Consumer processes.
    pub consumers: u32,
    /// Delivery mode.
    pub mode: Mode,
    /// Slots.
    pub slots: u32,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// Batches to publish.
    pub batches: u64,
    /// Whole-run limit.
    pub timeout: Duration,
    /// JSON output.
    pub json: bool,
    /// Backend name for the report.
    pub backend: &'static str,
    /// Extra arguments for the consumer processes (backend selection).
    pub consumer_args: Vec<String>,
    /// Measure each batch's round trip (publish -> consumer done -> slot free); needs 1 slot.
    pub round_trip: bool,
}

/// The bench result.
#[derive(Debug, serde::Serialize)]
pub struct BenchReport {
    /// Backend used.
    pub backend: String,
    /// Delivery mode.
    pub mode: Mode,
    /// Consumers.
    pub consumers: u32,
    /// Slots.
    pub slots: u32,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// Batches published.
    pub published: u64,
    /// Seconds from the first timed batch (after the warm-up) to the last release.
    pub elapsed_s: f64,
    /// Batches published before timing started (verified, not timed).
    pub warmup: u64,
    /// Batches per second published and fully consumed.
    pub batches_per_s: f64,
    /// GB/s of batches handed over (published bytes / s).
    pub gb_per_s: f64,
    /// GB/s delivered summed over consumers (broadcast: x consumers).
    pub delivered_gb_per_s: f64,
    /// Each consumer's report.
    pub per_consumer: Vec<ConsumerReport>,
    /// Batches that failed verification.
    pub mismatches: u64,
    /// Batches lost (never delivered where they should have been).
    pub lost: u64,
    /// Batches delivered more than once (shared) or twice to one consumer.
    pub duplicated: u64,
    /// Seconds the producer spent in `acquire` waiting for consumers to release (whole run).
    pub producer_acquire_wait_s: f64,
    /// Round trip publish -> consumer done -> slot free, median (µs), with `--round-trip`.
    pub round_trip_p50_us: Option<f64>,
    /// Round trip, 99th percentile (µs).
    pub round_trip_p99_us: Option<f64>,
    /// Problems found, in words.
    pub problems: Vec<String>,
    /// Extra measurements the backend adds (e.g. the CUDA single-process ceiling).
    pub extra: serde_json::Value,
}

struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn temp_dir() -> Result<PathBuf, String> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("gpipe-bench-{}-{nanos}", std::process::id()));
    std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    Ok(dir)
}

/// Runs the bench with backend `B` filled by `fill`. `extra` may add measurements.
pub fn run<B: ProducerBackend, F: Fill<B>>(
    args: &BenchArgs,
    options: B::Options,
    fill: &mut F,
) -> Result<BenchReport, String> {
    let dir = temp_dir()?;
    let result = run_in(&dir, args, options, fill);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_in<B: ProducerBackend, F: Fill<B>>(
    dir: &Path,
    args: &BenchArgs,
    options: B::Options,
    fill: &mut F,
) -> Result<BenchReport, String> {
    if args.batch_bytes % 8 != 0 || args.batch_bytes == 0 {
        return Err("--batch-bytes must be a positive multiple of 8".into());
    }
    let sock = dir.join("ring.sock");
    let config = ProducerConfig {
        slots: args.slots,
        batch_bytes: args.batch_bytes,
        mode: args.mode,
        max_consumers: args.consumers.max(1),
        drain_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let deadline = Instant::now() + args.timeout;
    let mut producer: Producer<B> =
        Producer::bind(&sock, config, options).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Children(Vec::new());
    for i in 0..args.consumers {
        let child = Command::new(&exe)
            .arg("consume")
            .arg("--socket")
            .arg(&sock)
            .arg("--verify")
            .arg("--bench-child")
            .arg("--seq-log")
            .arg(dir.join(format!("consumer-{i}.seq")))
            .args(&args.consumer_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start consumer process: {e}"))?;
        children.0.push(child);
    }
    // Wait for every consumer to attach (a child that exits early fails the run).
    while producer.consumers() < args.consumers {
        for c in &mut children.0 {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(format!("a consumer process exited before attaching ({st})"));
            }
        }
        if Instant::now() >= deadline.min(Instant::now() + Duration::from_secs(60)) {
            return Err("consumers did not attach in time".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let bar = if std::io::stderr().is_terminal() && !args.json {
        let b = indicatif::ProgressBar::new(args.batches);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} batches ({per_sec})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(b)
    } else {
        None
    };
    let stop = AtomicBool::new(false);
    let mut timing = work::ProduceTiming {
        round_trips: args.round_trip.then(Vec::new),
        ..Default::default()
    };
    // The first batches warm up (kernel compilation, first touches) and are not timed, but
    // they are verified like every other.
    let warmup = (args.batches / 5).min(100);
    let mut timed_from: Option<Instant> = (warmup == 0).then(Instant::now);
    let published = work::produce_loop(
        &mut producer,
        fill,
        Some(args.batches),
        args.batch_bytes,
        &stop,
        &mut timing,
        |n, _| {
            if n == warmup {
                timed_from = Some(Instant::now());
            }
            if let Some(b) = &bar {
                if n % 64 == 0 {
                    b.set_position(n);
                }
            }
        },
    );
    // The timed run ends when every consumer has released (and, on a GPU, finished) the
    // last batch; closing (consumers detach, free their imports, exit) is not timed.
    let flushed = producer
        .flush(Duration::from_secs(60))
        .map_err(|e| e.to_string())
        .and_then(|_| fill.settle(producer.backend()));
    let elapsed = timed_from.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
    let stats = producer.close();
    flushed?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let published = published?;
    // Collect consumer reports.
    let mut per_consumer = Vec::new();
    let mut problems = Vec::new();
    for (i, mut c) in std::mem::take(&mut children.0).into_iter().enumerate() {
        let status = loop {
            match c.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => {
                    let _ = c.kill();
                    let _ = c.wait();
                    break None;
                }
            }
        };
        let mut out = String::new();
        if let Some(mut so) = c.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut so, &mut out);
        }
        let report = out
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<ConsumerReport>(l).ok());
        match (status, report) {
            (None, _) => problems.push(format!("consumer {i} hung and was killed")),
            (Some(_), None) => problems.push(format!("consumer {i} gave no report")),
            (Some(st), Some(r)) => {
                if let Some(e) = &r.error {
                    problems.push(format!("consumer {i}: {e}"));
                } else if !st.success() {
                    problems.push(format!("consumer {i} exited with {st}"));
                }
                per_consumer.push(r);
            }
        }
    }
    // Exact loss/duplication check from the sequence logs.
    let mut lost = 0u64;
    let mut duplicated = 0u64;
    let logs: Vec<Vec<u64>> = (0..args.consumers)
        .map(|i| read_seq_log(&dir.join(format!("consumer-{i}.seq"))))
        .collect();
    match args.mode {
        Mode::Broadcast => {
            for (i, log) in logs.iter().enumerate() {
                let mut seen = vec![0u32; published as usize];
                for &s in log {
                    if (s as usize) < seen.len() {
                        seen[s as usize] += 1;
                    }
                }
                let l = seen.iter().filter(|&&c| c == 0).count() as u64;
                let d = seen.iter().filter(|&&c| c > 1).count() as u64;
                if l > 0 {
                    problems.push(format!("consumer {i} missed {l} batches"));
                }
                if d > 0 {
                    problems.push(format!("consumer {i} got {d} batches twice"));
                }
                lost += l;
                duplicated += d;
            }
        }
        Mode::Shared => {
            let mut seen = vec![0u32; published as usize];
            for log in &logs {
                for &s in log {
                    if (s as usize) < seen.len() {
                        seen[s as usize] += 1;
                    }
                }
            }
            lost = seen.iter().filter(|&&c| c == 0).count() as u64;
            duplicated = seen.iter().filter(|&&c| c > 1).count() as u64;
            if lost > 0 {
                problems.push(format!("{lost} batches reached no consumer"));
            }
            if duplicated > 0 {
                problems.push(format!(
                    "{duplicated} batches reached more than one consumer"
                ));
            }
        }
    }
    let mismatches: u64 = per_consumer.iter().map(|r| r.mismatches).sum();
    if mismatches > 0 {
        problems.push(format!("{mismatches} batches failed checksum verification"));
    }
    if stats.died > 0 || stats.detached > 0 {
        problems.push(format!(
            "{} died and {} detached during the run",
            crate::duration::plural(stats.died, "consumer", "consumers"),
            stats.detached
        ));
    }
    let mut rtt = timing.round_trips.take().unwrap_or_default();
    rtt.sort_by(f64::total_cmp);
    let pct = |p: f64| -> Option<f64> {
        (!rtt.is_empty()).then(|| rtt[((rtt.len() - 1) as f64 * p).round() as usize] * 1e6)
    };
    let timed = published.saturating_sub(warmup);
    let delivered: u64 =
        per_consumer.iter().map(|r| r.bytes).sum::<u64>() * timed / published.max(1);
    let bytes = timed * args.batch_bytes;
    Ok(BenchReport {
        backend: args.backend.to_string(),
        mode: args.mode,
        consumers: args.consumers,
        slots: args.slots,
        batch_bytes: args.batch_bytes,
        published,
        elapsed_s: elapsed,
        warmup,
        batches_per_s: timed as f64 / elapsed,
        gb_per_s: bytes as f64 / elapsed / 1e9,
        delivered_gb_per_s: delivered as f64 / elapsed / 1e9,
        per_consumer,
        mismatches,
        lost,
        duplicated,
        producer_acquire_wait_s: timing.acquire_wait.as_secs_f64(),
        round_trip_p50_us: pct(0.5),
        round_trip_p99_us: pct(0.99),
        problems,
        extra: serde_json::Value::Null,
    })
}

/// Reads a sequence log written by [`write_seq_log`] (missing file: empty).
pub fn read_seq_log(path: &Path) -> Vec<u64> {
    std::fs::read(path)
        .map(|b| {
            b.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        })
        .unwrap_or_default()
}

/// Writes a sequence log (u64 little-endian each).
pub fn write_seq_log(path: &Path, seqs: &[u64]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(seqs.len() * 8);
    for s in seqs {
        b.extend_from_slice(&s.to_le_bytes());
    }
    std::fs::write(path, b)
}

/// Writes a JSON value as labelled lines ("ceiling batches per s: 142907"), nested objects
/// indented, for the text report (`--json` keeps the raw object).
fn write_labelled(
    f: &mut std::fmt::Formatter<'_>,
    v: &serde_json::Value,
    depth: usize,
) -> std::fmt::Result {
    fn scalar(v: &serde_json::Value) -> String {
        match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => u.to_string(),
                (_, Some(i), _) => i.to_string(),
                (_, _, Some(x)) if x.abs() >= 100.0 => format!("{x:.0}"),
                (_, _, Some(x)) => format!("{x:.3}"),
                _ => n.to_string(),
            },
            serde_json::Value::Array(a) => a.iter().map(scalar).collect::<Vec<_>>().join(", "),
            serde_json::Value::Null => "-".into(),
            other => other.to_string(),
        }
    }
    let pad = "  ".repeat(depth);
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let label = k.replace('_', " ");
                if v.is_object() {
                    writeln!(f, "{pad}{label}:")?;
                    write_labelled(f, v, depth + 1)?;
                } else {
                    writeln!(f, "{pad}{label}: {}", scalar(v))?;
                }
            }
            Ok(())
        }
        other => writeln!(f, "{pad}{}", scalar(other)),
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "gpipe bench: backend {} | mode {} | {} | {} slots | {} per batch",
            self.backend,
            self.mode,
            crate::duration::plural(self.consumers, "consumer", "consumers"),
            self.slots,
            crate::size::format(self.batch_bytes)
        )?;
        writeln!(
            f,
            "  {} timed batches (after {} warm-up) in {:.3} s: {:.0} batches/s, {:.2} GB/s handed over ({:.2} GB/s delivered to all consumers)",
            self.published - self.warmup,
            self.warmup,
            self.elapsed_s,
            self.batches_per_s,
            self.gb_per_s,
            self.delivered_gb_per_s
        )?;
        for r in &self.per_consumer {
            writeln!(
                f,
                "  consumer #{:<2} pid {:>7}: {:>8} batches, {} checksum mismatches{}",
                r.index,
                r.pid,
                r.received,
                r.mismatches,
                if r.verified { "" } else { " (not verified)" }
            )?;
        }
        writeln!(
            f,
            "  where the time went: producer waited {:.3} s for free slots; consumers waited {} s for batches",
            self.producer_acquire_wait_s,
            self.per_consumer
                .iter()
                .map(|r| format!("{:.3}", r.recv_wait_s))
                .collect::<Vec<_>>()
                .join("/")
        )?;
        if let (Some(p50), Some(p99)) = (self.round_trip_p50_us, self.round_trip_p99_us) {
            writeln!(
                f,
                "  round trip (publish -> consumer done -> slot free): p50 {p50:.1} µs, p99 {p99:.1} µs"
            )?;
        }
        if !self.extra.is_null() {
            write_labelled(f, &self.extra, 1)?;
        }
        if self.problems.is_empty() {
            writeln!(f, "  OK: every batch verified; none lost, none duplicated")
        } else {
            for p in &self.problems {
                writeln!(f, "  PROBLEM: {p}")?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod report_tests {
    use super::write_labelled;

    struct Show(serde_json::Value);
    impl std::fmt::Display for Show {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write_labelled(f, &self.0, 1)
        }
    }

    #[test]
    fn extra_figures_become_labelled_lines() {
        let v = serde_json::json!({
            "ceiling_batches_per_s": 142907.4,
            "ratio_to_ceiling": 0.7712,
            "memory": "pool",
            "attach": {"total_us": 812, "slots": [31, 40]},
        });
        let text = Show(v).to_string();
        assert!(text.contains("  ceiling batches per s: 142907\n"), "{text}");
        assert!(text.contains("  ratio to ceiling: 0.771\n"), "{text}");
        assert!(text.contains("  memory: pool\n"), "{text}");
        assert!(
            text.contains("  attach:\n    slots: 31, 40\n    total us: 812\n"),
            "{text}"
        );
        assert!(!text.contains('{'), "{text}");
    }
}
