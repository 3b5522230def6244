//! The ```rust code blocks of README.md and docs/*.md, compiled and run as written, on the
//! host backend; blocks marked `gpu` run only with `--include-ignored` (or `--ignored`), on a
//! GPU machine. `build.rs` extracts them into a table of groups: a lone block, or the blocks
//! that the documents show as separate processes (a producer and its consumer, marked with
//! one group name). This runner (a test target without libtest's harness) runs each group's
//! blocks concurrently, each in a process of its own (this executable again, told which
//! block to run), started in document order: CUDA IPC handles cannot be opened by the process
//! that exported them, so threads of one process would not do.
//!
//! A group runs in a fresh private directory as its working directory, so a relative socket
//! path such as `feed.sock` is private to the run, under a watchdog that kills its processes.
//! A failure names the document and line of each block that failed, with its output.
//!
//! Arguments, as libtest takes them: names filter the groups (a group runs when its name
//! contains one); `--include-ignored` / `--ignored` add / keep only the GPU groups; `--list`
//! lists them; other options are accepted and ignored.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// Set in a block's own process: the name of the block to run.
const CHILD_VAR: &str = "GPIPE_DOC_BLOCK";

/// One documented block.
struct DocBlock {
    /// `README.md:123`: where its fence is.
    place: &'static str,
    /// Its function's name, unique in the table.
    name: &'static str,
    run: fn(),
    /// Start it only once this path (relative to the group's directory) exists.
    wait_for: Option<&'static str>,
}

/// Blocks that run together (or one block alone).
struct DocGroup {
    /// From the first block's place and the group's name, e.g. `readme_md_123_host_api`.
    name: &'static str,
    /// Needs a CUDA GPU.
    gpu: bool,
    /// The watchdog.
    timeout_s: f64,
    blocks: &'static [DocBlock],
}

