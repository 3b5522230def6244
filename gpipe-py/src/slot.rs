//! `gpipe.Slot`: a slot the producer acquired, its tensors and its publish.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;
use pipeline_core::{Error, SlotLoan, TensorPlan, USER_HEADER_WORDS, pattern};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pipeline_cuda::driver::CUstream;
use pipeline_cuda::ordering::{OrderWrites, PublishAfter};

use crate::args;
use crate::dlpack::{DEVICE_CPU, DLDevice};
use crate::errors::{BackendError, Closed, GpipeError, to_py};
use crate::interop::{current_stream, is_torch_dtype, parse_dtype, stream_handle, torch_tensor};
use crate::producer_cell::{AnyProducer, ProducerCell};
use crate::tensor::{PyTensor, StreamUse, remember_stream, stream_handles};

pub(crate) struct SlotState {
    pub(crate) plan: TensorPlan,
    /// Published (Some(true)) or given back (Some(false)).
    pub(crate) done: Option<bool>,
}

/// The streams a slot's tensors were made for (CUDA): each waits for the slot's previous
/// consumers, and `publish` orders `ready` after all of them.
pub(crate) struct SlotStreams {
    pub(crate) cell: Arc<ProducerCell>,
    pub(crate) streams: Mutex<Vec<u64>>,
}

impl SlotStreams {
    /// The streams used on the slot, as handles.
    fn handles(&self) -> Vec<CUstream> {
        stream_handles(&self.streams)
    }
}

impl StreamUse for SlotStreams {
    fn use_on(&self, stream: u64) -> Result<(), String> {
        if self.streams.lock().contains(&stream) {
            return Ok(());
        }
        // The producer lock is taken before the streams lock, as in publish.
        if let AnyProducer::Cuda(p) = &*self.cell.producer.lock() {
            // SAFETY: the handle a DLPack consumer named for this slot's tensor (or 1/2).
            unsafe { p.order_writes_on(stream as usize as CUstream) }.map_err(|e| e.to_string())?;
        }
        remember_stream(&self.streams, stream);
        Ok(())
    }
}

/// A slot the producer acquired: declare tensors with ``tensor()``, write them, then
/// ``publish()``. Use it as a context manager: leaving the block without ``publish()`` gives
/// the slot back unpublished (``abandon()``), and the next ``acquire()`` returns it again.
#[pyclass(frozen, module = "gpipe", name = "Slot")]
pub struct PySlot {
    pub(crate) streams: Arc<SlotStreams>,
    pub(crate) cell: Arc<ProducerCell>,
    pub(crate) loan: SlotLoan,
    pub(crate) base: usize,
    pub(crate) capacity: u64,
    pub(crate) device: DLDevice,
    pub(crate) state: Mutex<SlotState>,
}

