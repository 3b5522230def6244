//! `gpipe relay`: a ring's batches carried to "another host" (another process pair on this
//! machine, over TCP, and NCCL for CUDA rings): every batch verified at the far consumer, the
//! ring closing end to end, and a kill on either side giving a clear error within seconds,
//! with the local ring going on for its other consumers and a receiver that can take a
//! restarted sender back. The host tests run in CI; the CUDA ones (`two_gpu_relay_*`) need
//! two GPUs and an NCCL library (GPIPE_NCCL_LIB, docs/relay.md).

mod common;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;

fn secret_file(dir: &Path) -> PathBuf {
    secret_file_with(dir, b"relay test secret, not a real one\n")
}

fn secret_file_with(dir: &Path, text: &[u8]) -> PathBuf {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join("secret");
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&p)
        .unwrap()
        .write_all(text)
        .unwrap();
    p
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

struct Relay {
    dir: PathBuf,
    a: PathBuf,
    b: PathBuf,
    secret: PathBuf,
    addr: String,
}

impl Relay {
    fn new(tag: &str) -> Relay {
        let dir = tmpdir(tag);
        let secret = secret_file(&dir);
        Relay {
            a: dir.join("a.sock"),
            b: dir.join("b.sock"),
            addr: format!("127.0.0.1:{}", free_port()),
            secret,
            dir,
        }
    }

    fn sender(&self, procs: &Procs, extra: &[&str], env: &[(&str, &str)]) -> Child {
        let mut args = vec![
            "relay",
            "send",
            "--socket",
            self.a.to_str().unwrap(),
            "--listen",
            &self.addr,
            "--secret-file",
            self.secret.to_str().unwrap(),
            "--connect-timeout",
            "20s",
            "--json",
        ];
        args.extend_from_slice(extra);
        spawn_env(procs, &args, env)
    }

    fn receiver(&self, procs: &Procs, extra: &[&str], env: &[(&str, &str)]) -> Child {
        let mut args = vec![
            "relay",
            "recv",
            "--connect",
            &self.addr,
            "--socket",
            self.b.to_str().unwrap(),
            "--secret-file",
            self.secret.to_str().unwrap(),
            "--connect-timeout",
            "20s",
            "--json",
        ];
        args.extend_from_slice(extra);
        let c = spawn_env(procs, &args, env);
        let b = self.b.clone();
        wait_until(Duration::from_secs(30), "the receiver's ring", move || {
            std::os::unix::net::UnixStream::connect(&b).is_ok()
        });
        c
    }
}

/// One report line (the last JSON line of stdout).
fn json_of(e: &Exit) -> serde_json::Value {
    e.stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_default()
}

/// Producer on ring A, sender, receiver making ring B, a verifying consumer on B: the
/// producer's batches arrive at B in order and intact; A's close closes B and ends its
/// consumer.
fn end_to_end(
    backend: &'static str,
    env: &'static [(&'static str, &'static str)],
    batch: &'static str,
) {
    watchdog(120, move |procs| {
        let r = Relay::new(&format!("relay-{backend}"));
        let p = producer_on_env(
            &procs,
            &r.a,
            backend,
            &["--batch-bytes", batch, "--rate", "500"],
            env,
        );
        let send = r.sender(&procs, &[], env);
        let recv = r.receiver(&procs, far_device(backend), env);
        let far = consumer_with(
            &procs,
            &r.b,
            &r.dir.join("far.seq"),
            far_device(backend),
            env,
        );
        wait_until(Duration::from_secs(30), "batches at the far ring", || {
            head(&r.b) > 300
        });
        signal(p.id(), libc::SIGINT);
        let pe = finish(p, Duration::from_secs(20));
        assert_eq!(pe.code, Some(0), "producer: {}", pe.stderr);
        let se = finish(send, Duration::from_secs(20));
        assert_eq!(se.code, Some(0), "sender: {}\n{}", se.stderr, se.stdout);
        let re = finish(recv, Duration::from_secs(20));
        assert_eq!(re.code, Some(0), "receiver: {}\n{}", re.stderr, re.stdout);
        let fe = finish(far, Duration::from_secs(20));
        assert_eq!(
            fe.code,
            Some(0),
            "far consumer: {}\n{}",
            fe.stderr,
            fe.stdout
        );
        let fr = report(&fe);
        assert_eq!(fr["mismatches"], 0, "{fr}");
        let s = seqs(&r.dir.join("far.seq"));
        assert!(s.len() > 100, "the far consumer got {} batches", s.len());
        assert_contiguous(&s, "far consumer");
        let (sj, rj) = (json_of(&se), json_of(&re));
        assert_eq!(sj["backend"], backend);
        // Everything sent was published at B.
        assert_eq!(sj["batches"], rj["batches"], "sender {sj} receiver {rj}");
        let _ = std::fs::remove_dir_all(&r.dir);
    });
}

