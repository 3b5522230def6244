//! Arguments from Python: each converted with an error that names the argument and says what
//! it accepts. A wrong type is a `TypeError`, a value out of range a `ValueError` (never the
//! bare `OverflowError` of an integer conversion). The ranges of a ring's shape are
//! `pipeline_core::limits`' rule, applied after the conversion; here only what a value must be
//! to reach it (a whole number, not negative, within its Rust type).
//!
//! Functions named after an argument are for `#[pyo3(from_py_with = ...)]`, which takes a path.

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use crate::pin::PinMode;

/// `repr(obj)`, cut to a length that fits in a message.
fn short_repr(obj: &Bound<'_, PyAny>) -> String {
    let r = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    if r.chars().count() > 60 {
        let cut: String = r.chars().take(57).collect();
        format!("{cut}...")
    } else {
        r
    }
}

/// The type of `obj` as Python names it, with its module unless it is a builtin
/// (`list`, `numpy.ndarray`, `torch.Tensor`).
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    let t = obj.get_type();
    let name = t
        .qualname()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    match t.module().map(|m| m.to_string()) {
        Ok(m) if m != "builtins" => format!("{}.{name}", m.split('.').next().unwrap_or(&m)),
        _ => name,
    }
}

/// "not float (2.5)": what was given instead, for a TypeError.
fn given(obj: &Bound<'_, PyAny>) -> String {
    format!("not {} ({})", type_name(obj), short_repr(obj))
}

/// An integer argument as `T`: an int, or anything with `__index__` (a NumPy integer), but not
/// a bool. `accepts` says what the argument is, e.g. "a number of bytes, 1 or more".
pub(crate) fn int<T: TryFrom<i128>>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    accepts: &str,
) -> PyResult<T> {
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be {accepts}, {}",
            given(obj)
        )));
    }
    let v: i128 = match obj.extract::<i128>() {
        Ok(v) => v,
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
            return Err(PyValueError::new_err(format!(
                "{name} must be {accepts}, not {}",
                short_repr(obj)
            )));
        }
        Err(_) => {
            return Err(PyTypeError::new_err(format!(
                "{name} must be {accepts}, {}",
                given(obj)
            )));
        }
    };
    T::try_from(v).map_err(|_| PyValueError::new_err(format!("{name} must be {accepts}, not {v}")))
}

/// As [`int`], with None for None.
pub(crate) fn opt_int<T: TryFrom<i128>>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    accepts: &str,
) -> PyResult<Option<T>> {
    if obj.is_none() {
        return Ok(None);
    }
    int(obj, name, accepts).map(Some)
}

/// A number of seconds: an int or a float (not a str, not a bool). The range is checked where
/// it is used.
pub(crate) fn seconds(obj: &Bound<'_, PyAny>, name: &str, accepts: &str) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be {accepts}, {}",
            given(obj)
        )));
    }
    obj.extract::<f64>()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be {accepts}, {}", given(obj))))
}

/// A str argument (a mode, a backend name).
pub(crate) fn text(obj: &Bound<'_, PyAny>, name: &str, accepts: &str) -> PyResult<String> {
    obj.extract::<String>()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be {accepts}, {}", given(obj))))
}

/// A sequence of integers (a list or tuple; not a str), each converted as [`int`] and named
/// `name[i]` in errors.
pub(crate) fn int_list<T: TryFrom<i128>>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    accepts: &str,
    each: &str,
) -> PyResult<Vec<T>> {
    let wrong = || PyTypeError::new_err(format!("{name} must be {accepts}, {}", given(obj)));
    if obj.is_instance_of::<PyString>() {
        return Err(wrong());
    }
    let Ok(iter) = obj.try_iter() else {
        return Err(wrong());
    };
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        out.push(int(&item?, &format!("{name}[{i}]"), each)?);
    }
    Ok(out)
}

// The arguments, by name (see the module doc). Their ranges are in words: what the value is,
// and where a limit applies later, which one.

/// A timeout in seconds or None (None: no limit), for `timeout=` of the blocking calls.
pub(crate) fn timeout(obj: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    if obj.is_none() {
        return Ok(None);
    }
    seconds(
        obj,
        "timeout",
        "a number of seconds (0 or more) or None (no limit)",
    )
    .map(Some)
}

/// `Consumer(timeout=)`: seconds for each step of the attach handshake.
pub(crate) fn attach_timeout(obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    seconds(obj, "timeout", "a number of seconds, more than 0")
}

/// `Consumer(spin=)`: seconds, or None (the default spin).
pub(crate) fn spin(obj: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    if obj.is_none() {
        return Ok(None);
    }
    seconds(
        obj,
        "spin",
        "a number of seconds from 0 to 1, or None (the default, 100 µs)",
    )
    .map(Some)
}

