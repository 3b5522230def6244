//! Multi-process tests on the host backend: they spawn the real `gpipe` binary as producer
//! and consumers, kill them, feed garbage, scribble on the control segment, and check that
//! survivors lose nothing. Every test runs under a watchdog that kills its processes and
//! fails the test instead of letting CI hang.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn bench_broadcast_verifies_every_batch() {
    watchdog(120, |_| {
        let r = bench_json(&[
            "bench",
            "--backend",
            "host",
            "--consumers",
            "3",
            "--batches",
            "400",
            "--batch-bytes",
            "256KiB",
            "--json",
        ]);
        assert_eq!(r["published"], 400);
        assert_eq!(r["lost"], 0);
        assert_eq!(r["duplicated"], 0);
        assert_eq!(r["mismatches"], 0);
        let per = r["per_consumer"].as_array().unwrap();
        assert_eq!(per.len(), 3);
        assert!(
            per.iter()
                .all(|c| c["received"] == 400 && c["verified"] == true)
        );
    });
}

#[test]
fn bench_shared_splits_work_exactly_once() {
    watchdog(120, |_| {
        let r = bench_json(&[
            "bench",
            "--backend",
            "host",
            "--mode",
            "shared",
            "--consumers",
            "3",
            "--batches",
            "600",
            "--batch-bytes",
            "128KiB",
            "--json",
        ]);
        assert_eq!(r["lost"], 0);
        assert_eq!(r["duplicated"], 0);
        assert_eq!(r["mismatches"], 0);
        let total: u64 = r["per_consumer"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["received"].as_u64().unwrap())
            .sum();
        assert_eq!(total, 600);
    });
}

#[test]
fn late_consumer_starts_at_head_and_misses_nothing_after() {
    late_join_case("host");
}

#[test]
fn consumer_sigkill_does_not_stall_producer_or_others() {
    consumer_sigkill_case("host");
}

#[test]
fn consumer_killed_at_every_protocol_step() {
    for point in [
        "consumer.before_wait",
        "consumer.after_wait",
        "consumer.before_release",
        "consumer.after_release",
    ] {
        consumer_death_case("host", Some(point));
    }
}

#[test]
fn producer_killed_before_and_after_publish() {
    for point in ["producer.before_publish", "producer.after_publish"] {
        producer_death_case("host", point);
    }
}