/// The device arguments of the far side (GPU 1 on the CUDA backend).
fn far_device(backend: &str) -> &'static [&'static str] {
    if backend == "cuda" {
        &["--device", "1"]
    } else {
        &[]
    }
}

/// Ring `a` goes on for its `other` consumer (logging to `log`) after a fault elsewhere; then
/// its producer `p` closes it cleanly and the other consumer ends cleanly with every batch in
/// order. Returns the other consumer's exit.
fn ring_goes_on(p: std::process::Child, other: std::process::Child, a: &Path, log: &Path) -> Exit {
    let h = head(a);
    wait_until(Duration::from_secs(10), "ring A to go on", || {
        head(a) > h + 200
    });
    signal(p.id(), libc::SIGINT);
    assert_eq!(finish(p, Duration::from_secs(20)).code, Some(0));
    let oe = finish(other, Duration::from_secs(20));
    assert_eq!(oe.code, Some(0), "{}", oe.stderr);
    assert_contiguous(&seqs(log), "the other consumer");
    oe
}

/// Kill the receiver: the sender ends with an error naming the receiver within seconds, and
/// ring A goes on for its other consumer.
fn receiver_killed(backend: &'static str, env: &'static [(&'static str, &'static str)]) {
    let dev = far_device(backend);
    // The receiver dies.
    watchdog(120, move |procs| {
        let r = Relay::new(&format!("relay-kr-{backend}"));
        let p = producer_on_env(&procs, &r.a, backend, &["--rate", "1000"], env);
        let other = consumer_with(&procs, &r.a, &r.dir.join("other.seq"), &[], env);
        let send = r.sender(&procs, &[], env);
        let mut recv = r.receiver(&procs, dev, env);
        wait_until(Duration::from_secs(30), "batches through the relay", || {
            head(&r.b) > 100
        });
        recv.kill().unwrap();
        let _ = recv.wait();
        let t = Instant::now();
        let se = finish(send, Duration::from_secs(15));
        assert_ne!(se.code, Some(0), "the sender should fail: {}", se.stderr);
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "sender took {:?}",
            t.elapsed()
        );
        assert!(
            se.stderr.contains("receiver is gone") || se.stderr.contains("NCCL"),
            "sender: {}",
            se.stderr
        );
        // Ring A goes on for its other consumer.
        let oe = ring_goes_on(p, other, &r.a, &r.dir.join("other.seq"));
        assert_eq!(report(&oe)["mismatches"], 0);
        let _ = std::fs::remove_dir_all(&r.dir);
    });
}

/// The sender dies: a receiver with --rejoin keeps its ring and takes a restarted sender; its
/// consumer goes on and every batch it gets verifies.
fn sender_killed_and_rejoined(backend: &'static str, env: &'static [(&'static str, &'static str)]) {
    let dev = far_device(backend);
    watchdog(150, move |procs| {
        let r = Relay::new(&format!("relay-ks-{backend}"));
        let p = producer_on_env(&procs, &r.a, backend, &["--rate", "1000"], env);
        let mut send = r.sender(&procs, &[], env);
        let mut rargs = vec!["--rejoin"];
        rargs.extend_from_slice(dev);
        let recv = r.receiver(&procs, &rargs, env);
        let far = consumer_with(&procs, &r.b, &r.dir.join("far.seq"), dev, env);
        wait_until(Duration::from_secs(30), "batches through the relay", || {
            head(&r.b) > 100
        });
        send.kill().unwrap();
        let _ = send.wait();
        let h = head(&r.b);
        std::thread::sleep(Duration::from_millis(500));
        let send2 = r.sender(&procs, &[], env);
        wait_until(Duration::from_secs(40), "batches after the rejoin", || {
            head(&r.b) > h + 100
        });
        signal(p.id(), libc::SIGINT);
        assert_eq!(finish(p, Duration::from_secs(20)).code, Some(0));
        let se = finish(send2, Duration::from_secs(20));
        assert_eq!(se.code, Some(0), "second sender: {}", se.stderr);
        let re = finish(recv, Duration::from_secs(20));
        assert_eq!(re.code, Some(0), "receiver: {}", re.stderr);
        assert_eq!(json_of(&re)["sessions"], 2, "{}", re.stdout);
        let fe = finish(far, Duration::from_secs(20));
        assert_eq!(fe.code, Some(0), "far consumer: {}", fe.stderr);
        // B's own sequence stays contiguous across the rejoin (its producer never stopped),
        // and every batch verified, before and after.
        assert_eq!(report(&fe)["mismatches"], 0);
        assert_contiguous(&seqs(&r.dir.join("far.seq")), "far consumer");
        let _ = std::fs::remove_dir_all(&r.dir);
    });
}

