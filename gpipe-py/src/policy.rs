//! `gpipe.resolve()` and the settings of `gpipe.Producer`: every `auto` is resolved by the
//! policy the command line shares (`pipeline_cuda::policy`), as a Python front-end
//! ([`FrontEnd::PYTHON`]: `sync="auto"` takes timeline words, which consumers release when
//! the producer dies; a broadcast ring takes the VMM path where the device has it, so
//! consumers map the slots read-only). No rule lives here.

use std::path::PathBuf;

use pipeline_core::{BackendKind, Mode};
use pipeline_cuda::backend::{SyncMode, TimelineMemory};
use pipeline_cuda::policy::{
    self, Facts, FrontEnd, Inputs, LeadRequest, Resolution, Setting, signals,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::args;
use crate::errors::BackendError;

/// What a Python caller asked, as `Producer(...)` and `gpipe.resolve(...)` take it.
pub(crate) struct Asked<'a> {
    pub backend: &'a str,
    pub device: i32,
    pub mode: Mode,
    pub batch_bytes: u64,
    /// None: the default; `Auto`: "auto".
    pub slots: Option<args::OrAuto>,
    pub default_slots: u32,
    pub depth_budget: u64,
    /// None: the ring's own bound.
    pub max_lead: Option<args::OrAuto>,
    pub sync: &'a str,
    pub timeline_memory: &'a str,
    pub side_signals: Option<bool>,
}

/// The policy's inputs for `asked`; ValueError for a value no setting has.
pub(crate) fn inputs(asked: &Asked<'_>) -> PyResult<Inputs> {
    let backend = match asked.backend {
        "auto" => None,
        "host" => Some(BackendKind::Host),
        "cuda" => Some(BackendKind::Cuda),
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown backend {other:?}: use \"auto\", \"cuda\" or \"host\""
            )));
        }
    };
    let sync = match asked.sync {
        "auto" => None,
        "semaphore" => Some(SyncMode::Semaphore),
        "events" => Some(SyncMode::Events),
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown sync {other:?}: use \"auto\", \"semaphore\" or \"events\""
            )));
        }
    };
    let timeline_memory = match asked.timeline_memory {
        "auto" => None,
        w => Some(
            w.parse::<TimelineMemory>()
                .map_err(|e| PyValueError::new_err(format!("{e}; or \"auto\"")))?,
        ),
    };
    if asked.device < 0 {
        return Err(PyValueError::new_err(format!(
            "device must be a CUDA device index, 0 or more, not {}",
            asked.device
        )));
    }
    Ok(Inputs {
        backend,
        device: asked.device as usize,
        mode: asked.mode,
        batch_bytes: asked.batch_bytes,
        slots: match asked.slots {
            None => Some(asked.default_slots),
            Some(args::OrAuto::Auto) => None,
            Some(args::OrAuto::Value(n)) => Some(n),
        },
        depth_budget: asked.depth_budget,
        max_lead: match asked.max_lead {
            None => LeadRequest::Ring,
            Some(args::OrAuto::Auto) => LeadRequest::Auto,
            Some(args::OrAuto::Value(n)) => LeadRequest::Batches(n),
        },
        memory: None,
        handle: pipeline_cuda::backend::HandleKind::PosixFd,
        sync,
        timeline_memory,
        side_signals: asked.side_signals,
        front_end: FrontEnd::PYTHON,
    })
}

/// Resolves `inputs`, probing the driver once unless the ring is on the host (or reading a
/// saved `gpipe probe --json` report from `report`). BackendError names the argument that
/// cannot be met.
pub(crate) fn resolve(inputs: &Inputs, report: Option<PathBuf>) -> PyResult<Resolution> {
    let facts = match report {
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| PyValueError::new_err(format!("report {}: {e}", path.display())))?;
            let report = serde_json::from_str(&text).map_err(|e| {
                PyValueError::new_err(format!(
                    "report {}: not a `gpipe probe --json` report: {e}",
                    path.display()
                ))
            })?;
            Ok(Facts::of(report, signals::max_connections()))
        }
        // Never read for the host backend: no probe.
        None if inputs.backend == Some(BackendKind::Host) => Err(String::new()),
        None => Facts::probe().map_err(|e| e.to_string()),
    };
    policy::resolve(inputs, &facts).map_err(|e| {
        let setting = match e.setting {
            Setting::Backend => "backend=\"cuda\"",
            Setting::Memory => "memory",
            Setting::MaxLead => "max_lead=\"auto\"",
        };
        BackendError::new_err(format!("{setting}: {e}"))
    })
}

/// Resolves what ``gpipe.Producer(...)`` would make of these arguments, without making a
/// ring: every ``"auto"`` resolved by the rules the ``gpipe`` command line uses too (``gpipe
/// probe --python`` prints the same), each setting as ``{"value", "auto", "reason"}``.
/// ``side_signals``: a consumer's choice (None: ``"auto"``). ``report``: the path of a saved
/// ``gpipe probe --json`` report to resolve against instead of this machine's driver.
/// Returns a dict: ``backend``, ``slots``, ``max_lead``, ``cuda`` (None on the host backend:
/// ``device``, ``memory``, ``handle``, ``sync``, ``timeline_memory``, ``l2_cache_bytes``),
/// ``side_signals`` and ``side_signals_queues``.
#[pyfunction(name = "resolve")]
#[pyo3(signature = (*, slots=None, batch_bytes=pipeline_core::ProducerConfig::default().batch_bytes, mode="broadcast", backend="auto", device=0, sync="auto", max_lead=None, depth_budget=policy::depth::DEFAULT_DEPTH_BUDGET, timeline_memory="host", side_signals=None, report=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn resolve_settings<'py>(
    py: Python<'py>,
    #[pyo3(from_py_with = args::slots)] slots: Option<args::OrAuto>,
    #[pyo3(from_py_with = args::batch_bytes)] batch_bytes: u64,
    mode: &str,
    backend: &str,
    device: i32,
    sync: &str,
    #[pyo3(from_py_with = args::max_lead)] max_lead: Option<args::OrAuto>,
    #[pyo3(from_py_with = args::depth_budget)] depth_budget: u64,
    timeline_memory: &str,
    side_signals: Option<bool>,
    report: Option<PathBuf>,
) -> PyResult<Bound<'py, PyAny>> {
    let mode: Mode = mode.parse().map_err(PyValueError::new_err)?;
    let inputs = inputs(&Asked {
        backend,
        device,
        mode,
        batch_bytes,
        slots,
        default_slots: pipeline_core::ProducerConfig::default().slots,
        depth_budget,
        max_lead,
        sync,
        timeline_memory,
        side_signals,
    })?;
    let resolution = py.detach(|| resolve(&inputs, report))?;
    let text = serde_json::to_string(&resolution)
        .map_err(|e| PyValueError::new_err(format!("the resolution as JSON: {e}")))?;
    py.import("json")?.call_method1("loads", (text,))
}
