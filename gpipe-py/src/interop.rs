//! The caller's framework objects, read without importing the framework: dtypes given as
//! names, NumPy or torch dtypes; CUDA streams given as handles or torch/CuPy streams; torch
//! tensors made over gpipe's memory.

use pipeline_core::DType;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A dtype given as a name (`"float32"`), a NumPy dtype or scalar type, or a torch dtype.
pub(crate) fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    let name: String = if let Ok(s) = obj.extract::<String>() {
        s
    } else if let Ok(n) = obj.getattr("__name__") {
        n.str()?.to_string()
    } else {
        obj.str()?.to_string()
    };
    let bare = name.strip_prefix("torch.").unwrap_or(&name);
    DType::from_name(bare).ok_or_else(|| {
        let known: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        PyValueError::new_err(format!(
            "unknown dtype {name:?}; gpipe supports {}",
            known.join(", ")
        ))
    })
}

/// True when `obj` is a torch dtype (`torch.float16`), told by its type, without importing
/// torch: such a dtype names the framework the caller works in.
pub(crate) fn is_torch_dtype(obj: &Bound<'_, PyAny>) -> bool {
    let t = obj.get_type();
    t.module().is_ok_and(|m| m == "torch") && t.name().is_ok_and(|n| n == "dtype")
}

/// `gpipe.torch.as_tensor`, looked up once.
static AS_TENSOR: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();

/// A torch tensor over a gpipe tensor's memory, made by `gpipe.torch.as_tensor`: what
/// `torch.from_dlpack` gives, with its stream rule (torch's current stream on the tensor's
/// device is the one ordered for its use), and the same lifetime (the tensor keeps the
/// memory, and so the slot or batch, until torch frees it).
pub(crate) fn torch_tensor<'py>(tensor: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = tensor.py();
    let as_tensor = AS_TENSOR.get_or_try_init(py, || {
        py.import("gpipe.torch")?
            .getattr("as_tensor")
            .map(Bound::unbind)
    })?;
    as_tensor.bind(py).call1((tensor,))
}

/// A CUDA stream given as a handle (int) or an object with `cuda_stream` (torch) or `ptr`
/// (CuPy). Handle 0 (the legacy default stream as torch names it) becomes 1, its DLPack name.
pub(crate) fn stream_handle(stream: &Bound<'_, PyAny>) -> PyResult<u64> {
    let v: i64 = if let Ok(v) = stream.extract::<i64>() {
        v
    } else if let Ok(v) = stream.getattr("cuda_stream") {
        v.extract()?
    } else if let Ok(v) = stream.getattr("ptr") {
        v.extract()?
    } else {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "stream must be an int handle or a torch/CuPy stream",
        ));
    };
    match v {
        0 => Ok(1),
        v if v > 0 => Ok(v as u64),
        v => Err(PyValueError::new_err(format!("invalid stream handle {v}"))),
    }
}

/// torch's `_cuda_getCurrentRawStream`, found once torch has initialised CUDA (it stays
/// initialised): the current stream's raw handle with no Python stream object made per call.
static TORCH_RAW_STREAM: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();

/// The caller's current CUDA stream: torch's current stream on `device` when torch is
/// loaded and has initialised CUDA, else the legacy default stream (1). Called twice per
/// batch (acquire and publish), so the torch function is looked up once.
pub(crate) fn current_stream(py: Python<'_>, device: i32) -> PyResult<u64> {
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
