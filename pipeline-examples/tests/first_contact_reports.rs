//! What a newcomer reads (issue 32, points 8, 9 and 11; issue 36 point 6): reports and log
//! lines of the real `gpipe` binary that must say what happened, in the CLI's own voice. An
//! interrupted soak says it stopped early and exits 130; the soak's own kills are not
//! warnings; a detached consumer is told it was detached (a batch taken back is not a
//! checksum mismatch, and the ring moving on without it is not corruption); counts are
//! pluralised, GB has one format, and `inspect` explains its marks. Every test runs under a
//! watchdog.

mod common;

use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// A `gpipe produce` on the host backend with the environment given (and no `RUST_LOG`
/// unless given: the terminal format is the default one), ready once its socket accepts.
fn producer_logging(procs: &Procs, sock: &Path, extra: &[&str], rust_log: Option<&str>) -> Child {
    let mut cmd = Command::new(GPIPE);
    cmd.args(["produce", "--socket", sock.to_str().unwrap()])
        .args([
            "--backend",
            "host",
            "--batch-bytes",
            "64KiB",
            "--slots",
            "4",
        ])
        .args(extra)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(filter) = rust_log {
        cmd.env("RUST_LOG", filter);
    }
    let c = cmd.spawn().expect("spawn gpipe produce");
    procs.add(&c);
    wait_until(Duration::from_secs(10), "producer socket", || {
        UnixStream::connect(sock).is_ok()
    });
    c
}

/// A `gpipe consume --verify` with a text report (the one a user reads).
fn text_consumer(procs: &Procs, sock: &Path) -> Child {
    spawn(
        procs,
        &["consume", "--socket", sock.to_str().unwrap(), "--verify"],
    )
}

/// SIGKILLs `c`, reaps it and waits until the producer has recorded its death.
fn kill_and_see_it_dead(c: &mut Child, sock: &Path) {
    c.kill().unwrap();
    c.wait().unwrap();
    wait_until(Duration::from_secs(10), "the death to be recorded", || {
        inspect(sock)["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["state"] == "dead")
    });
}

/// The number of decimals of every "<number> GB" in `text`.
fn gb_decimals(text: &str) -> Vec<usize> {
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[1].trim_end_matches([',', ';']) == "GB")
        .filter_map(|w| {
            w[0].parse::<f64>()
                .ok()
                .map(|_| w[0].split_once('.').map_or(0, |(_, d)| d.len()))
        })
        .collect()
}

#[test]
fn an_interrupted_soak_says_it_stopped_early_exits_130_and_does_not_warn_about_its_own_kills() {
    watchdog(120, |procs| {
        let requested = 20;
        let child = Command::new(GPIPE)
            .args(["soak", "--backend", "host", "--batch-bytes", "64KiB"])
            .args(["--duration", &format!("{requested}s"), "--tick-ms", "60"])
            .env_remove("RUST_LOG")
            // Its own process group, so that the SIGINT below reaches every process of it,
            // as a terminal's Ctrl-C does.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn gpipe soak");
        procs.add(&child);
        let pgid = child.id() as i32;
        std::thread::sleep(Duration::from_secs(4));
        // SAFETY: kill(2) on the process group of a child we spawned has no memory effects.
        unsafe {
            libc::kill(-pgid, libc::SIGINT);
        }
        let e = finish(child, Duration::from_secs(60));
        assert_eq!(
            e.code,
            Some(130),
            "an interrupted soak exits 130\nstdout:\n{}\nstderr:\n{}",
            e.stdout,
            e.stderr
        );
        assert!(
            e.stdout.contains("stopped early") && e.stdout.contains(&format!("of {requested} s")),
            "the report says it stopped early, after how long of how long:\n{}",
            e.stdout
        );
        assert!(
            !e.stdout.contains("PROBLEM"),
            "what ran is still checked, and a Ctrl-C loses nothing:\n{}",
            e.stdout
        );
        assert!(
            e.stdout.contains("lost 0") && e.stdout.contains("duplicated 0"),
            "the checks of what ran are reported:\n{}",
            e.stdout
        );
        let words: Vec<&str> = e.stdout.split_whitespace().collect();
        let killed: u64 = words
            .windows(2)
            .find(|w| w[1] == "killed")
            .and_then(|w| w[0].parse().ok())
            .unwrap_or_else(|| panic!("no kill count in:\n{}", e.stdout));
        assert!(killed > 0, "the soak killed nobody in 4 s:\n{}", e.stdout);
        assert!(
            !e.stderr.contains("consumer died") && !e.stderr.contains("WARN"),
            "the soak's own {killed} kills are not warnings:\n{}",
            e.stderr
        );
    });
}

