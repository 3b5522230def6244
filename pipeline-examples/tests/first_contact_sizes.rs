//! A newcomer's first sizes (issue 32, points 4 to 6): one rule for a ring's shape in every
//! subcommand and in the library, a ring larger than the memory it would live in refused
//! before anything is allocated, and messages in words and units.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Procs, spawn, tmpdir, watchdog};
use pipeline_core::limits::{MAX_SLOT_BYTES, MAX_SLOTS};
use pipeline_core::{Error, HostOptions, HostProducer, Producer, ProducerConfig};

/// Runs `gpipe ARGS` to its end under the test's watchdog: exit code, stderr, how long it took.
fn run(procs: &Procs, args: &[&str]) -> (Option<i32>, String, Duration) {
    let start = Instant::now();
    let out = spawn(procs, args).wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        start.elapsed(),
    )
}

/// The `gpipe: error: ...` line of a failed run.
fn error_line(stderr: &str) -> String {
    stderr
        .lines()
        .find(|l| l.contains("error"))
        .unwrap_or_else(|| panic!("no error line in {stderr:?}"))
        .to_string()
}

/// Runs `gpipe produce` on the host backend with `extra` arguments, expecting it to be refused
/// before it binds its socket; returns its error line.
fn produce_refused(procs: &Procs, dir: &Path, extra: &[&str]) -> String {
    let sock = dir.join("feed.sock");
    let mut args = vec![
        "produce",
        "--backend",
        "host",
        "--socket",
        sock.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, stderr, _) = run(procs, &args);
    assert_ne!(code, Some(0), "gpipe {args:?} was accepted: {stderr}");
    assert!(
        !sock.exists(),
        "gpipe {args:?} bound its socket before refusing"
    );
    let line = error_line(&stderr);
    assert!(!line.contains("..="), "Rust range syntax in {line:?}");
    line
}

/// MemAvailable of this machine in bytes.
fn mem_available() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|r| r.trim().strip_suffix("kB"))
        .and_then(|n| n.trim().parse().ok())
        .expect("MemAvailable in /proc/meminfo");
    kib * 1024
}

