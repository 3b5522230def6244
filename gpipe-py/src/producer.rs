//! `gpipe.Producer` and `gpipe.Slot`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use pipeline_core::{
    BackendKind, Error, HostOptions, HostProducer, LagPolicy, Mode, Producer, ProducerConfig,
    SlotLoan, TensorPlan, USER_HEADER_WORDS, WaitPolicy, pattern,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use pipeline_cuda::backend::{
    CudaOptions, CudaProducer, HandleKind, MemoryPath, SyncMode, TimelineMemory,
};
use pipeline_cuda::driver::CUstream;

use crate::consumer::{TICK, stream_handle};
use crate::dlpack::{DEVICE_CPU, DEVICE_CUDA, DLDevice};
use crate::tensor::{PyTensor, StreamUse};
use crate::{
    Closed, GpipeError, args, blocking, deadline, is_torch_dtype, parse_dtype, to_py, torch_tensor,
};

/// A producer on one of the backends.
enum AnyProducer {
    Host(Producer<HostProducer>),
    Cuda(Producer<CudaProducer>),
}

/// Runs `$e` with `$p` bound to the producer, whichever backend it has.
macro_rules! with_producer {
    ($any:expr, $p:ident => $e:expr) => {
        match $any {
            AnyProducer::Host($p) => $e,
            AnyProducer::Cuda($p) => $e,
        }
    };
}

/// The CUDA options of a Python producer: `ready` as timeline words (a consumer's stream
/// waiting on a dead producer's word is released by its watch thread; an IPC event of a
/// dead process may never complete), and in broadcast mode the VMM path where the device
/// has it, so consumers map the slots read-only.
fn cuda_options(
    device: usize,
    mode: Mode,
    sync: SyncMode,
    words: Option<TimelineMemory>,
) -> Result<CudaOptions, String> {
    if !pipeline_cuda::driver::driver_present() {
        return Err("no CUDA driver (libcuda.so.1) could be loaded".into());
    }
    let report = pipeline_cuda::probe::probe().map_err(|e| e.to_string())?;
    let caps = report
        .devices
        .iter()
        .find(|d| d.ordinal == device)
        .ok_or_else(|| format!("no CUDA device {device} ({} visible)", report.devices.len()))?;
    let memory = if mode == Mode::Broadcast
        && caps
            .check_path(MemoryPath::Vmm, HandleKind::PosixFd)
            .is_ok()
    {
        MemoryPath::Vmm
    } else {
        caps.auto_memory_path(HandleKind::PosixFd)
            .map_err(|e| e.to_string())?
    };
    Ok(CudaOptions {
        device: Some(device),
        memory,
        handle: HandleKind::PosixFd,
        sync,
        // None: "auto".
        timeline_memory: words
            .unwrap_or_else(|| pipeline_cuda::probe::auto_timeline_memory(&report, device).0),
        ..CudaOptions::default()
    })
}

/// torch's `_cuda_getCurrentRawStream`, found once torch has initialised CUDA (it stays
/// initialised): the current stream's raw handle with no Python stream object made per call.
static TORCH_RAW_STREAM: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();

/// The caller's current CUDA stream: torch's current stream on `device` when torch is
/// loaded and has initialised CUDA, else the legacy default stream (1). Called twice per
/// batch (acquire and publish), so the torch function is looked up once.
fn current_stream(py: Python<'_>, device: i32) -> PyResult<u64> {
    let raw = match TORCH_RAW_STREAM.get(py) {
        Some(f) => f.bind(py).clone(),
        None => {
            let modules = py.import("sys")?.getattr("modules")?;
            let Ok(torch) = modules.get_item("torch") else {
                return Ok(1);
            };
            let cuda = torch.getattr("cuda")?;
            if !cuda.call_method0("is_initialized")?.extract::<bool>()? {
                return Ok(1);
            }
            match torch
                .getattr("_C")
                .and_then(|c| c.getattr("_cuda_getCurrentRawStream"))
            {
                Ok(f) => TORCH_RAW_STREAM
                    .get_or_init(py, || f.unbind())
                    .bind(py)
                    .clone(),
                // An older or unusual torch: its public API.
                Err(_) => {
                    let s = cuda.call_method1("current_stream", (device,))?;
                    return stream_handle(&s);
                }
            }
        }
    };
    stream_handle(&raw.call1((device,))?)
}

/// The producer and what it shares with its slots' tensors: the slot memory lives until the
/// last of them is gone, even after `close()`.
struct ProducerCell {
    producer: Mutex<AnyProducer>,
    /// Sequence number + 1 of the slot handed out and not yet published or abandoned.
    open: AtomicU64,
}

