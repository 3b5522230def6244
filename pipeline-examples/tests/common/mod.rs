//! Helpers shared by the multi-process test files: spawning `gpipe`, a watchdog that kills
//! every spawned process and fails the test instead of hanging, and result readers.
#![allow(dead_code)]

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

pub const GPIPE: &str = env!("CARGO_BIN_EXE_gpipe");

/// Kills registered processes if the test body overruns or panics.
#[derive(Clone, Default)]
pub struct Procs(pub Arc<Mutex<Vec<u32>>>);

impl Procs {
    pub fn add(&self, c: &Child) {
        self.0.lock().unwrap().push(c.id());
    }
    pub fn kill_all(&self) {
        for &pid in self.0.lock().unwrap().iter() {
            signal(pid, libc::SIGKILL);
        }
    }
}

pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid we spawned and a valid signal number has no memory effects.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// Runs `body` with a watchdog: after `secs` every registered process is killed and the
/// test fails.
pub fn watchdog(secs: u64, body: impl FnOnce(Procs) + Send + 'static) {
    let procs = Procs::default();
    let p2 = procs.clone();
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(p2.clone())));
        p2.kill_all();
        let _ = tx.send(());
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => {
            if let Err(e) = t.join() {
                std::panic::resume_unwind(e);
            }
        }
        Err(_) => {
            procs.kill_all();
            panic!("watchdog: test did not finish within {secs} s (processes killed)");
        }
    }
}

pub fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "gpipe-test-{tag}-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos() ^ rand_u32() as u128
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn rand_u32() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
}

pub fn spawn(procs: &Procs, args: &[&str]) -> Child {
    spawn_env(procs, args, &[])
}

pub fn spawn_env(procs: &Procs, args: &[&str], env: &[(&str, &str)]) -> Child {
    let c = Command::new(GPIPE)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn gpipe");
    procs.add(&c);
    c
}

pub fn producer(procs: &Procs, sock: &Path, extra: &[&str]) -> Child {
    producer_on(procs, sock, "host", extra)
}

pub fn producer_on(procs: &Procs, sock: &Path, backend: &str, extra: &[&str]) -> Child {
    producer_on_env(procs, sock, backend, extra, &[])
}

