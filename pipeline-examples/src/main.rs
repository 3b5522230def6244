//! `gpipe`: run, feed, consume, inspect and benchmark gpipe rings.
//!
//! Each subcommand lives in its own module (its arguments and what it does); this file holds
//! the command list, logging, signal handling and the dispatch.

mod args;
mod bench;
mod consume;
mod cuda_work;
mod duration;
mod inspect;
mod probe;
mod produce;
mod relay;
mod size;
mod soak;
mod work;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Parser, Subcommand};

/// Set by SIGINT/SIGTERM.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to a static atomic, which is async-signal-safe;
        // `signal` is called before any other thread could race on the disposition.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

#[derive(Parser)]
#[command(
    name = "gpipe",
    version,
    about = "Zero-copy GPU/host batch pipelines between processes"
)]
struct Cli {
    /// Log filter (e.g. info, debug, pipeline_core=debug); also RUST_LOG.
    #[arg(long, global = true, default_value = "warn")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start a producer and N consumer processes, verify every batch, report throughput.
    Bench(bench::BenchCmd),
    /// Run a ring for a while with consumers joining, leaving and being killed at random;
    /// report batches delivered, verified and lost (must be 0) and the producer's memory and
    /// open fds (must not grow).
    Soak(soak::SoakCmd),
    /// Show the CUDA devices, driver, the capabilities gpipe uses and the path it takes.
    Probe(probe::ProbeCmd),
    /// Run a producer that publishes pattern batches until Ctrl-C (or --batches).
    Produce(produce::ProduceCmd),
    /// Attach to a producer and consume batches until it closes (or Ctrl-C).
    Consume(consume::ConsumeCmd),
    /// Show the live state of a ring: slots, sequence numbers, consumers, lag, liveness.
    Inspect(inspect::InspectCmd),
    /// Carry a ring's batches to another host: `send` on the ring's host, `recv` on the
    /// other (NCCL for a CUDA ring; see docs/relay.md).
    Relay(relay::RelayCmd),
}

/// Colour in logs only on a terminal, and never when `NO_COLOR` is set to anything non-empty
/// (no-color.org): `gpipe produce ... 2>log` writes plain text.
fn use_color(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before anything else: these may set CUDA's environment, which must precede any thread.
    match &cli.cmd {
        // SAFETY: nothing has started a thread yet (argument parsing starts none; the tracing
        // subscriber and the signal handlers come after).
        Cmd::Bench(cmd) => unsafe { bench::set_process_env(cmd) },
        // SAFETY: as above.
        Cmd::Produce(cmd) => unsafe { produce::set_process_env(cmd) },
        _ => {}
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(use_color(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR"),
        ))
        .init();
    install_signal_handlers();
    let result = match cli.cmd {
        Cmd::Bench(cmd) => bench::command(cmd),
        Cmd::Soak(cmd) => soak::command(cmd),
        Cmd::Probe(cmd) => probe::command(cmd),
        Cmd::Produce(cmd) => produce::command(cmd),
        Cmd::Consume(cmd) => consume::command(cmd),
        Cmd::Inspect(cmd) => inspect::command(cmd),
        Cmd::Relay(cmd) => relay::command(cmd),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpipe: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Prints a run's report (JSON or text); the exit code says whether it found problems.
fn print_report<R: serde::Serialize + std::fmt::Display>(
    report: &R,
    json: bool,
    ok: bool,
) -> Result<ExitCode, String> {
    if json {
        let text = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
        println!("{text}");
    } else {
        print!("{report}");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod color_tests {
    use super::use_color;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_color(true, None));
        assert!(!use_color(false, None));
        assert!(!use_color(true, Some("1".into())));
        assert!(use_color(true, Some("".into())));
    }
}
