//! `gpipe inspect`: the live state of a ring (slots, sequence numbers, consumers, lag,
//! liveness), read from its control segment without attaching as a consumer.

use std::path::PathBuf;
use std::process::ExitCode;

use pipeline_core::ConsumerConfig;
use pipeline_core::inspect::Snapshot;

/// Arguments of `gpipe inspect`.
#[derive(clap::Args)]
pub struct InspectCmd {
    /// The producer's socket.
    #[arg(long)]
    socket: PathBuf,
    /// JSON output.
    #[arg(long)]
    json: bool,
}

/// Runs `gpipe inspect`.
pub fn command(cmd: InspectCmd) -> Result<ExitCode, String> {
    let (seg, backend) = pipeline_core::observe(&cmd.socket, ConsumerConfig::default())
        .map_err(|e| e.to_string())?;
    let snap = Snapshot::read(&seg, &backend.to_string());
    if cmd.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&snap).map_err(|e| e.to_string())?
        );
    } else {
        print!("{snap}");
        if snap.consumers.iter().any(|c| !c.pid_alive) {
            println!(
                "  † after a pid: that process is no longer running (or it runs in a pid namespace that cannot be seen from here)"
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
