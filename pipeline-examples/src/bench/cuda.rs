//! A CUDA run: the run itself, then, in this process, the single-process ceilings it is
//! measured against, and a hint when MPS is not running.

use std::collections::BTreeMap;
use std::fmt::Display;

use pipeline_core::Mode;
use pipeline_cuda::backend::{CudaProducer, HandleKind, MemoryPath, SyncMode, TimelineMemory};

use super::report::BenchReport;
use super::timeline::{self, TimelineStamps, TimelineSummary};
use super::{BenchArgs, hint, spawn, warmup_of};
use crate::args::{CudaArgs, DepthChoice, LeadChoice};
use crate::gpu::{self, ceilings};

/// What a CUDA run adds to the report (`extra` in the JSON, where its keys come out in
/// alphabetical order): the paths it took, the single-process ceilings measured right after
/// it and its ratios to them, where its consumers ran, and how the `auto`s resolved.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CudaFigures {
    /// The slots' memory path.
    #[serde(serialize_with = "display")]
    pub memory: MemoryPath,
    /// How the slots' handles were shared.
    #[serde(serialize_with = "display")]
    pub handle: HandleKind,
    /// How `ready` was signalled.
    #[serde(serialize_with = "display")]
    pub sync: SyncMode,
    /// Where the timeline words lived.
    #[serde(serialize_with = "display")]
    pub timeline_memory: TimelineMemory,
    /// The first consumer's attach cost, per step (µs), as it reported it.
    pub attach_us: Option<serde_json::Value>,
    /// The fill and verify kernels on one stream in one process (batches/s).
    pub ceiling_batches_per_s: f64,
    /// As the ceiling, each verify reading the buffer filled `lag` batches earlier.
    pub lagged_ceiling_batches_per_s: f64,
    /// As the ceiling, in buffers from an IPC-capable pool like the slots.
    pub pool_ceiling_batches_per_s: f64,
    /// The lag of the lagged ceiling (half the slots, at least 1).
    pub lag: u32,
    /// Fills on one stream, verifies on another, as the pipeline overlaps them.
    pub two_stream_ceiling_batches_per_s: f64,
    /// The run's rate over the ceiling.
    pub ratio_to_ceiling: f64,
    /// The run's own work per batch in one process: the better of the two below.
    pub fair_ceiling_batches_per_s: f64,
    /// That work on one stream.
    pub fair_ceiling_one_stream_batches_per_s: f64,
    /// That work spread over streams the way the pipeline spreads it.
    pub fair_ceiling_spread_batches_per_s: f64,
    /// Verifies per batch in that work (every reader's `--passes`).
    pub fair_ceiling_verifies_per_batch: u32,
    /// The run's rate over the fair ceiling.
    pub ratio_to_fair_ceiling: f64,
    /// MPS looked active.
    pub mps_active: bool,
    /// The producer's GPU.
    pub producer_device: usize,
    /// Each consumer's GPU.
    pub consumer_devices: Vec<usize>,
    /// Each consumer's delivery, as it reported it ("in-place" or "mirror").
    pub delivery: Vec<String>,
    /// `--gpu-timeline`: what the GPU did over the stamped batches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_timeline: Option<TimelineSummary>,
    /// Consumers on other GPUs: the link's single-process ceilings, per device.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peer_ceilings: Vec<PeerCeilings>,
    /// What MPS would do for this run, when it is not running (the text report prints it
    /// last, as `hint: ...`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mps_hint: Option<String>,
    /// How `--max-lead auto` resolved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_lead_auto: Option<LeadChoice>,
    /// How `--slots auto` resolved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots_auto: Option<DepthChoice>,
    /// What this process set in the run's environment ([`super::set_process_env`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_env: Option<BTreeMap<String, String>>,
}

/// The single-process ceilings of the link from the producer's GPU to one other.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PeerCeilings {
    /// The other GPU.
    pub device: usize,
    /// Copies by that GPU's copy engine (batches/s), as a mirroring consumer's.
    pub peer_copy_ceiling_batches_per_s: f64,
    /// The same in GB/s.
    pub peer_copy_ceiling_gb_per_s: f64,
    /// The verify kernel on that GPU reading in place (batches/s), as an in-place consumer.
    pub remote_read_ceiling_batches_per_s: f64,
    /// The same in GB/s.
    pub remote_read_ceiling_gb_per_s: f64,
}

/// Serializes a value as its text (`pool`, `posix_fd`, `semaphore`, `device`).
fn display<T: Display, S: serde::Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(value)
}

/// Runs the bench on the CUDA backend, then measures the ceilings; `lead` and `depth` are
/// how `--max-lead` and `--slots` resolved.
pub(super) fn run(
    args: &BenchArgs,
    cuda: &CudaArgs,
    lead: LeadChoice,
    depth: &DepthChoice,
) -> Result<BenchReport, String> {
    let mps = pipeline_cuda::probe::probe()
        .map(|r| r.mps_active())
        .unwrap_or(false);
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
