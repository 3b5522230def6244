//! `gpipe probe`: the CUDA devices, the driver, the capabilities gpipe uses, and how every
//! `auto` of the given ring and CUDA arguments resolves (the policy the Python package shares,
//! `pipeline_cuda::policy`); exits non-zero where CUDA cannot be used.

use std::fmt;
use std::path::PathBuf;
use std::process::ExitCode;

use pipeline_cuda::policy::fanout::Fanout;
use pipeline_cuda::policy::{self, Choice, Facts, FrontEnd, Resolution, signals};
use pipeline_cuda::probe::{PathSupport, PeerLink, ProbeReport};

use crate::args::{BackendArg, CudaArgs, RingArgs, SideSignalsArg};
use crate::gpu;

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
    /// Resolve against a saved `gpipe probe --json` report instead of this machine's driver
    /// (CUDA_DEVICE_MAX_CONNECTIONS still comes from the environment).
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Resolve as a Python producer (`gpipe.Producer`, `gpipe.resolve`) does: `--sync auto`
    /// takes timeline words, which consumers release when the producer dies, and a broadcast
    /// ring takes the VMM path where the device has it. Python's own default for
    /// `timeline_memory` is host: give `--timeline-memory host` to match it.
    #[arg(long)]
    python: bool,
    /// Where a CUDA consumer of the ring waits for `ready` and writes `finished`.
    #[arg(long, value_enum, default_value = "auto")]
    side_signals: SideSignalsArg,
    #[command(flatten)]
    ring: RingArgs,
    #[command(flatten)]
    cuda: CudaArgs,
}

