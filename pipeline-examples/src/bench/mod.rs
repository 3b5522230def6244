//! `gpipe bench`: one producer (this process) and N consumer processes (this binary's
//! `consume` command), every batch verified, results checked for loss and duplication.
//!
//! | file | holds |
//! | --- | --- |
//! | `mod.rs` | [`command`]: resolve, run each repetition, report |
//! | `args.rs` | the arguments ([`BenchCmd`]), what a run is given ([`BenchArgs`]), the backend it resolved to |
//! | `checks.rs` | the checks of the arguments, and the warnings about them |
//! | `env.rs` | the environment a CUDA run's processes need (`CUDA_DEVICE_MAX_CONNECTIONS`) |
//! | `depth.rs` | `--slots auto` without MPS: a trial run at each depth |
//! | `spawn.rs` | one run: the ring, the forwarders and consumer processes, the timed loop, their reports |
//! | `seq_log.rs` | the consumers' sequence logs, and the batches lost or duplicated by them |
//! | `cuda.rs` | a CUDA run: the run, then the single-process ceilings it is measured against |
//! | `timeline.rs` | `--gpu-timeline`: what the GPU did over the stamped batches |
//! | `hint.rs` | the hint a CUDA run gives when MPS is not running |
//! | `stats.rs` | `--repeat`: the median repetition and the spread |
//! | `report.rs` | the report ([`report::BenchReport`]) and its text |
//! | `cuda_figures.rs` | what a CUDA run adds to the report: its paths, ceilings and ratios |
//! | `repetitions.rs` | what `--repeat` adds to the report: each repetition and the spread |
//! | `format.rs` | how figures are written: rates in three figures, JSON keys sorted |

mod args;
mod checks;
mod cuda;
mod cuda_figures;
mod depth;
mod env;
mod format;
mod hint;
mod repetitions;
mod report;
mod seq_log;
mod spawn;
mod stats;
mod timeline;

use std::process::ExitCode;

use pipeline_core::{HostOptions, HostProducer};

use crate::args::{BackendArg, resolve_backend};
use crate::work;

use args::{Backend, BenchArgs};

pub use args::BenchCmd;
pub use env::{set_cuda_env, set_process_env};
pub use seq_log::{read_seq_log, write_seq_log};

/// Runs `gpipe bench`.
pub fn command(cmd: BenchCmd) -> Result<ExitCode, String> {
    let mut args = BenchArgs::of(&cmd);
    checks::arguments(&cmd, &args)?;
    let resolved = resolve_backend(cmd.backend)?;
    checks::gpu_timeline_backend(&cmd, resolved)?;
    let cuda = resolved == BackendArg::Cuda;
    if cuda {
        args.backend = Backend::Cuda;
    }
    let mut depth = cmd.ring.depth(cuda)?;
    crate::args::check_memory(resolved, depth.slots, cmd.ring.batch_bytes)?;
    if depth.auto && cuda && depth.slots > 8 {
        // No MPS: measure the depths within the budget, and take the best.
        depth = depth::measure(&args, &cmd)?;
    }
    if let Some(why) = &depth.why {
        eprintln!("gpipe bench: --slots auto: {} slots ({why})", depth.slots);
    }
    args.slots = depth.slots;
    let lead = cmd.ring.lead(cuda, depth.slots)?;
    args.max_lead = lead.max_lead;
    if let Some(why) = checks::side_signals_with_lead(
        resolved,
        cmd.side_signals,
        args.batch_bytes,
        args.slots,
        args.max_lead,
    ) {
        eprintln!("gpipe bench: {why}");
    }
    checks::fanout(&cmd, &args, resolved)?;
    if resolved != BackendArg::Host {
        args.cuda_env = env::process_env();
        for (k, v) in &args.cuda_env {
            eprintln!(
                "gpipe bench: the producer and consumers run with {k}={v} (side signals on and \
                 the variable unset: under MPS a process's streams would share hardware queues)"
            );
        }
    }
    let mut reports = Vec::new();
    for i in 0..cmd.repeat {
        if cmd.repeat > 1 && !cmd.json {
            eprintln!("gpipe bench: repetition {} of {}", i + 1, cmd.repeat);
        }
        let report = match args.backend {
            Backend::Host => {
                spawn::run::<HostProducer, _>(&args, HostOptions::default(), &mut work::HostFill)?
            }
            Backend::Cuda => cuda::run(&args, &cmd.cuda, lead, &depth)?,
        };
        reports.push(report);
        if crate::signals::STOP.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
    }
    let report = stats::fold_repetitions(reports);
    crate::output::print_report(&report, cmd.json, report.problems.is_empty())
}