#[test]
fn host_relay_carries_every_batch_intact_and_closes_end_to_end() {
    end_to_end("host", &[], "64KiB");
}

#[test]
fn host_relay_sender_fails_clearly_when_the_receiver_is_killed() {
    receiver_killed("host", &[]);
}

#[test]
fn host_relay_receiver_takes_back_a_restarted_sender() {
    sender_killed_and_rejoined("host", &[]);
}

#[test]
fn a_relay_with_the_wrong_secret_is_refused_on_both_sides() {
    watchdog(60, |procs| {
        let r = Relay::new("relay-secret");
        let other = tmpdir("relay-secret-2");
        let wrong = secret_file_with(&other, b"a different secret, also long\n");
        let p = producer_on(&procs, &r.a, "host", &[]);
        let send = r.sender(&procs, &[], &[]);
        let recv = spawn(
            &procs,
            &[
                "relay",
                "recv",
                "--connect",
                &r.addr,
                "--socket",
                r.b.to_str().unwrap(),
                "--secret-file",
                wrong.to_str().unwrap(),
                "--connect-timeout",
                "10s",
            ],
        );
        let re = finish(recv, Duration::from_secs(20));
        assert_ne!(re.code, Some(0));
        assert!(
            re.stderr.to_lowercase().contains("proof"),
            "receiver: {}",
            re.stderr
        );
        let se = finish(send, Duration::from_secs(20));
        assert_ne!(se.code, Some(0));
        assert!(
            se.stderr.to_lowercase().contains("proof"),
            "sender: {}",
            se.stderr
        );
        signal(p.id(), libc::SIGINT);
        assert_eq!(finish(p, Duration::from_secs(20)).code, Some(0));
        let _ = std::fs::remove_dir_all(&r.dir);
        let _ = std::fs::remove_dir_all(&other);
    });
}

