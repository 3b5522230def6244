//! `gpipe.forward` and `gpipe.fanout_plan`: re-publishing a ring on another GPU (issue #20),
//! on `pipeline_relay`'s forwarder.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use pipeline_core::ProducerConfig;
use pipeline_relay::{Fanout, Flow, ForwardOptions};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args;
use crate::blocking::SLICE;
use crate::errors::GpipeError;

/// forward(upstream, socket, *, device=None, slots=8, max_consumers=16,
///         wait_for_consumers=0, chunk=None) -> dict
///
/// Consumes the ring at ``upstream`` and re-publishes every batch in a ring of its own at
/// ``socket`` (same slot size and mode), on CUDA device ``device`` (default: the upstream
/// producer's GPU): GPU 0's ring forwarded to GPU 1, whose consumers then read their own
/// GPU's memory. Blocks until the upstream ring closes (then closes its own once its
/// consumers are done) and returns the report (``batches``, ``bytes``, ``elapsed_s``,
/// ``gb_per_s``). ``slots``: slots in the forwarder's ring, 1 to 4096. ``max_consumers``:
/// the most consumers attached to it at once, 1 to 63. ``wait_for_consumers``: take no batch
/// until that many consumers attached downstream. ``chunk``: copy each batch in chunks of this
/// many bytes and publish the progress after each, so that a forwarder downstream with the
/// same ``chunk`` starts copying a chunk once it has landed here (a chain of them carries one
/// large batch, a weight update say, in about one hop's time); consumers still see a batch only
/// once it is whole. None (the default): whole batches, which move the most in a steady stream
/// of batches. Ctrl-C stops it (closing its ring) and raises ``KeyboardInterrupt``; if the
/// upstream ring fails (its producer died), it raises ``gpipe.Error`` and leaves its ring as a
/// crashed producer would, so that its consumers see the producer die.
#[pyfunction]
#[pyo3(signature = (upstream, socket, *, device=None, slots=8, max_consumers=16, wait_for_consumers=0, chunk=None))]
#[allow(clippy::too_many_arguments)] // one per keyword argument of the Python function
pub fn forward<'py>(
    py: Python<'py>,
    #[pyo3(from_py_with = args::upstream)] upstream: PathBuf,
    #[pyo3(from_py_with = args::socket)] socket: PathBuf,
    #[pyo3(from_py_with = args::forward_device)] device: Option<usize>,
    #[pyo3(from_py_with = args::forward_slots)] slots: u32,
    #[pyo3(from_py_with = args::max_consumers)] max_consumers: u32,
    #[pyo3(from_py_with = args::wait_for_consumers)] wait_for_consumers: u32,
    #[pyo3(from_py_with = args::forward_chunk)] chunk: Option<u64>,
) -> PyResult<Bound<'py, PyDict>> {
    // The ring's shape rule (pipeline_core::limits); its slot size is the upstream ring's.
    pipeline_core::limits::check_slots(slots)
        .and_then(|()| pipeline_core::limits::check_max_consumers(max_consumers))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let config = ProducerConfig {
        slots,
        max_consumers: max_consumers.max(wait_for_consumers),
        ..ProducerConfig::default()
    };
    let opts = ForwardOptions {
        device,
        wait_for_consumers,
        wait_timeout: None,
        sync: None,
        chunk_bytes: chunk,
        depth: None,
        memory: None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = crossbeam_channel::bounded(1);
    let flag = stop.clone();
    let worker = std::thread::spawn(move || {
        let r = pipeline_relay::run_forwarder(&upstream, &socket, config, &opts, &flag);
        let _ = tx.send(r);
    });
    let result = loop {
        match py.detach(|| rx.recv_timeout(SLICE)) {
            Ok(r) => break r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if let Err(e) = py.check_signals() {
                    stop.store(true, Ordering::Relaxed);
                    py.detach(|| {
                        let _ = worker.join();
                    });
                    return Err(e);
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                return Err(GpipeError::new_err("the forwarder thread ended abnormally"));
            }
        }
    };
    let _ = worker.join();
    let report = result.map_err(|e| GpipeError::new_err(e.0))?;
    let d = PyDict::new(py);
    d.set_item("backend", &report.backend)?;
    d.set_item("batches", report.batches)?;
    d.set_item("bytes", report.bytes)?;
    d.set_item("elapsed_s", report.elapsed_s)?;
    d.set_item("gb_per_s", report.gb_per_s())?;
    d.set_item("error", report.error.clone())?;
    Ok(d)
}

/// fanout_plan(consumer_devices, shape="auto", batch_bytes=64 << 20, producer_device=0,
///             one_at_a_time=False) -> dict
///
/// How ``shape`` (``"direct"``, ``"chain"``, ``"tree"`` or ``"auto"``) reaches one consumer
/// per entry of ``consumer_devices`` (its GPU) from a producer on ``producer_device``, for
/// batches of ``batch_bytes`` bytes (what ``"auto"`` weighs):
/// ``{"shape", "rings": [{"device", "parent"}], "consumer_ring": [...], "depth",
/// "chunk_bytes"}``. Ring 0 is the producer's; start one :func:`forward` per other ring, from
/// its parent's socket, on its device, with ``chunk=plan["chunk_bytes"]``, and attach each
/// consumer to its ring. ``chunk_bytes``: the chunk the forwarders should copy in (None:
/// whole batches, which keep every link busy in a steady stream of batches).
/// ``one_at_a_time``: the batches go one at a time, each waited for end to end (a weight
/// update): a chain of two forwarders or more then copies in chunks, so that each hop starts
/// before the batch has crossed the one before.
#[pyfunction]
// 67108864: 64 MiB, written out so that the signature shows it.
#[pyo3(signature = (consumer_devices, shape="auto", batch_bytes=67108864, producer_device=0, one_at_a_time=false))]
pub fn fanout_plan<'py>(
    py: Python<'py>,
    #[pyo3(from_py_with = args::consumer_devices)] consumer_devices: Vec<usize>,
    shape: &str,
    #[pyo3(from_py_with = args::batch_bytes)] batch_bytes: u64,
    #[pyo3(from_py_with = args::producer_device_index)] producer_device: usize,
    one_at_a_time: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let shape: Fanout = shape.parse().map_err(PyValueError::new_err)?;
    let flow = if one_at_a_time {
        Flow::OneAtATime
    } else {
        Flow::Steady
    };
    let plan = pipeline_relay::plan_fanout_for(
        shape,
        producer_device,
        &consumer_devices,
        batch_bytes,
        flow,
    );
    let d = PyDict::new(py);
    d.set_item("shape", plan.shape.to_string())?;
    let rings = plan
        .rings
        .iter()
        .map(|r| {
            let x = PyDict::new(py);
            x.set_item("device", r.device)?;
            x.set_item("parent", r.parent)?;
            Ok(x)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("rings", rings)?;
    d.set_item("consumer_ring", plan.consumer_ring.clone())?;
    d.set_item("depth", plan.depth())?;
    d.set_item("chunk_bytes", plan.chunk_bytes)?;
    Ok(d)
}