/// The producing side of a ring: it makes the ring's slots, listens on ``socket`` for
/// consumers, and publishes batches. ``send()`` copies tensors into the next slot and
/// publishes them; ``acquire()`` gives a slot to write in place. Use it as a context manager:
/// leaving the block closes the ring (consumers get everything published, then Closed).
///
/// ``socket``: the Unix socket path consumers attach to, made with mode 0600 (only the same
/// user may attach). ``slots``: slots in the ring, 1 to 4096, or ``"auto"``: 8 with MPS
/// running (and on the host); without MPS, where the GPU time-slices between processes and a
/// deeper ring moves more, the deepest of 8, 16, 32 and 64 whose slots fit ``depth_budget``
/// (``slots_auto`` says which and why). ``batch_bytes``: the largest batch in bytes, at most
/// 64 GiB; each slot holds this rounded up to 2 MiB. ``mode``: ``"broadcast"`` (every
/// consumer gets every batch published after it attached) or ``"shared"`` (each batch goes
/// to exactly one consumer). ``backend``: ``"auto"`` (CUDA when a GPU is usable, else host
/// memory), ``"cuda"`` or ``"host"``. ``device``: the CUDA device index of the slots (CUDA
/// backend). ``detach_after_ms``: detach a consumer that holds a slot the producer needs for
/// longer than this many milliseconds; None: wait for it (back-pressure).
/// ``max_consumers``: the most consumers attached at once, 1 to 63. ``drain_timeout``:
/// seconds ``close()`` waits for consumers to release what they hold before it takes it
/// back. ``sync`` (CUDA): how ``ready`` is signalled: ``"auto"`` or ``"semaphore"``
/// (timeline words, which consumers release when the producer dies) or ``"events"`` (IPC
/// events). ``max_lead``: write a batch only once the batch this many back was consumed by
/// everyone who got it; below ``slots`` it keeps the data in flight small enough for a GPU's
/// L2 cache; None: the ring's own bound (``slots``); ``"auto"``: from the GPU's L2 size and
/// ``batch_bytes`` (host rings: None). ``depth_budget``: the most slot memory in bytes that
/// ``slots="auto"`` may take. ``timeline_memory`` (CUDA): where the ``ready`` and
/// ``finished`` words live: ``"host"``, ``"device"`` (faster; see docs/python.md for when it
/// is safe) or ``"auto"``. ``keep_dumpable``: leave this process dumpable; by default the
/// producer makes it not dumpable, so that other processes of the same user cannot open its
/// read-write memory through ``/proc/PID/fd`` (no core dumps then, and debuggers and
/// profilers such as py-spy or gdb need root; docs/security.md).
///
/// Wrong arguments raise TypeError (a wrong type) or ValueError (a value out of range),
/// naming the argument.
#[pyclass(frozen, subclass, module = "gpipe", name = "Producer")]
pub struct PyProducer {
    cell: Arc<ProducerCell>,
    socket: String,
    backend: BackendKind,
    memory: &'static str,
    mode: Mode,
    slots: u32,
    slot_bytes: u64,
    device: DLDevice,
    max_lead: Option<u32>,
    slots_auto: Option<String>,
}

fn parse_mode(mode: &str) -> PyResult<Mode> {
    mode.parse().map_err(PyValueError::new_err)
}

/// The defaults of `Producer(...)`'s arguments, in one place: the ring's own
/// (`ProducerConfig::default()`), the depth budget of `slots="auto"`, and the Python
/// package's choices. The signature below uses them, and `gpipe.Producer`'s Python signature
/// shows them (through `_defaults()`); an argument not here has None (or False) for default.
struct Defaults {
    slots: u32,
    batch_bytes: u64,
    mode: String,
    /// CUDA when a GPU is usable, else host memory.
    backend: String,
    device: i32,
    max_consumers: u32,
    drain_timeout: f64,
    /// Timeline words (see `sync` in the constructor).
    sync: String,
    depth_budget: u64,
    /// Host memory (see `timeline_memory` in the constructor).
    timeline_memory: String,
}

impl Defaults {
    fn get() -> Self {
        let ring = ProducerConfig::default();
        Self {
            slots: ring.slots,
            batch_bytes: ring.batch_bytes,
            mode: ring.mode.to_string(),
            backend: "auto".into(),
            device: 0,
            max_consumers: ring.max_consumers,
            drain_timeout: ring.drain_timeout.as_secs_f64(),
            sync: "auto".into(),
            depth_budget: pipeline_cuda::probe::DEFAULT_DEPTH_BUDGET,
            timeline_memory: "host".into(),
        }
    }
}

