//! `gpipe.Batch`: a received batch, its tensors and its release (on CUDA, ordered after the
//! work of the streams its tensors were made for).

use std::sync::Arc;

use parking_lot::Mutex;
use pipeline_core::{Batch, Error, HostConsumer, TensorInfo, USER_HEADER_WORDS, pattern};
use pyo3::exceptions::{PyBufferError, PyKeyError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use pipeline_cuda::backend::CudaConsumer;
use pipeline_cuda::driver::CUstream;
use pipeline_cuda::ordering::ReleaseAfter;

use crate::dlpack::{DEVICE_CPU, DLDevice};
use crate::errors::{BackendError, GpipeError, to_py};
use crate::interop::stream_handle;
use crate::tensor::{Keep, PyTensor, StreamUse, remember_stream, stream_handles};

/// A received batch on one of the backends. Dropping it releases it (the core's rule).
pub(crate) enum AnyBatch {
    Host(Batch<HostConsumer>),
    Cuda(Batch<CudaConsumer>),
}

/// After `fork()`, the child holds a copy of its parent's consumer: the same socket, the same
/// consumer index, the same held slots. Were the child to receive or release with it (or say
/// goodbye when the copy is collected), it would act for the parent, which the producer would
/// then detach. So a consumer and its batches refuse all use in any process but the one that
/// attached, and are let go of there without a word to the producer.
pub(crate) fn forked_child(attached_in: u32) -> PyResult<()> {
    let here = std::process::id();
    if here == attached_in {
        return Ok(());
    }
    Err(GpipeError::new_err(format!(
        "this gpipe consumer was attached in process {attached_in}, and this is process {here}, \
         a child forked from it: a forked child cannot use its parent's consumer or batches \
         (it would receive and release for the parent); attach a new gpipe.Consumer in the \
         child after the fork, or start child processes with the 'spawn' method"
    )))
}

/// Holds the core batch; the slot is released when the last owner (the Python batch, or a
/// tensor made from it) lets go. On CUDA it also remembers the streams tensors were made
/// for: the release orders `finished` after their work.
pub(crate) struct BatchCell {
    pub(crate) batch: Option<AnyBatch>,
    pub(crate) streams: Mutex<Vec<u64>>,
    /// The process that attached (see [`forked_child`]).
    pub(crate) attached_in: u32,
}

impl BatchCell {
    /// CUDA: the streams the batch's tensors were made for, as handles; the release orders
    /// `finished` after their work.
    fn handles(&self) -> Vec<CUstream> {
        stream_handles(&self.streams)
    }

    /// Releases now, reporting errors.
    fn release(mut self) -> Result<(), Error> {
        match self.batch.take() {
            Some(AnyBatch::Host(b)) => b.release(),
            // SAFETY: each stream is a handle the user gave for this batch's tensors (or
            // 1/2); the user keeps it alive while the batch's tensors are (docs/python.md).
            Some(AnyBatch::Cuda(b)) => unsafe { b.release_after(&self.handles()) },
            None => Ok(()),
        }
    }
}

impl Drop for BatchCell {
    fn drop(&mut self) {
        if forked_child(self.attached_in).is_err() {
            // The parent's batch: it stays held by the parent (see `forked_child`).
            std::mem::forget(self.batch.take());
            return;
        }
        // A host batch releases itself as the field drops; a CUDA one after its streams.
        if let Some(AnyBatch::Cuda(b)) = self.batch.take() {
            // SAFETY: as in `release`.
            if let Err(e) = unsafe { b.drop_after(&self.handles()) } {
                eprintln!("gpipe: ordering a released batch after its streams failed: {e}");
            }
        }
    }
}

impl StreamUse for BatchCell {
    fn use_on(&self, stream: u64) -> Result<(), String> {
        let Some(AnyBatch::Cuda(b)) = &self.batch else {
            return Ok(());
        };
        // SAFETY: `stream` is the handle a DLPack consumer named for this tensor (or 1/2).
        unsafe { b.order_reads_on(stream as usize as CUstream) }.map_err(|e| e.to_string())?;
        remember_stream(&self.streams, stream);
        Ok(())
    }
}

/// One batch, in place. Release it with `release()`, a `with` block, or by dropping it; the
/// slot returns to the producer once that has happened and every tensor made from the batch
/// is gone.
#[pyclass(frozen, module = "gpipe", name = "Batch")]
pub struct PyBatch {
    pub(crate) cell: Mutex<Option<Arc<BatchCell>>>,
    pub(crate) seq: u64,
    pub(crate) slot: u32,
    pub(crate) len: u64,
    pub(crate) header: [u64; USER_HEADER_WORDS],
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) base: usize,
    pub(crate) device: DLDevice,
    pub(crate) consumer: u32,
}

impl PyBatch {
    fn keep(&self) -> PyResult<Arc<BatchCell>> {
        if let Some(cell) = self.cell.lock().as_ref() {
            forked_child(cell.attached_in)?;
        }
        self.cell.lock().clone().ok_or_else(|| {
            GpipeError::new_err(format!(
                "batch {} was released: make tensors from it before releasing it",
                self.seq
            ))
        })
    }

    fn view(&self, t: &TensorInfo) -> PyResult<PyTensor> {
        let cell = self.keep()?;
        let streams: Option<Arc<dyn StreamUse>> = if self.device.device_type == DEVICE_CPU {
            None
        } else {
            Some(cell.clone())
        };
        let keep: Keep = cell;
        Ok(PyTensor {
            streams,
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
        self.view(self.only()?)?
            .export(py, stream.as_ref(), max_version, dl_device, copy)
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
        match &keep.batch {
            Some(AnyBatch::Host(b)) => Ok(b.header()[pattern::HEADER_SEQ] == b.seq()
                && pattern::checksum(b.data()) == b.header()[pattern::HEADER_CHECKSUM]),
            Some(AnyBatch::Cuda(_)) => Err(BackendError::new_err(
                "verify_pattern checks host batches; verify CUDA batches with `gpipe consume --verify`",
            )),
            None => Err(GpipeError::new_err("batch already released")),
        }
    }

    /// Releases the batch now. The slot returns to the producer at once unless tensors made
    /// from the batch are still alive; then it returns when the last of them is gone.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(cell) = self.cell.lock().as_ref() {
            forked_child(cell.attached_in)?;
        }
        let Some(cell) = self.cell.lock().take() else {
            return Ok(());
        };
        match Arc::try_unwrap(cell) {
            Ok(cell) => py.detach(|| cell.release()).map_err(to_py),
            // Tensors still hold it: the last of them releases it.
            Err(_) => Ok(()),
        }
    }

    /// Declares that work on this batch's tensors also runs on `stream` (a CUDA stream
    /// handle, or an object with `cuda_stream` or `ptr`, e.g. a torch or CuPy stream), as
    /// torch's `Tensor.record_stream`: the stream waits for the batch to be ready, and the
    /// slot is handed back only after the work enqueued on it by then. A no-op for host
    /// batches.
    fn record_stream(&self, py: Python<'_>, stream: Bound<'_, PyAny>) -> PyResult<()> {
        if self.device.device_type == DEVICE_CPU {
            return Ok(());
        }
        let handle = stream_handle(&stream)?;
        let cell = self.keep()?;
        py.detach(|| cell.use_on(handle))
            .map_err(BackendError::new_err)
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