pub fn producer_on_env(
    procs: &Procs,
    sock: &Path,
    backend: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Child {
    let mut args = vec![
        "produce",
        "--socket",
        sock.to_str().unwrap(),
        "--backend",
        backend,
    ];
    // Defaults a caller may override.
    for (flag, value) in [("--batch-bytes", "64KiB"), ("--slots", "4")] {
        if !extra.contains(&flag) {
            args.extend_from_slice(&[flag, value]);
        }
    }
    args.extend_from_slice(extra);
    let c = spawn_env(procs, &args, env);
    wait_until(Duration::from_secs(10), "producer socket", || {
        UnixStream::connect(sock).is_ok()
    });
    c
}

pub fn consumer(procs: &Procs, sock: &Path, log: &Path) -> Child {
    consumer_env(procs, sock, log, &[])
}

pub fn consumer_env(procs: &Procs, sock: &Path, log: &Path, env: &[(&str, &str)]) -> Child {
    consumer_with(procs, sock, log, &[], env)
}

/// A verifying consumer with extra arguments (e.g. `--device 1 --delivery mirror`).
pub fn consumer_with(
    procs: &Procs,
    sock: &Path,
    log: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Child {
    let mut args = vec![
        "consume",
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--json",
        "--seq-log",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    spawn_env(procs, &args, env)
}

pub fn wait_until(timeout: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `gpipe ARGS` (a `bench ... --json`), asserts it succeeded and returns its JSON report.
pub fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(GPIPE).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "gpipe {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs `gpipe ARGS` to its end: its exit code (None: killed by a signal) and its stderr.
pub fn gpipe_exit(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(GPIPE).args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn inspect(sock: &Path) -> serde_json::Value {
    let out = Command::new(GPIPE)
        .args(["inspect", "--json", "--socket", sock.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

pub fn active_consumers(sock: &Path) -> usize {
    inspect(sock)["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state"] == "active")
        .count()
}

pub fn head(sock: &Path) -> u64 {
    inspect(sock)["head"].as_u64().unwrap()
}

pub struct Exit {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// The ring goes on, then Ctrl-C closes it: producer `p` and consumer `a` (logging to
/// `dir/a.seq`) both end cleanly, and the consumer's batches are contiguous.
pub fn progress_then_clean_close(p: Child, a: Child, sock: &Path, dir: &Path) {
    let h = head(sock);
    wait_until(Duration::from_secs(5), "progress", || head(sock) > h + 50);
    signal(p.id(), libc::SIGINT);
    assert_eq!(finish(p, Duration::from_secs(15)).code, Some(0));
    let ea = finish(a, Duration::from_secs(10));
    assert_eq!(ea.code, Some(0), "{}", ea.stderr);
    assert_contiguous(&seqs(&dir.join("a.seq")), "consumer");
    let _ = std::fs::remove_dir_all(dir);
}

pub fn finish(mut c: Child, timeout: Duration) -> Exit {
    let end = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if Instant::now() >= end {
            let _ = c.kill();
            panic!("process {} did not exit within {timeout:?}", c.id());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    c.stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    c.stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    Exit {
        code: status.code(),
        stdout,
        stderr,
    }
}

pub fn report(e: &Exit) -> serde_json::Value {
    let line = e
        .stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| {
            panic!(
                "no JSON report; stdout {:?} stderr {:?}",
                e.stdout, e.stderr
            )
        });
    serde_json::from_str(line).unwrap()
}

pub fn seqs(path: &Path) -> Vec<u64> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn assert_contiguous(s: &[u64], who: &str) {
    assert!(!s.is_empty(), "{who} received nothing");
    for w in s.windows(2) {
        assert_eq!(w[1], w[0] + 1, "{who}: gap or duplicate after {}", w[0]);
    }
}

/// A consumer joining late starts at the head and then misses nothing.
pub fn late_join_case(backend: &'static str) {
    watchdog(60, |procs| {
        let dir = tmpdir("late");
        let sock = dir.join("ring.sock");
        let p = producer_on(&procs, &sock, backend, &["--rate", "400"]);
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        wait_until(Duration::from_secs(10), "first consumer", || {
            active_consumers(&sock) == 1
        });
        wait_until(Duration::from_secs(10), "some batches", || head(&sock) > 50);
        let b = consumer(&procs, &sock, &dir.join("b.seq"));
        wait_until(Duration::from_secs(10), "second consumer", || {
            active_consumers(&sock) == 2
        });
        let h = head(&sock);
        wait_until(Duration::from_secs(10), "more batches", || {
            head(&sock) > h + 100
        });
        signal(p.id(), libc::SIGINT);
        let pe = finish(p, Duration::from_secs(15));
        assert_eq!(pe.code, Some(0), "producer: {}", pe.stderr);
        let (ea, eb) = (
            finish(a, Duration::from_secs(10)),
            finish(b, Duration::from_secs(10)),
        );
        assert_eq!(ea.code, Some(0), "consumer a: {} {}", ea.stdout, ea.stderr);
        assert_eq!(eb.code, Some(0), "consumer b: {} {}", eb.stdout, eb.stderr);
        let (sa, sb) = (seqs(&dir.join("a.seq")), seqs(&dir.join("b.seq")));
        assert_contiguous(&sa, "early consumer");
        assert_contiguous(&sb, "late consumer");
        assert!(
            sb[0] > 50,
            "late consumer should start at the head, started at {}",
            sb[0]
        );
        assert_eq!(sa.last(), sb.last(), "both drain to the same last batch");
        assert_eq!(report(&ea)["mismatches"], 0);
        assert_eq!(report(&eb)["mismatches"], 0);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// SIGKILL of one consumer mid-stream: the producer and the others go on, nothing lost.
pub fn consumer_sigkill_case(backend: &'static str) {
    consumer_death_case(backend, None);
}

/// One consumer dies mid-stream — SIGKILLed by the test (`fault: None`), or killing itself
/// at a protocol step (`GPIPE_FAULT`) — in both modes; the producer and the others go on with
/// nothing lost or duplicated.
pub fn consumer_death_case(backend: &'static str, fault: Option<&'static str>) {
    consumer_death_case_with(backend, fault, &[]);
}

/// As [`consumer_death_case`], with extra producer arguments (e.g. `--memory vmm`).
pub fn consumer_death_case_with(
    backend: &'static str,
    fault: Option<&'static str>,
    extra: &[&'static str],
) {
    consumer_death_case_placed(backend, fault, extra, [&[], &[], &[]]);
}

/// As [`consumer_death_case_with`], with extra arguments for each consumer: the survivors
/// a and c, then the victim (e.g. `--device 1 --delivery mirror`).
pub fn consumer_death_case_placed(
    backend: &'static str,
    fault: Option<&'static str>,
    extra: &[&'static str],
    consumers: [&'static [&'static str]; 3],
) {
    for mode in ["broadcast", "shared"] {
        let extra = extra.to_vec();
        watchdog(60, move |procs| {
            let dir = tmpdir("ckill");
            let sock = dir.join("ring.sock");
            let mut args = vec!["--mode", mode];
            args.extend(extra);
            let p = producer_on(&procs, &sock, backend, &args);
            let a = consumer_with(&procs, &sock, &dir.join("a.seq"), consumers[0], &[]);
            let c = consumer_with(&procs, &sock, &dir.join("c.seq"), consumers[1], &[]);
            wait_until(Duration::from_secs(10), "two consumers", || {
                active_consumers(&sock) >= 2
            });
            // The victim attaches last: a consumer attaching after its death could take its
            // index and overwrite the dead record checked below.
            let fault_env = fault.map(|f| format!("{f}:300"));
            let env: Vec<(&str, &str)> = fault_env
                .as_deref()
                .map(|f| vec![("GPIPE_FAULT", f)])
                .unwrap_or_default();
            let mut victim = consumer_with(&procs, &sock, &dir.join("v.seq"), consumers[2], &env);
            wait_until(Duration::from_secs(10), "batches flowing", || {
                head(&sock) > 200
            });
            if fault.is_none() {
                wait_until(Duration::from_secs(10), "the victim to attach", || {
                    active_consumers(&sock) >= 3
                });
                victim.kill().unwrap();
            }
            let status = victim.wait().unwrap();
            {
                use std::os::unix::process::ExitStatusExt;
                assert_eq!(
                    status.signal(),
                    Some(libc::SIGKILL),
                    "{mode} {fault:?}: victim {status}"
                );
            }
            let killed_at = Instant::now();
            let mut victim_released = 0;
            let mut tries = 0;
            let (found, last) = loop {
                tries += 1;
                let last = inspect(&sock);
                if let Some(c) = last["consumers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["state"] == "dead")
                {
                    victim_released = c["released"].as_u64().unwrap();
                    break (true, last);
                }
                if killed_at.elapsed() > Duration::from_secs(1) {
                    break (false, last);
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            assert!(
                found,
                "no dead consumer {:?} after the kill ({tries} looks): {last}",
                killed_at.elapsed()
            );
            assert!(killed_at.elapsed() < Duration::from_secs(1));
            let h = head(&sock);
            wait_until(Duration::from_secs(5), "the producer to go on", || {
                head(&sock) > h + 500
            });
            signal(p.id(), libc::SIGINT);
            let pe = finish(p, Duration::from_secs(15));
            assert_eq!(pe.code, Some(0), "producer: {}", pe.stderr);
            assert!(
                pe.stderr.contains("died 1"),
                "producer should report the death: {}",
                pe.stderr
            );
            let (ea, ec) = (
                finish(a, Duration::from_secs(10)),
                finish(c, Duration::from_secs(10)),
            );
            assert_eq!(
                ea.code,
                Some(0),
                "{mode} consumer a: {}\n{}",
                ea.stderr,
                ea.stdout
            );
            assert_eq!(
                ec.code,
                Some(0),
                "{mode} consumer c: {}\n{}",
                ec.stderr,
                ec.stdout
            );
            let (sa, sc) = (seqs(&dir.join("a.seq")), seqs(&dir.join("c.seq")));
            assert_eq!(report(&ea)["mismatches"], 0);
            assert_eq!(report(&ec)["mismatches"], 0);
            if mode == "broadcast" {
                assert_contiguous(&sa, "consumer a");
                assert_contiguous(&sc, "consumer c");
                assert_eq!(sa.last(), sc.last());
            } else {
                // Shared: survivors' batches are disjoint, and together with the batches the
                // victim released before it died they cover everything published: what it had
                // claimed but not released was requeued for the survivors.
                let mut all: Vec<u64> = sa.iter().chain(&sc).copied().collect();
                all.sort_unstable();
                let n = all.len();
                all.dedup();
                assert_eq!(all.len(), n, "a batch reached two survivors");
                let published = all.last().copied().unwrap() + 1;
                let missing = published as usize - all.len();
                // The victim's counter is bumped just after its release, so a kill between
                // the two leaves it one short.
                assert!(
                    missing as u64 == victim_released || missing as u64 == victim_released + 1,
                    "survivors miss {missing} batches; the victim released {victim_released}"
                );
            }
            let _ = std::fs::remove_dir_all(&dir);
        });
    }
}

/// The producer kills itself at a protocol step: every consumer ends with a clear error
/// promptly, having received a contiguous, verified prefix.
pub fn producer_death_case(backend: &'static str, fault: &'static str) {
    producer_death_case_with(backend, fault, &[]);
}

/// As [`producer_death_case`], with extra producer arguments (e.g. its CUDA options).
pub fn producer_death_case_with(
    backend: &'static str,
    fault: &'static str,
    extra: &'static [&'static str],
) {
    watchdog(60, move |procs| {
        let dir = tmpdir("pfault");
        let sock = dir.join("ring.sock");
        // Late enough for every consumer to have attached (a CUDA attach takes a few hundred
        // ms; the producer runs at 2000 batches/s).
        let spec = format!("{fault}:4000");
        let mut args = vec!["--rate", "2000"];
        args.extend_from_slice(extra);
        let p = producer_on_env(&procs, &sock, backend, &args, &[("GPIPE_FAULT", &spec)]);
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        let b = consumer(&procs, &sock, &dir.join("b.seq"));
        let pe = finish(p, Duration::from_secs(20));
        assert_eq!(
            pe.code, None,
            "the producer should have been killed at {fault}: {}",
            pe.stderr
        );
        let t = Instant::now();
        for (name, c, log) in [("a", a, "a.seq"), ("b", b, "b.seq")] {
            assert_producer_died(finish(c, Duration::from_secs(3)), name);
            let s = seqs(&dir.join(log));
            if !s.is_empty() {
                assert_contiguous(&s, name);
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "consumers took {:?}",
            t.elapsed()
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// A consumer whose producer died exits with status 1, a report naming the death, and no
/// batch that failed verification.
pub fn assert_producer_died(e: Exit, name: &str) {
    assert_eq!(
        e.code,
        Some(1),
        "consumer {name} should fail: {} {}",
        e.stdout,
        e.stderr
    );
    let r = report(&e);
    let err = r["error"].as_str().unwrap_or_default();
    assert!(
        err.contains("producer died"),
        "consumer {name} error: {err:?}"
    );
    assert_eq!(r["mismatches"], 0, "consumer {name}: {r}");
}
