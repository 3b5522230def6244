//! `gpipe.Tensor`: one named tensor of a batch or a slot, exported through DLPack.

use std::alloc::Layout;
use std::sync::Arc;

use pipeline_core::TensorInfo;
use pyo3::exceptions::{PyAttributeError, PyBufferError};
use pyo3::prelude::*;

use crate::dlpack::{self, DEVICE_CPU, DLDevice, Export};

/// What keeps a tensor's memory valid: a held batch, a producer's slots, or a private copy.
pub(crate) type Keep = Arc<dyn Send + Sync>;

/// GPU memory: what to do with the stream a DLPack consumer says it will use the tensor on.
pub(crate) trait StreamUse: Send + Sync {
    /// Orders `stream` (a CUstream handle, 1 = legacy default, 2 = per-thread) for use of the
    /// memory, and remembers it so the memory is handed back only after its work.
    fn use_on(&self, stream: u64) -> Result<(), String>;
}

/// Adds `stream` to `streams`, the streams whose work must end before the memory is handed
/// back, unless it is there already.
pub(crate) fn remember_stream(streams: &parking_lot::Mutex<Vec<u64>>, stream: u64) {
    let mut streams = streams.lock();
    if !streams.contains(&stream) {
        streams.push(stream);
    }
}

/// CUDA: the streams of `streams` as handles, for ordering a release or a publish after them.
pub(crate) fn stream_handles(
    streams: &parking_lot::Mutex<Vec<u64>>,
) -> Vec<pipeline_cuda::driver::CUstream> {
    streams
        .lock()
        .iter()
        .map(|&s| s as usize as pipeline_cuda::driver::CUstream)
        .collect()
}

/// The `stream` argument of `__dlpack__` for CUDA memory, as the array API standard defines
/// it: None is the legacy default stream (1), -1 means "do not synchronise", 0 is refused as
/// ambiguous, anything else is a stream handle.
pub(crate) fn cuda_stream(stream: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(s) = stream else { return Ok(Some(1)) };
    if s.is_none() {
        return Ok(Some(1));
    }
    let v: i64 = s.extract().map_err(|_| {
        PyBufferError::new_err("stream must be an int (a CUDA stream handle), -1 or None")
    })?;
    match v {
        -1 => Ok(None),
        0 => Err(PyBufferError::new_err(
            "stream=0 is ambiguous in DLPack; pass 1 for the legacy default stream or 2 for the per-thread one",
        )),
        v if v < -1 => Err(PyBufferError::new_err(format!("invalid stream {v}"))),
        v => Ok(Some(v as u64)),
    }
}

/// One named tensor of a batch or a slot: a DLPack view, not an array. Making a framework
/// tensor from it (``torch.from_dlpack(t)``, ``gpipe.torch.as_tensor(t)``,
/// ``numpy.from_dlpack(t)``, ``cupy.from_dlpack(t)``) gives an array over the memory itself,
/// with no copy; the memory stays valid, and a batch's slot stays held, until every such array
/// is gone. A slot's tensor declared with a torch dtype is returned as a ``torch.Tensor``
/// already. Arrays of a consumer's batch are read-only (NumPy enforces it; torch does not: an
/// in-place write there kills the writing process, never another's data).
#[pyclass(frozen, module = "gpipe", name = "Tensor")]
pub struct PyTensor {
    pub(crate) keep: Keep,
    pub(crate) data: usize,
    pub(crate) info: TensorInfo,
    pub(crate) device: DLDevice,
    pub(crate) readonly: bool,
    pub(crate) copied: bool,
    pub(crate) origin: String,
    /// GPU memory: stream ordering for exports.
    pub(crate) streams: Option<Arc<dyn StreamUse>>,
}

