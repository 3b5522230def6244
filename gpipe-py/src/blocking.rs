//! Blocking calls: they release the GIL and wake every [`SLICE`] to let Python run signal
//! handlers, so Ctrl-C interrupts them.

use std::time::{Duration, Instant};

use pipeline_core::Error;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;

/// How long a blocking call runs without the GIL before it checks for signals.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// The wait tick of Python consumers: a blocking call's slices end within about this much of
/// their deadline, so Ctrl-C and `timeout=` are honoured promptly.
pub(crate) const TICK: Duration = Duration::from_millis(20);

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