#[test]
fn a_consumer_stopped_past_detach_after_is_told_it_was_detached_not_corrupt_nor_mismatched() {
    watchdog(120, |procs| {
        let dir = tmpdir("detach-report");
        let sock = dir.join("ring.sock");
        let p = producer(
            &procs,
            &sock,
            &[
                "--rate",
                "200",
                "--batch-bytes",
                "1MiB",
                "--detach-after-ms",
                "300",
            ],
        );
        // Where the stop lands (in a wait, in a receive, in a check) varies: several rounds.
        for round in 0..4 {
            let json = round < 3;
            let mut args = vec!["consume", "--socket", sock.to_str().unwrap(), "--verify"];
            if json {
                args.push("--json");
            }
            let c = spawn(&procs, &args);
            wait_until(Duration::from_secs(10), "the consumer to attach", || {
                active_consumers(&sock) == 1
            });
            std::thread::sleep(Duration::from_millis(300 + 70 * round));
            signal(c.id(), libc::SIGSTOP);
            // Detached after 300 ms; the producer then goes on past the whole ring.
            std::thread::sleep(Duration::from_millis(1500));
            signal(c.id(), libc::SIGCONT);
            let e = finish(c, Duration::from_secs(15));
            assert_eq!(e.code, Some(1), "round {round}: {}\n{}", e.stdout, e.stderr);
            if json {
                let r = report(&e);
                let err = r["error"].as_str().unwrap_or_default();
                assert!(
                    err.contains("detached") && !err.contains("corrupt"),
                    "round {round}: a detached consumer is told so: {r}"
                );
                assert_eq!(
                    r["mismatches"], 0,
                    "round {round}: a batch taken back is not a checksum mismatch: {r}"
                );
                assert!(
                    r["taken_back"].as_u64().is_some_and(|n| n <= 1),
                    "round {round}: it held one batch at most: {r}"
                );
            } else {
                let out = e.stdout.trim();
                assert!(
                    out.contains("detached") && !out.contains("corrupt"),
                    "{out}"
                );
                assert!(
                    out.contains("no checksum mismatches"),
                    "a batch taken back is not a checksum mismatch: {out}"
                );
                assert!(
                    !out.contains("taken back by the producer")
                        || out.contains("1 batch taken back by the producer when it detached"),
                    "{out}"
                );
            }
        }
        signal(p.id(), libc::SIGINT);
        let pe = finish(p, Duration::from_secs(15));
        assert_eq!(pe.code, Some(0), "{}", pe.stderr);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn log_lines_speak_in_the_cli_voice_and_the_detail_stays_under_log_and_rust_log() {
    for (rust_log, flag, detailed) in [
        (None, None, false),
        (Some("warn"), None, true),
        (None, Some("warn"), true),
    ] {
        watchdog(60, move |procs| {
            let dir = tmpdir("voice");
            let sock = dir.join("ring.sock");
            let mut extra = vec!["--rate", "300"];
            if let Some(f) = flag {
                extra.extend(["--log", f]);
            }
            let p = producer_logging(&procs, &sock, &extra, rust_log);
            let mut c = text_consumer(&procs, &sock);
            wait_until(Duration::from_secs(10), "the consumer to attach", || {
                active_consumers(&sock) == 1
            });
            kill_and_see_it_dead(&mut c, &sock);
            signal(p.id(), libc::SIGINT);
            let pe = finish(p, Duration::from_secs(15));
            assert_eq!(pe.code, Some(0), "{}", pe.stderr);
            let case = format!("RUST_LOG {rust_log:?}, --log {flag:?}");
            if detailed {
                assert!(
                    pe.stderr.contains("WARN") && pe.stderr.contains("pipeline_core::producer"),
                    "{case}: the detailed format (level, module path): {}",
                    pe.stderr
                );
            } else {
                assert!(
                    pe.stderr.contains("gpipe: warning: consumer died"),
                    "{case}: a warning in the CLI's voice: {}",
                    pe.stderr
                );
                assert!(
                    pe.stderr.lines().all(|l| l.starts_with("gpipe")),
                    "{case}: every line in the CLI's voice, no timestamps or module paths: {}",
                    pe.stderr
                );
            }
            let _ = std::fs::remove_dir_all(&dir);
        });
    }
}

#[test]
fn one_batch_is_one_batch_and_gb_has_one_format() {
    watchdog(60, |procs| {
        let dir = tmpdir("plural");
        let sock = dir.join("ring.sock");
        let p = producer_logging(
            &procs,
            &sock,
            &["--wait-for-consumers", "1", "--batches", "1"],
            None,
        );
        let c = text_consumer(&procs, &sock);
        let pe = finish(p, Duration::from_secs(15));
        let ce = finish(c, Duration::from_secs(15));
        assert_eq!(pe.code, Some(0), "{}", pe.stderr);
        assert_eq!(ce.code, Some(0), "{}\n{}", ce.stdout, ce.stderr);
        for (who, text) in [("producer", &pe.stderr), ("consumer", &ce.stdout)] {
            assert!(
                !text.contains(" 1 batches") && !text.contains(" 1 consumers"),
                "{who}: {text}"
            );
        }
        assert!(pe.stderr.contains("after 1 batch;"), "{}", pe.stderr);
        assert!(ce.stdout.contains(": 1 batch,"), "{}", ce.stdout);

        // Progress lines (stderr, every second) and the final line (stdout): one GB format.
        let p = producer_logging(&procs, &sock, &["--rate", "300"], None);
        let c = text_consumer(&procs, &sock);
        wait_until(Duration::from_secs(10), "the consumer to attach", || {
            active_consumers(&sock) == 1
        });
        std::thread::sleep(Duration::from_millis(2500));
        signal(c.id(), libc::SIGINT);
        let ce = finish(c, Duration::from_secs(15));
        assert_eq!(ce.code, Some(0), "{}\n{}", ce.stdout, ce.stderr);
        let (progress, last) = (gb_decimals(&ce.stderr), gb_decimals(&ce.stdout));
        assert!(
            !progress.is_empty() && !last.is_empty(),
            "{}\n{}",
            ce.stderr,
            ce.stdout
        );
        assert!(
            progress.iter().chain(&last).all(|&d| d == last[0]),
            "GB with {progress:?} decimals in progress lines, {last:?} in the final line:\n{}\n{}",
            ce.stderr,
            ce.stdout
        );
        signal(p.id(), libc::SIGINT);
        assert_eq!(finish(p, Duration::from_secs(15)).code, Some(0));
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn inspect_explains_the_mark_of_a_dead_pid() {
    watchdog(60, |procs| {
        let dir = tmpdir("legend");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &["--rate", "300"]);
        let mut c = text_consumer(&procs, &sock);
        wait_until(Duration::from_secs(10), "the consumer to attach", || {
            active_consumers(&sock) == 1
        });
        kill_and_see_it_dead(&mut c, &sock);
        let out = Command::new(GPIPE)
            .args(["inspect", "--socket", sock.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        let marked = text.lines().filter(|l| l.contains('†')).count();
        let legend = text
            .lines()
            .find(|l| l.trim_start().starts_with('†'))
            .unwrap_or_else(|| panic!("no legend for †:\n{text}"));
        assert!(marked >= 2, "a dead pid marked, and its legend:\n{text}");
        assert!(legend.contains("no longer running"), "{legend}");
        signal(p.id(), libc::SIGINT);
        assert_eq!(finish(p, Duration::from_secs(15)).code, Some(0));
        let _ = std::fs::remove_dir_all(&dir);
    });
}