#[pymethods]
impl PyProducer {
    #[new]
    #[pyo3(signature = (socket, *, slots=None, batch_bytes=Defaults::get().batch_bytes, mode=Defaults::get().mode, backend=Defaults::get().backend, device=Defaults::get().device, detach_after_ms=None, max_consumers=Defaults::get().max_consumers, drain_timeout=Defaults::get().drain_timeout, sync=Defaults::get().sync, max_lead=None, depth_budget=Defaults::get().depth_budget, timeline_memory=Defaults::get().timeline_memory, keep_dumpable=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        #[pyo3(from_py_with = args::socket)] socket: PathBuf,
        #[pyo3(from_py_with = args::slots)] slots: Option<args::OrAuto>,
        #[pyo3(from_py_with = args::batch_bytes)] batch_bytes: u64,
        #[pyo3(from_py_with = args::mode)] mode: String,
        #[pyo3(from_py_with = args::backend)] backend: String,
        #[pyo3(from_py_with = args::producer_device)] device: i32,
        #[pyo3(from_py_with = args::detach_after_ms)] detach_after_ms: Option<u64>,
        #[pyo3(from_py_with = args::max_consumers)] max_consumers: u32,
        #[pyo3(from_py_with = args::drain_timeout)] drain_timeout: f64,
        #[pyo3(from_py_with = args::sync)] sync: String,
        #[pyo3(from_py_with = args::max_lead)] max_lead: Option<args::OrAuto>,
        #[pyo3(from_py_with = args::depth_budget)] depth_budget: u64,
        #[pyo3(from_py_with = args::timeline_memory)] timeline_memory: String,
        keep_dumpable: bool,
    ) -> PyResult<Self> {
        let (mode, backend, sync, timeline_memory) = (
            mode.as_str(),
            backend.as_str(),
            sync.as_str(),
            timeline_memory.as_str(),
        );
        // None: the default; Some(None): "auto", resolved once the backend is known. The
        // ring's shape rule checks the range.
        let slots_arg: Option<u32> = match slots {
            None => Some(Defaults::get().slots),
            Some(args::OrAuto::Auto) => None,
            Some(args::OrAuto::Value(n)) => Some(n),
        };
        let mut slots = slots_arg.unwrap_or(Defaults::get().slots);
        // None: the ring's own bound; Some(None): "auto", resolved once the backend is known.
        let max_lead: Option<Option<u32>> = max_lead.map(|l| match l {
            args::OrAuto::Auto => None,
            args::OrAuto::Value(n) => Some(n),
        });
        let mode = parse_mode(mode)?;
        // `auto`: timeline words, which a consumer can release when the producer dies (an IPC
        // event recorded by a dead process may never complete).
        let sync = match sync {
            "auto" | "semaphore" => SyncMode::Semaphore,
            "events" => SyncMode::Events,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown sync {other:?}: use \"auto\", \"semaphore\" or \"events\""
                )));
            }
        };
        // Host memory by default: a dead peer's device words are released by a write on a
        // stream of ours, which must not share a hardware queue with a stream stalled on
        // them, and an application's own streams (PyTorch's pool) are beyond our control.
        // Device memory is faster (docs/benchmarks.md, "Timeline words in device memory").
        let words = match timeline_memory {
            "auto" => None,
            w => Some(
                w.parse::<TimelineMemory>()
                    .map_err(|e| PyValueError::new_err(format!("{e}; or \"auto\"")))?,
            ),
        };
        if !(drain_timeout.is_finite() && drain_timeout >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "drain_timeout must be a non-negative number of seconds, not {drain_timeout}"
            )));
        }
        if device < 0 {
            return Err(PyValueError::new_err(format!(
                "device must be a CUDA device index, 0 or more, not {device}"
            )));
        }
        let mut config = ProducerConfig {
            slots,
            batch_bytes,
            mode,
            max_consumers,
            wait: WaitPolicy {
                tick: TICK,
                ..WaitPolicy::default()
            },
            lag: match detach_after_ms {
                None => LagPolicy::Block,
                Some(ms) => LagPolicy::DetachAfter(Duration::from_millis(ms)),
            },
            drain_timeout: Duration::from_secs_f64(drain_timeout.min(3600.0)),
            max_lead: max_lead.flatten(),
            keep_dumpable,
            ..ProducerConfig::default()
        };
        // The one rule for a ring's shape (pipeline_core::limits), as the CLI checks it.
        pipeline_core::limits::check_shape(config.slots, config.batch_bytes, config.max_consumers)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let cuda = match backend {
            "host" => None,
            "cuda" => Some(
                cuda_options(device as usize, mode, sync, words)
                    .map_err(|e| crate::BackendError::new_err(format!("backend=\"cuda\": {e}")))?,
            ),
            "auto" => cuda_options(device as usize, mode, sync, words).ok(),
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown backend {other:?}: use \"auto\", \"cuda\" or \"host\""
                )));
            }
        };
        let mut slots_auto = None;
        if slots_arg.is_none() {
            let (n, why) = if cuda.is_none() {
                (8, "the host backend".to_string())
            } else if pipeline_cuda::probe::probe().is_ok_and(|r| r.mps_active()) {
                (8, "MPS is running".to_string())
            } else {
                (
                    pipeline_cuda::probe::rule_depth(false, batch_bytes, depth_budget),
                    format!(
                        "MPS is not running: the deepest ring within depth_budget ({} MiB)",
                        depth_budget >> 20
                    ),
                )
            };
            slots = n;
            config.slots = n;
            pipeline_core::limits::check_slots(n)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            slots_auto = Some(format!("{n} slots: {why}"));
        }
        if max_lead == Some(None) && cuda.is_some() {
            // auto on a GPU: as many batches as fit in its L2 (pipeline_cuda::probe::l2_max_lead).
            let (lead, _l2) =
                pipeline_cuda::probe::auto_max_lead(device as usize, batch_bytes, slots)
                    .map_err(|e| crate::BackendError::new_err(format!("max_lead=\"auto\": {e}")))?;
            config.max_lead = lead;
        }
        let resolved_lead = config.max_lead;
        let path = socket.clone();
        let (producer, dl) = match cuda {
            None => (
                AnyProducer::Host(
                    py.detach(|| {
                        Producer::<HostProducer>::bind(&path, config, HostOptions::default())
                    })
                    .map_err(to_py)?,
                ),
                DLDevice {
                    device_type: DEVICE_CPU,
                    device_id: 0,
                },
            ),
            Some(options) => (
                AnyProducer::Cuda(
                    py.detach(|| Producer::<CudaProducer>::bind(&path, config, options))
                        .map_err(to_py)?,
                ),
                DLDevice {
                    device_type: DEVICE_CUDA,
                    device_id: device,
                },
            ),
        };
        let layout = with_producer!(&producer, p => p.layout());
        let (kind, memory) = match &producer {
            AnyProducer::Host(_) => (BackendKind::Host, "host"),
            AnyProducer::Cuda(p) => (BackendKind::Cuda, p.backend().memory_path().as_str()),
        };
        Ok(Self {
            cell: Arc::new(ProducerCell {
                producer: Mutex::new(producer),
                open: AtomicU64::new(0),
            }),
            socket: socket.display().to_string(),
            backend: kind,
            memory,
            mode,
            slots: layout.slot_count,
            slot_bytes: layout.slot_bytes,
            device: dl,
            max_lead: resolved_lead,
            slots_auto,
        })
    }

    /// The defaults of the arguments that come from the library (see [`Defaults`]), by
    /// name: what `gpipe.Producer`'s signature shows.
    #[staticmethod]
    fn _defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        let d = Defaults::get();
        let out = PyDict::new(py);
        out.set_item("slots", d.slots)?;
        out.set_item("batch_bytes", d.batch_bytes)?;
        out.set_item("mode", d.mode)?;
        out.set_item("backend", d.backend)?;
        out.set_item("device", d.device)?;
        out.set_item("max_consumers", d.max_consumers)?;
        out.set_item("drain_timeout", d.drain_timeout)?;
        out.set_item("sync", d.sync)?;
        out.set_item("depth_budget", d.depth_budget)?;
        out.set_item("timeline_memory", d.timeline_memory)?;
        Ok(out)
    }

    /// Takes the next slot, once every consumer that had its previous batch released it. One
    /// slot at a time: publish it or leave its ``with`` block before acquiring another.
    ///
    /// ``timeout``: seconds to wait for the slot (None: as long as it takes); raises Timeout
    /// when it runs out (nothing is lost: call again), Closed after close().
    /// ``stream`` (CUDA): the stream your writes to the slot run on, ordered after the slot's
    /// previous consumers before this returns (a torch or CuPy stream or a handle; None:
    /// torch's current stream if torch has started CUDA, else the legacy default stream).
    /// Host rings ignore it.
    ///
    /// Use it as a context manager: leaving the block without ``publish()`` gives the slot
    /// back unpublished.
    #[pyo3(signature = (timeout=None, stream=None))]
    fn acquire(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::timeout)] timeout: Option<f64>,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<PySlot> {
        let still_open = |open: u64| {
            format!(
                "the slot for batch {} is still open: publish it or leave its with-block before acquiring another",
                open - 1
            )
        };
        let open = self.cell.open.load(Ordering::Acquire);
        if open != 0 {
            return Err(GpipeError::new_err(still_open(open)));
        }
        let deadline = deadline(timeout)?;
        let cell = &self.cell;
        let user_stream = match (&stream, self.backend) {
            (_, BackendKind::Host) => None,
            (Some(s), _) => Some(stream_handle(s)?),
            (None, _) => Some(current_stream(py, self.device.device_id)?),
        };
        let (loan, base, capacity) = blocking(py, deadline, |until| {
            let mut g = cell.producer.lock();
            // Checked again under the producer lock: two threads may acquire at once.
            let open = cell.open.load(Ordering::Acquire);
            if open != 0 {
                return Err(Error::InvalidArgument(still_open(open)));
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            match &mut *g {
                AnyProducer::Host(p) => {
                    if p.is_closed() {
                        return Err(Error::Closed);
                    }
                    let mut s = p.acquire_timeout(left)?;
                    let base = s.memory().as_mut_ptr() as usize;
                    let capacity = s.capacity();
                    Ok((s.into_loan(), base, capacity))
                }
                AnyProducer::Cuda(p) => {
                    if p.is_closed() {
                        return Err(Error::Closed);
                    }
                    let mut s = p.acquire_timeout(left)?;
                    let base = s.memory().ptr as usize;
                    let capacity = s.capacity();
                    if let Some(h) = user_stream {
                        // SAFETY: `h` is the caller's stream handle (or 1/2).
                        unsafe { s.backend().order_after(h as usize as CUstream) }
                            .map_err(|e| Error::Backend(Box::new(e)))?;
                    }
                    Ok((s.into_loan(), base, capacity))
                }
            }
            .inspect(|(loan, _, _): &(SlotLoan, usize, u64)| {
                cell.open.store(loan.seq() + 1, Ordering::Release)
            })
        })?;
        Ok(PySlot {
            streams: Arc::new(SlotStreams {
                cell: self.cell.clone(),
                streams: Mutex::new(user_stream.into_iter().collect()),
            }),
            cell: self.cell.clone(),
            loan,
            base,
            capacity,
            device: self.device,
            state: Mutex::new(SlotState {
                plan: TensorPlan::new(),
                done: None,
            }),
        })
    }

    /// Waits until at least ``n`` consumers are attached, up to ``timeout`` seconds (None: as
    /// long as it takes; then Timeout). Ctrl-C interrupts it.
    #[pyo3(signature = (n=1, timeout=None))]
    fn wait_for_consumers(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::consumers_n)] n: u32,
        #[pyo3(from_py_with = args::timeout)] timeout: Option<f64>,
    ) -> PyResult<()> {
        let deadline = deadline(timeout)?;
        let cell = &self.cell;
        blocking(py, deadline, |until| {
            let g = cell.producer.lock();
            let left = until.saturating_duration_since(std::time::Instant::now());
            with_producer!(&*g, p => p.wait_for_consumers(n, left))
        })
    }

    /// Waits until every published batch was released by every consumer that got it, up to
    /// ``timeout`` seconds (None: as long as it takes; then Timeout).
    #[pyo3(signature = (timeout=None))]
    fn flush(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::timeout)] timeout: Option<f64>,
    ) -> PyResult<()> {
        let deadline = deadline(timeout)?;
        let cell = &self.cell;
        blocking(py, deadline, |until| {
            let mut g = cell.producer.lock();
            let left = until.saturating_duration_since(std::time::Instant::now());
            with_producer!(&mut *g, p => p.flush(left))
        })
    }

    /// Closes the ring cleanly: consumers receive everything published, then `Closed`.
    /// Waits up to `drain_timeout` for them to finish. Returns the run's counters.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cell = &self.cell;
        let stats = py.detach(|| with_producer!(&mut *cell.producer.lock(), p => p.shutdown()));
        let d = PyDict::new(py);
        d.set_item("published", stats.published)?;
        d.set_item("attached", stats.attached)?;
        d.set_item("left", stats.left)?;
        d.set_item("died", stats.died)?;
        d.set_item("detached", stats.detached)?;
        d.set_item("refused", stats.refused)?;
        d.set_item("requeued", stats.requeued)?;
        Ok(d)
    }

    /// The producer-lead bound in batches (None: the ring's own, slots); "auto" resolved.
    #[getter]
    fn max_lead(&self) -> Option<u32> {
        self.max_lead
    }

    /// With slots="auto": the depth chosen and why (None otherwise).
    #[getter]
    fn slots_auto(&self) -> Option<String> {
        self.slots_auto.clone()
    }

    /// True after close().
    #[getter]
    fn closed(&self) -> bool {
        with_producer!(&*self.cell.producer.lock(), p => p.is_closed())
    }

    /// Consumers attached now.
    #[getter]
    fn consumers(&self) -> u32 {
        with_producer!(&*self.cell.producer.lock(), p => p.consumers())
    }

    /// Sequence number of the next batch.
    #[getter]
    fn next_seq(&self) -> u64 {
        with_producer!(&*self.cell.producer.lock(), p => p.next_seq())
    }

    /// The socket path consumers attach to.
    #[getter]
    fn socket(&self) -> &str {
        &self.socket
    }

    /// "host" or "cuda".
    #[getter]
    fn backend(&self) -> String {
        self.backend.to_string()
    }

    /// Where the slots live: "host", or the CUDA memory path ("pool", "vmm", "legacy").
    #[getter]
    fn memory(&self) -> &'static str {
        self.memory
    }

    /// The device: "cpu" or "cuda:N".
    #[getter]
    fn device(&self) -> String {
        self.device.name()
    }

    /// "broadcast" or "shared".
    #[getter]
    fn mode(&self) -> String {
        self.mode.to_string()
    }

    /// Slots in the ring.
    #[getter]
    fn slots(&self) -> u32 {
        self.slots
    }

    /// Capacity of each slot in bytes (batch_bytes rounded up to 2 MiB).
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "gpipe.Producer(socket={:?}, mode={}, backend={}, device={}, memory={}, slots={}, slot_bytes={}, consumers={}, next_seq={}, {})",
            self.socket,
            self.mode,
            self.backend,
            self.device(),
            self.memory,
            self.slots,
            self.slot_bytes,
            self.consumers(),
            self.next_seq(),
            if self.closed() { "closed" } else { "open" }
        )
    }
}

