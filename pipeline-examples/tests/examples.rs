//! Runs the `producer` and `consumer` examples (`pipeline-examples/examples/`) as real
//! processes on the host backend, under a watchdog, and checks that the consumer verified
//! every batch: the README's library snippets keep working.
//!
//! Cargo gives integration tests the paths of the package's binaries (`CARGO_BIN_EXE_*`) but
//! not of its examples, so they are found next to this test executable:
//!
//! * under cargo, the test runs from `target/<profile>/deps/` and the examples are in
//!   `target/<profile>/examples/`. `cargo test -p pipeline-examples` (and `cargo test
//!   --workspace`) build the examples before running tests; `cargo test --test examples`
//!   alone does not, so run the package's tests as a whole (or `cargo build --examples`
//!   first), or an old build of the examples is used;
//! * staged for a GPU machine (`scripts/gpu/build`), the test runs from `.gpu/tests/` and the
//!   examples are in `.gpu/bin/`. Where a staged copy has no examples, the test says so and
//!   passes; under cargo a missing example fails the test.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{Procs, watchdog};

/// The example binary `name`, or why it cannot be used: `Err(Some(reason))` fails the test,
/// `Err(None)` means a staged copy without examples (skip).
fn example(name: &str) -> Result<PathBuf, Option<String>> {
    let exe = std::env::current_exe()
        .map_err(|e| Some(format!("cannot locate the test executable: {e}")))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let up = dir.parent().unwrap_or(Path::new("."));
    let candidates = [up.join("examples").join(name), up.join("bin").join(name)];
    if let Some(found) = candidates.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    let staged = dir.file_name().is_some_and(|n| n == "tests")
        && up.file_name().is_some_and(|n| n == ".gpu");
    if staged {
        return Err(None);
    }
    Err(Some(format!(
        "example `{name}` not found (looked at {} and {}); build it with \
         `cargo build -p pipeline-examples --examples`, or run `cargo test -p pipeline-examples`, \
         which builds the examples first",
        candidates[0].display(),
        candidates[1].display()
    )))
}

/// Both examples, or `None` (with the reason printed) where a staged copy lacks them.
fn examples() -> Option<(PathBuf, PathBuf)> {
    match (example("producer"), example("consumer")) {
        (Ok(p), Ok(c)) => Some((p, c)),
        (Err(Some(why)), _) | (_, Err(Some(why))) => panic!("{why}"),
        _ => {
            eprintln!(
                "skipped: this staged copy has no producer/consumer examples in .gpu/bin \
                 (stage with `scripts/gpu/build`, which builds them)"
            );
            None
        }
    }
}

/// A socket path no other run of this test uses.
fn unique_socket(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    std::env::temp_dir().join(format!(
        "gpipe-example-{tag}-{}-{nanos}.sock",
        std::process::id()
    ))
}

/// Starts `exe` with `args`, registered with the watchdog, and collects its output on a
/// thread (so neither process can block on a full pipe while the test waits on the other).
fn start(procs: &Procs, exe: &Path, args: &[&str]) -> std::thread::JoinHandle<Output> {
    let child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", exe.display()));
    procs.add(&child);
    let what = exe.display().to_string();
    std::thread::spawn(move || {
        child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("waiting for {what}: {e}"))
    })
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn producer_and_consumer_examples_verify_every_batch() {
    let Some((producer, consumer)) = examples() else {
        return;
    };
    watchdog(120, move |procs| {
        const BATCHES: u64 = 50;
        let count = BATCHES.to_string();
        let sock = unique_socket("run");
        let sock_arg = sock.to_str().expect("temp dir path is UTF-8");
        // The producer waits for the consumer before publishing, and the consumer waits for
        // the producer's socket, so the order of the two starts does not matter.
        let p = start(&procs, &producer, &[sock_arg, &count]);
        let c = start(&procs, &consumer, &[sock_arg, &count]);
        let (p, c) = (
            p.join().expect("producer thread"),
            c.join().expect("consumer thread"),
        );
        assert!(p.status.success(), "producer failed: {}", text(&p));
        assert!(c.status.success(), "consumer failed: {}", text(&c));
        let summary = String::from_utf8_lossy(&c.stdout);
        assert!(
            summary.contains(&format!(
                "consumer: {BATCHES} of {BATCHES} batches verified (seq 0..={})",
                BATCHES - 1
            )),
            "the consumer did not verify every batch: {}",
            text(&c)
        );
        assert!(
            String::from_utf8_lossy(&p.stdout)
                .contains(&format!("producer: published {BATCHES} batches")),
            "{}",
            text(&p)
        );
        assert!(!sock.exists(), "the producer left its socket behind");
    });
}

#[test]
fn examples_report_bad_arguments_without_panicking() {
    let Some((producer, consumer)) = examples() else {
        return;
    };
    watchdog(60, move |_| {
        let sock = unique_socket("args");
        let sock_arg = sock.to_str().expect("temp dir path is UTF-8");
        for (exe, name) in [(&producer, "producer"), (&consumer, "consumer")] {
            let out = Command::new(exe)
                .args([sock_arg, "many"])
                .output()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", exe.display()));
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{name}: {}", text(&out));
            assert!(
                stderr.contains("BATCHES must be a whole number, not \"many\""),
                "{name}: {}",
                text(&out)
            );
            assert!(!stderr.contains("panicked"), "{name}: {}", text(&out));
        }
    });
}
