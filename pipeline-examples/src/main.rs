//! `gpipe`: run, feed, consume, inspect and benchmark gpipe rings.
//!
//! Each subcommand lives in its own module (its arguments and what it does); this file holds
//! the command list, logging, signal handling and the dispatch.

mod args;
mod bench;
mod consume;
mod duration;
mod gpu;
mod inspect;
mod logging;
mod output;
mod probe;
mod produce;
mod relay;
mod signals;
mod size;
mod soak;
mod work;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "gpipe",
    version,
    about = "Zero-copy GPU/host batch pipelines between processes"
)]
struct Cli {
    /// Log filter (e.g. warn, info, debug, pipeline_core=debug); RUST_LOG does the same.
    /// With either, log lines come in the detailed format (time, level, module path);
    /// without, warnings and errors read like the CLI's own lines.
    #[arg(long, global = true, value_name = "FILTER")]
    log: Option<String>,
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
    logging::init(cli.log.as_deref());
    signals::install();
    // A print to a closed pipe panics (SIGPIPE is ignored); `signals` keeps that panic
    // silent, and here it ends the command quietly, after unwinding has closed the ring.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(cli.cmd))) {
        Ok(code) => code,
        Err(p) if signals::is_closed_pipe(&*p) => ExitCode::from(signals::EXIT_CLOSED_PIPE),
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// Runs one subcommand; an error is printed, status 2.
fn run(cmd: Cmd) -> ExitCode {
    let result = match cmd {
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
