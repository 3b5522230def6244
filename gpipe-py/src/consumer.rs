//! `gpipe.Consumer` and `gpipe.Batch`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pipeline_core::{
    BackendKind, Consumer, ConsumerBackend, ConsumerConfig, Delivery, Error, HostConsumer,
    HostOptions, OnMap, PendingAttach, WaitPolicy,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pipeline_cuda::backend::{CudaConsumer, CudaOptions};

use crate::args;
use crate::batch::{AnyBatch, BatchCell, PyBatch, forked_child};
use crate::blocking::{TICK, blocking, deadline};
use crate::dlpack::{DEVICE_CPU, DEVICE_CUDA, DLDevice};
use crate::errors::{AttachError, Closed, PinError, attach_error, to_py};
use crate::pin::{self, PinMode};
use crate::ring::RingInfo;

/// A consumer on one of the backends.
enum AnyConsumer {
    Host(Consumer<HostConsumer>),
    Cuda(Consumer<CudaConsumer>),
}

/// A device argument: None, an ordinal, "cpu", "cuda", "cuda:N" or a torch.device.
/// `Some(None)`: CUDA, any device; `Some(Some(n))`: CUDA device n; `None`: host or unset.
fn parse_device(device: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Option<usize>>> {
    let Some(d) = device else { return Ok(None) };
    if d.is_none() {
        return Ok(None);
    }
    if let Ok(n) = d.extract::<i64>() {
        return usize::try_from(n)
            .map(|n| Some(Some(n)))
            .map_err(|_| PyValueError::new_err(format!("invalid device {n}")));
    }
    let s = d.str()?.to_string();
    match s.as_str() {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(None)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(|n| Some(Some(n)))
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "invalid device {s:?}: use None, \"cpu\", \"cuda\", \"cuda:N\" or an int"
                ))
            }),
    }
}

thread_local! {
    /// The exception a signal handler raised while an attach waited ([`signal_arrived`]).
    static SIGNAL_ERROR: std::cell::RefCell<Option<PyErr>> = const { std::cell::RefCell::new(None) };
}

/// The core's interruption check during an attach: runs Python's signal handlers (taking
/// the GIL back for the moment); an exception they raise (KeyboardInterrupt on Ctrl-C) ends
/// the attach and is raised by [`attach_failed`].
fn signal_arrived() -> bool {
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            SIGNAL_ERROR.with(|s| *s.borrow_mut() = Some(e));
            true
        }
    })
}

/// An attach failed: the exception a signal handler raised meanwhile, if any (Ctrl-C is
/// KeyboardInterrupt, not an attach error), else the attach error.
fn attach_failed(e: Error) -> PyErr {
    let refused = pin::take_refusal().is_some();
    SIGNAL_ERROR
        .with(|s| s.borrow_mut().take())
        .unwrap_or_else(|| {
            if refused {
                PinError::new_err(e.to_string())
            } else {
                attach_error(e)
            }
        })
}

