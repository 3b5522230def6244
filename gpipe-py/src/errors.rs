//! The exception classes of `gpipe` and how a core error maps to one.

use pipeline_core::Error;
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
        PinError,
        AttachError,
        "pin_memory could not page-lock the ring (no CUDA driver here, or the driver refused); the ring can be read without pin_memory."
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
    AttachError, BackendError, Closed, Deadlock, Detached, Error as GpipeError, PinError,
    ProducerDied, ProtocolError, Timeout,
};

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
