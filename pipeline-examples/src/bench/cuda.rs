//! A CUDA run: the run itself, then, in this process, the single-process ceilings it is
//! measured against, and a hint when MPS is not running.

use pipeline_core::Mode;
use pipeline_cuda::backend::CudaProducer;

use super::args::{BenchArgs, warmup_of};
use super::cuda_figures::{CudaFigures, PeerCeilings};
use super::report::BenchReport;
use super::timeline::{self, TimelineStamps};
use super::{hint, spawn};
use crate::args::{CudaArgs, DepthChoice, LeadChoice};
use crate::gpu::{self, ceilings};

/// Runs the bench on the CUDA backend, then measures the ceilings; `lead` and `depth` are
/// how `--max-lead` and `--slots` resolved.
pub(super) fn run(
    args: &BenchArgs,
    cuda: &CudaArgs,
    lead: LeadChoice,
    depth: &DepthChoice,
) -> Result<BenchReport, String> {
    let mps = gpu::facts().as_ref().is_ok_and(|f| f.report.mps_active());
    let options = cuda.options()?;
    let mut fill = gpu::CudaFill::with_timeline(warmup_of(args.batches), args.gpu_timeline);
    let mut report = spawn::run::<CudaProducer, _>(args, options, &mut fill)?;
    let gpu_timeline = match fill.timeline()? {
        Some(fills) => {
            let verifies: Vec<Vec<[u64; 2]>> = report
                .per_consumer
                .iter_mut()
                .map(|c| c.gpu_timeline.take().unwrap_or_default())
                .collect();
            let summary = timeline::summary(&fills, &verifies);
            if let Some(path) = &args.gpu_timeline_out {
                let stamps = TimelineStamps {
                    first_seq: warmup_of(args.batches),
                    fills,
                    verifies,
                };
                stamps
                    .write(path)
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            }
            Some(summary)
        }
        None => None,
    };
    let (bytes, slots, batches) = (args.batch_bytes, args.slots, args.batches.min(4000));
    let ceiling = ceilings::ceiling(bytes, slots, batches)
        .map_err(|e| format!("measuring the single-process ceiling: {e}"))?;
    let overlapped = ceilings::two_stream_ceiling(bytes, slots, batches)
        .map_err(|e| format!("measuring the two-stream ceiling: {e}"))?;
    let lag = (slots / 2).max(1);
    let lagged = ceilings::lagged_ceiling(bytes, slots, batches, lag)
        .map_err(|e| format!("measuring the lagged ceiling: {e}"))?;
    let pool = ceilings::pool_ceiling(bytes, slots, batches)
        .map_err(|e| format!("measuring the pool ceiling: {e}"))?;
    // The fair ceiling: the run's own work per batch (1 fill + N verifies in broadcast with N
    // consumers, 1 + 1 in shared; each consumer's --passes times), on one stream and spread
    // over streams; the better counts.
    let reads: Vec<u32> = match args.mode {
        Mode::Broadcast => (0..args.consumers.max(1))
            .map(|i| args.passes_of(i))
            .collect(),
        Mode::Shared => vec![args.passes_of(0)],
    };
    let fair_one = ceilings::fair_ceiling(bytes, slots, batches, &reads, false)
        .map_err(|e| format!("measuring the fair ceiling on one stream: {e}"))?;
    let fair_spread = ceilings::fair_ceiling(bytes, slots, batches, &reads, true)
        .map_err(|e| format!("measuring the fair ceiling over streams: {e}"))?;
    let fair = fair_one.max(fair_spread);
    let peer_ceilings = peer_ceilings(args, bytes, slots, batches)?;
    let mps_hint = hint::mps_hint(mps, report.batches_per_s, ceiling, report.round_trip_p50_us);
    report.cuda = Some(CudaFigures {
        memory: options.memory,
        handle: options.handle,
        sync: options.sync,
        timeline_memory: options.timeline_memory,
        attach_us: report.per_consumer.first().and_then(|c| c.attach.clone()),
        ceiling_batches_per_s: ceiling,
        lagged_ceiling_batches_per_s: lagged,
        pool_ceiling_batches_per_s: pool,
        lag,
        two_stream_ceiling_batches_per_s: overlapped,
        ratio_to_ceiling: report.batches_per_s / ceiling,
        fair_ceiling_batches_per_s: fair,
        fair_ceiling_one_stream_batches_per_s: fair_one,
        fair_ceiling_spread_batches_per_s: fair_spread,
        fair_ceiling_verifies_per_batch: reads.iter().sum(),
        ratio_to_fair_ceiling: report.batches_per_s / fair,
        mps_active: mps,
        producer_device: 0,
        consumer_devices: args.devices(),
        delivery: report
            .per_consumer
            .iter()
            .map(|c| c.delivery.clone().unwrap_or_default())
            .collect(),
        gpu_timeline,
        peer_ceilings,
        mps_hint,
        max_lead_auto: lead.auto.then_some(lead),
        slots_auto: depth.auto.then(|| depth.clone()),
        cuda_env: (!args.cuda_env.is_empty()).then(|| args.cuda_env.iter().cloned().collect()),
    });
    Ok(report)
}

/// Consumers on other GPUs: the same-run single-process ceilings of the link, per device.
fn peer_ceilings(
    args: &BenchArgs,
    bytes: u64,
    slots: u32,
    batches: u64,
) -> Result<Vec<PeerCeilings>, String> {
    let mut others: Vec<usize> = args
        .consumer_devices
        .iter()
        .copied()
        .filter(|&d| d != 0)
        .collect();
    others.sort_unstable();
    others.dedup();
    let mut peers = Vec::new();
    for d in others {
        let copy = ceilings::peer_copy_ceiling(bytes, 0, d, slots, batches)
            .map_err(|e| format!("measuring the peer-copy ceiling 0 -> {d}: {e}"))?;
        let read = ceilings::remote_read_ceiling(bytes, 0, d, slots, batches)
            .map_err(|e| format!("measuring the remote-read ceiling 0 -> {d}: {e}"))?;
        peers.push(PeerCeilings {
            device: d,
            peer_copy_ceiling_batches_per_s: copy,
            peer_copy_ceiling_gb_per_s: copy * bytes as f64 / 1e9,
            remote_read_ceiling_batches_per_s: read,
            remote_read_ceiling_gb_per_s: read * bytes as f64 / 1e9,
        });
    }
    Ok(peers)
}
