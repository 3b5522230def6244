//! One bench run: the producer's ring in this process, the forwarders of a chain or tree
//! fan-out and the consumer processes (this binary's `relay forward` and `consume`), the
//! timed loop, and what the children report.

use std::io::IsTerminal;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use pipeline_core::{Producer, ProducerBackend, ProducerConfig};
use pipeline_relay::{Fanout, FanoutPlan, RelayReport};

use super::args::{Backend, BenchArgs, warmup_of};
use super::report::{BenchReport, FanoutReport, RingReport};
use super::seq_log;
use crate::duration;
use crate::work::{self, ConsumerReport, Fill};

/// Child processes, killed and reaped when dropped (a run that fails leaves none behind).
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
    let nanos = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("gpipe-bench-{}-{nanos}", std::process::id()));
    std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    Ok(dir)
}

/// Runs the bench with backend `B` filled by `fill`, in a directory of its own (the sockets
/// and the consumers' sequence logs), removed afterwards.
pub fn run<B: ProducerBackend, F: Fill<B>>(
    args: &BenchArgs,
    options: B::Options,
    fill: &mut F,
) -> Result<BenchReport, String> {
    let dir = temp_dir()?;
    let result = run_in(&dir, args, options, fill);
    // The forwarders' chunk progress boards (in /dev/shm), which a forwarder that failed or
    // was killed leaves behind.
    for r in 1..args.plan().rings.len() {
        let _ = std::fs::remove_file(pipeline_relay::chunks::board_path(&ring_sock(&dir, r)));
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The socket of ring `r` in `dir` (ring 0: the producer's).
fn ring_sock(dir: &Path, r: usize) -> PathBuf {
    if r == 0 {
        dir.join("ring.sock")
    } else {
        dir.join(format!("ring-{r}.sock"))
    }
}

/// The sequence log of consumer `i` in `dir`.
fn seq_log_path(dir: &Path, i: u32) -> PathBuf {
    dir.join(format!("consumer-{i}.seq"))
}

fn run_in<B: ProducerBackend, F: Fill<B>>(
    dir: &Path,
    args: &BenchArgs,
    options: B::Options,
    fill: &mut F,
) -> Result<BenchReport, String> {
    crate::args::check_pattern_bytes(args.batch_bytes)?;
    let plan = args.plan();
    let config = ProducerConfig {
        slots: args.slots,
        batch_bytes: args.batch_bytes,
        mode: args.mode,
        max_consumers: plan.attachments(0).max(1),
        drain_timeout: Duration::from_secs(30),
        max_lead: args.max_lead,
        ..Default::default()
    };
    let deadline = Instant::now() + args.timeout;
    let mut producer: Producer<B> =
        Producer::bind(ring_sock(dir, 0), config, options).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Children(Vec::new());
    let chunk = args.chunk_bytes()?;
    let hosts = forwarder_hosts(args, &plan);
    let shape = Shape {
        plan: &plan,
        hosts: &hosts,
        chunk,
    };
    let mut forwarders = start_forwarders(&exe, dir, args, &shape, deadline)?;
    start_consumers(
        &exe,
        dir,
        args,
        &shape,
        &mut children,
        &mut forwarders,
        deadline,
    )?;
    // Wait for everything that reads the producer's ring to attach (a child that exits early
    // fails the run).
    while producer.consumers() < plan.attachments(0) {
        for c in children.0.iter_mut().chain(forwarders.0.iter_mut()) {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(format!(
                    "a consumer or forwarder process exited before attaching ({st})"
                ));
            }
        }
        if Instant::now() >= deadline.min(Instant::now() + Duration::from_secs(60)) {
            return Err("consumers did not attach in time".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let bar = progress_bar(args);
    // Ctrl-C ends the run early; the report covers the batches published until then.
    let stop = &crate::signals::STOP;
    let mut timing = work::ProduceTiming {
        round_trips: args.round_trip.then(Vec::new),
        timed_from: warmup_of(args.batches),
        ..Default::default()
    };
    // The first batches warm up (kernel compilation, first touches) and are not timed, but
    // they are verified like every other.
    let warmup = warmup_of(args.batches);
    let mut timed_from: Option<Instant> = (warmup == 0).then(Instant::now);
    let mut timed_from_wall = SystemTime::now();
    let published = work::produce_loop(
        &mut producer,
        fill,
        Some(args.batches),
        args.batch_bytes,
        stop,
        &mut timing,
        |n, _| {
            if n == warmup {
                timed_from = Some(Instant::now());
                timed_from_wall = SystemTime::now();
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
    let mut elapsed = timed_from.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
    let stats = producer.close();
    flushed?;
    // A fan-out's run ends when the last ring drained: each forwarder says when its own did.
    let mut problems = Vec::new();
    let mut forwarded = collect_forwarders(&mut forwarders, &hosts, deadline, &mut problems);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let published = published?;
    let per_consumer = collect_consumers(&mut children, deadline, &mut problems);
    // The forwarders that ran in consumers' processes report through them.
    for (r, host) in hosts.iter().enumerate() {
        let Some(i) = host else { continue };
        let report = per_consumer
            .iter()
            .find(|c| c.bench_index == Some(*i as u32))
            .and_then(|c| c.forwarder.clone());
        match &report {
            None => problems.push(format!(
                "the forwarder of ring {r} (in consumer {i}'s process) gave no report"
            )),
            Some(f) => {
                if let Some(e) = &f.error {
                    problems.push(format!(
                        "the forwarder of ring {r} (in consumer {i}'s process): {e}"
                    ));
                }
            }
        }
        if let Some(slot) = r.checked_sub(1).and_then(|k| forwarded.get_mut(k)) {
            *slot = report;
        }
    }
    if let Ok(start) = timed_from_wall.duration_since(std::time::UNIX_EPOCH) {
        for f in forwarded.iter().flatten() {
            if let Some(t) = f.drained_at_unix_s {
                elapsed = elapsed.max(t - start.as_secs_f64());
            }
        }
    }
    // Exact loss/duplication check from the sequence logs.
    let logs: Vec<Vec<u64>> = (0..args.consumers)
        .map(|i| seq_log::read_seq_log(&seq_log_path(dir, i)))
        .collect();
    let tally = seq_log::tally(args.mode, &logs, published, &mut problems);
    let mismatches: u64 = per_consumer.iter().map(|r| r.mismatches).sum();
    if mismatches > 0 {
        problems.push(format!("{mismatches} batches failed checksum verification"));
    }
    if stats.died > 0 || stats.detached > 0 {
        problems.push(format!(
            "{} died and {} detached during the run",
            duration::plural(stats.died, "consumer", "consumers"),
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
        backend: args.backend,
        mode: args.mode,
        consumers: args.consumers,
        slots: args.slots,
        max_lead: args.max_lead,
        passes: (0..args.consumers).map(|i| args.passes_of(i)).collect(),
        batch_bytes: args.batch_bytes,
        published,
        elapsed_s: elapsed,
        warmup,
        batches_per_s: timed as f64 / elapsed,
        gb_per_s: bytes as f64 / elapsed / 1e9,
        delivered_gb_per_s: delivered as f64 / elapsed / 1e9,
        per_consumer,
        mismatches,
        lost: tally.lost,
        duplicated: tally.duplicated,
        producer_acquire_wait_s: timing.acquire_wait.as_secs_f64(),
        producer_fill_s: timing.fill.as_secs_f64(),
        producer_publish_s: timing.publish.as_secs_f64(),
        producer_host_timed: timing.timed,
        round_trip_p50_us: pct(0.5),
        round_trip_p99_us: pct(0.99),
        problems,
        fanout: fanout_report(&plan, &forwarded, chunk, hosts.iter().any(Option::is_some)).map(
            |f| FanoutReport {
                why: args.fanout.why(plan.rings.len() - 1),
                ..f
            },
        ),
        cuda: None,
        repetitions: None,
    })
}

/// A fan-out as the processes of a run carry it out: the plan, where each forwarder runs
/// ([`forwarder_hosts`]) and the forwarders' chunk size.
#[derive(Clone, Copy)]
struct Shape<'a> {
    plan: &'a FanoutPlan,
    hosts: &'a [Option<usize>],
    chunk: Option<u64>,
}

/// For each ring, the consumer whose process runs its forwarder (`--forwarders
/// in-consumer`: the first consumer reading it); None: a forwarder process of its own (and
/// ring 0, the producer's).
fn forwarder_hosts(args: &BenchArgs, plan: &FanoutPlan) -> Vec<Option<usize>> {
    (0..plan.rings.len())
        .map(|r| {
            (r > 0 && args.forwarders_in_consumers)
                .then(|| plan.consumer_ring.iter().position(|&c| c == r))
                .flatten()
        })
        .collect()
}

/// The forwarder's settings beyond its rings: chunking and copies in flight.
fn forward_tuning(
    args: &BenchArgs,
    chunk: Option<u64>,
    chunk_flag: &str,
    depth_flag: &str,
) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(c) = chunk {
        v.extend([chunk_flag.to_string(), c.to_string()]);
    }
    if let Some(d) = args.forward_depth {
        v.extend([depth_flag.to_string(), d.to_string()]);
    }
    v
}

/// Starts the forwarder processes of a chain or tree fan-out (those not in a consumer's
/// process), a parent's ring before its children's, each waiting for everything that reads
/// its ring before it takes a batch.
fn start_forwarders(
    exe: &Path,
    dir: &Path,
    args: &BenchArgs,
    shape: &Shape<'_>,
    deadline: Instant,
) -> Result<Children, String> {
    let Shape { plan, hosts, chunk } = *shape;
    let mut forwarders = Children(Vec::new());
    for (r, node) in plan.rings.iter().enumerate().skip(1) {
        if hosts[r].is_some() {
            continue;
        }
        let parent = ring_sock(dir, node.parent.unwrap_or(0));
        wait_for_socket(&parent, &mut forwarders, deadline)?;
        let n = plan.attachments(r);
        let mut cmd = Command::new(exe);
        cmd.args(["relay", "forward", "--json", "--upstream"])
            .arg(&parent)
            .arg("--socket")
            .arg(ring_sock(dir, r))
            .args(["--slots", &args.slots.to_string()])
            .args(["--max-consumers", &n.max(1).to_string()])
            .args(["--wait-for-consumers", &n.to_string()])
            .args(forward_tuning(args, chunk, "--chunk", "--depth"));
        if args.backend == Backend::Cuda {
            cmd.args(["--device", &node.device.to_string()]);
        }
        // A process group of its own, as for the consumers.
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start forwarder process: {e}"))?;
        forwarders.0.push(child);
    }
    Ok(forwarders)
}

/// Starts the consumer processes, each on its ring once that is up.
fn start_consumers(
    exe: &Path,
    dir: &Path,
    args: &BenchArgs,
    shape: &Shape<'_>,
    children: &mut Children,
    forwarders: &mut Children,
    deadline: Instant,
) -> Result<(), String> {
    let Shape { plan, hosts, chunk } = *shape;
    let cuda = args.backend == Backend::Cuda;
    for i in 0..args.consumers {
        let ring = plan.consumer_ring.get(i as usize).copied().unwrap_or(0);
        let device = cuda
            .then(|| args.consumer_devices.get(i as usize))
            .flatten();
        // The consumer that runs its ring's forwarder waits for the ring before (it makes
        // its own); every other waits for its ring.
        let forward: Vec<String> = if hosts[ring] == Some(i as usize) {
            let parent = ring_sock(dir, plan.rings[ring].parent.unwrap_or(0));
            wait_for_socket(&parent, forwarders, deadline)?;
            let n = plan.attachments(ring);
            let mut v = vec![
                "--forward-from".to_string(),
                parent.to_string_lossy().into_owned(),
                "--forward-slots".into(),
                args.slots.to_string(),
                "--forward-wait".into(),
                n.to_string(),
            ];
            v.extend(forward_tuning(
                args,
                chunk,
                "--forward-chunk",
                "--forward-depth",
            ));
            if let (true, Some(m)) = (cuda, args.forward_memory) {
                v.extend(["--forward-memory".to_string(), m.to_string()]);
            }
            if cuda && device.is_none() {
                v.extend(["--device".to_string(), plan.rings[ring].device.to_string()]);
            }
            v
        } else {
            wait_for_socket(&ring_sock(dir, ring), forwarders, deadline)?;
            Vec::new()
        };
        let child = Command::new(exe)
            .arg("consume")
            .args(&forward)
            .args(["--bench-index", &i.to_string()])
            .arg("--socket")
            .arg(ring_sock(dir, ring))
            .arg("--verify")
            .arg("--bench-child")
            .arg("--seq-log")
            .arg(seq_log_path(dir, i))
            .arg("--passes")
            .arg(args.passes_of(i).to_string())
            .arg("--timed-from")
            .arg(warmup_of(args.batches).to_string())
            .args(&args.consumer_args)
            .args(
                (args.gpu_timeline > 0 && cuda)
                    .then(|| {
                        [
                            "--gpu-timeline".to_string(),
                            format!("{}:{}", warmup_of(args.batches), args.gpu_timeline),
                        ]
                    })
                    .into_iter()
                    .flatten(),
            )
            .args(
                device
                    .map(|d| ["--device".to_string(), d.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .args(
                args.delivery
                    .get(i as usize)
                    .or(args.delivery.first())
                    .map(|d| ["--delivery".to_string(), d.to_string()])
                    .into_iter()
                    .flatten(),
            )
            // A process group of its own: Ctrl-C at a terminal reaches the bench alone, which
            // stops publishing and closes the ring; its consumers take every batch published
            // and report on them, rather than stopping at once and missing some.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start consumer process: {e}"))?;
        children.0.push(child);
    }
    Ok(())
}

/// A progress bar on a terminal (none with `--json` or when stderr is not a terminal).
fn progress_bar(args: &BenchArgs) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() || args.json {
        return None;
    }
    let b = indicatif::ProgressBar::new(args.batches);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} batches ({per_sec})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(b)
}

/// Waits for a ring's socket to appear (made by a forwarder started just before).
fn wait_for_socket(
    path: &Path,
    forwarders: &mut Children,
    deadline: Instant,
) -> Result<(), String> {
    let until = deadline.min(Instant::now() + Duration::from_secs(60));
    while !path.exists() {
        for c in &mut forwarders.0 {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(format!(
                    "a forwarder process exited before its ring was up ({st})"
                ));
            }
        }
        if Instant::now() >= until {
            return Err(format!(
                "the ring at {} did not come up in time",
                path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Waits for the consumers to end and reads their reports; a consumer that hung, gave no
/// report, failed or exited badly is a problem.
fn collect_consumers(
    children: &mut Children,
    deadline: Instant,
    problems: &mut Vec<String>,
) -> Vec<ConsumerReport> {
    let mut per_consumer = Vec::new();
    let ended = wait_all_with_output(std::mem::take(&mut children.0), deadline);
    for (i, (status, out)) in ended.into_iter().enumerate() {
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
    per_consumer
}

/// What a forwarder that failed prints instead of its report.
#[derive(serde::Deserialize)]
struct ForwarderFailure {
    error: String,
}

/// Waits for the forwarders to end (the producer's ring closed, so each closes its own once
/// its consumers are done) and reads their reports.
/// Returns one entry per forwarded ring (ring r at r - 1); those whose forwarder runs in a
/// consumer's process are None here.
fn collect_forwarders(
    forwarders: &mut Children,
    hosts: &[Option<usize>],
    deadline: Instant,
    problems: &mut Vec<String>,
) -> Vec<Option<RelayReport>> {
    let mut out = Vec::new();
    let ended = wait_all_with_output(std::mem::take(&mut forwarders.0), deadline);
    // The rings whose forwarder is a process, in the order they were started.
    let rings: Vec<usize> = (1..hosts.len()).filter(|&r| hosts[r].is_none()).collect();
    let mut by_ring: Vec<Option<RelayReport>> = vec![None; hosts.len().saturating_sub(1)];
    for (k, (status, text)) in ended.into_iter().enumerate() {
        let report = text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<RelayReport>(l).ok());
        // A forwarder that failed prints {"error": "..."} instead of a report.
        let failure = text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .and_then(|v| serde_json::from_value::<ForwarderFailure>(v).ok())
            .map(|f| f.error);
        let ring = rings.get(k).copied().unwrap_or(k + 1);
        match (&status, &report) {
            (None, _) => problems.push(format!("the forwarder of ring {ring} hung and was killed")),
            (Some(st), None) => problems.push(format!(
                "the forwarder of ring {ring} failed ({st}): {}",
                failure.as_deref().unwrap_or("no report")
            )),
            (Some(st), Some(r)) => {
                if let Some(e) = &r.error {
                    problems.push(format!("the forwarder of ring {ring}: {e}"));
                } else if !st.success() {
                    problems.push(format!("the forwarder of ring {ring} exited with {st}"));
                }
            }
        }
        if let Some(slot) = by_ring.get_mut(ring - 1) {
            *slot = report;
        }
    }
    out.extend(by_ring);
    out
}

/// A chain or tree fan-out's rings and what each forwarder reported (None: direct).
fn fanout_report(
    plan: &FanoutPlan,
    forwarded: &[Option<RelayReport>],
    chunk: Option<u64>,
    in_consumers: bool,
) -> Option<FanoutReport> {
    (plan.shape != Fanout::Direct).then(|| FanoutReport {
        shape: plan.shape,
        depth: plan.depth(),
        chunk_bytes: chunk,
        forwarders: if in_consumers {
            "in-consumer"
        } else {
            "process"
        },
        rings: plan
            .rings
            .iter()
            .enumerate()
            .map(|(r, node)| RingReport {
                device: node.device,
                parent: node.parent,
                consumers: plan.consumer_ring.iter().filter(|&&c| c == r).count(),
                forwarder: r
                    .checked_sub(1)
                    .and_then(|i| forwarded.get(i).cloned().flatten()),
            })
            .collect(),
        why: None,
    })
}

/// Waits for every child (killing those still running at `deadline`: None) and returns
/// each one's stdout. Every stdout is read from the start, on a thread of its own: a child
/// whose report is larger than a pipe holds would otherwise block writing it while we wait
/// for it to exit.
fn wait_all_with_output(
    children: Vec<Child>,
    deadline: Instant,
) -> Vec<(Option<ExitStatus>, String)> {
    let mut children = children;
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            c.stdout.take().map(|mut so| {
                std::thread::spawn(move || {
                    let mut text = String::new();
                    let _ = std::io::Read::read_to_string(&mut so, &mut text);
                    text
                })
            })
        })
        .collect();
    children
        .iter_mut()
        .zip(readers)
        .map(|(c, reader)| {
            let status = wait_child(c, deadline);
            let text = reader.and_then(|r| r.join().ok()).unwrap_or_default();
            (status, text)
        })
        .collect()
}

/// Waits for a child until `deadline`, then kills it (None: it had to be killed).
fn wait_child(c: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        match c.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
        }
    }
}
