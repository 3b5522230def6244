//! What a newcomer meets first with the `gpipe` CLI (issue 32): Ctrl-C answered at once by
//! every wait, a closed pipe ending a command quietly, errors that name the socket path,
//! `--rate` kept after a stall, and a producer that says which consumer holds it back.
//! Multi-process tests with the real binary on the host backend, each under a watchdog.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// How soon a command must have exited after SIGINT: it answers within about 0.1 s (every
/// wait looks at Ctrl-C at least every 50 ms); the rest is headroom for a loaded 2-core CI
/// machine, well below what any of these waits took before (250 ms to 300 s).
const ANSWER: Duration = Duration::from_millis(600);

/// SIGINT to `child`, then how long it took to exit and how.
fn interrupt(child: std::process::Child) -> (Duration, Exit) {
    signal(child.id(), libc::SIGINT);
    let t = Instant::now();
    let exit = finish(child, Duration::from_secs(20));
    (t.elapsed(), exit)
}

fn sock_arg(sock: &std::path::Path) -> &str {
    sock.to_str().unwrap()
}

#[test]
fn ctrl_c_while_waiting_for_consumers_closes_the_ring_at_once() {
    watchdog(60, |procs| {
        let dir = tmpdir("fc-wait");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &["--wait-for-consumers", "2"]);
        std::thread::sleep(Duration::from_millis(300));
        let (took, e) = interrupt(p);
        assert!(
            took < ANSWER,
            "took {took:?} to answer Ctrl-C: {}",
            e.stderr
        );
        assert_eq!(e.code, Some(0), "{}", e.stderr);
        assert!(
            e.stderr
                .contains("interrupted while waiting for consumers (0 of 2 attached)"),
            "{}",
            e.stderr
        );
        assert!(
            e.stderr.contains("producer stopped after 0 batch"),
            "{}",
            e.stderr
        );
        assert!(
            !sock.exists(),
            "the ring was not closed: its socket is still there"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn waiting_for_more_consumers_than_the_ring_takes_is_refused_at_once() {
    watchdog(60, |_| {
        let dir = tmpdir("fc-toomany");
        let sock = dir.join("ring.sock");
        let t = Instant::now();
        let (code, stderr) = gpipe_exit(&[
            "produce",
            "--backend",
            "host",
            "--socket",
            sock_arg(&sock),
            "--wait-for-consumers",
            "20",
            "--max-consumers",
            "16",
        ]);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        assert!(
            stderr.contains("--wait-for-consumers 20 can never be met")
                && stderr.contains("--max-consumers 16"),
            "{stderr}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn ctrl_c_during_a_slow_rate_pause() {
    watchdog(60, |procs| {
        let dir = tmpdir("fc-slow");
        let sock = dir.join("ring.sock");
        // The first batch goes out at once, the next 10 s later.
        let p = producer(&procs, &sock, &["--rate", "0.1"]);
        wait_until(Duration::from_secs(10), "the first batch", || {
            head(&sock) == 1
        });
        std::thread::sleep(Duration::from_millis(200));
        let (took, e) = interrupt(p);
        assert!(
            took < ANSWER,
            "took {took:?} to answer Ctrl-C: {}",
            e.stderr
        );
        assert_eq!(e.code, Some(0), "{}", e.stderr);
        assert!(
            e.stderr.contains("producer stopped after 1 batch"),
            "{}",
            e.stderr
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn absurd_rates_are_refused_with_a_reason() {
    let dir = tmpdir("fc-rate");
    let sock = dir.join("ring.sock");
    for rate in ["1e-300", "-5", "inf", "NaN", "fast"] {
        let (code, stderr) = gpipe_exit(&[
            "produce",
            "--backend",
            "host",
            "--socket",
            sock_arg(&sock),
            &format!("--rate={rate}"),
        ]);
        assert_eq!(code, Some(2), "--rate {rate}: {stderr}");
        assert!(!stderr.contains("panicked"), "--rate {rate}: {stderr}");
        assert!(stderr.contains("--rate"), "--rate {rate}: {stderr}");
    }
    let (_, stderr) = gpipe_exit(&["produce", "--socket", sock_arg(&sock), "--rate", "1e-300"]);
    assert!(stderr.contains("the slowest rate is one a day"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_rate_is_not_exceeded_after_a_stall() {
    watchdog(90, |procs| {
        let dir = tmpdir("fc-burst");
        let sock = dir.join("ring.sock");
        let rate = 50.0;
        let p = producer(&procs, &sock, &["--rate", "50", "--slots", "4"]);
        let c = consumer(&procs, &sock, &dir.join("c.seq"));
        wait_until(Duration::from_secs(10), "the consumer", || {
            active_consumers(&sock) == 1
        });
        // Batches published over one second once a stall of `who` has ended.
        let after_stall = |who: u32| {
            signal(who, libc::SIGSTOP);
            std::thread::sleep(Duration::from_secs(2));
            signal(who, libc::SIGCONT);
            let t0 = Instant::now();
            let h0 = head(&sock);
            std::thread::sleep(Duration::from_secs(1));
            let h1 = head(&sock);
            (h1 - h0) as f64 / t0.elapsed().as_secs_f64()
        };
        // The consumer stopped: the ring fills and the producer waits for it.
        let consumer_stall = after_stall(c.id());
        // The producer itself stopped: its schedule falls behind the clock.
        let producer_stall = after_stall(p.id());
        // One batch of fencepost, one for the time `inspect` takes.
        let most = rate + 2.0;
        assert!(
            consumer_stall <= most,
            "{consumer_stall:.0} batches/s after a consumer's stall, at --rate {rate}"
        );
        assert!(
            producer_stall <= most,
            "{producer_stall:.0} batches/s after the producer's stall, at --rate {rate}"
        );
        assert!(
            consumer_stall > 0.0 && producer_stall > 0.0,
            "the ring did not go on"
        );
        let (took, e) = interrupt(p);
        assert!(took < ANSWER + Duration::from_secs(1), "took {took:?}");
        assert_eq!(e.code, Some(0), "{}", e.stderr);
        let ec = finish(c, Duration::from_secs(10));
        assert_eq!(ec.code, Some(0), "consumer: {}", ec.stderr);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn a_consumer_holding_the_ring_is_named_once() {
    watchdog(60, |procs| {
        let dir = tmpdir("fc-stuck");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &["--slots", "2"]);
        let mut c = consumer(&procs, &sock, &dir.join("c.seq"));
        wait_until(Duration::from_secs(10), "the consumer", || {
            active_consumers(&sock) == 1
        });
        wait_until(Duration::from_secs(10), "batches", || head(&sock) > 10);
        signal(c.id(), libc::SIGSTOP);
        // Past the notice (3 s), and long enough to see it is said only once.
        std::thread::sleep(Duration::from_millis(5500));
        let pid = c.id();
        // Ctrl-C while it is still held: it stops at once, gives the stopped consumer the
        // drain time (5 s) to take what was published, says so, and detaches it.
        let (took, e) = interrupt(p);
        assert!(took < Duration::from_secs(8), "took {took:?}");
        c.kill().unwrap();
        let _ = c.wait();
        assert_eq!(e.code, Some(0), "{}", e.stderr);
        let notices: Vec<&str> = e
            .stderr
            .lines()
            .filter(|l| l.contains("held the ring back"))
            .collect();
        assert_eq!(notices.len(), 1, "one notice per stall: {}", e.stderr);
        let notice = notices[0];
        assert!(notice.starts_with("gpipe: "), "{notice}");
        assert!(
            notice.contains(&format!("consumer #0 (pid {pid})")),
            "{notice}"
        );
        assert!(notice.contains("--detach-after-ms"), "{notice}");
        assert!(
            e.stderr.contains(&format!(
                "closing the ring; consumer #0 (pid {pid}) holding slot"
            )),
            "{}",
            e.stderr
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn ctrl_c_while_attaching_to_a_stalled_producer() {
    watchdog(60, |procs| {
        let dir = tmpdir("fc-attach");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &[]);
        signal(p.id(), libc::SIGSTOP);
        let c = spawn(&procs, &["consume", "--socket", sock_arg(&sock)]);
        std::thread::sleep(Duration::from_millis(500));
        let (took, e) = interrupt(c);
        assert!(
            took < ANSWER,
            "took {took:?} to answer Ctrl-C: {}",
            e.stderr
        );
        assert_eq!(e.code, Some(130), "{}", e.stderr);
        assert!(
            e.stderr.contains("interrupted while attaching"),
            "{}",
            e.stderr
        );
        assert!(!e.stderr.contains("error"), "{}", e.stderr);
        signal(p.id(), libc::SIGCONT);
        let _ = interrupt(p);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Runs `gpipe ARGS` with its stdout a pipe closed before it writes: it must end quietly.
fn with_stdout_closed(args: &[&str]) {
    let mut child = Command::new(GPIPE)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(0) | Some(141)),
        "gpipe {args:?} with stdout closed: {} {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "gpipe {args:?}: {stderr}");
}

#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    watchdog(120, |procs| {
        let dir = tmpdir("fc-pipe");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &[]);
        with_stdout_closed(&["inspect", "--socket", sock_arg(&sock)]);
        with_stdout_closed(&["inspect", "--json", "--socket", sock_arg(&sock)]);
        let _ = interrupt(p);
        with_stdout_closed(&[
            "bench",
            "--backend",
            "host",
            "--consumers",
            "1",
            "--batches",
            "200",
            "--batch-bytes",
            "64KiB",
        ]);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn socket_path_errors_name_the_path_and_what_to_do() {
    let dir = tmpdir("fc-nodir");
    let missing = dir.join("nonexistent-dir").join("x");
    let sock = missing.join("feed.sock");
    let (code, stderr) = gpipe_exit(&["produce", "--backend", "host", "--socket", sock_arg(&sock)]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains(sock_arg(&sock)), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the directory {} does not exist",
            missing.display()
        )),
        "{stderr}"
    );
    // A file where the directory should be.
    let file = dir.join("a-file");
    std::fs::write(&file, b"").unwrap();
    let sock = file.join("feed.sock");
    let (code, stderr) = gpipe_exit(&["produce", "--backend", "host", "--socket", sock_arg(&sock)]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("{} is not a directory", file.display())),
        "{stderr}"
    );
    // A path another producer listens on.
    watchdog(30, move |procs| {
        let sock = tmpdir("fc-inuse").join("ring.sock");
        let p = producer(&procs, &sock, &[]);
        let (code, stderr) =
            gpipe_exit(&["produce", "--backend", "host", "--socket", sock_arg(&sock)]);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "cannot make the socket {}: it is in use",
                sock.display()
            )) && stderr.contains("give another --socket"),
            "{stderr}"
        );
        let (_, e) = interrupt(p);
        assert_eq!(e.code, Some(0), "the first producer: {}", e.stderr);
        let _ = std::fs::remove_dir_all(sock.parent().unwrap());
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cuda_advice_only_once_the_backend_is_cuda() {
    watchdog(60, |_| {
        let dir = tmpdir("fc-env");
        let sock = dir.join("ring.sock");
        // Without --backend, with batches large enough for side signals, and the variable
        // unset (gpipe sets it only then).
        let out = Command::new(GPIPE)
            .args([
                "produce",
                "--socket",
                sock_arg(&sock),
                "--batch-bytes",
                "16MiB",
            ])
            .args(["--slots", "1", "--batches", "1"])
            .env_remove("CUDA_DEVICE_MAX_CONNECTIONS")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let host = stderr.contains("(host backend)");
        let said = stderr.contains("CUDA_DEVICE_MAX_CONNECTIONS");
        // On a machine with a GPU the ring is CUDA's and the line is right; without one the
        // host backend is taken and the line would be noise.
        assert_eq!(said, !host, "{stderr}");
        if said {
            let advice = stderr.find("CUDA_DEVICE_MAX_CONNECTIONS").unwrap();
            assert!(
                stderr.find("(cuda backend)").is_some_and(|b| advice < b),
                "{stderr}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn ctrl_c_while_a_forwarder_waits_for_its_consumers() {
    watchdog(60, |procs| {
        let dir = tmpdir("fc-fwd");
        let (up, down) = (dir.join("up.sock"), dir.join("down.sock"));
        let p = producer(&procs, &up, &[]);
        let f = spawn(
            &procs,
            &[
                "relay",
                "forward",
                "--upstream",
                sock_arg(&up),
                "--socket",
                sock_arg(&down),
                "--wait-for-consumers",
                "1",
            ],
        );
        wait_until(Duration::from_secs(10), "the forwarder's socket", || {
            std::os::unix::net::UnixStream::connect(&down).is_ok()
        });
        std::thread::sleep(Duration::from_millis(300));
        let (took, e) = interrupt(f);
        assert!(
            took < ANSWER,
            "took {took:?} to answer Ctrl-C: {}",
            e.stderr
        );
        assert_eq!(e.code, Some(0), "{} {}", e.stdout, e.stderr);
        let (_, pe) = interrupt(p);
        assert_eq!(pe.code, Some(0), "{}", pe.stderr);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn ctrl_c_at_a_terminal_ends_a_bench_with_a_report_on_what_ran() {
    watchdog(90, |procs| {
        use std::os::unix::process::CommandExt;
        // As at a terminal: Ctrl-C goes to the foreground process group, the bench's.
        let b = Command::new(GPIPE)
            .args(["bench", "--backend", "host", "--batch-bytes", "64KiB"])
            .args(["--batches", "100000000", "--consumers", "2"])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        procs.add(&b);
        std::thread::sleep(Duration::from_secs(3));
        // SAFETY: kill(2) on the process group we made; no memory effects.
        unsafe { libc::kill(-(b.id() as i32), libc::SIGINT) };
        let t = Instant::now();
        let e = finish(b, Duration::from_secs(30));
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        assert!(
            e.stdout.contains("none lost, none duplicated"),
            "{}\n{}",
            e.stdout,
            e.stderr
        );
    });
}