/// `Producer(drain_timeout=)`.
pub(crate) fn drain_timeout(obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    seconds(obj, "drain_timeout", "a number of seconds, 0 or more")
}

/// `Producer(batch_bytes=)`.
pub(crate) fn batch_bytes(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int(
        obj,
        "batch_bytes",
        &format!(
            "a whole number of bytes, from 1 to {} GiB",
            pipeline_core::layout::MAX_SLOT_BYTES >> 30
        ),
    )
}

/// `Producer(depth_budget=)`.
pub(crate) fn depth_budget(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int(obj, "depth_budget", "a whole number of bytes, 0 or more")
}

/// `Producer(max_consumers=)`.
pub(crate) fn max_consumers(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    int(
        obj,
        "max_consumers",
        &format!(
            "a whole number of consumers, from 1 to {}",
            pipeline_core::layout::MAX_CONSUMERS
        ),
    )
}

/// `Producer(detach_after_ms=)`.
pub(crate) fn detach_after_ms(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    opt_int(
        obj,
        "detach_after_ms",
        "a whole number of milliseconds (0 or more), or None (never detach: back-pressure)",
    )
}

/// `Producer(device=)`.
pub(crate) fn producer_device(obj: &Bound<'_, PyAny>) -> PyResult<i32> {
    int(obj, "device", "a CUDA device index, 0 or more")
}

/// A number, or "auto" (resolved where the backend is known).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OrAuto {
    /// "auto".
    Auto,
    /// A number.
    Value(u32),
}

/// Whether `obj` is the str "auto"; Err(ValueError) for another str; Ok(false) for a non-str.
fn is_auto(obj: &Bound<'_, PyAny>, name: &str, accepts: &str) -> PyResult<bool> {
    if !obj.is_instance_of::<PyString>() {
        return Ok(false);
    }
    if obj.extract::<String>()? == "auto" {
        Ok(true)
    } else {
        Err(PyValueError::new_err(format!(
            "{name} must be {accepts}, not {}",
            short_repr(obj)
        )))
    }
}

/// `Producer(slots=)`: a number of slots, "auto", or None (the default).
pub(crate) fn slots(obj: &Bound<'_, PyAny>) -> PyResult<Option<OrAuto>> {
    let accepts = format!(
        "a whole number of slots from 1 to {}, or \"auto\" (8 with MPS; without it the deepest ring within depth_budget)",
        pipeline_core::layout::MAX_SLOTS
    );
    if obj.is_none() {
        return Ok(None);
    }
    if is_auto(obj, "slots", &accepts)? {
        return Ok(Some(OrAuto::Auto));
    }
    int(obj, "slots", &accepts).map(|n| Some(OrAuto::Value(n)))
}

/// `Producer(max_lead=)`: None (the ring's own bound), "auto", or a number of batches, 1 or
/// more.
pub(crate) fn max_lead(obj: &Bound<'_, PyAny>) -> PyResult<Option<OrAuto>> {
    let accepts = "a whole number of batches (1 or more), \"auto\" (from the GPU's L2 size), or None (the ring's own bound, slots)";
    if obj.is_none() {
        return Ok(None);
    }
    if is_auto(obj, "max_lead", accepts)? {
        return Ok(Some(OrAuto::Auto));
    }
    match int::<u32>(obj, "max_lead", accepts)? {
        0 => Err(PyValueError::new_err(format!(
            "max_lead must be {accepts}, not 0"
        ))),
        n => Ok(Some(OrAuto::Value(n))),
    }
}

/// `Consumer(mirror_buffers=)`.
pub(crate) fn mirror_buffers(obj: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
    let accepts = "a whole number of batches, 1 or more, or None (the ring's slot count)";
    match opt_int::<u32>(obj, "mirror_buffers", accepts)? {
        Some(0) => Err(PyValueError::new_err(format!(
            "mirror_buffers must be {accepts}, not 0"
        ))),
        n => Ok(n),
    }
}

/// `Producer.wait_for_consumers(n=)`.
pub(crate) fn consumers_n(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    int(obj, "n", "a whole number of consumers, 0 or more")
}

/// `Slot.publish(nbytes=)`.
pub(crate) fn publish_nbytes(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    opt_int(
        obj,
        "nbytes",
        "a whole number of bytes (0 or more, at most the slot capacity), or None (the declared tensors)",
    )
}

/// `Slot.fill_pattern(nbytes)`.
pub(crate) fn pattern_nbytes(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int(
        obj,
        "nbytes",
        "a whole number of bytes, 0 or more, at most the slot capacity",
    )
}

