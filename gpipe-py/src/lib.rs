//! `gpipe._gpipe`: the native module under the `gpipe` Python package.
//!
//! It only translates: the ring, its ordering rules and its checks live in `pipeline-core`
//! (and `pipeline-cuda`). Blocking calls release the GIL and wake every [`blocking::SLICE`] to let
//! Python run signal handlers, so Ctrl-C interrupts them.

mod args;
mod batch;
mod blocking;
mod consumer;
mod dlpack;
mod errors;
mod forward;
mod interop;
mod pin;
mod policy;
mod producer;
mod producer_cell;
mod ring;
mod slot;
mod tensor;

use pipeline_core::DType;
use pyo3::prelude::*;

use crate::errors::{
    AttachError, BackendError, Closed, Deadlock, Detached, GpipeError, PinError, ProducerDied,
    ProtocolError, Timeout,
};

/// The native module.
#[pymodule]
fn _gpipe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<GpipeError>())?;
    m.add("ProducerDied", py.get_type::<ProducerDied>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    m.add("AttachError", py.get_type::<AttachError>())?;
    m.add("PinError", py.get_type::<PinError>())?;
    m.add("Detached", py.get_type::<Detached>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("Deadlock", py.get_type::<Deadlock>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add_class::<consumer::PyConsumer>()?;
    m.add_class::<batch::PyBatch>()?;
    m.add_class::<producer::PyProducer>()?;
    m.add_class::<slot::PySlot>()?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_function(wrap_pyfunction!(forward::forward, m)?)?;
    m.add_function(wrap_pyfunction!(forward::fanout_plan, m)?)?;
    m.add_function(wrap_pyfunction!(policy::resolve_settings, m)?)?;
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
