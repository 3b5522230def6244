//! `--slots auto` on a GPU without MPS: a short run at each depth within the budget.

use pipeline_cuda::backend::CudaProducer;

use super::args::{Backend, BenchArgs, BenchCmd};
use super::format::compact_rate;
use super::spawn;
use crate::args::DepthChoice;
use crate::gpu;

/// A short run at each depth within `--depth-budget` (the same consumers, batch size and
/// mode), and the depth that moved the most batches.
pub(super) fn measure(args: &BenchArgs, cmd: &BenchCmd) -> Result<DepthChoice, String> {
    let depths = crate::args::depths_within(cmd.ring.batch_bytes, cmd.ring.depth_budget);
    let mut trial = args.clone();
    trial.json = true;
    trial.backend = Backend::Cuda;
    trial.round_trip = false;
    // About a quarter of a second each at the rates seen without MPS, at least 200 batches.
    trial.batches = (args.batches / 4).clamp(200, 2000);
    let options = cmd.cuda.options()?;
    let mut trials = Vec::new();
    for &d in &depths {
        trial.slots = d;
        // The lead bound the run will have at this depth (--max-lead auto depends on it).
        trial.max_lead = cmd.ring.lead(true, d)?.max_lead;
        let r = spawn::run::<CudaProducer, _>(&trial, options, &mut gpu::CudaFill::default())?;
        if !r.problems.is_empty() {
            return Err(format!(
                "--slots auto: the trial run at {d} slots failed: {}",
                r.problems.join("; ")
            ));
        }
        eprintln!(
            "gpipe bench: --slots auto: {d} slots: {:.0} batches/s",
            r.batches_per_s
        );
        trials.push((d, r.batches_per_s));
    }
    let best = trials
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(8, |t| t.0);
    Ok(DepthChoice {
        slots: best,
        auto: true,
        why: Some(format!(
            "MPS is not running: measured {} within the {} budget; {best} moved the most",
            trials
                .iter()
                .map(|(d, r)| format!("{d}: {}/s", compact_rate(*r)))
                .collect::<Vec<_>>()
                .join(", "),
            crate::size::format(cmd.ring.depth_budget)
        )),
        trials,
    })
}