#[test]
fn producer_sigkill_gives_consumers_a_clear_error_promptly() {
    watchdog(60, |procs| {
        let dir = tmpdir("pkill");
        let sock = dir.join("ring.sock");
        let mut p = producer(&procs, &sock, &["--rate", "200"]);
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        let b = consumer(&procs, &sock, &dir.join("b.seq"));
        wait_until(Duration::from_secs(10), "two consumers", || {
            active_consumers(&sock) == 2
        });
        wait_until(Duration::from_secs(10), "batches", || head(&sock) > 20);
        p.kill().unwrap();
        p.wait().unwrap();
        let t = Instant::now();
        for (name, c) in [("a", a), ("b", b)] {
            assert_producer_died(finish(c, Duration::from_secs(3)), name);
        }
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "consumers took {:?} to notice",
            t.elapsed()
        );
        assert_contiguous(&seqs(&dir.join("a.seq")), "consumer a");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

fn frame(kind: u16, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(b"GPW1");
    f.extend_from_slice(&kind.to_le_bytes());
    f.extend_from_slice(&0u16.to_le_bytes());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// Sends bytes to the producer and returns what it answered before closing.
fn poke(sock: &Path, bytes: &[u8]) -> Vec<u8> {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn garbage_and_wrong_version_handshakes_are_refused_without_harm() {
    watchdog(60, |procs| {
        let dir = tmpdir("garbage");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &["--rate", "300"]);
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        wait_until(Duration::from_secs(10), "consumer", || {
            active_consumers(&sock) == 1
        });
        // Random garbage: refused with a reason naming the magic.
        let r = poke(&sock, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(
            String::from_utf8_lossy(&r).contains("magic"),
            "reply: {:?}",
            String::from_utf8_lossy(&r)
        );
        // A well-framed Hello with a future version: refused naming the version.
        let mut hello = Vec::new();
        for v in [99u32, 1, 0] {
            hello.extend_from_slice(&v.to_le_bytes());
        }
        let r = poke(&sock, &frame(1, &hello));
        assert!(
            String::from_utf8_lossy(&r).contains("version"),
            "reply: {:?}",
            String::from_utf8_lossy(&r)
        );
        // A huge announced body: refused, not allocated.
        let mut big = frame(1, &[]);
        big[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let r = poke(&sock, &big);
        assert!(
            String::from_utf8_lossy(&r).contains("limit"),
            "reply: {:?}",
            String::from_utf8_lossy(&r)
        );
        // Truncated mid-frame, then closed.
        let _ = poke(&sock, &frame(1, &hello)[..7]);
        // The consumer never noticed; the ring goes on.
        assert_eq!(active_consumers(&sock), 1);
        progress_then_clean_close(p, a, &sock, &dir);
    });
}

#[test]
fn socket_is_private_and_foreign_uids_are_refused() {
    watchdog(60, |procs| {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        let dir = tmpdir("uid");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &["--rate", "100"]);
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "socket mode");
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            // Root can impersonate another uid: open the directory to it, and expect the
            // producer's SO_PEERCRED check (not file permissions) to refuse it.
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
            std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o777)).unwrap();
            // It trusts root's producer (a consumer's own check), so that the producer's
            // check is the one that refuses.
            let out = Command::new(GPIPE)
                .args([
                    "consume",
                    "--socket",
                    sock.to_str().unwrap(),
                    "--allow-producer-uid",
                    "0",
                ])
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            assert!(!out.status.success());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("uid 65534 is not allowed"), "stderr: {err}");
        } else {
            // Not root: another uid cannot even reach the socket (mode 0600, checked above).
            eprintln!("not root: the SO_PEERCRED refusal path is covered only when run as root");
        }
        signal(p.id(), libc::SIGINT);
        let pe = finish(p, Duration::from_secs(15));
        assert_eq!(pe.code, Some(0), "{}", pe.stderr);
        assert!(
            !sock.exists(),
            "the producer removes its socket on a clean exit"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn a_consumer_write_to_the_control_segment_faults_in_the_writer_alone() {
    watchdog(60, |procs| {
        let dir = tmpdir("scribble");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &["--rate", "300"]);
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        wait_until(Duration::from_secs(10), "consumer", || {
            active_consumers(&sock) == 1
        });
        wait_until(Duration::from_secs(10), "batches", || head(&sock) > 20);
        // A hostile consumer attaches like any other, then tries to scribble on the shared
        // head (before protocol version 4 it could, and the victim stopped with "control
        // segment corrupted"). The segment is mapped read-only and sealed against writes:
        // the write faults in the writer alone (a forked child here, so that the fault is
        // observable), and the victim goes on undisturbed.
        let hostile: pipeline_core::Consumer<pipeline_core::HostConsumer> =
            pipeline_core::Consumer::attach(&sock, pipeline_core::HostOptions::default()).unwrap();
        let h = &hostile.segment().header().head.value;
        // SAFETY: the child only stores to a mapped word and exits, with no lock held.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            h.fetch_add(1_000_000, Ordering::SeqCst);
            // Reached only if the write landed.
            // SAFETY: ends the forked child at once, running nothing of the parent's.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
            "a consumer's write to the control segment must fault (wait status {status:#x})"
        );
        drop(hostile);
        progress_then_clean_close(p, a, &sock, &dir);
    });
}

#[test]
fn socket_closed_mid_handshake_frees_the_consumer_slot() {
    watchdog(60, |procs| {
        let dir = tmpdir("midhs");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &["--rate", "500", "--max-consumers", "1"]);
        // Hello, read the Welcome (its fds are dropped by a plain read), then hang up.
        let mut hello = Vec::new();
        // Version, role (consumer), backend (any).
        for v in [pipeline_core::layout::PROTOCOL_VERSION, 1, 0] {
            hello.extend_from_slice(&v.to_le_bytes());
        }
        {
            let mut s = UnixStream::connect(&sock).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(&frame(1, &hello)).unwrap();
            let mut prefix = [0u8; 12];
            s.read_exact(&mut prefix).unwrap();
            assert_eq!(&prefix[..4], b"GPW1");
            assert_eq!(
                u16::from_le_bytes([prefix[4], prefix[5]]),
                2,
                "expected Welcome"
            );
        }
        // The only consumer index must be free again: a real consumer attaches and receives.
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        wait_until(Duration::from_secs(10), "the consumer to attach", || {
            active_consumers(&sock) == 1
        });
        progress_then_clean_close(p, a, &sock, &dir);
    });
}