/// `Slot.publish(meta=)`: up to 8 header words.
pub(crate) fn meta(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u64>>> {
    if obj.is_none() {
        return Ok(None);
    }
    int_list(
        obj,
        "meta",
        "a list or tuple of up to 8 ints (the batch's user header), or None",
        "an int from 0 to 2**64 - 1",
    )
    .map(Some)
}

/// `Slot.tensor(shape=)`: dimensions, or None (a tensor declared before). Negative ones are
/// refused where the tensor's name is known.
pub(crate) fn shape(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    if obj.is_none() {
        return Ok(None);
    }
    int_list(
        obj,
        "shape",
        "a tuple or list of dimensions (ints, 0 or more), e.g. (64, 3, 32, 32)",
        "a dimension (an int, 0 or more)",
    )
    .map(Some)
}

/// `Slot.tensor(strides=)`: strides in elements, or None (row-major).
pub(crate) fn strides(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    if obj.is_none() {
        return Ok(None);
    }
    int_list(
        obj,
        "strides",
        "a tuple or list of strides in elements (ints, 0 or more, one per dimension), or None (row-major)",
        "a stride in elements (an int, 0 or more)",
    )
    .map(Some)
}

/// A `name` argument (a tensor's name).
pub(crate) fn tensor_name(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    text(obj, "name", "a str (the tensor's name)")
}

/// `Producer(mode=)`.
pub(crate) fn mode(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    text(obj, "mode", "\"broadcast\" or \"shared\"")
}

/// `Producer(backend=)`.
pub(crate) fn backend(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    text(obj, "backend", "\"auto\", \"cuda\" or \"host\"")
}

/// `Producer(sync=)`.
pub(crate) fn sync(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    text(obj, "sync", "\"auto\", \"semaphore\" or \"events\"")
}

/// `Producer(timeline_memory=)`.
pub(crate) fn timeline_memory(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    text(obj, "timeline_memory", "\"host\", \"device\" or \"auto\"")
}

/// `forward(upstream)`: a path.
pub(crate) fn upstream(obj: &Bound<'_, PyAny>) -> PyResult<std::path::PathBuf> {
    obj.extract::<std::path::PathBuf>().map_err(|_| {
        PyTypeError::new_err(format!(
            "upstream must be a path (a str or os.PathLike), {}",
            given(obj)
        ))
    })
}

/// `forward(device=)`.
pub(crate) fn forward_device(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    opt_int(
        obj,
        "device",
        "a CUDA device index (0 or more), or None (the upstream producer's GPU)",
    )
}

/// `forward(slots=)`.
pub(crate) fn forward_slots(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    int(
        obj,
        "slots",
        &format!(
            "a whole number of slots, from 1 to {}",
            pipeline_core::layout::MAX_SLOTS
        ),
    )
}

/// `forward(chunk=)`: None (whole batches) or a chunk size in bytes, 1 or more.
pub(crate) fn forward_chunk(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    let c: Option<u64> = opt_int(
        obj,
        "chunk",
        "a chunk size in bytes (1 or more), or None (whole batches)",
    )?;
    if c == Some(0) {
        return Err(PyValueError::new_err(
            "chunk must be a chunk size in bytes (1 or more), or None for whole batches; got 0",
        ));
    }
    Ok(c)
}

/// `forward(wait_for_consumers=)`.
pub(crate) fn wait_for_consumers(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    int(
        obj,
        "wait_for_consumers",
        "a whole number of consumers, 0 or more",
    )
}

/// `fanout_plan(producer_device=)`.
pub(crate) fn producer_device_index(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    int(obj, "producer_device", "a CUDA device index, 0 or more")
}

/// `fanout_plan(consumer_devices)`.
pub(crate) fn consumer_devices(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    int_list(
        obj,
        "consumer_devices",
        "a list of CUDA device indices, one per consumer",
        "a CUDA device index (an int, 0 or more)",
    )
}

/// A `socket` argument: a path (str or os.PathLike).
pub(crate) fn socket(obj: &Bound<'_, PyAny>) -> PyResult<std::path::PathBuf> {
    obj.extract::<std::path::PathBuf>().map_err(|_| {
        PyTypeError::new_err(format!(
            "socket must be a path (a str or os.PathLike), {}",
            given(obj)
        ))
    })
}

/// `Consumer(pin_memory=)`: True, False, or "try".
pub(crate) fn pin_memory(obj: &Bound<'_, PyAny>) -> PyResult<PinMode> {
    let accepts = "True, False, or \"try\" (page-lock where the driver allows it, else read the ring unlocked)";
    if obj.is_instance_of::<PyBool>() {
        return Ok(if obj.is_truthy()? {
            PinMode::On
        } else {
            PinMode::Off
        });
    }
    if obj.is_instance_of::<PyString>() {
        return match obj.extract::<String>()?.as_str() {
            "try" => Ok(PinMode::Try),
            _ => Err(PyValueError::new_err(format!(
                "pin_memory must be {accepts}, not {}",
                short_repr(obj)
            ))),
        };
    }
    Err(PyTypeError::new_err(format!(
        "pin_memory must be {accepts}, {}",
        given(obj)
    )))
}