struct SlotState {
    plan: TensorPlan,
    /// Published (Some(true)) or given back (Some(false)).
    done: Option<bool>,
}

/// The streams a slot's tensors were made for (CUDA): each waits for the slot's previous
/// consumers, and `publish` orders `ready` after all of them.
struct SlotStreams {
    cell: Arc<ProducerCell>,
    streams: Mutex<Vec<u64>>,
}

impl SlotStreams {
    /// Orders `ready` for batch `seq` in `slot` after the work on every stream used on the
    /// slot: with one stream (the usual case) `ready` is signalled on it directly; with
    /// several, the producer's stream waits for each and the publish signals there.
    fn order_ready(&self, backend: &CudaProducer, slot: u32, seq: u64) -> Result<(), Error> {
        let streams = self.streams.lock();
        let be = |e| Error::Backend(Box::new(e));
        match streams.as_slice() {
            [] => {}
            // SAFETY: a stream handle the caller gave for this slot (or 1/2), alive while the
            // slot is open.
            [s] => unsafe { backend.signal_ready_on(*s as usize as CUstream, slot, seq) }
                .map_err(be)?,
            many => {
                for &s in many {
                    // SAFETY: as above.
                    unsafe { backend.join(s as usize as CUstream) }.map_err(be)?;
                }
            }
        }
        Ok(())
    }
}