impl PySlot {
    fn finish(&self, st: &mut SlotState, published: bool) {
        st.done = Some(published);
        let _ = self.cell.open.compare_exchange(
            self.loan.seq() + 1,
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    fn check_open(&self, st: &SlotState) -> PyResult<()> {
        match st.done {
            None => Ok(()),
            Some(true) => Err(GpipeError::new_err(format!(
                "the slot of batch {} was published; acquire a new one",
                self.loan.seq()
            ))),
            Some(false) => Err(GpipeError::new_err(format!(
                "the slot of batch {} was given back unpublished; acquire a new one",
                self.loan.seq()
            ))),
        }
    }

    fn writable(&self, t: &pipeline_core::TensorInfo) -> PyTensor {
        PyTensor {
            keep: self.cell.clone(),
            data: self.base + t.offset as usize,
            info: *t,
            device: self.device,
            readonly: false,
            copied: false,
            origin: format!("slot {} of batch {}", self.loan.index(), self.loan.seq()),
            streams: if self.device.device_type == DEVICE_CPU {
                None
            } else {
                Some(self.streams.clone())
            },
        }
    }
}

impl Drop for PySlot {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        if st.done.is_none() {
            st.done = Some(false);
            let _ = self.cell.open.compare_exchange(
                self.loan.seq() + 1,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }
}

#[pymethods]
impl PySlot {
    /// Declares a tensor in this slot, or returns the one declared under ``name`` before, and
    /// gives a writable view of it: a ``torch.Tensor`` when ``dtype`` is a torch dtype (made
    /// as ``torch.from_dlpack`` would, for torch's current stream), else a ``gpipe.Tensor``,
    /// which any DLPack library takes (``numpy.from_dlpack``, ``cupy.from_dlpack``).
    ///
    /// ``name``: the tensor's name, 1 to 32 bytes. ``dtype``: a name (``"float32"``), a NumPy
    /// dtype or scalar type, or a torch dtype; None to get a tensor declared before.
    /// ``shape``: its dimensions (None: a tensor declared before). ``strides``: in elements
    /// (None: row-major); a channels_last layout stays channels_last.
    ///
    /// Tensors are placed in declaration order, each at the previous one's end rounded up to
    /// 256 bytes, so the same declaration in the same slot always has the same address.
    /// Raises ValueError if the tensor does not fit the slot.
    #[pyo3(signature = (name, dtype=None, shape=None, strides=None))]
    fn tensor<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::tensor_name)] name: String,
        dtype: Option<Bound<'py, PyAny>>,
        #[pyo3(from_py_with = args::shape)] shape: Option<Vec<i64>>,
        #[pyo3(from_py_with = args::strides)] strides: Option<Vec<i64>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let name = name.as_str();
        let t = {
            let mut st = self.state.lock();
            self.check_open(&st)?;
            let to_u64 = |v: Vec<i64>, what: &str| -> PyResult<Vec<u64>> {
                v.into_iter()
                    .map(|x| {
                        u64::try_from(x).map_err(|_| {
                            PyValueError::new_err(format!(
                                "tensor {name:?}: negative {what} ({x}) are not supported"
                            ))
                        })
                    })
                    .collect()
            };
            let shape = shape.map(|s| to_u64(s, "dimensions")).transpose()?;
            let strides = strides.map(|s| to_u64(s, "strides")).transpose()?;
            let parsed = dtype.as_ref().map(parse_dtype).transpose()?;
            if let Some(t) = st.plan.get(name) {
                let same = parsed.is_none_or(|d| d == t.dtype)
                    && shape.as_deref().is_none_or(|s| s == t.shape())
                    && strides.as_deref().is_none_or(|s| s == t.strides());
                if !same {
                    return Err(PyValueError::new_err(format!(
                        "tensor {name:?} is already declared in this slot as {} {:?}",
                        t.dtype,
                        t.shape()
                    )));
                }
                *t
            } else {
                let (Some(parsed), Some(shape)) = (parsed, shape) else {
                    return Err(PyValueError::new_err(format!(
                        "tensor {name:?} is not declared yet: give its dtype and shape"
                    )));
                };
                *st.plan
                    .push(name, parsed, &shape, strides.as_deref(), self.capacity)
                    .map_err(PyValueError::new_err)?
            }
        };
        // The slot's state is unlocked: making a torch tensor orders a stream (StreamUse),
        // which takes the producer's lock.
        let view = Bound::new(py, self.writable(&t))?.into_any();
        match &dtype {
            Some(d) if is_torch_dtype(d) => torch_tensor(&view),
            _ => Ok(view),
        }
    }

    /// Writes the test pattern of ``gpipe produce`` (batch ``seq``'s words) over the first
    /// ``nbytes`` bytes of a host slot and returns the header that ``gpipe consume --verify``
    /// checks; publish with ``publish(meta=header, nbytes=nbytes)``.
    fn fill_pattern(
        &self,
        #[pyo3(from_py_with = args::pattern_nbytes)] nbytes: u64,
    ) -> PyResult<[u64; USER_HEADER_WORDS]> {
        let st = self.state.lock();
        self.check_open(&st)?;
        if nbytes > self.capacity {
            return Err(PyValueError::new_err(format!(
                "{nbytes} bytes exceed the slot capacity of {}",
                self.capacity
            )));
        }
        if !st.plan.is_empty() {
            return Err(PyValueError::new_err(
                "fill_pattern writes raw bytes; this slot already has tensors declared",
            ));
        }
        if self.device.device_type != DEVICE_CPU {
            return Err(BackendError::new_err(
                "fill_pattern writes host slots; a CUDA ring's pattern batches come from `gpipe produce`",
            ));
        }
        // SAFETY: the slot is ours until published or given back (the loan is open and only
        // one slot is out at a time), its memory spans `capacity` bytes from `base` and is
        // kept mapped by `cell`; no Rust reference to it exists elsewhere.
        let mem = unsafe { std::slice::from_raw_parts_mut(self.base as *mut u8, nbytes as usize) };
        let sum = pattern::fill(mem, self.loan.seq());
        let mut h = [0u64; USER_HEADER_WORDS];
        h[pattern::HEADER_CHECKSUM] = sum;
        h[pattern::HEADER_SEQ] = self.loan.seq();
        Ok(h)
    }