#[test]
fn lag_policy_detach_after_drops_a_stuck_consumer_only() {
    watchdog(60, |procs| {
        let dir = tmpdir("lagdetach");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &["--detach-after-ms", "300"]);
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        // Holds each batch for 3 s: alive, but not releasing.
        let slow = spawn(
            &procs,
            &[
                "consume",
                "--socket",
                sock.to_str().unwrap(),
                "--json",
                "--work-us",
                "3000000",
            ],
        );
        let es = finish(slow, Duration::from_secs(10));
        assert_eq!(
            es.code,
            Some(1),
            "the slow consumer must be told: {}",
            es.stdout
        );
        let err = report(&es)["error"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(err.contains("detached"), "error: {err}");
        let h = head(&sock);
        wait_until(Duration::from_secs(5), "the producer to go on", || {
            head(&sock) > h + 200
        });
        assert!(
            inspect(&sock)["consumers"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["state"] == "detached")
        );
        signal(p.id(), libc::SIGINT);
        let pe = finish(p, Duration::from_secs(15));
        assert_eq!(pe.code, Some(0), "{}", pe.stderr);
        assert!(pe.stderr.contains("detached 1"), "{}", pe.stderr);
        let ea = finish(a, Duration::from_secs(10));
        assert_eq!(ea.code, Some(0), "{}", ea.stderr);
        assert_contiguous(&seqs(&dir.join("a.seq")), "the healthy consumer");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn lag_policy_block_holds_the_producer_until_a_stopped_consumer_resumes() {
    watchdog(60, |procs| {
        let dir = tmpdir("lagblock");
        let sock = dir.join("ring.sock");
        let p = producer(&procs, &sock, &[]);
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        let b = consumer(&procs, &sock, &dir.join("b.seq"));
        wait_until(Duration::from_secs(10), "two consumers", || {
            active_consumers(&sock) == 2
        });
        wait_until(Duration::from_secs(10), "batches", || head(&sock) > 100);
        signal(b.id(), libc::SIGSTOP);
        std::thread::sleep(Duration::from_millis(200));
        let h1 = head(&sock);
        std::thread::sleep(Duration::from_millis(500));
        let h2 = head(&sock);
        assert_eq!(
            h1, h2,
            "the producer must wait for the stopped consumer (back-pressure)"
        );
        signal(b.id(), libc::SIGCONT);
        wait_until(Duration::from_secs(5), "the producer to resume", || {
            head(&sock) > h2 + 100
        });
        signal(p.id(), libc::SIGINT);
        assert_eq!(finish(p, Duration::from_secs(15)).code, Some(0));
        for (name, c, log) in [("a", a, "a.seq"), ("b", b, "b.seq")] {
            let e = finish(c, Duration::from_secs(10));
            assert_eq!(e.code, Some(0), "consumer {name}: {}", e.stderr);
            assert_contiguous(&seqs(&dir.join(log)), name);
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn short_soak_loses_nothing() {
    watchdog(120, |_| {
        for mode in ["broadcast", "shared"] {
            let out = Command::new(GPIPE)
                .args([
                    "soak",
                    "--backend",
                    "host",
                    "--duration",
                    "4",
                    "--mode",
                    mode,
                    "--batch-bytes",
                    "128KiB",
                    "--seed",
                    "3",
                    "--json",
                ])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{mode}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(r["lost"], 0, "{mode}");
            assert_eq!(r["duplicated"], 0, "{mode}");
            assert_eq!(r["mismatches"], 0, "{mode}");
            assert!(r["consumers_started"].as_u64().unwrap() > 3, "{mode}: {r}");
            assert!(r["delivered"].as_u64().unwrap() > 0, "{mode}: {r}");
            assert_eq!(r["delivered"], r["verified"], "{mode}");
            // One RSS sample per tenth of the run, all real.
            let series = r["rss_kib_series"].as_array().unwrap();
            assert_eq!(series.len(), 10, "{mode}: {r}");
            assert!(
                series.iter().all(|k| k.as_u64().unwrap() > 0),
                "{mode}: {r}"
            );
        }
    });
}

/// A consumer whose attach fails still ends with a JSON report that says why, so a harness
/// (bench, soak) can tell a refused attach from a crash.
#[test]
fn failed_attach_still_reports_why() {
    watchdog(30, |_| {
        let dir = std::env::temp_dir().join(format!("gpipe-noattach-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("nobody-here.sock");
        let out = Command::new(GPIPE)
            .args(["consume", "--json", "--socket"])
            .arg(&sock)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let line = String::from_utf8_lossy(&out.stdout);
        let r: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
        assert_eq!(r["attach_failed"], true, "{r}");
        assert_eq!(r["received"], 0, "{r}");
        let why = r["error"].as_str().unwrap();
        assert!(why.contains("nobody-here.sock"), "{why}");
        // The same reason goes to stderr for a person.
        assert!(String::from_utf8_lossy(&out.stderr).contains("nobody-here.sock"));
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn consumer_devices_are_checked_before_anything_starts() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(GPIPE)
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&[
        "bench",
        "--backend",
        "host",
        "--consumers",
        "1",
        "--consumer-devices",
        "0,1",
    ]);
    assert!(err.contains("names 2 device(s) for 1 consumer"), "{err}");
    let err = run(&[
        "bench",
        "--backend",
        "host",
        "--consumers",
        "1",
        "--consumer-devices",
        "0",
    ]);
    assert!(err.contains("applies to the CUDA backend"), "{err}");
}

#[test]
fn bench_with_a_lead_bound_verifies_every_batch_and_reports_it() {
    let r = bench_json(&[
        "bench",
        "--backend",
        "host",
        "--consumers",
        "2",
        "--batches",
        "300",
        "--slots",
        "8",
        "--max-lead",
        "2",
        "--batch-bytes",
        "64KiB",
        "--json",
    ]);
    assert_eq!(r["max_lead"], 2);
    assert_eq!(
        (r["lost"].as_u64(), r["mismatches"].as_u64()),
        (Some(0), Some(0))
    );
    let (code, err) = gpipe_exit(&["bench", "--backend", "host", "--max-lead", "0"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("max-lead"));
}

#[test]
fn bench_gpu_timeline_needs_the_cuda_backend() {
    let (code, err) = gpipe_exit(&["bench", "--backend", "host", "--gpu-timeline", "10"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--gpu-timeline stamps GPU kernels"), "{err}");
    let (code, err) = gpipe_exit(&["bench", "--backend", "host", "--gpu-timeline-out", "/tmp/x"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--gpu-timeline"), "{err}");
    // Only one fill and one verify per consumer of each batch are stamped.
    for extra in [
        ["--mode", "shared"],
        ["--passes", "2"],
        ["--delivery", "mirror"],
    ] {
        let mut args = vec!["bench", "--backend", "host", "--gpu-timeline", "10"];
        args.extend(extra);
        let (code, err) = gpipe_exit(&args);
        assert_ne!(code, Some(0), "{extra:?}");
        assert!(
            err.contains("needs --mode broadcast, --passes 1"),
            "{extra:?}: {err}"
        );
    }
}

#[test]
fn bench_repeat_keeps_every_repetition_and_reports_the_median() {
    let r = bench_json(&[
        "bench",
        "--backend",
        "host",
        "--consumers",
        "1",
        "--batches",
        "200",
        "--batch-bytes",
        "64KiB",
        "--repeat",
        "3",
        "--max-lead",
        "auto",
        "--json",
    ]);
    let rep = &r["repetitions"];
    let runs = rep["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    let mut rates: Vec<f64> = runs
        .iter()
        .map(|x| x["batches_per_s"].as_f64().unwrap())
        .collect();
    rates.sort_by(f64::total_cmp);
    assert_eq!(rep["batches_per_s"]["median"].as_f64(), Some(rates[1]));
    assert_eq!(rep["batches_per_s"]["min"].as_f64(), Some(rates[0]));
    // The report is the median repetition's.
    assert_eq!(r["batches_per_s"].as_f64(), Some(rates[1]));
    // auto on the host backend: the ring's own bound.
    assert!(r.get("max_lead").is_none() || r["max_lead"].is_null());
    assert_eq!(
        (r["lost"].as_u64(), r["problems"].as_array().map(Vec::len)),
        (Some(0), Some(0))
    );
}

/// A fan-out on the host backend: each group of consumers (what a GPU is on a CUDA node)
/// gets a ring of its own, fed by a forwarder (in the process of the group's first consumer,
/// the default, or a process of its own) from its parent's ring; every batch reaches every
/// consumer through one or more forwarders, verified, and the report shows the rings.
fn host_fanout(
    shape: &'static str,
    devices: &'static str,
    rings: &'static [(u64, Option<u64>)],
    depth: u64,
) {
    host_fanout_with(shape, devices, rings, depth, &[]);
}

fn host_fanout_with(
    shape: &'static str,
    devices: &'static str,
    rings: &'static [(u64, Option<u64>)],
    depth: u64,
    extra: &'static [&'static str],
) {
    watchdog(120, move |_| {
        let n = devices.split(',').count().to_string();
        let mut args = vec![
            "bench",
            "--backend",
            "host",
            "--consumers",
            &n,
            "--consumer-devices",
            devices,
            "--fanout",
            shape,
            "--batches",
            "400",
            "--slots",
            "4",
            "--batch-bytes",
            "64KiB",
            "--json",
        ];
        args.extend_from_slice(extra);
        let r = bench_json(&args);
        assert_eq!(r["published"], 400);
        assert_eq!(
            (
                r["lost"].as_u64(),
                r["duplicated"].as_u64(),
                r["mismatches"].as_u64()
            ),
            (Some(0), Some(0), Some(0)),
            "{r}"
        );
        let per = r["per_consumer"].as_array().unwrap();
        assert!(
            per.iter()
                .all(|c| c["received"] == 400 && c["verified"] == true)
        );
        let fan = &r["fanout"];
        assert_eq!(fan["shape"], shape);
        assert_eq!(fan["depth"], depth);
        let got: Vec<(u64, Option<u64>)> = fan["rings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| (g["device"].as_u64().unwrap(), g["parent"].as_u64()))
            .collect();
        assert_eq!(got, rings);
        for g in &fan["rings"].as_array().unwrap()[1..] {
            assert_eq!(g["forwarder"]["batches"], 400, "{g}");
            assert!(
                g["forwarder"]["drained_at_unix_s"].as_f64().is_some(),
                "{g}"
            );
        }
        assert!(r["problems"].as_array().unwrap().is_empty(), "{r}");
    });
}

#[test]
fn bench_fanout_chain_forwards_every_batch_along_the_groups() {
    host_fanout(
        "chain",
        "0,1,2,2",
        &[(0, None), (1, Some(0)), (2, Some(1))],
        2,
    );
}

/// Issue #34: chunked forwarders (16 KiB chunks of 64 KiB batches), in the consumers'
/// processes and as processes of their own: every batch whole on every group, and the
/// forwarders after the first copied batches ahead of their publication upstream.
#[test]
fn bench_fanout_chunked_chain_verifies_every_batch_in_consumer_and_process_forwarders() {
    for forwarders in ["in-consumer", "process"] {
        let extra: &'static [&'static str] = match forwarders {
            "in-consumer" => &["--chunk", "16KiB", "--forwarders", "in-consumer"],
            _ => &["--chunk", "16KiB", "--forwarders", "process"],
        };
        host_fanout_with(
            "chain",
            "1,2,3",
            &[(0, None), (1, Some(0)), (2, Some(1)), (3, Some(2))],
            3,
            extra,
        );
    }
}

/// The rings of a binary tree of 4 GPUs under the producer's GPU 0: (ring, fed by ring).
const TREE: &[(u64, Option<u64>)] = &[
    (0, None),
    (1, Some(0)),
    (2, Some(0)),
    (3, Some(1)),
    (4, Some(1)),
];

#[test]
fn bench_fanout_chunked_tree_verifies_every_batch() {
    host_fanout_with("tree", "1,2,3,4", TREE, 2, &["--chunk", "16KiB"]);
}

#[test]
fn bench_fanout_tree_forwards_every_batch_down_a_binary_tree() {
    host_fanout("tree", "1,2,3,4", TREE, 2);
}

#[test]
fn bench_fanout_refuses_shared_mode_and_auto_stays_direct_for_one_group() {
    let (code, err) = gpipe_exit(&[
        "bench",
        "--backend",
        "host",
        "--mode",
        "shared",
        "--consumers",
        "2",
        "--consumer-devices",
        "0,1",
        "--fanout",
        "chain",
    ]);
    assert_ne!(code, Some(0));
    assert!(err.contains("needs --mode broadcast"), "{err}");
    // One other group: auto is direct, and direct takes no groups on the host backend.
    let (code, err) = gpipe_exit(&[
        "bench",
        "--backend",
        "host",
        "--consumers",
        "2",
        "--consumer-devices",
        "0,1",
        "--fanout",
        "auto",
    ]);
    assert_ne!(code, Some(0));
    assert!(err.contains("applies to the CUDA backend"));
}

#[test]
fn bench_slots_auto_on_the_host_is_eight_and_says_why() {
    let out = std::process::Command::new(GPIPE)
        .args([
            "bench",
            "--backend",
            "host",
            "--consumers",
            "1",
            "--slots",
            "auto",
            "--batches",
            "100",
            "--batch-bytes",
            "64KiB",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["slots"], 8);
    assert_eq!(r["lost"], 0);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--slots auto: 8 slots (the host backend)"),
        "{err}"
    );
}

#[test]
fn consume_passes_reads_each_batch_again_and_still_verifies_every_one() {
    watchdog(60, |procs| {
        let dir = tmpdir("passes");
        let sock = dir.join("ring.sock");
        let p = producer(
            &procs,
            &sock,
            &["--batches", "200", "--wait-for-consumers", "1"],
        );
        let args = [
            "consume",
            "--socket",
            sock.to_str().unwrap(),
            "--verify",
            "--passes",
            "3",
            "--json",
        ];
        let c = spawn(&procs, &args);
        let e = finish(c, Duration::from_secs(30));
        assert_eq!(e.code, Some(0), "{}", e.stderr);
        let r = report(&e);
        assert_eq!(r["received"], 200, "{r}");
        assert_eq!(r["verified"], true, "{r}");
        assert_eq!(r["mismatches"], 0, "{r}");
        assert_eq!(finish(p, Duration::from_secs(10)).code, Some(0));
        // --passes without --verify is refused before attaching.
        let refused = spawn(
            &procs,
            &[
                "consume",
                "--socket",
                sock.to_str().unwrap(),
                "--passes",
                "2",
            ],
        );
        let e = finish(refused, Duration::from_secs(10));
        assert_eq!(e.code, Some(2), "{}", e.stderr);
        assert!(e.stderr.contains("--verify"), "{}", e.stderr);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn bench_passes_per_consumer_are_run_and_recorded() {
    let r = bench_json(&[
        "bench",
        "--json",
        "--backend",
        "host",
        "--consumers",
        "2",
        "--passes",
        "3,1",
        "--batches",
        "200",
        "--batch-bytes",
        "256KiB",
    ]);
    assert_eq!(r["passes"], serde_json::json!([3, 1]), "{r}");
    assert_eq!(r["mismatches"], 0, "{r}");
    assert_eq!(r["lost"], 0, "{r}");
    for c in r["per_consumer"].as_array().unwrap() {
        assert_eq!(c["received"], 200, "{c}");
    }
}

#[test]
fn bench_refuses_passes_that_do_not_fit_the_consumers_or_the_mode() {
    for (args, says) in [
        (
            &["--consumers", "2", "--passes", "1,2,3"][..],
            "give one for all, or one per consumer",
        ),
        (
            &["--consumers", "2", "--mode", "shared", "--passes", "2,1"][..],
            "one value in shared mode",
        ),
        (&["--consumers", "0"][..], "give 1 consumer or more"),
    ] {
        let mut all = vec!["bench", "--backend", "host", "--batches", "10"];
        all.extend_from_slice(args);
        let (code, err) = gpipe_exit(&all);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// `--fanout auto` with two or more other groups: a chain of whole-batch forwarders, and the
/// report says why (the shape asked for by name carries no reason).
#[test]
fn bench_fanout_auto_takes_a_whole_batch_chain_and_says_why() {
    watchdog(120, |_| {
        let run = |shape: &str| {
            bench_json(&[
                "bench",
                "--backend",
                "host",
                "--consumers",
                "3",
                "--consumer-devices",
                "1,2,3",
                "--fanout",
                shape,
                "--batches",
                "60",
                "--batch-bytes",
                "64KiB",
                "--json",
            ])
        };
        let r = run("auto");
        assert_eq!(r["fanout"]["shape"], "chain", "{r}");
        assert_eq!(r["fanout"]["chunk_bytes"], serde_json::Value::Null, "{r}");
        assert!(
            r["fanout"]["why"].as_str().unwrap().contains("chain"),
            "{r}"
        );
        assert_eq!(r["mismatches"], 0, "{r}");
        assert_eq!(run("chain")["fanout"]["why"], serde_json::Value::Null);
    });
}