impl Drop for ProducerCell {
    fn drop(&mut self) {
        // The application's streams may still be writing slots: wait for them before the
        // slots are freed with the producer.
        if let AnyProducer::Cuda(p) = self.producer.get_mut() {
            if let Err(e) = p.backend().synchronize_all() {
                eprintln!("gpipe: synchronising before freeing the CUDA ring failed: {e}");
            }
        }
    }
}

impl StreamUse for SlotStreams {
    fn use_on(&self, stream: u64) -> Result<(), String> {
        if self.streams.lock().contains(&stream) {
            return Ok(());
        }
        // The producer lock is taken before the streams lock, as in publish.
        if let AnyProducer::Cuda(p) = &*self.cell.producer.lock() {
            // SAFETY: the handle a DLPack consumer named for this slot's tensor (or 1/2).
            unsafe { p.backend().order_after(stream as usize as CUstream) }
                .map_err(|e| e.to_string())?;
        }
        let mut streams = self.streams.lock();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        Ok(())
    }
}

/// A slot the producer acquired: declare tensors with ``tensor()``, write them, then
/// ``publish()``. Use it as a context manager: leaving the block without ``publish()`` gives
/// the slot back unpublished (``abandon()``), and the next ``acquire()`` returns it again.
#[pyclass(frozen, module = "gpipe", name = "Slot")]
pub struct PySlot {
    streams: Arc<SlotStreams>,
    cell: Arc<ProducerCell>,
    loan: SlotLoan,
    base: usize,
    capacity: u64,
    device: DLDevice,
    state: Mutex<SlotState>,
}