    /// Publishes the batch and returns its sequence number. Do not write the slot's tensors
    /// afterwards: consumers are reading them.
    ///
    /// ``meta``: the batch's user header, up to 8 ints from 0 to 2**64 - 1 (``batch.meta`` on
    /// the consumer side; missing words are 0). ``nbytes``: the batch's length in bytes when
    /// no tensors were declared (a raw batch, read as one uint8 tensor ``data``); None: the
    /// declared tensors' extent. ``stream`` (CUDA): ``ready`` is signalled after the work
    /// enqueued by now on this stream (a torch or CuPy stream or a handle; None: torch's
    /// current stream if torch has started CUDA, else the legacy default stream) and on every
    /// stream the slot's tensors were made for. Host rings ignore it.
    #[pyo3(signature = (meta=None, nbytes=None, stream=None))]
    fn publish(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::meta)] meta: Option<Vec<u64>>,
        #[pyo3(from_py_with = args::publish_nbytes)] nbytes: Option<u64>,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        if self.device.device_type != DEVICE_CPU {
            let h = match &stream {
                Some(s) => stream_handle(s)?,
                None => current_stream(py, self.device.device_id)?,
            };
            remember_stream(&self.streams.streams, h);
        }
        let mut st = self.state.lock();
        self.check_open(&st)?;
        let mut header = [0u64; USER_HEADER_WORDS];
        if let Some(m) = meta {
            if m.len() > USER_HEADER_WORDS {
                return Err(PyValueError::new_err(format!(
                    "meta has {} words; a batch carries at most {USER_HEADER_WORDS}",
                    m.len()
                )));
            }
            header[..m.len()].copy_from_slice(&m);
        }
        let len = match nbytes {
            Some(n) if n < st.plan.len() => {
                return Err(PyValueError::new_err(format!(
                    "nbytes={n} is shorter than the declared tensors ({} bytes)",
                    st.plan.len()
                )));
            }
            Some(n) => n,
            None if st.plan.is_empty() => {
                return Err(PyValueError::new_err(
                    "nothing to publish: declare tensors with slot.tensor(...) or pass nbytes=",
                ));
            }
            None => st.plan.len(),
        };
        let loan = self.loan;
        let cell = &self.cell;
        let tensors = st.plan.tensors();
        let streams = &self.streams;
        // Not detached from the GIL: `st` is locked, and a thread that blocks on it while
        // holding the GIL would deadlock with us. Publishing never waits.
        let publish = || match &mut *cell.producer.lock() {
            AnyProducer::Host(p) => p.resume(loan)?.publish_with(len, &header, tensors),
            // SAFETY: every stream is a handle the caller gave for this slot (or 1/2), alive
            // while the slot is open, and holds or waits for its writes (docs/python.md).
            AnyProducer::Cuda(p) => unsafe {
                p.resume(loan)?
                    .publish_after(&streams.handles(), len, &header, tensors)
            },
        };
        let seq = publish().map_err(|e| match e {
            Error::Closed => Closed::new_err("the producer is closed"),
            e => to_py(e),
        })?;
        self.finish(&mut st, true);
        Ok(seq)
    }

    /// Gives the slot back unpublished (the next acquire returns it again).
    fn abandon(&self) {
        let mut st = self.state.lock();
        if st.done.is_none() {
            self.finish(&mut st, false);
        }
    }

    /// The sequence number this batch will have.
    #[getter]
    fn seq(&self) -> u64 {
        self.loan.seq()
    }

    /// The slot index.
    #[getter]
    fn index(&self) -> u32 {
        self.loan.index()
    }

    /// Capacity in bytes.
    #[getter]
    fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Names of the tensors declared so far.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.state
            .lock()
            .plan
            .tensors()
            .iter()
            .map(|t| t.name.to_string())
            .collect()
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.abandon();
        false
    }

    fn __repr__(&self) -> String {
        let st = self.state.lock();
        let state = match st.done {
            None => "open",
            Some(true) => "published",
            Some(false) => "given back",
        };
        let names: Vec<&str> = st.plan.tensors().iter().map(|t| t.name.as_str()).collect();
        format!(
            "gpipe.Slot(seq={}, index={}, capacity={}, tensors={names:?}, {state})",
            self.loan.seq(),
            self.loan.index(),
            self.capacity
        )
    }
}
