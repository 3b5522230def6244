//! NCCL point-to-point for the relay (`gpipe relay`): a communicator of two ranks, `send` and
//! `recv` of raw bytes on a stream, and the asynchronous-error check and abort that keep a
//! dead peer from hanging a stream for good.
//!
//! The types are cudarc's (`cudarc::nccl::sys`), the library is opened here: cudarc's loader
//! looks for `libnccl.so`, while PyTorch's wheels, the usual NCCL on a GPU machine, ship
//! `nvidia/nccl/lib/libnccl.so.2`. [`load`] takes `GPIPE_NCCL_LIB` (a path) if set, else
//! `libnccl.so.2` and `libnccl.so` from the loader's path. Without NCCL everything else in
//! gpipe works; the relay's CUDA path says what is missing and how to point at a library.
//!
//! Keep NVLink multicast off (`NCCL_NVLS_ENABLE=0`): loading NCCL here sets it unless the
//! caller did.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclResult_t, ncclUniqueId};

use crate::driver::{CUdeviceptr, CUstream, Context};

/// The environment variable naming the NCCL library to use (a full path).
pub const NCCL_LIB_ENV: &str = "GPIPE_NCCL_LIB";

/// How to find an NCCL library, for error messages.
pub const NCCL_HINT: &str = "set GPIPE_NCCL_LIB to a libnccl.so.2 (PyTorch's wheel ships one: \
     python3 -c 'import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), \"lib\", \"libnccl.so.2\"))'), \
     or put its directory on LD_LIBRARY_PATH";

/// An NCCL failure: the call and NCCL's description.
#[derive(Debug, Clone)]
pub struct NcclError(pub String);

impl std::fmt::Display for NcclError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NcclError {}

type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t;
type CommInitRank =
    unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t;
type SendFn = unsafe extern "C" fn(
    *const c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> ncclResult_t;
type RecvFn = unsafe extern "C" fn(
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> ncclResult_t;
type CommFn = unsafe extern "C" fn(ncclComm_t) -> ncclResult_t;
type AsyncError = unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;
type ErrorString = unsafe extern "C" fn(ncclResult_t) -> *const c_char;
type GetVersion = unsafe extern "C" fn(*mut c_int) -> ncclResult_t;

/// The NCCL entry points the relay uses.
struct Api {
    path: String,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    send: SendFn,
    recv: RecvFn,
    comm_destroy: CommFn,
    comm_abort: CommFn,
    async_error: AsyncError,
    error_string: ErrorString,
    version: c_int,
    /// Kept open for the process's life: the function pointers above point into it.
    _lib: libloading::Library,
}

/// Opens the NCCL library once per process; later calls return the first result.
fn api() -> Result<&'static Api, NcclError> {
    static API: OnceLock<Result<Api, NcclError>> = OnceLock::new();
    API.get_or_init(open).as_ref().map_err(Clone::clone)
}

fn open() -> Result<Api, NcclError> {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // Set once, before NCCL is loaded, so before any thread of NCCL's exists (the unique
        // id's bootstrap thread, a communicator's proxies), from the one thread that loads it
        // under `API`'s once-lock. What else may read the environment from a thread of its own
        // then is the CUDA driver, which reads its settings at `cuInit`.
        // SAFETY: no other thread writes or reads the environment here, as argued above.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    let candidates: Vec<String> = match std::env::var(NCCL_LIB_ENV) {
        Ok(p) if !p.is_empty() => vec![p],
        _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
    };
    let mut tried = Vec::new();
    for name in &candidates {
        // SAFETY: loading NCCL runs its library constructors, which have no preconditions.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib, name),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(NcclError(format!(
        "no NCCL library could be loaded ({}); {NCCL_HINT}",
        tried.join("; ")
    )))
}

fn bind(lib: libloading::Library, path: &str) -> Result<Api, NcclError> {
    fn sym<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> Result<T, NcclError> {
        // SAFETY: each symbol is looked up with the C signature NCCL's nccl.h declares for it
        // (the aliases above, with cudarc's types for NCCL's).
        unsafe { lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| NcclError(format!("{path} has no {name}: {e}")))
    }
    let get_version: GetVersion = sym(&lib, path, "ncclGetVersion")?;
    let mut version: c_int = 0;
    // SAFETY: ncclGetVersion writes one int.
    unsafe { get_version(&mut version) };
    Ok(Api {
        path: path.to_string(),
        get_unique_id: sym(&lib, path, "ncclGetUniqueId")?,
        comm_init_rank: sym(&lib, path, "ncclCommInitRank")?,
        send: sym(&lib, path, "ncclSend")?,
        recv: sym(&lib, path, "ncclRecv")?,
        comm_destroy: sym(&lib, path, "ncclCommDestroy")?,
        comm_abort: sym(&lib, path, "ncclCommAbort")?,
        async_error: sym(&lib, path, "ncclCommGetAsyncError")?,
        error_string: sym(&lib, path, "ncclGetErrorString")?,
        version,
        _lib: lib,
    })
}

