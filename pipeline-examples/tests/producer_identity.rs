//! Who is the producer: a consumer checks the uid that listens on the socket (its own, or one
//! it allows), `--allow-uid` really lets the allowed user connect, a producer removes only the
//! socket it created, and of producers started at once on one path exactly one wins.
//!
//! The tests with a second user run as root (they run processes as uid 65534, `nobody`, and
//! 65533, which need no account); elsewhere they say so and pass without running.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const OTHER: u32 = 65534;
const THIRD: u32 = 65533;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn skip_unless_root() -> bool {
    if is_root() {
        return false;
    }
    eprintln!("SKIPPED: needs root, to run processes as a second uid ({OTHER})");
    true
}

/// A directory every user can reach and write (the socket's, for tests across users).
fn shared_dir(tag: &str) -> std::path::PathBuf {
    let dir = tmpdir(tag);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

/// `gpipe ARGS` as `uid` (None: ourselves).
fn gpipe_as(procs: &Procs, uid: Option<u32>, args: &[&str]) -> Child {
    let mut cmd = Command::new(GPIPE);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let c = cmd.spawn().expect("spawn gpipe");
    procs.add(&c);
    c
}

fn produce_args<'a>(sock: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "produce",
        "--socket",
        sock,
        "--backend",
        "host",
        "--batch-bytes",
        "64KiB",
        "--slots",
        "4",
        "--rate",
        "300",
    ];
    a.extend_from_slice(extra);
    a
}

fn wait_for_socket(sock: &Path) {
    wait_until(Duration::from_secs(10), "the producer's socket", || {
        std::os::unix::net::UnixStream::connect(sock).is_ok()
    });
}

/// `gpipe consume` of 20 batches as `uid`, to its end.
fn consume_as(uid: Option<u32>, sock: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(GPIPE);
    cmd.args([
        "consume",
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--max-batches",
        "20",
    ])
    .args(extra);
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn stop(p: Child) -> Exit {
    signal(p.id(), libc::SIGINT);
    finish(p, Duration::from_secs(15))
}

/// Another user's producer on the path a consumer was given: refused, naming the uid, unless
/// the consumer allows that uid (before: root attached to the other user's ring silently).
#[test]
fn a_consumer_refuses_a_producer_of_another_uid() {
    if skip_unless_root() {
        return;
    }
    watchdog(60, |procs| {
        let dir = shared_dir("foreign-producer");
        let sock = dir.join("feed.sock");
        let s = sock.to_str().unwrap();
        let p = gpipe_as(&procs, Some(OTHER), &produce_args(s, &["--allow-uid", "0"]));
        wait_for_socket(&sock);
        let (code, out) = consume_as(None, &sock, &[]);
        assert_ne!(code, Some(0), "attached to uid {OTHER}'s producer: {out}");
        assert!(
            out.contains(&format!("runs as uid {OTHER}"))
                && out.contains(&format!("--allow-producer-uid {OTHER}")),
            "{out}"
        );
        let (code, out) = consume_as(None, &sock, &["--allow-producer-uid", &OTHER.to_string()]);
        assert_eq!(code, Some(0), "allowed, it must attach: {out}");
        let pe = stop(p);
        assert_eq!(pe.code, Some(0), "{}", pe.stderr);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// `--allow-uid` lets that user connect (the socket is opened to others and the uid check
/// filters), and only that user (before: the socket stayed 0600 and the allowed user got
/// "permission denied").
#[test]
fn allow_uid_lets_the_allowed_user_attach_and_no_other() {
    if skip_unless_root() {
        return;
    }
    watchdog(60, |procs| {
        // Made by root: others may search it but not write it.
        let dir = tmpdir("allow-uid");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let sock = dir.join("feed.sock");
        let s = sock.to_str().unwrap();
        let p = gpipe_as(
            &procs,
            None,
            &produce_args(s, &["--allow-uid", &OTHER.to_string()]),
        );
        wait_for_socket(&sock);
        let (code, out) = consume_as(Some(OTHER), &sock, &["--allow-producer-uid", "0"]);
        assert_eq!(code, Some(0), "the allowed uid must attach: {out}");
        let (code, out) = consume_as(Some(THIRD), &sock, &["--allow-producer-uid", "0"]);
        assert_ne!(code, Some(0), "uid {THIRD} attached: {out}");
        assert!(
            out.contains(&format!("uid {THIRD} is not allowed")),
            "{out}"
        );
        let pe = stop(p);
        assert_eq!(pe.code, Some(0), "{}", pe.stderr);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Producer A's socket is removed and producer B starts on the path; A stopping must not
/// delete B's socket (before: it did, and B was unreachable).
#[test]
fn a_producer_removes_only_the_socket_it_created() {
    watchdog(60, |procs| {
        let dir = tmpdir("own-socket");
        let sock = dir.join("ring.sock");
        let s = sock.to_str().unwrap();
        let a = gpipe_as(&procs, None, &produce_args(s, &[]));
        wait_for_socket(&sock);
        std::fs::remove_file(&sock).unwrap();
        let b = gpipe_as(&procs, None, &produce_args(s, &[]));
        wait_for_socket(&sock);
        let ea = stop(a);
        assert_eq!(ea.code, Some(0), "{}", ea.stderr);
        assert!(sock.exists(), "producer A removed producer B's socket");
        let (code, out) = consume_as(None, &sock, &[]);
        assert_eq!(code, Some(0), "B must still be reachable: {out}");
        let eb = stop(b);
        assert_eq!(eb.code, Some(0), "{}", eb.stderr);
        assert!(!sock.exists(), "B removes its own socket");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Several producers started at once on one path: exactly one keeps running, the others
/// exit saying another producer listens there (before: 2 of 20 starts left two running).
#[test]
fn of_producers_started_at_once_exactly_one_wins() {
    const ROUNDS: usize = 12;
    const AT_ONCE: usize = 3;
    watchdog(120, |procs| {
        let dir = tmpdir("race");
        let sock = dir.join("ring.sock");
        let s = sock.to_str().unwrap();
        for round in 0..ROUNDS {
            let mut ps: Vec<Child> = (0..AT_ONCE)
                .map(|_| gpipe_as(&procs, None, &produce_args(s, &[])))
                .collect();
            // Every loser exits at once; give them time to.
            let settle = Instant::now() + Duration::from_secs(3);
            let mut running;
            loop {
                running = 0;
                for p in ps.iter_mut() {
                    if p.try_wait().unwrap().is_none() {
                        running += 1;
                    }
                }
                if running <= 1 && sock.exists() || Instant::now() >= settle {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            std::thread::sleep(Duration::from_millis(300));
            let mut winners = Vec::new();
            let mut losers = Vec::new();
            for p in ps {
                let mut p = p;
                if p.try_wait().unwrap().is_none() {
                    winners.push(p);
                } else {
                    losers.push(finish(p, Duration::from_secs(1)));
                }
            }
            let n = winners.len();
            for w in winners {
                stop(w);
            }
            assert_eq!(n, 1, "round {round}: {n} producers kept running");
            for l in &losers {
                assert!(
                    l.stderr.contains("already listening")
                        || l.stderr.contains("at the same moment"),
                    "round {round}: a loser said {}",
                    l.stderr
                );
            }
            assert!(
                !sock.exists(),
                "round {round}: the winner removes its socket"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}
