//! How a command prints its report.

use std::process::ExitCode;

/// Prints a run's report (JSON or text); the exit code says whether it found problems.
pub fn print_report<R: serde::Serialize + std::fmt::Display>(
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