impl PySlot {
    fn finish(&self, st: &mut SlotState, published: bool) {
        st.done = Some(published);
        let _ = self.cell.open.compare_exchange(
            self.loan.seq() + 1,
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    fn check_open(&self, st: &SlotState) -> PyResult<()> {
        match st.done {
            None => Ok(()),
            Some(true) => Err(GpipeError::new_err(format!(
                "the slot of batch {} was published; acquire a new one",
                self.loan.seq()
            ))),
            Some(false) => Err(GpipeError::new_err(format!(
                "the slot of batch {} was given back unpublished; acquire a new one",
                self.loan.seq()
            ))),
        }
    }

    fn writable(&self, t: &pipeline_core::TensorInfo) -> PyTensor {
        PyTensor {
            keep: self.cell.clone(),
            data: self.base + t.offset as usize,
            info: *t,
            device: self.device,
            readonly: false,
            copied: false,
            origin: format!("slot {} of batch {}", self.loan.index(), self.loan.seq()),
            streams: if self.device.device_type == DEVICE_CPU {
                None
            } else {
                Some(self.streams.clone())
            },
        }
    }
}

impl Drop for PySlot {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        if st.done.is_none() {
            st.done = Some(false);
            let _ = self.cell.open.compare_exchange(
                self.loan.seq() + 1,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }
}

#[pymethods]
impl PySlot {
    /// Declares a tensor in this slot, or returns the one declared under ``name`` before, and
    /// gives a writable view of it: a ``torch.Tensor`` when ``dtype`` is a torch dtype (made
    /// as ``torch.from_dlpack`` would, for torch's current stream), else a ``gpipe.Tensor``,
    /// which any DLPack library takes (``numpy.from_dlpack``, ``cupy.from_dlpack``).
    ///
    /// ``name``: the tensor's name, 1 to 32 bytes. ``dtype``: a name (``"float32"``), a NumPy
    /// dtype or scalar type, or a torch dtype; None to get a tensor declared before.
    /// ``shape``: its dimensions (None: a tensor declared before). ``strides``: in elements
    /// (None: row-major); a channels_last layout stays channels_last.
    ///
    /// Tensors are placed in declaration order, each at the previous one's end rounded up to
    /// 256 bytes, so the same declaration in the same slot always has the same address.
    /// Raises ValueError if the tensor does not fit the slot.
    #[pyo3(signature = (name, dtype=None, shape=None, strides=None))]
    fn tensor<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::tensor_name)] name: String,
        dtype: Option<Bound<'py, PyAny>>,
        #[pyo3(from_py_with = args::shape)] shape: Option<Vec<i64>>,
        #[pyo3(from_py_with = args::strides)] strides: Option<Vec<i64>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let name = name.as_str();
        let t = {
            let mut st = self.state.lock();
            self.check_open(&st)?;
            let to_u64 = |v: Vec<i64>, what: &str| -> PyResult<Vec<u64>> {
                v.into_iter()
                    .map(|x| {
                        u64::try_from(x).map_err(|_| {
                            PyValueError::new_err(format!(
                                "tensor {name:?}: negative {what} ({x}) are not supported"
                            ))
                        })
                    })
                    .collect()
            };
            let shape = shape.map(|s| to_u64(s, "dimensions")).transpose()?;
            let strides = strides.map(|s| to_u64(s, "strides")).transpose()?;
            let parsed = dtype.as_ref().map(parse_dtype).transpose()?;
            if let Some(t) = st.plan.get(name) {
                let same = parsed.is_none_or(|d| d == t.dtype)
                    && shape.as_deref().is_none_or(|s| s == t.shape())
                    && strides.as_deref().is_none_or(|s| s == t.strides());
                if !same {
                    return Err(PyValueError::new_err(format!(
                        "tensor {name:?} is already declared in this slot as {} {:?}",
                        t.dtype,
                        t.shape()
                    )));
                }
                *t
            } else {
                let (Some(parsed), Some(shape)) = (parsed, shape) else {
                    return Err(PyValueError::new_err(format!(
                        "tensor {name:?} is not declared yet: give its dtype and shape"
                    )));
                };
                *st.plan
                    .push(name, parsed, &shape, strides.as_deref(), self.capacity)
                    .map_err(PyValueError::new_err)?
            }
        };
        // The slot's state is unlocked: making a torch tensor orders a stream (StreamUse),
        // which takes the producer's lock.
        let view = Bound::new(py, self.writable(&t))?.into_any();
        match &dtype {
            Some(d) if is_torch_dtype(d) => torch_tensor(&view),
            _ => Ok(view),
        }
    }