#[test]
fn a_batch_of_zero_bytes_gets_the_same_answer_from_every_subcommand() {
    watchdog(120, |procs| {
        let dir = tmpdir("zero-batch");
        let produce = produce_refused(&procs, &dir, &["--batch-bytes", "0", "--batches", "3"]);
        assert!(produce.contains("--batch-bytes"), "{produce}");
        assert!(produce.contains("0 bytes"), "{produce}");
        let reason = produce.split("--batch-bytes").nth(1).unwrap().to_string();
        for args in [
            &[
                "bench",
                "--backend",
                "host",
                "--batch-bytes",
                "0",
                "--batches",
                "10",
            ][..],
            &[
                "soak",
                "--backend",
                "host",
                "--batch-bytes",
                "0",
                "--duration",
                "2s",
            ][..],
        ] {
            let (code, stderr, _) = run(&procs, args);
            assert_ne!(code, Some(0), "gpipe {args:?} was accepted: {stderr}");
            let line = error_line(&stderr);
            assert!(
                line.ends_with(&reason),
                "gpipe {args:?} answered {line:?}, produce {produce:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn the_library_refuses_a_batch_of_zero_bytes_naming_the_setting() {
    let dir = tmpdir("zero-batch-lib");
    let config = ProducerConfig {
        batch_bytes: 0,
        ..ProducerConfig::default()
    };
    let r = Producer::<HostProducer>::bind(dir.join("feed.sock"), config, HostOptions::default());
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        Err(Error::InvalidArgument(m)) => assert!(m.starts_with("batch_bytes: "), "{m}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a ring for batches of 0 bytes was made"),
    }
}

#[test]
fn each_limit_is_named_in_words_and_units() {
    watchdog(120, |procs| {
        let dir = tmpdir("limits");
        let too_large = produce_refused(&procs, &dir, &["--batch-bytes", "100GiB"]);
        assert!(too_large.contains("--batch-bytes"), "{too_large}");
        assert!(too_large.contains("100 GiB"), "{too_large}");
        let max = pipeline_core::limits::human_bytes(MAX_SLOT_BYTES);
        assert!(too_large.contains(&format!("at most {max}")), "{too_large}");
        assert!(!too_large.contains("multiple"), "{too_large}");

        let slots = (MAX_SLOTS + 1).to_string();
        let too_deep = produce_refused(&procs, &dir, &["--slots", &slots]);
        assert!(too_deep.contains("--slots"), "{too_deep}");
        assert!(
            too_deep.contains(&format!("at most {MAX_SLOTS} slots")),
            "{too_deep}"
        );

        let consumers = (pipeline_core::limits::MAX_CONSUMERS + 1).to_string();
        let too_many = produce_refused(&procs, &dir, &["--max-consumers", &consumers]);
        assert!(too_many.contains("--max-consumers"), "{too_many}");
        assert!(
            too_many.contains(&format!("at most {}", pipeline_core::limits::MAX_CONSUMERS)),
            "{too_many}"
        );

        let odd = produce_refused(&procs, &dir, &["--batch-bytes", "1.1MiB"]);
        assert!(odd.contains("1153434 bytes"), "{odd}");
        assert!(odd.contains("8-byte words"), "{odd}");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn a_size_with_decimals_is_accepted() {
    watchdog(120, |procs| {
        let dir = tmpdir("decimal-size");
        let sock = dir.join("feed.sock");
        let args = [
            "produce",
            "--backend",
            "host",
            "--socket",
            sock.to_str().unwrap(),
            "--batch-bytes",
            "1.5MiB",
            "--batches",
            "2",
        ];
        let (code, stderr, _) = run(&procs, &args);
        assert_eq!(code, Some(0), "gpipe {args:?}: {stderr}");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn a_ring_larger_than_host_memory_is_refused_at_once_with_the_numbers() {
    watchdog(120, |procs| {
        let dir = tmpdir("ring-too-large");
        // The 8 × 64 GiB, or more slots where this machine has the memory for that.
        let slot = MAX_SLOT_BYTES;
        let slots = (mem_available() / slot + 1)
            .max(8)
            .min(u64::from(MAX_SLOTS));
        let slots_arg = slots.to_string();
        let max = pipeline_core::limits::human_bytes(slot);
        let sock = dir.join("feed.sock");
        let args = [
            "produce",
            "--backend",
            "host",
            "--socket",
            sock.to_str().unwrap(),
            "--slots",
            &slots_arg,
            "--batch-bytes",
            &max,
        ];
        let (code, stderr, took) = run(&procs, &args);
        assert_ne!(code, Some(0), "gpipe {args:?} was accepted: {stderr}");
        let line = error_line(&stderr);
        let ring = pipeline_core::limits::human_bytes(slots * slot);
        for part in [
            format!("{slots} slots × {max} = {ring}"),
            "available host memory".to_string(),
            "use fewer --slots or a smaller --batch-bytes".to_string(),
        ] {
            assert!(line.contains(&part), "{part:?} missing from {line:?}");
        }
        // Refused before anything was made: no time spent on memory.
        assert!(took < Duration::from_secs(10), "took {took:?}");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn the_library_refuses_a_ring_larger_than_host_memory() {
    let dir = tmpdir("ring-too-large-lib");
    let config = ProducerConfig {
        slots: MAX_SLOTS,
        batch_bytes: MAX_SLOT_BYTES,
        ..ProducerConfig::default()
    };
    let r = Producer::<HostProducer>::bind(dir.join("feed.sock"), config, HostOptions::default());
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("does not fit in"), "{m}");
            assert!(m.contains("available host memory"), "{m}");
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a ring of {MAX_SLOTS} slots of 64 GiB was made"),
    }
}