/// Runs `gpipe probe`.
pub fn command(cmd: ProbeCmd) -> Result<ExitCode, String> {
    let saved;
    let facts = match &cmd.report {
        Some(path) => {
            if cmd.call_costs || cmd.gpu_gaps {
                return Err(
                    "--call-costs and --gpu-gaps time this machine's GPU: leave out --report"
                        .into(),
                );
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--report {}: {e}", path.display()))?;
            let report: ProbeReport = serde_json::from_str(&text).map_err(|e| {
                format!(
                    "--report {}: not a `gpipe probe --json` report: {e}",
                    path.display()
                )
            })?;
            saved = Ok(Facts::of(report, signals::max_connections()));
            &saved
        }
        None => gpu::facts(),
    };
    let facts = match facts {
        Ok(facts) => facts,
        Err(e) => {
            eprintln!("gpipe probe: no usable CUDA GPU: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let report = &facts.report;
    // Every `auto` of the arguments (all `auto` by default), resolved by the policy the
    // Python package uses too, or why CUDA cannot be used.
    let mut inputs = crate::args::inputs(BackendArg::Cuda, &cmd.ring, &cmd.cuda)?;
    inputs.side_signals = cmd.side_signals.option();
    if cmd.python {
        inputs.front_end = FrontEnd::PYTHON;
    }
    let resolution = policy::resolve(&inputs, &Ok(facts.clone())).map_err(|e| e.problem);
    let path = resolution.as_ref().map_err(Clone::clone).and_then(|r| {
        let c = r.cuda.as_ref().ok_or("the ring resolved to host memory")?;
        Ok(format!(
            "memory {}, sync {}, timeline words in {} memory",
            c.memory.value, c.sync.value, c.timeline_memory.value
        ))
    });
    let costs = if cmd.call_costs && path.is_ok() {
        Some(gpu::call_costs::call_costs().map_err(|e| format!("timing the driver calls: {e}"))?)
    } else {
        None
    };
    // A device that cannot run one of the cases (say, without stream memory operations) still
    // gets the rest of its report, with the reason in place of the gaps.
    let gaps = (cmd.gpu_gaps && path.is_ok())
        .then(|| gpu::gaps::gpu_gaps(200).map_err(|e| format!("timing the GPU's gaps: {e}")));
    if cmd.json {
        let mut v = serde_json::to_value(report).map_err(|e| e.to_string())?;
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
        match &resolution {
            Ok(r) => v["resolution"] = serde_json::to_value(r).map_err(|e| e.to_string())?,
            Err(e) => v["resolution_error"] = serde_json::Value::String(e.clone()),
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
    } else {
        print!("{}", ProbeText(report));
        match &path {
            Ok(p) => println!("\ngpipe will use (auto): {p}"),
            Err(e) => println!("\ngpipe cannot use CUDA here: {e}"),
        }
        if let Ok(r) = &resolution {
            print!("{}", ResolutionText(r, cmd.python));
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

/// A resolution as text: one line per setting, its value and why (`python`: resolved as the
/// Python package does).
struct ResolutionText<'a>(&'a Resolution, bool);

impl fmt::Display for ResolutionText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn row<T: fmt::Display>(
            f: &mut fmt::Formatter<'_>,
            label: &str,
            c: &Choice<T>,
        ) -> fmt::Result {
            let how = if c.auto { "auto: " } else { "" };
            writeln!(f, "  {label:<24}{} ({how}{})", c.value, c.reason)
        }
        let r = self.0;
        let who = if self.1 { "a Python producer" } else { "gpipe" };
        writeln!(f, "\nhow {who} resolves these arguments:")?;
        row(f, "backend", &r.backend)?;
        row(f, "slots", &r.slots)?;
        let lead = Choice {
            value: r
                .max_lead
                .value
                .map_or("the ring's own bound".to_string(), |n| {
                    format!("{n} batches")
                }),
            auto: r.max_lead.auto,
            reason: r.max_lead.reason.clone(),
        };
        row(f, "max lead", &lead)?;
        if let Some(c) = &r.cuda {
            writeln!(f, "  {:<24}{}", "device", c.device)?;
            row(f, "memory", &c.memory)?;
            writeln!(f, "  {:<24}{}", "handle", c.handle)?;
            row(f, "sync", &c.sync)?;
            row(f, "timeline memory", &c.timeline_memory)?;
        }
        row(f, "side signals (consumer)", &r.side_signals)?;
        if let Some(why) = &r.side_signals_queues {
            writeln!(f, "  note: {why}")?;
        }
        Ok(())
    }
}

fn yes_no(v: bool) -> &'static str {
    if v { "yes" } else { "no" }
}

/// `gpipe probe`'s text: the driver, NVRTC, MPS, each device's capabilities and paths, and
/// with several devices which can consume from which.
struct ProbeText<'a>(&'a ProbeReport);

impl fmt::Display for ProbeText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let report = self.0;
        let v = report.driver_version;
        writeln!(
            f,
            "CUDA driver API   {}.{} ({v})",
            v / 1000,
            (v % 1000) / 10
        )?;
        match (&report.nvrtc_version, &report.nvrtc_error) {
            (Some([major, minor]), _) => writeln!(f, "NVRTC             {major}.{minor}")?,
            (None, Some(e)) => writeln!(f, "NVRTC             unavailable: {e}")?,
            (None, None) => writeln!(f, "NVRTC             unavailable")?,
        }
        match &report.mps_control_pipe {
            Some(pipe) => writeln!(f, "MPS control pipe  {pipe} (present; heuristic)")?,
            None => writeln!(f, "MPS control pipe  none found (heuristic)")?,
        }
        if report.devices.is_empty() {
            writeln!(f, "no CUDA devices visible")?;
        }
        for d in &report.devices {
            let [major, minor] = d.compute_capability;
            writeln!(
                f,
                "\ndevice {}: {} ({}), compute {major}.{minor}, {:.1} GiB, {} SMs",
                d.ordinal,
                d.name,
                d.uuid,
                d.total_memory_bytes as f64 / (1u64 << 30) as f64,
                d.multiprocessors
            )?;
            let mut types = Vec::new();
            if d.pool_posix_fd {
                types.push("posix_fd");
            }
            if d.pool_fabric {
                types.push("fabric");
            }
            let types = if types.is_empty() {
                String::from("none")
            } else {
                types.join(", ")
            };
            let mps = match d.mps_enabled {
                Some(v) => yes_no(v),
                None => "unknown",
            };
            let available: Vec<String> = d
                .memory_paths
                .iter()
                .filter(|p| p.available)
                .map(PathSupport::label)
                .collect();
            let unavailable: Vec<String> = d
                .memory_paths
                .iter()
                .filter(|p| !p.available)
                .map(|p| format!("{} (missing: {})", p.label(), p.missing.join(", ")))
                .collect();
            let rows: [(&str, String); 13] = [
                ("memory pools", yes_no(d.memory_pools).into()),
                (
                    "pool handle types",
                    format!("{types} (0x{:x})", d.pool_handle_types),
                ),
                ("VMM", yes_no(d.virtual_memory_management).into()),
                ("VMM POSIX fd handles", yes_no(d.posix_fd_handles).into()),
                ("VMM fabric handles", yes_no(d.fabric_handles).into()),
                ("IPC events", yes_no(d.ipc_events).into()),
                (
                    "64-bit stream mem ops",
                    yes_no(d.stream_mem_ops_64bit).into(),
                ),
                ("legacy IPC (UVA)", yes_no(d.legacy_ipc).into()),
                ("MPS (device)", mps.into()),
                ("IMEX channel", yes_no(d.imex_channel).into()),
                (
                    "memory paths",
                    if available.is_empty() {
                        String::from("none")
                    } else {
                        available.join(", ")
                    },
                ),
                (
                    "unavailable paths",
                    if unavailable.is_empty() {
                        String::from("none")
                    } else {
                        unavailable.join("; ")
                    },
                ),
                (
                    "gpipe path",
                    match d.chosen_path() {
                        Ok(path) => path.to_string(),
                        Err(_) => format!("none; missing: {}", d.missing().join(", ")),
                    },
                ),
            ];
            for (label, value) in rows {
                writeln!(f, "  {label:<24}{value}")?;
            }
            for note in &d.notes {
                writeln!(f, "  note: {note}")?;
            }
        }
        if report.devices.len() > 1 {
            writeln!(
                f,
                "\nconsumers on other GPUs (rows: the producer's device; columns: the consumer's;\n\
                 a number is the driver's relative link rank; `-`: no peer access)"
            )?;
            write!(f, "  {:<20}", "producer \\ consumer")?;
            for c in &report.devices {
                write!(f, "{:>6}", c.ordinal)?;
            }
            writeln!(f)?;
            for p in &report.devices {
                write!(f, "  {:<20}", p.ordinal)?;
                for c in &report.devices {
                    let cell = if p.ordinal == c.ordinal {
                        "self".to_string()
                    } else {
                        match report
                            .peers
                            .iter()
                            .find(|l| l.producer == p.ordinal && l.consumer == c.ordinal)
                        {
                            Some(PeerLink {
                                can_consume: true,
                                performance_rank,
                                ..
                            }) => performance_rank.map_or("yes".into(), |r| r.to_string()),
                            _ => "-".to_string(),
                        }
                    };
                    write!(f, "{cell:>6}")?;
                }
                writeln!(f)?;
            }
            let first = &report.devices[0];
            let others = report.devices.len() - 1;
            let shape = Fanout::Auto.resolve(others, 0);
            writeln!(
                f,
                "\nfan-out from device {} to the {others} other{} (`gpipe bench --fanout auto`, \
                 Python `gpipe.fanout_plan`): {}",
                first.ordinal,
                if others == 1 { "" } else { "s" },
                match shape {
                    Fanout::Chain => "a chain of whole-batch forwarders, each in the process of \
                                      a consumer on its GPU"
                        .to_string(),
                    Fanout::Direct => "direct: every consumer reads its ring".to_string(),
                    s => format!("{s}"),
                }
            )?;
            if let Some(why) = Fanout::Auto.why(others) {
                writeln!(f, "  why: {}", why.trim_start_matches("auto: "))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ProbeText;
    use pipeline_cuda::probe::{
        Capabilities, HANDLE_TYPE_FABRIC_BIT, HANDLE_TYPE_POSIX_FD_BIT, PeerLink, ProbeReport,
    };

    fn h100() -> Capabilities {
        let mut d = Capabilities {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
            compute_capability: [9, 0],
            total_memory_bytes: 80 << 30,
            multiprocessors: 132,
            l2_cache_bytes: Some(50 << 20),
            memory_pools: true,
            pool_handle_types: HANDLE_TYPE_POSIX_FD_BIT | HANDLE_TYPE_FABRIC_BIT,
            pool_posix_fd: true,
            pool_fabric: true,
            virtual_memory_management: true,
            posix_fd_handles: true,
            fabric_handles: true,
            ipc_events: true,
            stream_mem_ops_64bit: true,
            legacy_ipc: true,
            mps_enabled: Some(false),
            imex_channel: false,
            memory_paths: vec![],
            notes: vec![],
        };
        d.memory_paths = d.path_support();
        d
    }

    fn report(devices: Vec<Capabilities>) -> ProbeReport {
        ProbeReport {
            driver_version: 13000,
            nvrtc_version: Some([13, 0]),
            nvrtc_error: None,
            mps_control_pipe: None,
            devices,
            peers: vec![],
        }
    }

    fn text(r: &ProbeReport) -> String {
        ProbeText(r).to_string()
    }

    #[test]
    fn full_support_names_the_driver_the_handle_types_and_the_path() {
        let text = text(&report(vec![h100()]));
        assert!(text.contains("CUDA driver API   13.0 (13000)"), "{text}");
        assert!(text.contains("NVRTC             13.0\n"), "{text}");
        assert!(text.contains("posix_fd, fabric (0x9)"), "{text}");
        assert!(
            text.contains("gpipe path              pool + IPC events"),
            "{text}"
        );
    }

    #[test]
    fn the_peer_matrix_shows_which_devices_consume_from_which() {
        let mut second = h100();
        second.ordinal = 1;
        let mut r = report(vec![h100(), second]);
        r.peers = vec![
            PeerLink {
                producer: 0,
                consumer: 1,
                can_consume: true,
                performance_rank: Some(0),
            },
            PeerLink {
                producer: 1,
                consumer: 0,
                can_consume: false,
                performance_rank: None,
            },
        ];
        let text = text(&r);
        assert!(text.contains("consumers on other GPUs"), "{text}");
        let row = |p: &str| {
            text.lines()
                .find(|l| l.trim_start().starts_with(p) && l.contains("self"))
                .unwrap_or_else(|| panic!("no row for producer {p}: {text}"))
                .split_whitespace()
                .skip(1)
                .collect::<Vec<_>>()
        };
        assert_eq!(row("0"), ["self", "0"], "{text}");
        assert_eq!(row("1"), ["-", "self"], "{text}");
        // One other GPU reads the producer's ring directly, and the text says why.
        assert!(
            text.contains("fan-out from device 0 to the 1 other (")
                && text.contains("): direct: every consumer reads its ring"),
            "{text}"
        );
        assert!(text.contains("  why: one other GPU reads"), "{text}");
        // One device: no matrix and no fan-out.
        let one = super::tests::text(&report(vec![h100()]));
        assert!(
            !one.contains("other GPUs") && !one.contains("fan-out"),
            "{one}"
        );
    }

    #[test]
    fn four_devices_fan_out_through_a_chain_and_say_why() {
        let devices = (0..4)
            .map(|i| {
                let mut d = h100();
                d.ordinal = i;
                d
            })
            .collect();
        let text = text(&report(devices));
        assert!(
            text.contains("fan-out from device 0 to the 3 others")
                && text.contains("a chain of whole-batch forwarders"),
            "{text}"
        );
        assert!(
            text.contains("why: two or more other GPUs take a chain"),
            "{text}"
        );
    }

    #[test]
    fn memory_paths_are_listed_per_device_with_what_the_others_miss() {
        let text = text(&report(vec![h100()]));
        assert!(
            text.contains("memory paths            pool, vmm, legacy"),
            "{text}"
        );
        assert!(
            text.contains(
                "pool+fabric (missing: an IMEX channel (/dev/nvidia-caps-imex-channels))"
            ),
            "{text}"
        );
    }

    #[test]
    fn what_is_missing_is_said_in_place_of_what_is_not() {
        let mut d = h100();
        d.pool_posix_fd = false;
        d.ipc_events = false;
        d.mps_enabled = None;
        d.notes = vec!["CU_DEVICE_ATTRIBUTE_MPS_ENABLED: not reported".into()];
        let mut r = report(vec![d]);
        r.nvrtc_version = None;
        r.nvrtc_error = Some("NVRTC not found".into());
        r.mps_control_pipe = Some("/tmp/nvidia-mps/control".into());
        let text = text(&r);
        assert!(
            text.contains("NVRTC             unavailable: NVRTC not found\n"),
            "{text}"
        );
        assert!(
            text.contains("MPS control pipe  /tmp/nvidia-mps/control (present; heuristic)"),
            "{text}"
        );
        assert!(text.contains("MPS (device)            unknown\n"), "{text}");
        assert!(
            text.contains("gpipe path              none; missing: memory pools with POSIX fd handles, IPC events"),
            "{text}"
        );
        assert!(
            text.contains("  note: CU_DEVICE_ATTRIBUTE_MPS_ENABLED: not reported\n"),
            "{text}"
        );
        let none = super::tests::text(&report(vec![]));
        assert!(none.contains("no CUDA devices visible"), "{none}");
    }
}