    /// Writes the test pattern of ``gpipe produce`` (batch ``seq``'s words) over the first
    /// ``nbytes`` bytes of a host slot and returns the header that ``gpipe consume --verify``
    /// checks; publish with ``publish(meta=header, nbytes=nbytes)``.
    fn fill_pattern(
        &self,
        #[pyo3(from_py_with = args::pattern_nbytes)] nbytes: u64,
    ) -> PyResult<[u64; USER_HEADER_WORDS]> {
        let st = self.state.lock();
        self.check_open(&st)?;
        if nbytes > self.capacity {
            return Err(PyValueError::new_err(format!(
                "{nbytes} bytes exceed the slot capacity of {}",
                self.capacity
            )));
        }
        if !st.plan.is_empty() {
            return Err(PyValueError::new_err(
                "fill_pattern writes raw bytes; this slot already has tensors declared",
            ));
        }
        if self.device.device_type != DEVICE_CPU {
            return Err(crate::BackendError::new_err(
                "fill_pattern writes host slots; a CUDA ring's pattern batches come from `gpipe produce`",
            ));
        }
        // SAFETY: the slot is ours until published or given back (the loan is open and only
        // one slot is out at a time), its memory spans `capacity` bytes from `base` and is
        // kept mapped by `cell`; no Rust reference to it exists elsewhere.
        let mem = unsafe { std::slice::from_raw_parts_mut(self.base as *mut u8, nbytes as usize) };
        let sum = pattern::fill(mem, self.loan.seq());
        let mut h = [0u64; USER_HEADER_WORDS];
        h[pattern::HEADER_CHECKSUM] = sum;
        h[pattern::HEADER_SEQ] = self.loan.seq();
        Ok(h)
    }

