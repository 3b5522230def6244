//! `gpipe probe`: the CUDA devices, the driver, the capabilities gpipe uses and the path
//! `--memory auto --sync auto` takes; exits non-zero where CUDA cannot be used.

use std::process::ExitCode;

use pipeline_cuda::backend::HandleKind;

use crate::cuda_work;

/// Arguments of `gpipe probe`.
#[derive(clap::Args)]
pub struct ProbeCmd {
    /// JSON output.
    #[arg(long)]
    json: bool,
    /// Also time the driver calls of the hot path on device 0 (host µs per call; under MPS
    /// when its daemon runs).
    #[arg(long)]
    call_costs: bool,
    /// Also measure on device 0 how long the GPU idles between two kernels with each stream
    /// operation of the hot path between them (µs, from the kernels' own GPU timer stamps).
    #[arg(long)]
    gpu_gaps: bool,
}

/// Runs `gpipe probe`.
pub fn command(cmd: ProbeCmd) -> Result<ExitCode, String> {
    let report = match pipeline_cuda::probe::probe() {
        Ok(report) => report,
        Err(e) => {
            eprintln!("gpipe probe: no usable CUDA GPU: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    // What `--memory auto --sync auto --timeline-memory auto` resolves to (the paths as
    // measured in docs/benchmarks.md), or why CUDA cannot be used.
    let (words, _) = pipeline_cuda::probe::auto_timeline_memory(&report, 0);
    let path = report
        .auto_memory_path_for(0, HandleKind::PosixFd)
        .map(|m| {
            format!(
                "memory {m}, sync {}, timeline words in {words} memory",
                cuda_work::auto_sync(words)
            )
        })
        .map_err(|e| e.to_string())
        .and_then(|p| {
            pipeline_cuda::kernels::ensure_nvrtc()
                .map(|_| p)
                .map_err(|e| format!("the benchmark kernels need NVRTC: {e}"))
        });
    let costs = if cmd.call_costs && path.is_ok() {
        Some(cuda_work::call_costs().map_err(|e| format!("timing the driver calls: {e}"))?)
    } else {
        None
    };
    // A device that cannot run one of the cases (say, without stream memory operations) still
    // gets the rest of its report, with the reason in place of the gaps.
    let gaps = (cmd.gpu_gaps && path.is_ok())
        .then(|| cuda_work::gpu_gaps(200).map_err(|e| format!("timing the GPU's gaps: {e}")));
    if cmd.json {
        let mut v = serde_json::to_value(&report).map_err(|e| e.to_string())?;
        if let Some(c) = &costs {
            v["call_costs"] = serde_json::to_value(c).map_err(|e| e.to_string())?;
        }
        match &gaps {
            Some(Ok(g)) => v["gpu_gaps"] = serde_json::to_value(g).map_err(|e| e.to_string())?,
            Some(Err(e)) => v["gpu_gaps_error"] = serde_json::Value::String(e.clone()),
            None => {}
        }
        v["chosen_path"] = match &path {
            Ok(p) => serde_json::Value::String(p.clone()),
            Err(e) => serde_json::Value::String(format!("none: {e}")),
        };
        v["mps_active"] = serde_json::Value::Bool(report.mps_active());
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
    } else {
        print!("{report}");
        match &path {
            Ok(p) => println!("\ngpipe will use (auto): {p}"),
            Err(e) => println!("\ngpipe cannot use CUDA here: {e}"),
        }
        if let Some(c) = &costs {
            println!("\nhost cost of a driver call, µs (p50 / p90 over chunks of 128 calls):");
            for x in c {
                println!("  {:>7.2} / {:>7.2}  {}", x.p50_us, x.p90_us, x.call);
            }
        }
        if let Some(Err(e)) = &gaps {
            println!("\n{e}");
        }
        if let Some(Ok(g)) = &gaps {
            println!("\nGPU idle between two 2 MiB fills, µs (p50 / p90 / mean over 199 pairs):");
            for x in g {
                println!(
                    "  {:>7.2} / {:>7.2} / {:>7.2}  {}",
                    x.p50_us, x.p90_us, x.mean_us, x.case
                );
            }
        }
    }
    Ok(if path.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