/// A private host copy, 256-byte aligned, that Python libraries may write.
struct RawBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer is plain heap memory owned by this value; Rust never reads or writes it
// after the copy, only the DLPack consumer does, through the raw pointer.
unsafe impl Send for RawBuf {}
// SAFETY: as above: no Rust access to the contents that could race.
unsafe impl Sync for RawBuf {}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `copy_of` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl PyTensor {
    /// The DLPack capsule for this tensor.
    pub(crate) fn export<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some((t, id)) = dl_device {
            if (t, id) != (self.device.device_type, self.device.device_id) {
                return Err(PyBufferError::new_err(format!(
                    "tensor {} lives on DLPack device ({}, {}) and cannot be exported to ({t}, {id})",
                    self.info.name, self.device.device_type, self.device.device_id
                )));
            }
        }
        if copy == Some(true) {
            return self.copy_of()?.export(py, None, max_version, None, None);
        }
        if let Some(uses) = &self.streams {
            if let Some(s) = cuda_stream(stream)? {
                py.detach(|| uses.use_on(s))
                    .map_err(|e| PyBufferError::new_err(format!("ordering stream {s:#x}: {e}")))?;
            }
        }
        let ex = Export {
            data: self.data as *mut u8,
            device: self.device,
            dtype: self.info.dtype,
            shape: self.info.shape(),
            strides: self.info.strides(),
            readonly: self.readonly,
            copied: self.copied,
        };
        dlpack::capsule(
            py,
            &ex,
            Box::new(self.keep.clone()),
            dlpack::wants_versioned(max_version),
        )
    }

    /// A private, writable host copy of this tensor (same dtype, shape and strides).
    pub(crate) fn copy_of(&self) -> PyResult<PyTensor> {
        if self.device.device_type != DEVICE_CPU {
            return Err(PyBufferError::new_err(
                "copy=True is supported for host tensors; on the GPU, copy with your framework (tensor.clone())",
            ));
        }
        let extent = self.info.extent_bytes().map_err(PyBufferError::new_err)? as usize;
        let layout = Layout::from_size_align(extent.max(1), 256)
            .map_err(|e| PyBufferError::new_err(e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(pyo3::exceptions::PyMemoryError::new_err(format!(
                "cannot allocate {extent} bytes for a copy"
            )));
        }
        // SAFETY: the source spans `extent` bytes from `data` (validated against the batch or
        // slot), kept valid by `keep`; the destination was just allocated with that size.
        unsafe { std::ptr::copy_nonoverlapping(self.data as *const u8, ptr, extent) };
        let mut info = self.info;
        info.offset = 0;
        Ok(PyTensor {
            keep: Arc::new(RawBuf { ptr, layout }),
            data: ptr as usize,
            info,
            device: self.device,
            readonly: false,
            copied: true,
            origin: format!("copy of {}", self.origin),
            streams: None,
        })
    }
}

#[pymethods]
impl PyTensor {
    /// DLPack export (array API standard). `stream` is accepted and ignored for host memory.
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.export(py, stream.as_ref(), max_version, dl_device, copy)
    }

    /// `(device_type, device_id)` as DLPack numbers them: (1, 0) for host memory, (2, n) for
    /// CUDA device n.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (self.device.device_type, self.device.device_id)
    }

    /// A private, writable copy (host memory), as a new Tensor.
    fn copy(&self) -> PyResult<PyTensor> {
        self.copy_of()
    }

    /// The tensor's name.
    #[getter]
    fn name(&self) -> &str {
        self.info.name.as_str()
    }

    /// Element type name (`"float32"`, `"uint8"`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.info.dtype.name()
    }

    /// Dimensions.
    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.info.shape().to_vec()
    }

    /// Strides in elements (as PyTorch counts them; NumPy's are these times the item size).
    #[getter]
    fn strides(&self) -> Vec<u64> {
        self.info.strides().to_vec()
    }

    /// Byte offset of the tensor in its slot.
    #[getter]
    fn offset(&self) -> u64 {
        self.info.offset
    }

    /// Bytes from the first to the end of the last element.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.info.extent_bytes().unwrap_or(0)
    }

    /// The address of element 0 (host or device pointer).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.data
    }

    /// True when arrays made from it must not be written (a consumer's batch).
    #[getter]
    fn readonly(&self) -> bool {
        self.readonly
    }

    /// Reached only when the normal lookup fails (a torch method such as `fill_`): says how
    /// to make an array, which has such methods, over the same memory.
    fn __getattr__(&self, name: &str) -> PyResult<Py<PyAny>> {
        let hint = if name.starts_with("__") {
            String::new()
        } else {
            format!(
                ": a gpipe.Tensor is a DLPack view of {}, not an array; make one over the same \
                 memory with torch.from_dlpack(t) (or gpipe.torch.as_tensor(t)), \
                 numpy.from_dlpack(t) or cupy.from_dlpack(t). A slot's tensor declared with a \
                 torch dtype is a torch.Tensor already",
                self.origin
            )
        };
        Err(PyAttributeError::new_err(format!(
            "'gpipe.Tensor' object has no attribute '{name}'{hint}"
        )))
    }

    fn __repr__(&self) -> String {
        let device = self.device.name();
        format!(
            "gpipe.Tensor(name={:?}, dtype={}, shape={:?}, strides={:?}, device={device}, {}, {})",
            self.info.name.as_str(),
            self.info.dtype,
            self.info.shape(),
            self.info.strides(),
            if self.readonly {
                "read-only"
            } else {
                "writable"
            },
            self.origin
        )
    }
}
