//! The multi-process conformance tests on the CUDA backend. They need a CUDA GPU, so they are
//! ignored in CI; run them with `cargo test -- --include-ignored` (or `.gpu/run.sh`) on a GPU
//! machine.

mod common;

use std::process::Command;

use common::*;

fn bench(mode: &str, consumers: u32) {
    bench_with(mode, consumers, &[]);
}

fn bench_with(mode: &str, consumers: u32, extra: &[&str]) {
    let out = Command::new(GPIPE)
        .args([
            "bench",
            "--backend",
            "cuda",
            "--mode",
            mode,
            "--consumers",
            &consumers.to_string(),
            "--batches",
            "600",
            "--batch-bytes",
            "8MiB",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{mode} x{consumers}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["backend"], "cuda");
    assert_eq!(r["published"], 600);
    assert_eq!(r["lost"], 0);
    assert_eq!(r["duplicated"], 0);
    assert_eq!(r["mismatches"], 0);
    let per = r["per_consumer"].as_array().unwrap();
    assert_eq!(per.len(), consumers as usize);
    assert!(per.iter().all(|c| c["verified"] == true));
    let total: u64 = per.iter().map(|c| c["received"].as_u64().unwrap()).sum();
    let expected = if mode == "broadcast" {
        600 * consumers as u64
    } else {
        600
    };
    assert_eq!(
        total, expected,
        "every batch checked by the GPU verify kernel"
    );
    assert!(r["extra"]["ceiling_batches_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_broadcast_one_consumer() {
    watchdog(180, |_| bench("broadcast", 1));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_broadcast_four_consumers() {
    watchdog(180, |_| bench("broadcast", 4));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_shared_one_consumer() {
    watchdog(180, |_| bench("shared", 1));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_shared_four_consumers() {
    watchdog(180, |_| bench("shared", 4));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_late_join() {
    late_join_case("cuda");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_consumer_sigkill_mid_stream() {
    consumer_sigkill_case("cuda");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_consumer_killed_at_every_protocol_step() {
    for point in [
        "consumer.before_wait",
        "consumer.after_wait",
        "consumer.before_release",
        "consumer.after_release",
    ] {
        consumer_death_case("cuda", Some(point));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_producer_killed_before_and_after_publish() {
    for point in ["producer.before_publish", "producer.after_publish"] {
        producer_death_case("cuda", point);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_100_consumer_kill_cycles_without_growth() {
    watchdog(240, |_| {
        let out = Command::new(GPIPE)
            .args([
                "soak",
                "--backend",
                "cuda",
                "--duration",
                "90",
                "--tick-ms",
                "40",
                "--max-consumers",
                "4",
                "--batch-bytes",
                "2MiB",
                "--json",
            ])
            .output()
            .unwrap();
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(out.status.success(), "{r}");
        assert!(r["consumers_killed"].as_u64().unwrap() >= 100, "{r}");
        assert_eq!(r["lost"], 0);
        assert_eq!(r["duplicated"], 0);
        assert_eq!(r["mismatches"], 0);
        assert_eq!(r["delivered"], r["verified"]);
        // The soak itself fails on fd, RSS or pool growth; check the numbers are real.
        assert!(r["fds_after_warmup"].as_u64().unwrap() > 0);
        let (a, b) = (
            r["backend_bytes_start"].as_u64().unwrap(),
            r["backend_bytes_end"].as_u64().unwrap(),
        );
        assert!(a > 0 && b <= a, "pool memory {a} -> {b}");
    });
}

/// Every memory path with every sync mode passes the same conformance checks: both modes,
/// every batch verified, and a consumer SIGKILLed mid-stream costs the others nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_every_memory_path_and_sync_mode() {
    for memory in ["pool", "vmm", "legacy"] {
        for sync in ["events", "semaphore"] {
            let extra: &'static [&'static str] = match (memory, sync) {
                ("pool", "events") => &["--memory", "pool", "--sync", "events"],
                ("pool", _) => &["--memory", "pool", "--sync", "semaphore"],
                ("vmm", "events") => &["--memory", "vmm", "--sync", "events"],
                ("vmm", _) => &["--memory", "vmm", "--sync", "semaphore"],
                (_, "events") => &["--memory", "legacy", "--sync", "events"],
                _ => &["--memory", "legacy", "--sync", "semaphore"],
            };
            watchdog(180, move |_| {
                bench_with("broadcast", 2, extra);
                bench_with("shared", 2, extra);
            });
            consumer_death_case_with("cuda", None, extra);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_fabric_without_imex_fails_clearly_or_works() {
    let out = Command::new(GPIPE)
        .args([
            "bench",
            "--backend",
            "cuda",
            "--handle",
            "fabric",
            "--memory",
            "pool",
            "--consumers",
            "1",
            "--batches",
            "50",
            "--json",
        ])
        .output()
        .unwrap();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("IMEX"),
            "a fabric failure must name IMEX: {err}"
        );
    } else {
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["mismatches"], 0);
    }
}
