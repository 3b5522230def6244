//! `gpipe.Consumer` and `gpipe.Batch`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pipeline_core::{
    BackendKind, Batch, Consumer, ConsumerConfig, Error, HostConsumer, HostOptions, Mode,
    PendingAttach, TensorInfo, USER_HEADER_WORDS, WaitPolicy, pattern,
};
use pyo3::exceptions::{PyBufferError, PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dlpack::{DEVICE_CPU, DLDevice};
use crate::tensor::{Keep, PyTensor};
use crate::{Closed, GpipeError, attach_error, blocking, deadline, to_py};

/// A consumer on one of the backends.
enum AnyConsumer {
    Host(Consumer<HostConsumer>),
}

/// A received batch on one of the backends. Dropping it releases it (the core's rule).
enum AnyBatch {
    Host(Batch<HostConsumer>),
}

impl AnyBatch {
    fn release(self) -> Result<(), Error> {
        match self {
            AnyBatch::Host(b) => b.release(),
        }
    }
}

/// The wait tick of Python consumers: a blocking call's slices end within about this much of
/// their deadline, so Ctrl-C and `timeout=` are honoured promptly.
pub(crate) const TICK: Duration = Duration::from_millis(20);

/// Attaches to a producer's ring: `Consumer(socket, *, device=None, timeout=5.0)`.
#[pyclass(frozen, module = "gpipe", name = "Consumer")]
pub struct PyConsumer {
    inner: Mutex<Option<AnyConsumer>>,
    socket: String,
    backend: BackendKind,
    mode: Mode,
    index: u32,
    slots: u32,
    slot_bytes: u64,
    device: DLDevice,
}

#[pymethods]
impl PyConsumer {
    #[new]
    #[pyo3(signature = (socket, *, device=None, timeout=5.0))]
    fn new(
        py: Python<'_>,
        socket: PathBuf,
        device: Option<Bound<'_, PyAny>>,
        timeout: f64,
    ) -> PyResult<Self> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(PyValueError::new_err(format!(
                "timeout must be a positive number of seconds, not {timeout}"
            )));
        }
        let device = device.map(|d| d.str().map(|s| s.to_string())).transpose()?;
        let config = ConsumerConfig {
            handshake_timeout: Duration::from_secs_f64(timeout.min(3600.0)),
            wait: WaitPolicy {
                tick: TICK,
                ..WaitPolicy::default()
            },
        };
        let path = socket.clone();
        let pending = py
            .detach(|| PendingAttach::connect(&path, config))
            .map_err(attach_error)?;
        let layout = pending.layout();
        let (inner, dl) = match pending.backend() {
            BackendKind::Host => {
                if let Some(d) = device.as_deref().filter(|d| *d != "cpu") {
                    return Err(PyValueError::new_err(format!(
                        "device={d} given, but the producer's ring at {} is in host memory; leave device out (or pass \"cpu\")",
                        socket.display()
                    )));
                }
                let c = py
                    .detach(|| pending.finish::<HostConsumer>(HostOptions))
                    .map_err(attach_error)?;
                (
                    AnyConsumer::Host(c),
                    DLDevice {
                        device_type: DEVICE_CPU,
                        device_id: 0,
                    },
                )
            }
            BackendKind::Cuda => {
                return Err(crate::AttachError::new_err(format!(
                    "the producer at {} uses the CUDA backend, which this build of the Python package does not import yet",
                    socket.display()
                )));
            }
        };
        let index = match &inner {
            AnyConsumer::Host(c) => c.index(),
        };
        Ok(Self {
            inner: Mutex::new(Some(inner)),
            socket: socket.display().to_string(),
            backend: pending_kind(dl),
            mode: layout.mode,
            index,
            slots: layout.slot_count,
            slot_bytes: layout.slot_bytes,
            device: dl,
        })
    }

    /// Receives the next batch, waiting up to `timeout` seconds (None: until one comes).
    /// Raises Timeout, Closed once the producer closed the ring and everything published was
    /// received, ProducerDied, Detached, or Deadlock when the wait could never end.
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyBatch> {
        match self.next(py, timeout)? {
            Some(b) => Ok(b),
            None => Err(Closed::new_err(format!(
                "the producer at {} closed the ring and every batch it published was received",
                self.socket
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
        drop(self.inner.lock().take());
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
            None => 0,
        }
    }

    /// This consumer's index in the ring (0..max_consumers).
    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    /// "broadcast" or "shared".
    #[getter]
    fn mode(&self) -> String {
        self.mode.to_string()
    }

    /// "host" or "cuda".
    #[getter]
    fn backend(&self) -> String {
        self.backend.to_string()
    }

    /// The socket path.
    #[getter]
    fn socket(&self) -> &str {
        &self.socket
    }

    /// Slots in the ring.
    #[getter]
    fn slots(&self) -> u32 {
        self.slots
    }

    /// Capacity of each slot in bytes.
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.slot_bytes
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
            self.socket,
            self.index,
            self.mode,
            self.backend,
            self.slots,
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

impl PyConsumer {
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyBatch>> {
        let deadline = deadline(timeout)?;
        let got = blocking(py, deadline, |until| {
            let mut g = self.inner.lock();
            match g.as_mut() {
                None => Err(Error::Closed),
                Some(AnyConsumer::Host(c)) => {
                    c.recv_until(Some(until)).map(|b| b.map(AnyBatch::Host))
                }
            }
        });
        let got = match got {
            Err(e) if e.is_instance_of::<Closed>(py) && self.closed() => {
                return Err(Closed::new_err(format!(
                    "this Consumer of {} is closed",
                    self.socket
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
        };
        PyBatch {
            cell: Mutex::new(Some(Arc::new(BatchCell(b)))),
            seq,
            slot,
            len,
            header,
            tensors,
            base,
            device: self.device,
            consumer: self.index,
        }
    }
}

/// Holds the core batch; the slot is released when the last owner (the Python batch, or a
/// tensor made from it) lets go.
struct BatchCell(AnyBatch);

/// One batch, in place. Release it with `release()`, a `with` block, or by dropping it; the
/// slot returns to the producer once that has happened and every tensor made from the batch
/// is gone.
#[pyclass(frozen, module = "gpipe", name = "Batch")]
pub struct PyBatch {
    cell: Mutex<Option<Arc<BatchCell>>>,
    seq: u64,
    slot: u32,
    len: u64,
    header: [u64; USER_HEADER_WORDS],
    tensors: Vec<TensorInfo>,
    base: usize,
    device: DLDevice,
    consumer: u32,
}

impl PyBatch {
    fn keep(&self) -> PyResult<Arc<BatchCell>> {
        self.cell.lock().clone().ok_or_else(|| {
            GpipeError::new_err(format!(
                "batch {} was released: make tensors from it before releasing it",
                self.seq
            ))
        })
    }

    fn view(&self, t: &TensorInfo) -> PyResult<PyTensor> {
        let keep: Keep = self.keep()?;
        Ok(PyTensor {
            keep,
            data: self.base + t.offset as usize,
            info: *t,
            device: self.device,
            readonly: true,
            copied: false,
            origin: format!("batch {} slot {}", self.seq, self.slot),
        })
    }

    fn only(&self) -> PyResult<&TensorInfo> {
        match self.tensors.as_slice() {
            [t] => Ok(t),
            ts => Err(PyBufferError::new_err(format!(
                "batch {} carries {} tensors ({}); export one with batch[name]",
                self.seq,
                ts.len(),
                ts.iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }
}

#[pymethods]
impl PyBatch {
    /// Sequence number.
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }

    /// Slot index: tensors of the same declaration from slot k always have the same address.
    #[getter]
    fn slot(&self) -> u32 {
        self.slot
    }

    /// The 8-word user header the producer published (a tuple of ints).
    #[getter]
    fn meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        pyo3::types::PyTuple::new(py, self.header)
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.len
    }

    /// The names of the batch's tensors, in the producer's order.
    #[getter]
    fn names(&self) -> Vec<&str> {
        self.tensors.iter().map(|t| t.name.as_str()).collect()
    }

    /// True once release() ran (tensors made before may still hold the slot).
    #[getter]
    fn released(&self) -> bool {
        self.cell.lock().is_none()
    }

    /// The named tensor, as a DLPack-capable gpipe.Tensor.
    fn __getitem__(&self, name: &str) -> PyResult<PyTensor> {
        let t = self
            .tensors
            .iter()
            .find(|t| t.name.as_str() == name)
            .ok_or_else(|| {
                PyKeyError::new_err(format!(
                    "batch {} has no tensor {name:?}; it has {:?}",
                    self.seq,
                    self.names()
                ))
            })?;
        self.view(t)
    }

    fn __contains__(&self, name: &str) -> bool {
        self.tensors.iter().any(|t| t.name.as_str() == name)
    }

    /// Every tensor, by name.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for t in &self.tensors {
            d.set_item(t.name.as_str(), self.view(t)?)?;
        }
        Ok(d)
    }

    /// DLPack export of the batch's only tensor (use batch[name] when it has several).
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        self.view(self.only()?)?
            .export(py, max_version, dl_device, copy)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (self.device.device_type, self.device.device_id)
    }

    /// A private, writable copy of a tensor (the only one when `name` is None), independent
    /// of the slot.
    #[pyo3(signature = (name=None))]
    fn copy(&self, name: Option<&str>) -> PyResult<PyTensor> {
        let t = match name {
            None => *self.only()?,
            Some(n) => *self
                .tensors
                .iter()
                .find(|t| t.name.as_str() == n)
                .ok_or_else(|| PyKeyError::new_err(format!("no tensor {n:?}")))?,
        };
        self.view(&t)?.copy_of()
    }

    /// Checks the batch against the test pattern `gpipe produce` writes (and
    /// `Slot.fill_pattern` writes): the header's checksum and sequence number.
    fn verify_pattern(&self) -> PyResult<bool> {
        let keep = self.keep()?;
        match &keep.0 {
            AnyBatch::Host(b) => Ok(b.header()[pattern::HEADER_SEQ] == b.seq()
                && pattern::checksum(b.data()) == b.header()[pattern::HEADER_CHECKSUM]),
        }
    }

    /// Releases the batch now. The slot returns to the producer at once unless tensors made
    /// from the batch are still alive; then it returns when the last of them is gone.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let Some(cell) = self.cell.lock().take() else {
            return Ok(());
        };
        match Arc::try_unwrap(cell) {
            Ok(cell) => py.detach(|| cell.0.release()).map_err(to_py),
            // Tensors still hold it: the last of them releases it.
            Err(_) => Ok(()),
        }
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "gpipe.Batch(seq={}, slot={}, nbytes={}, tensors={:?}, consumer={}, {})",
            self.seq,
            self.slot,
            self.len,
            self.names(),
            self.consumer,
            if self.released() { "released" } else { "held" }
        )
    }
}
