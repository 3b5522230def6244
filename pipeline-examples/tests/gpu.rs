//! The multi-process conformance tests on the CUDA backend. They need a CUDA GPU, so they are
//! ignored in CI; run them with `cargo test -- --include-ignored` (or `scripts/gpu/test`) on a GPU
//! machine.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

fn bench(mode: &str, consumers: u32) {
    bench_with(mode, consumers, &[]);
}

fn bench_with(mode: &str, consumers: u32, extra: &[&str]) -> serde_json::Value {
    let consumers_arg = consumers.to_string();
    let mut args = vec![
        "bench",
        "--backend",
        "cuda",
        "--mode",
        mode,
        "--consumers",
        &consumers_arg,
        "--batches",
        "600",
        "--batch-bytes",
        "8MiB",
        "--json",
    ];
    args.extend_from_slice(extra);
    let r = bench_json(&args);
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
    // Each side's own host time was measured: a launch per batch costs something.
    assert!(r["producer_fill_s"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["producer_publish_s"].as_f64().unwrap() > 0.0, "{r}");
    assert!(
        per.iter()
            .all(|c| c["check_s"].as_f64().unwrap() > 0.0 && c["release_s"].as_f64().unwrap() > 0.0),
        "{r}"
    );
    r
}

/// Each consumer's `side_signals`, as its attach resolved it.
fn side_signals(r: &serde_json::Value) -> Vec<bool> {
    r["per_consumer"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["attach"]["side_signals"].as_bool().unwrap())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_side_signals_keep_every_batch_verified() {
    // `ready` waited for and `finished` written on the consumers' side streams: every batch
    // verified in both modes, with semaphores on device words and events with host words.
    for mode in ["broadcast", "shared"] {
        for (sync, words) in [("semaphore", "device"), ("events", "host")] {
            watchdog(180, move |_| {
                let extra = [
                    "--side-signals",
                    "on",
                    "--sync",
                    sync,
                    "--timeline-memory",
                    words,
                ];
                let r = bench_with(mode, 2, &extra);
                assert_eq!(side_signals(&r), [true, true], "{mode} {sync} {words}");
            });
        }
    }
    // By default: from 16 MiB slots on (here 32), not below (8 MiB).
    watchdog(180, |_| {
        let r = bench_with("broadcast", 1, &[]);
        assert_eq!(side_signals(&r), [false]);
        let r = bench_json(&[
            "bench",
            "--backend",
            "cuda",
            "--consumers",
            "1",
            "--batches",
            "300",
            "--batch-bytes",
            "32MiB",
            "--json",
        ]);
        assert_eq!(
            (r["lost"].as_u64(), r["mismatches"].as_u64()),
            (Some(0), Some(0))
        );
        assert_eq!(side_signals(&r), [true]);
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_bench_stamps_a_gpu_timeline() {
    watchdog(180, |_| {
        let out = tmpdir("timeline").join("timeline.json");
        let out_s = out.to_str().unwrap().to_string();
        let r = bench_json(&[
            "bench",
            "--backend",
            "cuda",
            "--consumers",
            "2",
            "--batches",
            "2400",
            "--batch-bytes",
            "8MiB",
            "--json",
            "--gpu-timeline",
            "2000",
            "--gpu-timeline-out",
            &out_s,
        ]); // fmt: skip
        assert_eq!(r["mismatches"], 0);
        let t = &r["extra"]["gpu_timeline"];
        // Batches 100..2100 (after the 100 warm-up ones) were stamped on both sides: each
        // consumer's report (tens of kB of stamps) is more than a pipe holds, which the bench
        // must read while the consumer writes it.
        assert_eq!(t["batches"], 2000, "{t}");
        let busy = t["busy"].as_f64().unwrap();
        assert!(busy > 0.0 && busy <= 1.0, "{t}");
        assert!(t["overlap"].as_f64().unwrap() <= busy, "{t}");
        assert!(t["fill_us_p50"].as_f64().unwrap() > 0.0, "{t}");
        assert!(t["verify_us_p50"].as_f64().unwrap() > 0.0, "{t}");
        // A verify starts after its fill ends: it waits for `ready`.
        assert!(t["handover_us_p50"].as_f64().unwrap() >= 0.0, "{t}");
        let raw: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(raw["first_seq"], 100);
        assert_eq!(raw["fills"].as_array().unwrap().len(), 2000);
        assert_eq!(raw["verifies"].as_array().unwrap().len(), 2);
        // The consumers' reports do not carry the raw stamps.
        assert!(r["per_consumer"][0].get("gpu_timeline").is_none(), "{r}");
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_probe_times_the_hot_paths_driver_calls() {
    watchdog(120, |_| {
        let r = bench_json(&["probe", "--json", "--call-costs", "--gpu-gaps"]);
        let costs = r["call_costs"].as_array().expect("call_costs");
        let calls: Vec<&str> = costs.iter().map(|c| c["call"].as_str().unwrap()).collect();
        for want in [
            "cuLaunchKernel",
            "cuStreamWriteValue64",
            "cuStreamWaitValue64",
        ] {
            assert!(calls.iter().any(|c| c.starts_with(want)), "{calls:?}");
        }
        for c in costs {
            let (p50, p90) = (c["p50_us"].as_f64().unwrap(), c["p90_us"].as_f64().unwrap());
            assert!(p50 > 0.0 && p50 <= p90 && p90 < 10_000.0, "{c}");
        }
        // Every operation between the two kernels keeps them in order, on one stream and
        // handed between two: the second never starts before the first has ended.
        let gaps = r["gpu_gaps"].as_array().expect("gpu_gaps");
        assert_eq!(gaps.len(), 17, "{gaps:?}");
        assert!(
            gaps.iter()
                .any(|g| g["case"].as_str().unwrap().starts_with("handover"))
        );
        for g in gaps {
            let (min, p50) = (g["min_us"].as_f64().unwrap(), g["p50_us"].as_f64().unwrap());
            assert!(min >= 0.0 && p50 >= min && p50 < 10_000.0, "{g}");
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_broadcast_one_consumer() {
    watchdog(180, |_| bench("broadcast", 1));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_mirror_buffers_moving_between_copy_streams_verify_every_batch() {
    // On the producer's GPU, mirrored: 5 slots and 3 buffers, so a buffer's consecutive
    // copies run on different copy streams (slot k on stream k mod 2); both modes, each
    // consumer reading every batch twice (--passes 2).
    for mode in ["broadcast", "shared"] {
        watchdog(180, move |_| {
            bench_with(
                mode,
                2,
                &[
                    "--delivery",
                    "mirror",
                    "--mirror-buffers",
                    "3",
                    "--slots",
                    "5",
                    "--passes",
                    "2",
                ],
            );
        });
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_broadcast_four_consumers() {
    watchdog(180, |_| bench("broadcast", 4));
}

/// The batched stream operations: under a lead bound the producer orders each batch after
/// two earlier ones in one operation; without one, it and broadcast consumers look ahead to
/// the next batch (two slots: the look ahead's slot is the one just released). Every batch
/// verified, both modes, three consumers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_lead_bound_and_look_aheads_keep_every_batch_verified() {
    for mode in ["broadcast", "shared"] {
        watchdog(180, move |_| {
            bench_with(mode, 3, &["--max-lead", "2", "--slots", "4"]);
            bench_with(mode, 3, &["--slots", "2"]);
        });
    }
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

/// Timeline words in device memory, with either sync mode: every batch verified in both
/// delivery modes; a consumer killed mid-stream is released (its words written from the
/// producer's release stream) and costs the others nothing; a producer killed before or after
/// publishing leaves its consumers with a clear error, not a hang.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_timeline_words_in_device_memory() {
    for sync in ["events", "semaphore"] {
        let extra: &'static [&'static str] = if sync == "events" {
            &["--timeline-memory", "device", "--sync", "events"]
        } else {
            &["--timeline-memory", "device", "--sync", "semaphore"]
        };
        watchdog(180, move |_| {
            bench_with("broadcast", 2, extra);
            bench_with("shared", 2, extra);
            let mut args = vec![
                "bench",
                "--backend",
                "cuda",
                "--consumers",
                "1",
                "--batches",
                "50",
                "--json",
            ];
            args.extend_from_slice(extra);
            let r = bench_json(&args);
            assert_eq!(r["extra"]["timeline_memory"], "device", "{r}");
        });
        consumer_death_case_with("cuda", None, extra);
        for point in ["producer.before_publish", "producer.after_publish"] {
            producer_death_case_with("cuda", point, extra);
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

/// A hostile consumer names another consumer in a slot's `claimer` (shared mode), so the
/// producer's stream waits for work that consumer never had on that slot. Under
/// `--detach-after-ms` the named consumer is detached with a clear error and the ring goes on;
/// under the default (block) the ring would stall until that consumer left.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_claims_forged_in_anothers_name_detach_nobody() {
    // Protocol version 4: the claim words are the one thing every consumer may write, and the
    // producer believes a claim only when the claimer's own page backs it. A peer that claims
    // batches in consumer a's name hands them to a (it sees its name and takes them, recording
    // that in its page): a verifies every batch, is never detached, and the ring goes on.
    use pipeline_core::{Consumer, ring};
    use pipeline_cuda::backend::{CudaConsumer, CudaOptions};
    use std::sync::atomic::Ordering;
    watchdog(90, |procs| {
        let rate = std::env::var("GPIPE_TEST_FORGE_RATE").unwrap_or_else(|_| "200".into());
        let dir = tmpdir("forge");
        let sock = dir.join("ring.sock");
        let p = producer_on(
            &procs,
            &sock,
            "cuda",
            &[
                "--mode",
                "shared",
                "--rate",
                &rate,
                "--detach-after-ms",
                "1000",
                "--log",
                "info",
            ],
        );
        let a = consumer(&procs, &sock, &dir.join("a.seq"));
        wait_until(Duration::from_secs(10), "consumer a", || {
            active_consumers(&sock) == 1
        });
        wait_until(Duration::from_secs(10), "batches", || head(&sock) > 20);
        let hostile: Consumer<CudaConsumer> =
            Consumer::attach(&sock, CudaOptions::default()).unwrap();
        let me = hostile.index();
        let (seg, claims) = (hostile.segment(), hostile.claims());
        let n = seg.layout().slot_count;
        // Consumer a's index, as a hostile peer sees it in the claim words.
        let mut a_index = None;
        let until = Instant::now() + Duration::from_secs(10);
        while a_index.is_none() && Instant::now() < until {
            a_index = (0..n)
                .filter_map(|k| ring::claim_owner(claims.claim(k).load(Ordering::Acquire)))
                .find(|&o| o != me && o < 63);
        }
        let a_index = a_index.expect("consumer a's index in the claim words");
        // For three seconds (three times the lag limit), claim every unclaimed batch in a's name.
        let mut forged = 0u64;
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            let head = seg.header().head.value.load(Ordering::Acquire);
            for s in ring::live_window(head, n) {
                let w = claims.claim(ring::slot_of(s, n));
                if w.compare_exchange(
                    ring::claim_word(s, None),
                    ring::claim_word(s, Some(a_index)),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
                {
                    forged += 1;
                }
            }
        }
        assert!(forged > 0, "forged no claim");
        let mut a = a;
        assert!(
            a.try_wait().unwrap().is_none(),
            "consumer a ended after {forged} claims were forged in its name: {}",
            inspect(&sock)
        );
        let h = head(&sock);
        wait_until(Duration::from_secs(10), "the producer to go on", || {
            head(&sock) > h + 50
        });
        drop(hostile);
        signal(p.id(), libc::SIGINT);
        let pe = finish(p, Duration::from_secs(15));
        assert_eq!(pe.code, Some(0), "producer: {}", pe.stderr);
        let ea = finish(a, Duration::from_secs(10));
        assert_eq!(ea.code, Some(0), "consumer a: {}\n{}", ea.stderr, ea.stdout);
        assert!(report(&ea)["received"].as_u64().unwrap() > 0);
        assert_eq!(report(&ea)["mismatches"], 0);
        assert!(
            !pe.stderr.contains("waited over"),
            "nobody should have been detached: {}",
            pe.stderr
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_a_consumer_device_that_does_not_exist_is_refused_naming_it() {
    let out = Command::new(GPIPE)
        .args([
            "bench",
            "--backend",
            "cuda",
            "--consumers",
            "1",
            "--batches",
            "50",
        ])
        .args(["--consumer-devices", "17"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("device 17 was asked for"), "{err}");
}
