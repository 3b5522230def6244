//! What a CUDA run adds to the bench's report: the paths it took, the single-process ceilings
//! it is measured against and its ratios to them.

use std::collections::BTreeMap;
use std::fmt::Display;

use pipeline_cuda::backend::{HandleKind, MemoryPath, SyncMode, TimelineMemory};

use super::timeline::TimelineSummary;
use crate::args::{DepthChoice, LeadChoice};

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