/// The consuming side of a ring: attaches to the producer listening on ``socket`` and
/// receives its batches in place, with ``recv()`` or by iterating (until the producer closes
/// the ring). Several batches may be held at once and released in any order. Use it as a
/// context manager: leaving the block detaches (``close()``).
///
/// ``socket``: the producer's socket path. ``device``: None (or ``"cpu"``) for a ring in host
/// memory; on a CUDA ring None means the producer's GPU, and ``"cuda:N"`` (or ``N``, or a
/// torch.device) consumes on GPU N, reading the slots in place by peer access or mirroring
/// them (see ``delivery``). ``timeout``: seconds the whole attach may take (connecting, the
/// producer's answers, mapping the ring); past it the attach raises Timeout. It bounds the
/// attach only: ``recv()`` has its own. ``spin``:
/// seconds ``recv()`` busy-waits for a batch before it sleeps, 0 to 1 (None: 100 µs). A
/// sleeping consumer is woken by the producer's publish, which costs a wake-up (tens to
/// hundreds of µs on a VM); a latency-critical consumer that receives a batch every few
/// milliseconds can spin that long instead, at the cost of a CPU core while it waits.
/// ``delivery``: ``"in-place"`` (batches are the producer's slots), ``"mirror"`` (a copy in
/// this consumer's own memory; the producer's slot is released as soon as it is made) or
/// ``"auto"`` (in place on the producer's GPU, mirrored on another; host rings: in place).
/// ``mirror_buffers``: the most batches a mirroring consumer holds at once (None: the ring's
/// slot count); it raises Deadlock when it asks for more. ``side_signals`` (CUDA, in place):
/// True waits for the producer's ``ready`` and writes ``finished`` on streams of the
/// consumer's own, joined to your streams by in-process events, so your stream carries no
/// cross-process signal between its kernels; False keeps both on your stream; None takes side
/// streams for slots of 16 MiB and more. With them on under MPS and
/// CUDA_DEVICE_MAX_CONNECTIONS unset or below 8, it warns (RuntimeWarning) saying what to set.
/// ``allow_producer_uids``: user ids besides this process's own whose producers it attaches
/// to (None: only its own). The producer is known by the uid listening on the socket, not by
/// the socket's path, which anyone able to create a file there could have made.
/// ``pin_memory`` (host rings): page-locks the memory the batches are read from with the
/// CUDA driver, for as long as it is mapped, so that ``tensor.to("cuda", non_blocking=True)``
/// from a batch is a DMA that returns at once, as from torch's pinned memory, with no copy
/// into pinned memory first. That copy reads the slot after the call returns: keep the batch
/// until it has run (its stream synchronised, or an event waited for), since the slot goes
/// back to the producer once the batch's tensors are gone. The lock is made once the
/// attach's handshake is over: ``timeout`` does not bound it. Where the driver refuses it,
/// ``True`` raises PinError (the consumer had joined the ring and leaves it, so a batch the
/// producer published meanwhile is not delivered to a later attach); ``"try"`` reads the
/// ring unlocked instead, missing nothing, with ``pinned`` False and ``pin_refused`` saying
/// why.
///
/// Wrong arguments raise TypeError (a wrong type) or ValueError (a value out of range),
/// naming the argument.
#[pyclass(frozen, module = "gpipe", name = "Consumer")]
pub struct PyConsumer {
    inner: Mutex<Option<AnyConsumer>>,
    /// The process that attached (see [`forked_child`]).
    attached_in: u32,
    /// The ring's socket, backend, mode, slots, slot size, and the device batches are on.
    ring: RingInfo,
    index: u32,
    /// Batches arrive as copies in the consumer's own memory (mirror delivery).
    mirrored: bool,
    /// CUDA: `ready` waited for and `finished` written on side streams of ours.
    side_signals: bool,
    /// Host: the batches are page-locked for copies to a GPU (`pin_memory`).
    pinned: bool,
    /// `pin_memory="try"` where the lock was refused: why (the batches are read unlocked).
    pin_refused: Option<String>,
}

