//! `gpipe.Producer`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use pipeline_core::{
    BackendKind, Error, HostOptions, HostProducer, LagPolicy, Mode, Producer, ProducerConfig,
    SlotLoan, TensorPlan, WaitPolicy,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use pipeline_cuda::backend::CudaProducer;
use pipeline_cuda::driver::CUstream;
use pipeline_cuda::ordering::OrderWrites;

use crate::args;
use crate::blocking::{TICK, blocking, deadline};
use crate::dlpack::{DEVICE_CPU, DEVICE_CUDA, DLDevice};
use crate::errors::{GpipeError, to_py};
use crate::interop::{current_stream, stream_handle};
use crate::producer_cell::{AnyProducer, ProducerCell, with_producer};
use crate::ring::RingInfo;
use crate::slot::{PySlot, SlotState, SlotStreams};

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
    /// The ring's socket, backend, mode, slots, slot size and device.
    ring: RingInfo,
    memory: &'static str,
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
            depth_budget: pipeline_cuda::policy::depth::DEFAULT_DEPTH_BUDGET,
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
        let mode = parse_mode(mode)?;
        // Every `auto` (slots, max_lead, backend, memory, sync, timeline_memory) is resolved
        // by the policy the CLI shares (crate::policy). Python's default timeline memory is
        // host (Defaults): a dead peer's device words are released by a write on a stream of
        // ours, which must not share a hardware queue with a stream stalled on them, and an
        // application's own streams (PyTorch's pool) are beyond our control. Device memory is
        // faster (docs/benchmarks.md, "Timeline words in device memory").
        let inputs = crate::policy::inputs(&crate::policy::Asked {
            backend,
            device,
            mode,
            batch_bytes,
            slots,
            default_slots: Defaults::get().slots,
            depth_budget,
            max_lead,
            sync,
            timeline_memory,
            side_signals: None,
        })?;
        // The ring's shape rule checks the range (before probing anything).
        let slots = inputs.slots.unwrap_or(Defaults::get().slots);
        if !(drain_timeout.is_finite() && drain_timeout >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "drain_timeout must be a non-negative number of seconds, not {drain_timeout}"
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
            max_lead: None,
            keep_dumpable,
            ..ProducerConfig::default()
        };
        // The one rule for a ring's shape (pipeline_core::limits), as the CLI checks it.
        pipeline_core::limits::check_shape(config.slots, config.batch_bytes, config.max_consumers)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let resolution = py.detach(|| crate::policy::resolve(&inputs, None))?;
        let cuda = resolution.cuda_options();
        let mut slots_auto = None;
        if resolution.slots.auto {
            let n = resolution.slots.value;
            config.slots = n;
            pipeline_core::limits::check_slots(n)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            slots_auto = Some(format!("{n} slots: {}", resolution.slots.reason));
        }
        config.max_lead = resolution.max_lead.value;
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
            ring: RingInfo {
                socket: socket.display().to_string(),
                backend: kind,
                mode,
                slots: layout.slot_count,
                slot_bytes: layout.slot_bytes,
                device: dl,
            },
            memory,
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
        let user_stream = match (&stream, self.ring.backend) {
            (_, BackendKind::Host) => None,
            (Some(s), _) => Some(stream_handle(s)?),
            (None, _) => Some(current_stream(py, self.ring.device.device_id)?),
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
                        unsafe { s.order_writes_on(h as usize as CUstream) }?;
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
            device: self.ring.device,
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
        self.ring.socket()
    }

    /// "host" or "cuda".
    #[getter]
    fn backend(&self) -> String {
        self.ring.backend()
    }

    /// Where the slots live: "host", or the CUDA memory path ("pool", "vmm", "legacy").
    #[getter]
    fn memory(&self) -> &'static str {
        self.memory
    }

    /// The device: "cpu" or "cuda:N".
    #[getter]
    fn device(&self) -> String {
        self.ring.device()
    }

    /// "broadcast" or "shared".
    #[getter]
    fn mode(&self) -> String {
        self.ring.mode()
    }

    /// Slots in the ring.
    #[getter]
    fn slots(&self) -> u32 {
        self.ring.slots
    }

    /// Capacity of each slot in bytes (batch_bytes rounded up to 2 MiB).
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.ring.slot_bytes
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
            self.ring.socket,
            self.ring.mode,
            self.ring.backend,
            self.device(),
            self.memory,
            self.ring.slots,
            self.ring.slot_bytes,
            self.consumers(),
            self.next_seq(),
            if self.closed() { "closed" } else { "open" }
        )
    }
}
