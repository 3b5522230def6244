//! DLPack export: the C structs of dlpack.h (v1.0, and the unversioned v0.8 form), and
//! capsules whose deleter drops an owner that keeps the memory (and so the slot) alive.
//!
//! The deleter may run on any thread, with or without the GIL (a library frees a tensor
//! where it likes): what it drops is plain Rust, never a Python object.

use std::ffi::{CStr, c_void};

use pipeline_core::DType;
use pipeline_core::tensor::MAX_DIMS;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::{Bound, ffi};

/// `kDLCPU`.
pub const DEVICE_CPU: i32 = 1;
/// `kDLCUDA`.
pub const DEVICE_CUDA: i32 = 2;

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    /// `kDLCPU`, `kDLCUDA`, ...
    pub device_type: i32,
    /// Device ordinal.
    pub device_id: i32,
}

impl DLDevice {
    /// "cpu", or "cuda:N", as torch names devices.
    pub fn name(&self) -> String {
        match self.device_type {
            DEVICE_CPU => "cpu".into(),
            DEVICE_CUDA => format!("cuda:{}", self.device_id),
            t => format!("dlpack-device-{t}:{}", self.device_id),
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const FLAG_READ_ONLY: u64 = 1;
const FLAG_IS_COPIED: u64 = 2;

const NAME: &CStr = c"dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

/// What keeps the exported memory valid; dropped by the capsule's deleter.
pub type Owner = Box<dyn Send + Sync>;

/// The manager context: the owner, and the shape and strides the `DLTensor` points into.
struct Ctx {
    _owner: Owner,
    shape: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
}

/// One tensor to export.
pub struct Export<'a> {
    /// Address of element 0.
    pub data: *mut u8,
    /// Where it lives.
    pub device: DLDevice,
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: &'a [u64],
    /// Strides in elements.
    pub strides: &'a [u64],
    /// Set DLPack's read-only flag (versioned capsules only).
    pub readonly: bool,
    /// Set DLPack's is-copied flag (versioned capsules only).
    pub copied: bool,
}

/// Whether `max_version` (from `__dlpack__`) lets us hand out a versioned capsule.
pub fn wants_versioned(max_version: Option<(u32, u32)>) -> bool {
    max_version.is_some_and(|(major, _)| major >= 1)
}

fn to_i64(v: u64) -> PyResult<i64> {
    i64::try_from(v).map_err(|_| PyBufferError::new_err("tensor dimension exceeds int64"))
}

/// Builds a capsule over `ex`, owned by `owner` until the consumer's deleter (or the capsule's
/// destructor, if nobody consumed it) runs.
pub fn capsule<'py>(
    py: Python<'py>,
    ex: &Export<'_>,
    owner: Owner,
    versioned: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let ndim = ex.shape.len();
    debug_assert!(ndim <= MAX_DIMS && ex.strides.len() == ndim);
    let mut ctx = Box::new(Ctx {
        _owner: owner,
        shape: [0; MAX_DIMS],
        strides: [0; MAX_DIMS],
    });
    for i in 0..ndim {
        ctx.shape[i] = to_i64(ex.shape[i])?;
        ctx.strides[i] = to_i64(ex.strides[i])?;
    }
    let dl_tensor = DLTensor {
        data: ex.data.cast(),
        device: ex.device,
        ndim: ndim as i32,
        dtype: DLDataType {
            code: ex.dtype.kind as u8,
            bits: ex.dtype.bits,
            lanes: 1,
        },
        shape: ctx.shape.as_mut_ptr(),
        strides: ctx.strides.as_mut_ptr(),
        byte_offset: 0,
    };
    let manager_ctx = Box::into_raw(ctx).cast::<c_void>();
    let (ptr, name, destructor): (*mut c_void, &CStr, ffi::PyCapsule_Destructor) = if versioned {
        let flags = if ex.readonly { FLAG_READ_ONLY } else { 0 }
            | if ex.copied { FLAG_IS_COPIED } else { 0 };
        let m = Box::into_raw(Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx,
            deleter: Some(delete_versioned),
            flags,
            dl_tensor,
        }));
        (m.cast(), NAME_VERSIONED, destroy_versioned)
    } else {
        let m = Box::into_raw(Box::new(DLManagedTensor {
            dl_tensor,
            manager_ctx,
            deleter: Some(delete_unversioned),
        }));
        (m.cast(), NAME, destroy_unversioned)
    };
    // SAFETY: `ptr` is a live DLManagedTensor[Versioned] matching `name`; the capsule takes it
    // over, and its destructor frees it unless a consumer renamed the capsule (took it).
    unsafe {
        let cap = ffi::PyCapsule_New(ptr, name.as_ptr(), Some(destructor));
        if cap.is_null() {
            // Not handed out: free it here.
            if versioned {
                delete_versioned(ptr.cast());
            } else {
                delete_unversioned(ptr.cast());
            }
        }
        Bound::from_owned_ptr_or_err(py, cap)
    }
}

/// `DLManagedTensor::deleter`: frees the struct and drops the owner.
///
/// # Safety
/// `m` came from [`capsule`] and is deleted once.
unsafe extern "C" fn delete_unversioned(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its manager context were made with Box::into_raw in `capsule`, and the
    // DLPack contract calls the deleter once.
    unsafe {
        let m = Box::from_raw(m);
        drop(Box::from_raw(m.manager_ctx.cast::<Ctx>()));
    }
}

/// `DLManagedTensorVersioned::deleter`.
///
/// # Safety
/// As for [`delete_unversioned`].
unsafe extern "C" fn delete_versioned(m: *mut DLManagedTensorVersioned) {
    if m.is_null() {
        return;
    }
    // SAFETY: as in delete_unversioned.
    unsafe {
        let m = Box::from_raw(m);
        drop(Box::from_raw(m.manager_ctx.cast::<Ctx>()));
    }
}

/// Capsule destructor: a capsule still named "dltensor" was never consumed, so we delete it;
/// a consumer renames it to "used_dltensor" and owns it from then on.
///
/// # Safety
/// Called by Python with a capsule object.
unsafe extern "C" fn destroy_unversioned(cap: *mut ffi::PyObject) {
    // SAFETY: `cap` is a capsule; IsValid checks the name without raising, and a valid one
    // holds the pointer `capsule` stored.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, NAME.as_ptr()).cast::<DLManagedTensor>();
            delete_unversioned(m);
        }
    }
}

/// As [`destroy_unversioned`], for "dltensor_versioned".
///
/// # Safety
/// Called by Python with a capsule object.
unsafe extern "C" fn destroy_versioned(cap: *mut ffi::PyObject) {
    // SAFETY: as in destroy_unversioned.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, NAME_VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, NAME_VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            delete_versioned(m);
        }
    }
}