const SOCKETS_ONLY: &[(&str, &str)] = &[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")];

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn two_gpu_relay_over_nccl_default_and_socket_transports() {
    end_to_end("cuda", &[], "8MiB");
    end_to_end("cuda", SOCKETS_ONLY, "8MiB");
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn two_gpu_relay_sender_fails_clearly_when_the_receiver_is_killed() {
    receiver_killed("cuda", &[]);
}

/// Failed on 2x H200 on 2026-11-23: after the sender was killed, no batch reached ring B from
/// the restarted sender within 40 s (docs/relay.md, "Known problems").
#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn two_gpu_relay_receiver_takes_back_a_restarted_sender() {
    sender_killed_and_rejoined("cuda", &[]);
}

/// Ring A → forwarder → ring B → forwarder → ring C → a verifying consumer: every batch of C
/// intact and in order, A's close closing the chain; then the middle forwarder killed: the
/// next one and C's consumer end with "producer died", and A goes on for its other consumer.
fn chain(backend: &'static str, dev: &'static [&'static str]) {
    chain_with(backend, dev, &[]);
}

/// As [`chain`], every forwarder started with `tuning` too (e.g. `--chunk 512KiB`).
fn chain_with(
    backend: &'static str,
    dev: &'static [&'static str],
    tuning: &'static [&'static str],
) {
    watchdog(120, move |procs| {
        let dir = tmpdir(&format!("chain-{backend}"));
        let (a, b, c) = (dir.join("a.sock"), dir.join("b.sock"), dir.join("c.sock"));
        let p = producer_on(&procs, &a, backend, &["--rate", "1000"]);
        let forward = |up: &Path, down: &Path| {
            let mut args = vec![
                "relay",
                "forward",
                "--upstream",
                up.to_str().unwrap(),
                "--socket",
                down.to_str().unwrap(),
                // Nothing forwarded before the next link (or the far consumer) is there, so
                // the far consumer gets every batch from the first.
                "--wait-for-consumers",
                "1",
                "--json",
            ];
            args.extend_from_slice(dev);
            args.extend_from_slice(tuning);
            let f = spawn(&procs, &args);
            let d = down.to_path_buf();
            wait_until(Duration::from_secs(30), "the forwarded ring", move || {
                std::os::unix::net::UnixStream::connect(&d).is_ok()
            });
            f
        };
        let f1 = forward(&a, &b);
        let f2 = forward(&b, &c);
        let far = consumer_with(&procs, &c, &dir.join("far.seq"), dev, &[]);
        wait_until(
            Duration::from_secs(30),
            "batches at the end of the chain",
            || head(&c) > 200,
        );
        signal(p.id(), libc::SIGINT);
        assert_eq!(finish(p, Duration::from_secs(20)).code, Some(0));
        for (name, f) in [("first", f1), ("second", f2)] {
            let e = finish(f, Duration::from_secs(20));
            assert_eq!(e.code, Some(0), "{name} forwarder: {}", e.stderr);
        }
        let fe = finish(far, Duration::from_secs(20));
        assert_eq!(fe.code, Some(0), "far consumer: {}", fe.stderr);
        assert_eq!(report(&fe)["mismatches"], 0);
        let s = seqs(&dir.join("far.seq"));
        assert!(s.len() > 200, "{} batches at the end of the chain", s.len());
        assert_eq!(s[0], 0, "the far consumer missed the first batches");
        assert_contiguous(&s, "far consumer");
        // The chunk progress boards a killed forwarder left in /dev/shm.
        for s in [&b, &c] {
            let _ = std::fs::remove_file(pipeline_relay::chunks::board_path(s));
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
    watchdog(120, move |procs| {
        let dir = tmpdir(&format!("chain-kill-{backend}"));
        let (a, b, c) = (dir.join("a.sock"), dir.join("b.sock"), dir.join("c.sock"));
        let p = producer_on(&procs, &a, backend, &["--rate", "1000"]);
        let other = consumer_with(&procs, &a, &dir.join("other.seq"), &[], &[]);
        let mut f1 = spawn(
            &procs,
            &[
                "relay",
                "forward",
                "--upstream",
                a.to_str().unwrap(),
                "--socket",
                b.to_str().unwrap(),
                "--wait-for-consumers",
                "1",
            ]
            .iter()
            .chain(tuning)
            .copied()
            .collect::<Vec<_>>(),
        );
        let bb = b.clone();
        wait_until(Duration::from_secs(30), "ring B", move || {
            std::os::unix::net::UnixStream::connect(&bb).is_ok()
        });
        let f2 = spawn(
            &procs,
            &[
                "relay",
                "forward",
                "--upstream",
                b.to_str().unwrap(),
                "--socket",
                c.to_str().unwrap(),
                // Ring C's batches start once the far consumer is attached, so that it is
                // killed mid-stream below, not mid-attach.
                "--wait-for-consumers",
                "1",
            ]
            .iter()
            .chain(tuning)
            .copied()
            .collect::<Vec<_>>(),
        );
        let cc = c.clone();
        wait_until(Duration::from_secs(30), "ring C", move || {
            std::os::unix::net::UnixStream::connect(&cc).is_ok()
        });
        let far = consumer_with(&procs, &c, &dir.join("far.seq"), &[], &[]);
        wait_until(
            Duration::from_secs(30),
            "batches at the end of the chain",
            || head(&c) > 100,
        );
        f1.kill().unwrap();
        let _ = f1.wait();
        let t = Instant::now();
        let e2 = finish(f2, Duration::from_secs(10));
        assert_ne!(e2.code, Some(0));
        assert!(
            e2.stderr.contains("producer died"),
            "second forwarder: {}",
            e2.stderr
        );
        let fe = finish(far, Duration::from_secs(10));
        assert_producer_died(fe, "far consumer");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        ring_goes_on(p, other, &a, &dir.join("other.seq"));
        // The chunk progress boards a killed forwarder left in /dev/shm.
        for s in [&b, &c] {
            let _ = std::fs::remove_file(pipeline_relay::chunks::board_path(s));
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn host_forwarders_chain_rings_and_a_killed_link_fails_clearly_downstream() {
    chain("host", &[]);
}

/// Issue #34: the same with chunked forwarders (the second copies each chunk once the first
/// wrote it): every batch whole at the end of the chain; the first forwarder SIGKILLed, with
/// batches part-copied, ends the second and the far consumer with "producer died", having
/// checked nothing wrong.
#[test]
fn host_chunked_forwarders_chain_rings_and_a_killed_link_fails_clearly_downstream() {
    chain_with("host", &[], &["--chunk", "256KiB"]);
}

/// GPU 0's ring forwarded to GPU 1, then along GPU 1.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn two_gpu_forwarders_chain_gpu0_to_gpu1() {
    chain("cuda", &["--device", "1"]);
}

/// The sender killed, with a receiver that does not rejoin: the receiver ends with an error
/// naming the sender within seconds, and its consumer sees its producer die (not a clean end
/// that would hide the batches that never came).
#[test]
fn host_relay_without_rejoin_ends_with_an_error_downstream() {
    watchdog(90, |procs| {
        let r = Relay::new("relay-norejoin");
        let p = producer_on(&procs, &r.a, "host", &["--rate", "1000"]);
        let mut send = r.sender(&procs, &[], &[]);
        let recv = r.receiver(&procs, &[], &[]);
        let far = consumer_with(&procs, &r.b, &r.dir.join("far.seq"), &[], &[]);
        wait_until(Duration::from_secs(30), "batches through the relay", || {
            head(&r.b) > 100
        });
        send.kill().unwrap();
        let _ = send.wait();
        let t = Instant::now();
        let re = finish(recv, Duration::from_secs(10));
        assert_ne!(re.code, Some(0), "receiver: {}", re.stderr);
        assert!(re.stderr.contains("sender"), "receiver: {}", re.stderr);
        assert_producer_died(finish(far, Duration::from_secs(10)), "far consumer");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        signal(p.id(), libc::SIGINT);
        assert_eq!(finish(p, Duration::from_secs(20)).code, Some(0));
        let _ = std::fs::remove_dir_all(&r.dir);
    });
}

/// Issue #34, one process per GPU (here: per group) on the host backend: each consumer runs the
/// forwarder of its ring (`gpipe consume --forward-from`), chunked. The far consumer gets every
/// batch whole; SIGKILLing the middle consumer takes its forwarder with it, and the far
/// consumer (and the forwarder in it) ends with "producer died" within seconds, having checked
/// nothing wrong, while ring A goes on for its other consumer.
#[test]
fn host_in_consumer_chunked_forwarders_and_a_killed_consumer_fail_downstream_only() {
    watchdog(120, |procs| {
        let dir = tmpdir("in-consumer-chain");
        let (a, b, c) = (dir.join("a.sock"), dir.join("b.sock"), dir.join("c.sock"));
        let p = producer_on(&procs, &a, "host", &["--rate", "1000"]);
        let other = consumer_with(&procs, &a, &dir.join("other.seq"), &[], &[]);
        let hop = |up: &Path, down: &Path, wait: &str, log: &str| {
            let c = consumer_with(
                &procs,
                down,
                &dir.join(log),
                &[
                    "--forward-from",
                    up.to_str().unwrap(),
                    "--forward-wait",
                    wait,
                    "--forward-chunk",
                    "16KiB",
                ],
                &[],
            );
            let d = down.to_path_buf();
            wait_until(Duration::from_secs(30), "a forwarded ring", move || {
                std::os::unix::net::UnixStream::connect(&d).is_ok()
            });
            c
        };
        let mut mid = hop(&a, &b, "2", "mid.seq");
        let far = hop(&b, &c, "1", "far.seq");
        wait_until(
            Duration::from_secs(30),
            "batches at the end of the chain",
            || head(&c) > 100,
        );
        mid.kill().unwrap();
        let _ = mid.wait();
        let t = Instant::now();
        let fe = finish(far, Duration::from_secs(10));
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        assert_ne!(fe.code, Some(0));
        let r = report(&fe);
        assert_eq!(r["mismatches"], 0, "{r}");
        let err = format!("{} {}", r["error"], r["forwarder"]["error"]);
        assert!(err.contains("producer died"), "{err}");
        let s = seqs(&dir.join("far.seq"));
        assert!(s.len() > 100 && s[0] == 0, "{} batches", s.len());
        assert_contiguous(&s, "far consumer");
        ring_goes_on(p, other, &a, &dir.join("other.seq"));
        // The chunk progress boards a killed forwarder left in /dev/shm.
        for s in [&b, &c] {
            let _ = std::fs::remove_file(pipeline_relay::chunks::board_path(s));
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}