#[pymethods]
impl PyConsumer {
    #[new]
    #[pyo3(signature = (socket, *, device=None, timeout=5.0, spin=None, delivery="auto", mirror_buffers=None, side_signals=None, allow_producer_uids=None, pin_memory=PinMode::Off))]
    // As `signature`, with pin_memory's default as Python writes it (pyo3 writes a default
    // that is not a literal as "...").
    #[pyo3(
        text_signature = "(socket, *, device=None, timeout=5.0, spin=None, delivery='auto', mirror_buffers=None, side_signals=None, allow_producer_uids=None, pin_memory=False)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        #[pyo3(from_py_with = args::socket)] socket: PathBuf,
        device: Option<Bound<'_, PyAny>>,
        #[pyo3(from_py_with = args::attach_timeout)] timeout: f64,
        #[pyo3(from_py_with = args::spin)] spin: Option<f64>,
        delivery: &str,
        #[pyo3(from_py_with = args::mirror_buffers)] mirror_buffers: Option<u32>,
        side_signals: Option<bool>,
        allow_producer_uids: Option<Vec<u32>>,
        #[pyo3(from_py_with = args::pin_memory)] pin_memory: PinMode,
    ) -> PyResult<Self> {
        let delivery: Delivery = delivery.parse().map_err(PyValueError::new_err)?;
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(PyValueError::new_err(format!(
                "timeout must be a positive number of seconds, not {timeout}"
            )));
        }
        let default_wait = WaitPolicy {
            tick: TICK,
            ..WaitPolicy::default()
        };
        let spin = match spin {
            None => default_wait.spin,
            Some(s) if s.is_finite() && (0.0..=1.0).contains(&s) => Duration::from_secs_f64(s),
            Some(s) => {
                return Err(PyValueError::new_err(format!(
                    "spin must be between 0 and 1 second, not {s}"
                )));
            }
        };
        let cpu_given = device
            .as_ref()
            .is_some_and(|d| d.str().is_ok_and(|s| s == "cpu"));
        let device = parse_device(device.as_ref())?;
        let config = ConsumerConfig {
            handshake_timeout: Duration::from_secs_f64(timeout.min(3600.0)),
            wait: WaitPolicy {
                spin,
                ..default_wait
            },
            allowed_producer_uids: allow_producer_uids.unwrap_or_default(),
            // Ctrl-C during the attach raises KeyboardInterrupt (within about 20 ms).
            interrupted: Some(signal_arrived),
        };
        let path = socket.clone();
        let pending = py
            .detach(|| PendingAttach::connect(&path, config))
            .map_err(attach_failed)?;
        let layout = pending.layout();
        let mut pinned = false;
        let mut pin_refused = None;
        let (inner, dl) = match pending.backend() {
            BackendKind::Host => {
                if let Some(d) = device {
                    let d = d.map_or("cuda".to_string(), |n| format!("cuda:{n}"));
                    return Err(PyValueError::new_err(format!(
                        "device {d} given, but the producer's ring at {} is in host memory; leave device out (or pass \"cpu\")",
                        socket.display()
                    )));
                }
                let no_driver = "no CUDA driver (libcuda.so.1) can be loaded here";
                let mut pin_memory = pin_memory;
                if pin_memory != PinMode::Off && !pipeline_cuda::driver::driver_present() {
                    if pin_memory == PinMode::On {
                        return Err(PinError::new_err(format!(
                            "pin_memory=True page-locks the batches for copies to a GPU, but {no_driver}; leave pin_memory out, or pass pin_memory=\"try\""
                        )));
                    }
                    pin_refused = Some(format!("pin_memory: {no_driver}"));
                    pin_memory = PinMode::Off;
                }
                let on_map: Option<OnMap> = match pin_memory {
                    PinMode::Off => None,
                    PinMode::On => Some(pin::page_lock),
                    PinMode::Try => Some(pin::page_lock_or_not),
                };
                // what an earlier attach on this thread may have left
                let _ = pin::take_refusal();
                let c = py
                    .detach(|| {
                        pending.finish::<HostConsumer>(HostOptions {
                            delivery,
                            mirror_buffers,
                            on_map,
                        })
                    })
                    .map_err(attach_failed)?;
                // "try" refused: read unlocked, and say why
                pin_refused = pin_refused.or(pin::take_refusal());
                pinned = pin_memory != PinMode::Off && pin_refused.is_none();
                (
                    AnyConsumer::Host(c),
                    DLDevice {
                        device_type: DEVICE_CPU,
                        device_id: 0,
                    },
                )
            }
            BackendKind::Cuda => {
                if pin_memory != PinMode::Off {
                    return Err(PyValueError::new_err(format!(
                        "pin_memory page-locks batches in host memory, but the producer's ring at {} is in CUDA memory (its batches are on the GPU already); leave pin_memory out",
                        socket.display()
                    )));
                }
                if cpu_given {
                    return Err(PyValueError::new_err(format!(
                        "device \"cpu\" given, but the producer's ring at {} is in CUDA memory",
                        socket.display()
                    )));
                }
                if !pipeline_cuda::driver::driver_present() {
                    return Err(AttachError::new_err(format!(
                        "the producer's ring at {} is in CUDA memory, but no CUDA driver (libcuda.so.1) can be loaded here",
                        socket.display()
                    )));
                }
                let c = py
                    .detach(|| {
                        pending.finish::<CudaConsumer>(CudaOptions {
                            // Each stream a tensor is made for waits `ready` itself.
                            defer_ready: true,
                            // Another GPU than the producer's reads the slots in place by
                            // peer access (the attach fails, naming both, where it cannot).
                            device: device.flatten(),
                            // Auto: in place on the producer's GPU, mirrored on another.
                            delivery,
                            mirror_buffers,
                            side_signals,
                            ..CudaOptions::default()
                        })
                    })
                    .map_err(attach_failed)?;
                let ordinal = c.backend().device_ordinal();
                // A dead producer must never leave a GPU stream of ours waiting on its
                // `ready` signal: release such waits as soon as it dies.
                c.watch_producer(TICK).map_err(to_py)?;
                (
                    AnyConsumer::Cuda(c),
                    DLDevice {
                        device_type: DEVICE_CUDA,
                        device_id: ordinal as i32,
                    },
                )
            }
        };
        let index = match &inner {
            AnyConsumer::Host(c) => c.index(),
            AnyConsumer::Cuda(c) => c.index(),
        };
        let mirrored = match &inner {
            AnyConsumer::Host(c) => c.backend().placement().mirror,
            AnyConsumer::Cuda(c) => c.backend().placement().mirror,
        };
        let side_signals = match &inner {
            AnyConsumer::Host(_) => false,
            AnyConsumer::Cuda(c) => c.backend().side_signals(),
        };
        if side_signals && pipeline_cuda::probe::mps_control_pipe().is_some() {
            // Under MPS, side streams without hardware queues of their own gain little
            // (docs/benchmarks.md); the queues are fixed when CUDA starts in this process, so
            // all we can do now is say what to set before it does.
            if let Err(why) = pipeline_cuda::policy::signals::side_signals_connections() {
                let msg = format!(
                    "gpipe: side signals are on (slots of {} bytes) and MPS is running, but {why} \
                     (before CUDA starts in this process, e.g. at the top of the script)",
                    layout.slot_bytes
                );
                let msg = std::ffi::CString::new(msg).unwrap_or_default();
                let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
                PyErr::warn(py, category.as_any(), &msg, 1)?;
            }
        }
        Ok(Self {
            inner: Mutex::new(Some(inner)),
            attached_in: std::process::id(),
            ring: RingInfo {
                socket: socket.display().to_string(),
                backend: pending_kind(dl),
                mode: layout.mode,
                slots: layout.slot_count,
                slot_bytes: layout.slot_bytes,
                device: dl,
            },
            index,
            mirrored,
            side_signals,
            pinned,
            pin_refused,
        })
    }

    /// Receives the next batch, waiting up to ``timeout`` seconds (None: until one comes).
    /// Raises Timeout (nothing was lost: call again), Closed once the producer closed the ring
    /// and everything published was received, ProducerDied, Detached, or Deadlock when the
    /// wait could never end. The GIL is released while it waits; Ctrl-C interrupts it.
    #[pyo3(signature = (timeout=None))]
    fn recv(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::timeout)] timeout: Option<f64>,
    ) -> PyResult<PyBatch> {
        match self.next(py, timeout)? {
            Some(b) => Ok(b),
            None => Err(Closed::new_err(format!(
                "the producer at {} closed the ring and every batch it published was received",
                self.ring.socket
            ))),
        }
    }

    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyBatch>> {
        self.next(py, None)
    }

    /// Detaches from the ring. Batches still held (and tensors made from them) stay valid;
    /// the producer is told goodbye once the last of them is released.
    fn close(&self) {
        let inner = self.inner.lock().take();
        if forked_child(self.attached_in).is_err() {
            // The parent's: no goodbye from here (see `forked_child`).
            std::mem::forget(inner);
        }
    }

    /// True after close().
    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().is_none()
    }

    /// Batches received and not yet released (by the batch or by tensors made from it).
    #[getter]
    fn held(&self) -> usize {
        match self.inner.lock().as_ref() {
            Some(AnyConsumer::Host(c)) => c.held(),
            Some(AnyConsumer::Cuda(c)) => c.held(),
            None => 0,
        }
    }

    /// True when this consumer's batches are mapped read-only on the device, so a kernel
    /// that writes one faults here alone (CUDA broadcast rings on the VMM path; host rings
    /// are always read-only).
    #[getter]
    fn enforced_read_only(&self) -> bool {
        match self.inner.lock().as_ref() {
            Some(AnyConsumer::Host(_)) => true,
            Some(AnyConsumer::Cuda(c)) => c.backend().read_only(),
            None => false,
        }
    }

    /// The device the batches are on: "cpu" or "cuda:N".
    #[getter]
    fn device(&self) -> String {
        self.ring.device()
    }

    /// This consumer's index in the ring (0..max_consumers).
    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    /// How batches arrive: "in-place" (the producer's slot itself) or "mirror" (a copy in
    /// the consumer's own memory, the producer's slot released as soon as it is made).
    #[getter]
    fn delivery(&self) -> &'static str {
        if self.mirrored { "mirror" } else { "in-place" }
    }

    /// True when this CUDA consumer waits for `ready` and writes `finished` on side streams
    /// of its own, joined to the tensors' streams by in-process events.
    #[getter]
    fn side_signals(&self) -> bool {
        self.side_signals
    }

    /// "broadcast" or "shared".
    #[getter]
    fn mode(&self) -> String {
        self.ring.mode()
    }

    /// True when the batches of this host ring are page-locked for copies to a GPU
    /// (``pin_memory=True``, or ``"try"`` where the driver allowed it).
    #[getter]
    fn pinned(&self) -> bool {
        self.pinned
    }

    /// Why the batches are not page-locked although ``pin_memory="try"`` asked for it (the
    /// driver's refusal, or no CUDA driver here); None otherwise.
    #[getter]
    fn pin_refused(&self) -> Option<String> {
        self.pin_refused.clone()
    }

    /// "host" or "cuda".
    #[getter]
    fn backend(&self) -> String {
        self.ring.backend()
    }

    /// The socket path.
    #[getter]
    fn socket(&self) -> &str {
        self.ring.socket()
    }

    /// Slots in the ring.
    #[getter]
    fn slots(&self) -> u32 {
        self.ring.slots
    }

    /// Capacity of each slot in bytes.
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.ring.slot_bytes
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { "closed" } else { "attached" };
        format!(
            "gpipe.Consumer(socket={:?}, index={}, mode={}, backend={}, slots={}, {state}, held={})",
            self.ring.socket,
            self.index,
            self.ring.mode,
            self.ring.backend,
            self.ring.slots,
            self.held()
        )
    }
}