/// Loads NCCL (if not yet) and returns the library opened and its version code (e.g. 22703
/// for 2.27.3).
pub fn load() -> Result<(String, i32), NcclError> {
    let a = api()?;
    Ok((a.path.clone(), a.version))
}

fn check(a: &Api, call: &str, r: ncclResult_t) -> Result<(), NcclError> {
    if r == ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result.
    let what = unsafe { CStr::from_ptr((a.error_string)(r)) }
        .to_string_lossy()
        .into_owned();
    Err(NcclError(format!("{call} failed: {what} ({r:?})")))
}

/// A fresh NCCL unique id (rank 0 makes it and hands it to the others).
pub fn unique_id() -> Result<[u8; 128], NcclError> {
    let a = api()?;
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: writes one ncclUniqueId.
    check(a, "ncclGetUniqueId", unsafe { (a.get_unique_id)(&mut id) })?;
    Ok(id.internal.map(|c| c as u8))
}

/// A communicator of this process's rank with its peers, on the context's device.
pub struct Comm {
    raw: ncclComm_t,
    api: &'static Api,
    aborted: std::sync::atomic::AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (the relay
// uses it from one thread; `abort` from a watcher is the documented way to end a blocked
// operation).
unsafe impl Send for Comm {}
// SAFETY: as above; the only call made from a second thread is `abort` / `async_error`,
// which NCCL documents for use while another thread waits in an operation.
unsafe impl Sync for Comm {}

impl Comm {
    /// Joins the communicator of `nranks` ranks named by `id` as `rank`, on `ctx`'s device.
    /// Blocks until every rank has joined.
    pub fn init(ctx: &Context, id: &[u8; 128], nranks: i32, rank: i32) -> Result<Comm, NcclError> {
        let a = api()?;
        ctx.make_current()
            .map_err(|e| NcclError(format!("making the context current: {e}")))?;
        let id = ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: the out-pointer is a local; the id is passed by value.
        check(a, "ncclCommInitRank", unsafe {
            (a.comm_init_rank)(&mut raw, nranks, id, rank)
        })?;
        Ok(Comm {
            raw,
            api: a,
            aborted: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Enqueues on `stream` a send of `bytes` at `ptr` to rank `peer`.
    ///
    /// # Safety
    /// `ptr` is device memory of the communicator's device valid for `bytes` reads until the
    /// send completes on `stream`, a live stream of that device.
    pub unsafe fn send(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        peer: i32,
        stream: CUstream,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller guarantees the buffer and the stream.
        check(self.api, "ncclSend", unsafe {
            (self.api.send)(
                ptr as *const c_void,
                bytes,
                ncclDataType_t::ncclUint8,
                peer,
                self.raw,
                stream as cudaStream_t,
            )
        })
    }

    /// Enqueues on `stream` a receive of `bytes` into `ptr` from rank `peer`.
    ///
    /// # Safety
    /// `ptr` is device memory of the communicator's device valid for `bytes` writes that
    /// nothing else uses until the receive completes on `stream`, a live stream of that device.
    pub unsafe fn recv(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        peer: i32,
        stream: CUstream,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller guarantees the buffer and the stream.
        check(self.api, "ncclRecv", unsafe {
            (self.api.recv)(
                ptr as *mut c_void,
                bytes,
                ncclDataType_t::ncclUint8,
                peer,
                self.raw,
                stream as cudaStream_t,
            )
        })
    }

    /// NCCL's asynchronous error for this communicator, if any (a peer that went away, a
    /// network failure): the operations enqueued may never complete; [`Comm::abort`] ends them.
    pub fn async_error(&self) -> Result<(), NcclError> {
        if self.aborted.load(std::sync::atomic::Ordering::Acquire) {
            return Err(NcclError("the communicator was aborted".into()));
        }
        let mut r = ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is live (not yet aborted or destroyed); one result written.
        check(self.api, "ncclCommGetAsyncError", unsafe {
            (self.api.async_error)(self.raw, &mut r)
        })?;
        check(self.api, "an asynchronous NCCL operation", r)
    }

    /// Aborts the communicator: its pending operations end (kernels waiting for a peer
    /// return), and it can no longer be used. Idempotent.
    pub fn abort(&self) {
        if self.aborted.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        // SAFETY: the communicator is live and aborted once; later calls see `aborted`.
        let r = unsafe { (self.api.comm_abort)(self.raw) };
        if r != ncclResult_t::ncclSuccess {
            tracing::warn!("ncclCommAbort returned {r:?}");
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.aborted.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        // SAFETY: the communicator is live and destroyed once, after the caller's streams
        // are done with it (the relay synchronises before dropping).
        let r = unsafe { (self.api.comm_destroy)(self.raw) };
        if r != ncclResult_t::ncclSuccess {
            tracing::warn!("ncclCommDestroy returned {r:?}");
        }
    }
}