fn main() -> ExitCode {
    if let Ok(name) = std::env::var(CHILD_VAR) {
        return run_child(&name);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    // libtest's options that take a value: their values are not name filters.
    const VALUED: [&str; 7] = [
        "--test-threads",
        "--skip",
        "--format",
        "--color",
        "--logfile",
        "--shuffle-seed",
        "-Z",
    ];
    let mut filters = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if VALUED.contains(&a.as_str()) {
            i += 1;
        } else if !a.starts_with('-') {
            filters.push(a.as_str());
        }
        i += 1;
    }
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let (include_gpu, only_gpu) = (has("--include-ignored"), has("--ignored"));

    if let Some(readme) = DOCUMENTS_MISSING {
        eprintln!(
            "{readme} not found: the documented Rust examples can only be checked in the \
             workspace, whose README.md and docs/ pipeline-examples/build.rs reads"
        );
        return ExitCode::FAILURE;
    }
    if GROUPS.is_empty() {
        eprintln!(
            "no ```rust blocks found in README.md and docs/*.md: has the extraction in \
             pipeline-examples/build.rs broken?"
        );
        return ExitCode::FAILURE;
    }
    let selected: Vec<&DocGroup> = GROUPS
        .iter()
        .filter(|g| filters.is_empty() || filters.iter().any(|f| g.name.contains(f)))
        .collect();
    if has("--list") {
        for g in &selected {
            println!("{}: test", g.name);
        }
        return ExitCode::SUCCESS;
    }

    println!(
        "\nrunning {} documented Rust example groups",
        selected.len()
    );
    let (mut passed, mut failed, mut ignored) = (0, Vec::new(), 0);
    for g in selected {
        let places: Vec<&str> = g.blocks.iter().map(|b| b.place).collect();
        let label = format!("{} ({})", g.name, places.join(", "));
        if (g.gpu && !include_gpu && !only_gpu) || (only_gpu && !g.gpu) {
            ignored += 1;
            let why = if g.gpu {
                "needs a CUDA GPU"
            } else {
                "not a GPU group"
            };
            println!("test {label} ... ignored, {why}");
            continue;
        }
        match run_group(g) {
            Ok(()) => {
                passed += 1;
                println!("test {label} ... ok");
            }
            Err(report) => {
                println!("test {label} ... FAILED");
                failed.push(report);
            }
        }
    }
    for report in &failed {
        eprintln!("\n{report}");
    }
    println!(
        "\ntest result: {}. {passed} passed; {} failed; {ignored} ignored\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        failed.len()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// In a block's own process: runs it (a failure panics, which exits non-zero).
fn run_child(name: &str) -> ExitCode {
    let block = GROUPS
        .iter()
        .flat_map(|g| g.blocks)
        .find(|b| b.name == name)
        .unwrap_or_else(|| panic!("{CHILD_VAR}={name}: no such documented block"));
    (block.run)();
    ExitCode::SUCCESS
}

/// A block's process and where its output goes.
struct Running<'a> {
    block: &'a DocBlock,
    child: Child,
    output: PathBuf,
    status: Option<std::process::ExitStatus>,
}

/// Runs a group's blocks concurrently in document order (each once its `wait_for` path
/// exists), each in a process of its own in a private directory. Fails, naming the place of
/// each block that failed, with the tail of its output, if one fails or the group is still
/// running after its timeout (its processes are then killed).
fn run_group(group: &DocGroup) -> Result<(), String> {
    let dir = private_dir(group.name);
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let limit = Duration::from_secs_f64(group.timeout_s);
    let deadline = Instant::now() + limit;
    let mut running: Vec<Running> = Vec::new();
    let mut failures = Vec::new();
    'start: for block in group.blocks {
        if let Some(path) = block.wait_for {
            while !dir.join(path).exists() {
                poll(&mut running);
                let ended = !running.is_empty() && running.iter().all(|r| r.status.is_some());
                if Instant::now() > deadline || ended || failed(&running) {
                    failures.push(format!(
                        "{}: not started: {path} did not appear in {}{}",
                        block.place,
                        dir.display(),
                        if ended {
                            ", and every block before it had ended"
                        } else {
                            ""
                        }
                    ));
                    break 'start;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let output = dir.join(format!("{}.out", block.name));
        let spawned = File::create(&output)
            .and_then(|log| Ok((log.try_clone()?, log)))
            .and_then(|(out, err)| {
                Command::new(&exe)
                    .env(CHILD_VAR, block.name)
                    .current_dir(&dir)
                    .stdin(Stdio::null())
                    .stdout(out)
                    .stderr(err)
                    .spawn()
            });
        match spawned {
            Ok(child) => running.push(Running {
                block,
                child,
                output,
                status: None,
            }),
            Err(e) => {
                failures.push(format!("{}: cannot start its process: {e}", block.place));
                break;
            }
        }
    }
    // Wait for every block; one that fails stops the others (a producer waiting for its
    // consumer) at once rather than at the watchdog.
    while failures.is_empty() && !failed(&running) && running.iter().any(|r| r.status.is_none()) {
        if Instant::now() > deadline {
            let late: Vec<&str> = running
                .iter()
                .filter(|r| r.status.is_none())
                .map(|r| r.block.place)
                .collect();
            failures.push(format!(
                "watchdog: still running after {} s (killed): {}",
                limit.as_secs_f64(),
                late.join(", ")
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        poll(&mut running);
    }
    for r in &mut running {
        if r.status.is_none() {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
    if failures.is_empty() && !failed(&running) {
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(());
    }
    for r in &running {
        let status = r.status.map_or_else(
            || "stopped, as another block failed or the watchdog fired".to_owned(),
            |s| s.to_string(),
        );
        failures.push(format!("{}: {status}\n{}", r.block.place, tail(&r.output)));
    }
    let places: Vec<&str> = group.blocks.iter().map(|b| b.place).collect();
    Err(format!(
        "the rust code block(s) at {} do not run as written (generated code: {}/doc_blocks.rs; \
         run directory {}):\n  {}",
        places.join(", "),
        env!("OUT_DIR"),
        dir.display(),
        failures.join("\n  ")
    ))
}

/// Records the exit status of every block process that has ended.
fn poll(running: &mut [Running]) {
    for r in running.iter_mut().filter(|r| r.status.is_none()) {
        r.status = r.child.try_wait().unwrap_or(None);
    }
}

fn failed(running: &[Running]) -> bool {
    running
        .iter()
        .any(|r| r.status.is_some_and(|s| !s.success()))
}

/// The last lines of a block's output, indented.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..]
        .iter()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn private_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("gpipe-doc-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create a private directory");
    dir
}

include!(concat!(env!("OUT_DIR"), "/doc_blocks.rs"));