fn pending_kind(d: DLDevice) -> BackendKind {
    if d.device_type == DEVICE_CPU {
        BackendKind::Host
    } else {
        BackendKind::Cuda
    }
}

impl Drop for PyConsumer {
    fn drop(&mut self) {
        if forked_child(self.attached_in).is_err() {
            // The parent's consumer: no goodbye, no release from here (see `forked_child`).
            std::mem::forget(self.inner.lock().take());
        }
    }
}

impl PyConsumer {
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyBatch>> {
        forked_child(self.attached_in)?;
        let deadline = deadline(timeout)?;
        let got = blocking(py, deadline, |until| {
            let mut g = self.inner.lock();
            match g.as_mut() {
                None => Err(Error::Closed),
                Some(AnyConsumer::Host(c)) => {
                    c.recv_until(Some(until)).map(|b| b.map(AnyBatch::Host))
                }
                Some(AnyConsumer::Cuda(c)) => {
                    c.recv_until(Some(until)).map(|b| b.map(AnyBatch::Cuda))
                }
            }
        });
        let got = match got {
            Err(e) if e.is_instance_of::<Closed>(py) && self.closed() => {
                return Err(Closed::new_err(format!(
                    "this Consumer of {} is closed",
                    self.ring.socket
                )));
            }
            other => other?,
        };
        Ok(got.map(|b| self.wrap(b)))
    }

    fn wrap(&self, b: AnyBatch) -> PyBatch {
        let (seq, slot, len, header, tensors, base) = match &b {
            AnyBatch::Host(h) => (
                h.seq(),
                h.slot(),
                h.len(),
                *h.header(),
                h.tensors().to_vec(),
                h.data().as_ptr() as usize,
            ),
            AnyBatch::Cuda(h) => (
                h.seq(),
                h.slot(),
                h.len(),
                *h.header(),
                h.tensors().to_vec(),
                h.data().ptr as usize,
            ),
        };
        PyBatch {
            cell: Mutex::new(Some(Arc::new(BatchCell {
                batch: Some(b),
                streams: Mutex::new(Vec::new()),
                attached_in: self.attached_in,
            }))),
            seq,
            slot,
            len,
            header,
            tensors,
            base,
            device: self.ring.device,
            consumer: self.index,
        }
    }
}
