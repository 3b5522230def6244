//! Rings across pid namespaces (containers): a producer and its consumers in different pid
//! namespaces attach, run and notice each other's death, whatever pid `SO_PEERCRED` reports
//! (0 for a peer in a namespace the reader cannot see into). Host backend; each process runs
//! under `unshare --pid --fork --mount-proc` (as root, or wherever the machine allows it).
//! Where `unshare` is not permitted the tests say so and pass without running.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// Why `unshare` cannot make a pid namespace here, if it cannot.
fn unshare_refused() -> Option<String> {
    match Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child", "true"])
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "`unshare --pid --fork --mount-proc` is not permitted here ({}): run as root, or \
             where unprivileged user namespaces are allowed",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("`unshare` cannot be run ({e})")),
    }
}

/// Skips (with the reason printed) where no pid namespace can be made.
fn skip() -> bool {
    match unshare_refused() {
        Some(why) => {
            eprintln!("SKIPPED: {why}");
            true
        }
        None => false,
    }
}

/// `gpipe ARGS`, in a pid namespace of its own when `isolated`. The process killed by the
/// watchdog (unshare) takes its child along (`--kill-child`).
fn gpipe_in(procs: &Procs, isolated: bool, args: &[&str]) -> Child {
    let mut cmd = if isolated {
        let mut c = Command::new("unshare");
        c.args(["--pid", "--fork", "--mount-proc", "--kill-child", GPIPE]);
        c
    } else {
        Command::new(GPIPE)
    };
    let c = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    procs.add(&c);
    c
}

/// The host pid of the gpipe process `c` runs: `c` itself, or the child `unshare` forked.
fn gpipe_pid(c: &Child, isolated: bool) -> u32 {
    if !isolated {
        return c.id();
    }
    let children = format!("/proc/{0}/task/{0}/children", c.id());
    std::fs::read_to_string(&children)
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unshare ({}) has no child", c.id()))
}

fn producer_in(procs: &Procs, isolated: bool, sock: &Path, backend: &str) -> Child {
    let p = gpipe_in(
        procs,
        isolated,
        &[
            "produce",
            "--socket",
            sock.to_str().unwrap(),
            "--backend",
            backend,
            "--batch-bytes",
            "64KiB",
            "--slots",
            "4",
            "--rate",
            "300",
        ],
    );
    wait_until(Duration::from_secs(10), "the producer's socket", || {
        std::os::unix::net::UnixStream::connect(sock).is_ok()
    });
    p
}

fn consumer_in(procs: &Procs, isolated: bool, sock: &Path, max_batches: Option<u64>) -> Child {
    let n = max_batches.map(|n| n.to_string());
    let mut args = vec![
        "consume",
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--json",
    ];
    if let Some(n) = &n {
        args.extend(["--max-batches", n]);
    }
    gpipe_in(procs, isolated, &args)
}

/// A consumer attaches, verifies `N` batches and ends cleanly; a second one attaches, is
/// killed, and the producer takes its slots back (liveness by the socket, not a pid); then
/// the producer stops cleanly.
fn ring_across(producer_isolated: bool, consumers_isolated: bool) {
    ring_across_on("host", producer_isolated, consumers_isolated);
}

fn ring_across_on(backend: &'static str, producer_isolated: bool, consumers_isolated: bool) {
    const N: u64 = 100;
    watchdog(90, move |procs| {
        let dir = tmpdir("pidns");
        let sock = dir.join("ring.sock");
        let p = producer_in(&procs, producer_isolated, &sock, backend);
        let a = consumer_in(&procs, consumers_isolated, &sock, Some(N));
        let ea = finish(a, Duration::from_secs(30));
        assert_eq!(
            ea.code,
            Some(0),
            "the consumer failed: {} {}",
            ea.stdout,
            ea.stderr
        );
        let r = report(&ea);
        assert_eq!(r["received"], N, "{r}");
        assert_eq!(r["mismatches"], 0, "{r}");
        // Liveness: a consumer killed mid-stream is noticed and its slots taken back.
        let mut b = consumer_in(&procs, consumers_isolated, &sock, None);
        wait_until(Duration::from_secs(10), "the second consumer", || {
            active_consumers(&sock) == 1
        });
        b.kill().unwrap();
        let _ = b.wait();
        wait_until(
            Duration::from_secs(5),
            "the producer to notice the death",
            || active_consumers(&sock) == 0,
        );
        // Ctrl-C to the producer itself: `unshare` does not pass signals on.
        signal(gpipe_pid(&p, producer_isolated), libc::SIGINT);
        let pe = finish(p, Duration::from_secs(15));
        assert_eq!(pe.code, Some(0), "producer: {}", pe.stderr);
        assert!(
            !pe.stderr.contains("cannot read"),
            "producer: {}",
            pe.stderr
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Before: "attach: cannot read peer credentials: Success (os error 0)" on the producer,
/// "Connection reset by peer" on the consumer.
#[test]
fn producer_in_a_pid_namespace_consumer_on_the_host() {
    if skip() {
        return;
    }
    ring_across(true, false);
}

/// The consumer reads the producer's credentials too (the producer-uid check), and sees pid
/// 0 for a producer outside its namespace.
#[test]
fn consumer_in_a_pid_namespace_producer_on_the_host() {
    if skip() {
        return;
    }
    ring_across(false, true);
}

/// Two containers: neither can see the other's pids.
#[test]
fn producer_and_consumer_in_sibling_pid_namespaces() {
    if skip() {
        return;
    }
    ring_across(true, true);
}

/// A CUDA ring (its memory and events shared by fd and handle, not by pid) with the producer
/// and its consumers in sibling pid namespaces.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ring_in_sibling_pid_namespaces() {
    if skip() {
        return;
    }
    ring_across_on("cuda", true, true);
}
