//! `gpipe._gpipe`: the native module under the `gpipe` Python package.
//!
//! It only translates: the ring, its ordering rules and its checks live in `pipeline-core`
//! (and `pipeline-cuda`). Blocking calls release the GIL and wake every [`SLICE`] to let
//! Python run signal handlers, so Ctrl-C interrupts them.

mod args;
mod consumer;
mod dlpack;
mod forward;
mod producer;
mod tensor;

use std::time::{Duration, Instant};

use pipeline_core::{DType, Error};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The exception classes (their Rust names are their Python names, so they pickle).
pub(crate) mod exc {
    use pyo3::create_exception;
    use pyo3::exceptions::PyException;

    create_exception!(
        gpipe,
        Error,
        PyException,
        "Base class of every error gpipe raises (besides ValueError/TypeError for bad arguments)."
    );
    create_exception!(
        gpipe,
        ProducerDied,
        Error,
        "The producer died without closing the ring; batches it had not published are lost."
    );
    create_exception!(
        gpipe,
        Closed,
        Error,
        "The ring was closed cleanly and everything published has been received, or this object was closed."
    );
    create_exception!(
        gpipe,
        AttachError,
        Error,
        "Attaching to a producer failed: nothing listens, permission, version or backend mismatch."
    );
    create_exception!(
        gpipe,
        Detached,
        Error,
        "The producer detached this consumer (its lag policy, or a protocol violation)."
    );
    create_exception!(
        gpipe,
        Timeout,
        Error,
        "A blocking call ran past its timeout; nothing was lost, call it again."
    );
    create_exception!(
        gpipe,
        Deadlock,
        Error,
        "The call could never return: this consumer holds the batch in the slot the producer must refill first."
    );
    create_exception!(
        gpipe,
        ProtocolError,
        Error,
        "A peer broke the protocol (a corrupted control segment, a malformed message)."
    );
    create_exception!(
        gpipe,
        BackendError,
        Error,
        "The memory backend (host memory or CUDA) failed."
    );
}

pub(crate) use exc::{
    AttachError, BackendError, Closed, Deadlock, Detached, Error as GpipeError, ProducerDied,
    ProtocolError, Timeout,
};

/// How long a blocking call runs without the GIL before it checks for signals.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// Maps a core error to its exception class, keeping the Rust message.
pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::ProducerDied => ProducerDied::new_err(msg),
        Error::Closed => Closed::new_err(msg),
        Error::Detached(_) => Detached::new_err(msg),
        Error::Timeout(_) => Timeout::new_err(msg),
        Error::Deadlock { .. } | Error::MirrorFull { .. } => Deadlock::new_err(msg),
        Error::Protocol(_) => ProtocolError::new_err(msg),
        Error::Backend(_) => BackendError::new_err(msg),
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::Connect { .. } | Error::BackendMismatch { .. } => AttachError::new_err(msg),
        Error::Os { .. } => GpipeError::new_err(msg),
    }
}

/// An error during attach: whatever it is, the attach failed.
pub(crate) fn attach_error(e: Error) -> PyErr {
    match e {
        Error::InvalidArgument(_) | Error::Timeout(_) => to_py(e),
        e => AttachError::new_err(e.to_string()),
    }
}

/// A timeout in seconds (None: forever) as a deadline.
pub(crate) fn deadline(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => {
            Ok(Some(Instant::now() + Duration::from_secs_f64(t.min(1e9))))
        }
        Some(t) => Err(PyValueError::new_err(format!(
            "timeout must be a non-negative number of seconds or None, not {t}"
        ))),
    }
}

/// Runs `step` without the GIL in slices of at most [`SLICE`] until it returns something
/// other than a timeout or `deadline` passes, checking for signals between slices (Ctrl-C
/// raises `KeyboardInterrupt` within about one slice). `step` gets the slice's end.
pub(crate) fn blocking<T: Send>(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut step: impl FnMut(Instant) -> Result<T, Error> + Send,
) -> PyResult<T> {
    loop {
        let slice = Instant::now() + SLICE;
        let until = deadline.map_or(slice, |d| d.min(slice));
        match py.detach(|| step(until)) {
            Err(Error::Timeout(what)) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(to_py(Error::Timeout(what)));
                }
                py.check_signals()?;
            }
            r => return r.map_err(to_py),
        }
    }
}

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

/// The native module.
#[pymodule]
fn _gpipe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<GpipeError>())?;
    m.add("ProducerDied", py.get_type::<ProducerDied>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    m.add("AttachError", py.get_type::<AttachError>())?;
    m.add("Detached", py.get_type::<Detached>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("Deadlock", py.get_type::<Deadlock>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add_class::<consumer::PyConsumer>()?;
    m.add_class::<consumer::PyBatch>()?;
    m.add_class::<producer::PyProducer>()?;
    m.add_class::<producer::PySlot>()?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_function(wrap_pyfunction!(forward::forward, m)?)?;
    m.add_function(wrap_pyfunction!(forward::fanout_plan, m)?)?;
    m.add("PROTOCOL_VERSION", pipeline_core::layout::PROTOCOL_VERSION)?;
    m.add("MAX_TENSORS", pipeline_core::tensor::MAX_TENSORS)?;
    m.add("MAX_DIMS", pipeline_core::tensor::MAX_DIMS)?;
    m.add("TENSOR_ALIGN", pipeline_core::tensor::TENSOR_ALIGN)?;
    m.add(
        "DTYPES",
        DType::ALL.iter().map(|d| d.name()).collect::<Vec<_>>(),
    )?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