    /// Publishes the batch and returns its sequence number. Do not write the slot's tensors
    /// afterwards: consumers are reading them.
    ///
    /// ``meta``: the batch's user header, up to 8 ints from 0 to 2**64 - 1 (``batch.meta`` on
    /// the consumer side; missing words are 0). ``nbytes``: the batch's length in bytes when
    /// no tensors were declared (a raw batch, read as one uint8 tensor ``data``); None: the
    /// declared tensors' extent. ``stream`` (CUDA): ``ready`` is signalled after the work
    /// enqueued by now on this stream (a torch or CuPy stream or a handle; None: torch's
    /// current stream if torch has started CUDA, else the legacy default stream) and on every
    /// stream the slot's tensors were made for. Host rings ignore it.
    #[pyo3(signature = (meta=None, nbytes=None, stream=None))]
    fn publish(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::meta)] meta: Option<Vec<u64>>,
        #[pyo3(from_py_with = args::publish_nbytes)] nbytes: Option<u64>,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        if self.device.device_type != DEVICE_CPU {
            let h = match &stream {
                Some(s) => stream_handle(s)?,
                None => current_stream(py, self.device.device_id)?,
            };
            let mut streams = self.streams.streams.lock();
            if !streams.contains(&h) {
                streams.push(h);
            }
        }
        let mut st = self.state.lock();
        self.check_open(&st)?;
        let mut header = [0u64; USER_HEADER_WORDS];
        if let Some(m) = meta {
            if m.len() > USER_HEADER_WORDS {
                return Err(PyValueError::new_err(format!(
                    "meta has {} words; a batch carries at most {USER_HEADER_WORDS}",
                    m.len()
                )));
            }
            header[..m.len()].copy_from_slice(&m);
        }
        let len = match nbytes {
            Some(n) if n < st.plan.len() => {
                return Err(PyValueError::new_err(format!(
                    "nbytes={n} is shorter than the declared tensors ({} bytes)",
                    st.plan.len()
                )));
            }
            Some(n) => n,
            None if st.plan.is_empty() => {
                return Err(PyValueError::new_err(
                    "nothing to publish: declare tensors with slot.tensor(...) or pass nbytes=",
                ));
            }
            None => st.plan.len(),
        };
        let loan = self.loan;
        let cell = &self.cell;
        let tensors = st.plan.tensors();
        let streams = &self.streams;
        // Not detached from the GIL: `st` is locked, and a thread that blocks on it while
        // holding the GIL would deadlock with us. Publishing never waits.
        let publish = || match &mut *cell.producer.lock() {
            AnyProducer::Host(p) => p.resume(loan)?.publish_with(len, &header, tensors),
            AnyProducer::Cuda(p) => {
                let slot = p.resume(loan)?;
                if len > slot.capacity() {
                    return Err(Error::InvalidArgument(format!(
                        "batch of {len} bytes exceeds the slot capacity {}",
                        slot.capacity()
                    )));
                }
                streams.order_ready(slot.backend(), loan.index(), loan.seq())?;
                let published = slot.publish_with(len, &header, tensors);
                if published.is_err() {
                    p.backend().forget_presignal(loan.index());
                }
                published
            }
        };
        let seq = publish().map_err(|e| match e {
            Error::Closed => Closed::new_err("the producer is closed"),
            e => to_py(e),
        })?;
        self.finish(&mut st, true);
        Ok(seq)
    }

    /// Gives the slot back unpublished (the next acquire returns it again).
    fn abandon(&self) {
        let mut st = self.state.lock();
        if st.done.is_none() {
            self.finish(&mut st, false);
        }
    }

    /// The sequence number this batch will have.
    #[getter]
    fn seq(&self) -> u64 {
        self.loan.seq()
    }

    /// The slot index.
    #[getter]
    fn index(&self) -> u32 {
        self.loan.index()
    }

    /// Capacity in bytes.
    #[getter]
    fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Names of the tensors declared so far.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.state
            .lock()
            .plan
            .tensors()
            .iter()
            .map(|t| t.name.to_string())
            .collect()
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.abandon();
        false
    }

    fn __repr__(&self) -> String {
        let st = self.state.lock();
        let state = match st.done {
            None => "open",
            Some(true) => "published",
            Some(false) => "given back",
        };
        let names: Vec<&str> = st.plan.tensors().iter().map(|t| t.name.as_str()).collect();
        format!(
            "gpipe.Slot(seq={}, index={}, capacity={}, tensors={names:?}, {state})",
            self.loan.seq(),
            self.loan.index(),
            self.capacity
        )
    }
}
