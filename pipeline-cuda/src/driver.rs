//! A thin, safe layer over the CUDA driver API (`cudarc::driver::sys`).
//!
//! cudarc's safe API covers neither stream-ordered memory pools nor IPC, so this module wraps the
//! raw calls itself, in cudarc's style: `sys` call → [`check`] → small RAII types that destroy what
//! they own on drop.
//!
//! Every entry point checks first that `libcuda` can be loaded (a raw `sys` call panics when it
//! cannot) and returns [`CudaError::NoDriver`] instead. Constructors go through [`init`]; the other
//! methods need a [`Context`], [`Stream`] or [`Device`], which only exist once the driver is loaded.
//!
//! Raw device addresses (`CUdeviceptr`) are plain integers: functions that make the GPU write or
//! read through one are `unsafe`, since nothing here can check that the address is live and that
//! no other work uses it at the same time.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

pub use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUevent, CUresult, CUstream};

/// Errors from the CUDA driver, NVRTC, or an unsupported configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// `libcuda` could not be loaded; the text says what was tried.
    NoDriver(String),
    /// `libnvrtc` could not be loaded; the text says what was tried.
    NoNvrtc(String),
    /// A driver call returned an error.
    Driver {
        /// The driver function that failed, e.g. `"cuMemPoolCreate"`.
        call: &'static str,
        /// The result code.
        code: CUresult,
        /// The code's name, e.g. `"CUDA_ERROR_INVALID_VALUE"`.
        name: String,
        /// The driver's description of the code (`cuGetErrorString`).
        message: String,
    },
    /// NVRTC failed to compile the kernels.
    Nvrtc {
        /// What failed, e.g. `"compiling gpipe kernels for compute_90"`.
        what: String,
        /// NVRTC's error and, for a compile error, its log.
        message: String,
    },
    /// The device, driver or object cannot do what was asked.
    Unsupported {
        /// What is missing.
        what: String,
        /// What to do about it.
        hint: String,
    },
    /// An argument was rejected before calling the driver.
    InvalidArgument(String),
}

impl CudaError {
    fn driver(call: &'static str, code: CUresult) -> Self {
        let message = if driver_present() {
            let mut text: *const c_char = ptr::null();
            // SAFETY: the library is loaded (checked above); cuGetErrorString writes a pointer to a
            // static NUL-terminated string, or leaves `text` null for an unknown code.
            let r = unsafe { sys::cuGetErrorString(code, &mut text) };
            if r == CUresult::CUDA_SUCCESS && !text.is_null() {
                // SAFETY: non-null results of cuGetErrorString point to static C strings.
                unsafe { CStr::from_ptr(text) }
                    .to_string_lossy()
                    .into_owned()
            } else {
                String::from("unknown error")
            }
        } else {
            String::from("(driver not loaded)")
        };
        CudaError::Driver {
            call,
            code,
            // The enum's variant names are the driver's names (what cuGetErrorName returns).
            name: format!("{code:?}"),
            message,
        }
    }

    /// The driver result code, for a [`CudaError::Driver`].
    pub fn driver_code(&self) -> Option<CUresult> {
        match self {
            CudaError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// What to do about a driver error, where something useful can be said.
fn driver_hint(call: &str, code: CUresult) -> Option<&'static str> {
    use CUresult::*;
    Some(match code {
        CUDA_ERROR_NO_DEVICE => {
            "no CUDA GPU is visible to this process: check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
        }
        CUDA_ERROR_OUT_OF_MEMORY => "GPU memory is exhausted: use fewer or smaller slots",
        CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            "NVRTC produced PTX newer than this driver accepts: use an NVRTC no newer than the \
             driver's CUDA version (`gpipe probe` shows both)"
        }
        CUDA_ERROR_MPS_CONNECTION_FAILED => {
            "the MPS control daemon is not reachable: start it with `nvidia-cuda-mps-control -d` \
             or unset CUDA_MPS_PIPE_DIRECTORY"
        }
        CUDA_ERROR_NOT_SUPPORTED => "this device or driver lacks the feature: run `gpipe probe`",
        CUDA_ERROR_INVALID_CONTEXT if call.starts_with("cuIpcOpen") => {
            "an IPC handle opens only in another process than the one that created it"
        }
        CUDA_ERROR_INVALID_VALUE if call.starts_with("cuStreamW") => {
            "stream memory operations reject memory from IPC-capable pools: put timeline words \
             in plain cuMemAlloc memory"
        }
        _ => return None,
    })
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::NoDriver(detail) => write!(
                f,
                "no CUDA driver found (libcuda.so.1 could not be loaded): {detail}"
            ),
            CudaError::NoNvrtc(detail) => {
                write!(
                    f,
                    "NVRTC not found (libnvrtc could not be loaded): {detail}"
                )
            }
            CudaError::Driver {
                call,
                code,
                name,
                message,
            } => {
                write!(f, "{call} failed: {name} ({}): {message}", *code as i32)?;
                if let Some(hint) = driver_hint(call, *code) {
                    write!(f, "; {hint}")?;
                }
                Ok(())
            }
            CudaError::Nvrtc { what, message } => write!(f, "NVRTC failed {what}: {message}"),
            CudaError::Unsupported { what, hint } => write!(f, "{what}: {hint}"),
            CudaError::InvalidArgument(what) => write!(f, "invalid argument: {what}"),
        }
    }
}

impl std::error::Error for CudaError {}

/// Turns a driver result into a `Result`, naming the call that produced it.
pub fn check(call: &'static str, result: CUresult) -> Result<(), CudaError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::driver(call, result))
    }
}

/// Whether `libcuda` can be loaded (checked once per process).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: is_culib_present only tries to dlopen the library names cudarc knows; loading
        // the NVIDIA driver library has no preconditions on our side.
        unsafe { sys::is_culib_present() }
    })
}

/// `Ok` when `libcuda` can be loaded, else [`CudaError::NoDriver`].
pub fn ensure_driver() -> Result<(), CudaError> {
    if driver_present() {
        Ok(())
    } else {
        Err(CudaError::NoDriver(
            "tried libcuda.so, libcuda.so.1 and the other names cudarc knows; install the NVIDIA \
             driver or put its library directory on LD_LIBRARY_PATH (use the host backend on \
             machines without a GPU)"
                .into(),
        ))
    }
}

/// Loads the driver and calls `cuInit(0)`, once per process; later calls return the first result.
pub fn init() -> Result<(), CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    INIT.get_or_init(|| {
        ensure_driver()?;
        // SAFETY: the library is loaded; cuInit has no other preconditions.
        check("cuInit", unsafe { sys::cuInit(0) })
    })
    .clone()
}

/// The driver's CUDA version as `1000 * major + 10 * minor` (e.g. 13000 for 13.0).
pub fn driver_version() -> Result<i32, CudaError> {
    ensure_driver()?;
    let mut version: c_int = 0;
    // SAFETY: the library is loaded; the out-pointer is a valid local.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    })?;
    Ok(version)
}

/// The number of CUDA devices visible to this process.
pub fn device_count() -> Result<usize, CudaError> {
    init()?;
    let mut count: c_int = 0;
    // SAFETY: the driver is initialised; the out-pointer is a valid local.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// A CUDA device, by ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    ordinal: usize,
    raw: sys::CUdevice,
}

impl Device {
    /// The device with this ordinal (initialising the driver if needed).
    pub fn get(ordinal: usize) -> Result<Device, CudaError> {
        init()?;
        let index = c_int::try_from(ordinal)
            .map_err(|_| CudaError::InvalidArgument(format!("device ordinal {ordinal}")))?;
        let mut raw: sys::CUdevice = 0;
        // SAFETY: the driver is initialised; the out-pointer is a valid local.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut raw, index) })?;
        Ok(Device { ordinal, raw })
    }

    /// The ordinal this device was opened with.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The raw driver handle.
    pub fn raw(&self) -> sys::CUdevice {
        self.raw
    }

    /// One device attribute.
    pub fn attribute(&self, attribute: CUdevice_attribute) -> Result<i32, CudaError> {
        let mut value: c_int = 0;
        // SAFETY: a Device exists only after init(); `raw` came from cuDeviceGet; the
        // out-pointer is a valid local.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&mut value, attribute, self.raw)
        })?;
        Ok(value)
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> Result<String, CudaError> {
        let mut buf: [c_char; 256] = [0; 256];
        // SAFETY: the driver is initialised; the driver writes at most `len` bytes including the
        // NUL terminator into `buf`.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, self.raw)
        })?;
        let bytes: Vec<u8> = buf
            .iter()
            .map(|c| c.to_ne_bytes()[0])
            .take_while(|&b| b != 0)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The device's 16-byte UUID.
    pub fn uuid(&self) -> Result<[u8; 16], CudaError> {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: the driver is initialised; the out-pointer is a valid local CUuuid.
        check("cuDeviceGetUuid_v2", unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, self.raw)
        })?;
        Ok(uuid.bytes.map(|c| c.to_ne_bytes()[0]))
    }

    /// The UUID in nvidia-smi's form, `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub fn uuid_string(&self) -> Result<String, CudaError> {
        let u = self.uuid()?;
        let hex = |r: std::ops::Range<usize>| -> String {
            u[r].iter().map(|b| format!("{b:02x}")).collect()
        };
        Ok(format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        ))
    }

    /// Compute capability as `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub fn compute_capability(&self) -> Result<(i32, i32), CudaError> {
        Ok((
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Number of streaming multiprocessors.
    pub fn multiprocessor_count(&self) -> Result<u32, CudaError> {
        let n = self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(u32::try_from(n).unwrap_or(1).max(1))
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize, CudaError> {
        let mut bytes: usize = 0;
        // SAFETY: the driver is initialised; the out-pointer is a valid local.
        check("cuDeviceTotalMem_v2", unsafe {
            sys::cuDeviceTotalMem_v2(&mut bytes, self.raw)
        })?;
        Ok(bytes)
    }
}

/// A retained primary context of one device. Released on drop.
///
/// The objects below keep an `Arc<Context>`, so the context outlives everything created in it.
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext is a handle the driver API accepts from any thread (cuCtxSetCurrent binds it
// to the calling thread); the driver serialises access internally. `Context` holds no Rust data
// behind the pointer.
unsafe impl Send for Context {}
// SAFETY: as for Send: every method takes `&self` and only passes the handle to thread-safe
// driver calls.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of device `ordinal` and makes it current on this thread.
    pub fn new(ordinal: usize) -> Result<Arc<Context>, CudaError> {
        let device = Device::get(ordinal)?;
        let mut raw: sys::CUcontext = ptr::null_mut();
        // SAFETY: the driver is initialised and `device.raw` is valid; out-pointer is a local.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, device.raw)
        })?;
        let ctx = Arc::new(Context { device, raw });
        ctx.make_current()?;
        Ok(ctx)
    }

    /// The device this context belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The raw context handle.
    pub fn raw(&self) -> sys::CUcontext {
        self.raw
    }

    /// Blocks until all work in this context is done, on every stream (gpipe's and the
    /// application's). For teardown only.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.make_current()?;
        // SAFETY: the context is current on this thread.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Binds this context to the calling thread (`cuCtxSetCurrent`).
    pub fn make_current(&self) -> Result<(), CudaError> {
        // SAFETY: `raw` is a retained primary context, valid until drop.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: we retained the primary context once in `new`; this releases that reference.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device.raw) };
        if let Err(e) = check("cuDevicePrimaryCtxRelease_v2", r) {
            tracing::warn!(
                device = self.device.ordinal,
                "releasing primary context: {e}"
            );
        }
    }
}

/// Logs a failure inside `Drop`, where it cannot be returned.
fn log_drop_error(what: &str, call: &'static str, r: CUresult) {
    if let Err(e) = check(call, r) {
        tracing::warn!("dropping {what}: {e}");
    }
}

/// A non-blocking stream (`CU_STREAM_NON_BLOCKING`). Destroyed on drop.
#[derive(Debug)]
pub struct Stream {
    raw: sys::CUstream,
    ctx: Arc<Context>,
}

// SAFETY: a CUstream handle may be used from any thread; the driver serialises enqueues.
unsafe impl Send for Stream {}
// SAFETY: all methods take `&self` and only pass the handle to thread-safe driver calls.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream that does not synchronise with the legacy default stream.
    pub fn new(ctx: &Arc<Context>) -> Result<Stream, CudaError> {
        ctx.make_current()?;
        let mut raw: sys::CUstream = ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        // SAFETY: the context is current; the out-pointer is a valid local.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, flags)
        })?;
        Ok(Stream {
            raw,
            ctx: Arc::clone(ctx),
        })
    }

    /// The raw stream handle.
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Makes later work on this stream wait for the event's most recent record.
    pub fn wait_event(&self, event: &Event) -> Result<(), CudaError> {
        // SAFETY: `event.raw()` is a live event owned by `event`, borrowed for this call.
        unsafe { self.wait_event_raw(event.raw()) }
    }

    /// Makes a stream given by handle wait for `event`'s most recent record.
    ///
    /// # Safety
    /// `stream` must be a live stream handle of a context on this device (or
    /// `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD`).
    pub unsafe fn raw_wait_event(stream: CUstream, event: &Event) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees `stream`; `event` is live (borrowed).
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream, event.raw(), 0)
        })
    }

    /// Like [`Stream::wait_event`], for an event handle owned elsewhere.
    ///
    /// # Safety
    /// `event` must be a live event handle (not destroyed) of a context on this device.
    pub unsafe fn wait_event_raw(&self, event: CUevent) -> Result<(), CudaError> {
        // SAFETY: `self.raw` is live; the caller guarantees `event` is live.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event, 0)
        })
    }

    /// Blocks the host until all work on the stream is done. For setup and teardown only.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: `self.raw` is a live stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: we created the stream and destroy it once; pending work still completes.
        let r = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        log_drop_error("stream", "cuStreamDestroy_v2", r);
    }
}

/// A CUDA event. Destroyed on drop.
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
    ipc: bool,
    _ctx: Arc<Context>,
}

// SAFETY: a CUevent handle may be used from any thread; the driver serialises access.
unsafe impl Send for Event {}
// SAFETY: all methods take `&self` and only pass the handle to thread-safe driver calls.
unsafe impl Sync for Event {}

impl Event {
    fn create(ctx: &Arc<Context>, flags: c_uint, ipc: bool) -> Result<Event, CudaError> {
        ctx.make_current()?;
        let mut raw: sys::CUevent = ptr::null_mut();
        // SAFETY: the context is current; the out-pointer is a valid local.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Event {
            raw,
            ipc,
            _ctx: Arc::clone(ctx),
        })
    }

    /// An event another process can open (`CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`).
    pub fn new_ipc(ctx: &Arc<Context>) -> Result<Event, CudaError> {
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as c_uint
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        Event::create(ctx, flags, true)
    }

    /// An event with timing enabled, for benchmarks ([`Event::elapsed_ms`]).
    pub fn new_timing(ctx: &Arc<Context>) -> Result<Event, CudaError> {
        Event::create(ctx, sys::CUevent_flags::CU_EVENT_DEFAULT as c_uint, false)
    }

    /// Opens an event exported by another process with [`Event::ipc_handle`]. The driver
    /// refuses handles created by this same process.
    pub fn open_ipc(ctx: &Arc<Context>, handle: &[u8; 64]) -> Result<Event, CudaError> {
        ctx.make_current()?;
        let handle = sys::CUipcEventHandle {
            reserved: handle.map(|b| c_char::from_ne_bytes([b])),
        };
        let mut raw: sys::CUevent = ptr::null_mut();
        // SAFETY: the context is current; the handle is passed by value; out-pointer is a local.
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut raw, handle)
        })?;
        Ok(Event {
            raw,
            ipc: true,
            _ctx: Arc::clone(ctx),
        })
    }

    /// The raw event handle.
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// The 64-byte handle another process passes to [`Event::open_ipc`].
    pub fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
        if !self.ipc {
            return Err(CudaError::InvalidArgument(
                "ipc_handle on an event not created with Event::new_ipc".into(),
            ));
        }
        let mut handle = sys::CUipcEventHandle { reserved: [0; 64] };
        // SAFETY: `self.raw` is a live interprocess event; out-pointer is a valid local.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut handle, self.raw)
        })?;
        Ok(handle.reserved.map(|c| c.to_ne_bytes()[0]))
    }

    /// An event for ordering only (`CU_EVENT_DISABLE_TIMING`), within this process.
    pub fn new_plain(ctx: &Arc<Context>) -> Result<Event, CudaError> {
        Event::create(
            ctx,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
            false,
        )
    }

    /// Captures the work enqueued so far on a stream given by handle: one of this context's,
    /// or `CU_STREAM_LEGACY` (1) / `CU_STREAM_PER_THREAD` (2).
    ///
    /// # Safety
    /// `stream` must be a live stream handle of this event's context (or one of the two
    /// special handles).
    pub unsafe fn record_raw(&self, stream: CUstream) -> Result<(), CudaError> {
        // SAFETY: `self.raw` is live; the caller guarantees `stream`.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream)
        })
    }

    /// Captures the work enqueued on `stream` so far.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: both handles are live for the duration of the call.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw)
        })
    }

    /// Blocks the host until the captured work is done. For setup, teardown and tests only.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: `self.raw` is a live event.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// `true` when the captured work is done (or the event was never recorded).
    pub fn query(&self) -> Result<bool, CudaError> {
        // SAFETY: `self.raw` is a live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(CudaError::driver("cuEventQuery", r)),
        }
    }

    /// Milliseconds between two completed records of timing events.
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32, CudaError> {
        let mut ms: f32 = 0.0;
        // SAFETY: both events are live; the out-pointer is a valid local.
        check("cuEventElapsedTime_v2", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, start.raw, end.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we own the event (created or opened) and destroy it once.
        let r = unsafe { sys::cuEventDestroy_v2(self.raw) };
        log_drop_error("event", "cuEventDestroy_v2", r);
    }
}

/// How a pool is shared with other processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PoolHandleType {
    /// A POSIX file descriptor, passed over a Unix socket (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    PosixFd,
    /// A fabric handle (`CU_MEM_HANDLE_TYPE_FABRIC`), for multi-node NVLink systems.
    Fabric,
}

impl PoolHandleType {
    /// The driver's handle type.
    pub(crate) fn raw(self) -> sys::CUmemAllocationHandleType {
        match self {
            PoolHandleType::PosixFd => {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            }
            PoolHandleType::Fabric => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        }
    }
}

/// The opaque data that names one pool allocation to an importer (`CUmemPoolPtrExportData`).
pub type PointerExport = [u8; 64];

/// A fabric handle (`CUmemFabricHandle`): 64 opaque bytes that name a pool or a VMM
/// allocation to an importer on any node of the NVLink fabric (through IMEX).
pub type FabricHandle = [u8; 64];

/// The legacy IPC handle of a `cuMemAlloc` allocation (`CUipcMemHandle`).
pub type IpcMemHandle = [u8; 64];

/// An exportable stream-ordered memory pool, created here or imported from another process.
/// Destroyed on drop.
#[derive(Debug)]
pub struct MemPool {
    raw: sys::CUmemoryPool,
    handle_type: PoolHandleType,
    imported: bool,
    ctx: Arc<Context>,
}

// SAFETY: a CUmemoryPool handle may be used from any thread; the driver serialises access.
unsafe impl Send for MemPool {}
// SAFETY: all methods take `&self` and only pass the handle to thread-safe driver calls.
unsafe impl Sync for MemPool {}

pub(crate) fn device_location(device: &Device) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device.raw,
    }
}

impl MemPool {
    /// Creates a pool of pinned memory on the context's device, exportable as `handle_type`,
    /// holding at most `max_size_bytes` (0: the driver's default). Freed memory stays in the
    /// pool (release threshold `u64::MAX`) instead of going back to the OS at each sync.
    pub fn new_exportable(
        ctx: &Arc<Context>,
        max_size_bytes: usize,
        handle_type: PoolHandleType,
    ) -> Result<MemPool, CudaError> {
        ctx.make_current()?;
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: handle_type.raw(),
            location: device_location(ctx.device()),
            win32SecurityAttributes: ptr::null_mut(),
            maxSize: max_size_bytes,
            usage: 0,
            reserved: [0; 54],
        };
        let mut raw: sys::CUmemoryPool = ptr::null_mut();
        // SAFETY: `props` is fully initialised and outlives the call; out-pointer is a local.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(&mut raw, &props)
        })?;
        let pool = MemPool {
            raw,
            handle_type,
            imported: false,
            ctx: Arc::clone(ctx),
        };
        let mut threshold: u64 = u64::MAX;
        // SAFETY: the pool is live; RELEASE_THRESHOLD takes a pointer to a cuuint64_t.
        check("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                pool.raw,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast::<c_void>(),
            )
        })?;
        Ok(pool)
    }

    /// Imports a pool from a file descriptor made by [`MemPool::export_fd`] in another process.
    /// The descriptor stays owned by the caller (close it once imported).
    pub fn import_fd(ctx: &Arc<Context>, fd: BorrowedFd<'_>) -> Result<MemPool, CudaError> {
        ctx.make_current()?;
        let mut raw: sys::CUmemoryPool = ptr::null_mut();
        // For POSIX fds the "handle" is the descriptor's value itself, cast to a pointer.
        let handle = fd.as_raw_fd() as usize as *mut c_void;
        // SAFETY: the fd is open for the duration of the call (borrowed); out-pointer is a local.
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &mut raw,
                handle,
                PoolHandleType::PosixFd.raw(),
                0,
            )
        })?;
        Ok(MemPool {
            raw,
            handle_type: PoolHandleType::PosixFd,
            imported: true,
            ctx: Arc::clone(ctx),
        })
    }

    /// Imports a pool from a fabric handle made by [`MemPool::export_fabric`] in another
    /// process (needs an IMEX channel on both sides).
    pub fn import_fabric(ctx: &Arc<Context>, handle: &FabricHandle) -> Result<MemPool, CudaError> {
        ctx.make_current()?;
        let mut raw: sys::CUmemoryPool = ptr::null_mut();
        let mut fabric = sys::CUmemFabricHandle { data: *handle };
        // SAFETY: for fabric handles the driver reads a CUmemFabricHandle through the pointer,
        // which points to a valid local; the out-pointer is a local.
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &mut raw,
                (&mut fabric as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                PoolHandleType::Fabric.raw(),
                0,
            )
        })?;
        Ok(MemPool {
            raw,
            handle_type: PoolHandleType::Fabric,
            imported: true,
            ctx: Arc::clone(ctx),
        })
    }

    /// Exports the pool as a fabric handle, to send to another process as bytes. The pool must
    /// have been created with [`PoolHandleType::Fabric`].
    pub fn export_fabric(&self) -> Result<FabricHandle, CudaError> {
        if self.handle_type != PoolHandleType::Fabric || self.imported {
            return Err(CudaError::Unsupported {
                what: "export_fabric on a pool that is imported or not created with Fabric".into(),
                hint: "create the pool with MemPool::new_exportable(.., PoolHandleType::Fabric)"
                    .into(),
            });
        }
        let mut fabric = sys::CUmemFabricHandle { data: [0; 64] };
        // SAFETY: the pool is live; for fabric handles the driver writes a CUmemFabricHandle
        // through the pointer, which points to a valid local.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&mut fabric as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                self.raw,
                self.handle_type.raw(),
                0,
            )
        })?;
        Ok(fabric.data)
    }

    /// The handle type the pool was created (or imported) with.
    pub fn handle_type(&self) -> PoolHandleType {
        self.handle_type
    }

    /// The context the pool belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw pool handle.
    pub fn raw(&self) -> sys::CUmemoryPool {
        self.raw
    }

    /// Whether this pool was imported from another process.
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// Bytes of device memory the pool holds now (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub fn reserved_bytes(&self) -> Result<u64, CudaError> {
        let mut v: u64 = 0;
        // SAFETY: the pool is live; RESERVED_MEM_CURRENT writes one cuuint64_t to `v`.
        check("cuMemPoolGetAttribute", unsafe {
            sys::cuMemPoolGetAttribute(
                self.raw,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&mut v as *mut u64).cast::<c_void>(),
            )
        })?;
        Ok(v)
    }

    /// Exports the pool as a new file descriptor, to send to another process (SCM_RIGHTS).
    pub fn export_fd(&self) -> Result<OwnedFd, CudaError> {
        if self.handle_type != PoolHandleType::PosixFd || self.imported {
            return Err(CudaError::Unsupported {
                what: "export_fd on a pool that is imported or not created with PosixFd".into(),
                hint: "create the pool with MemPool::new_exportable(.., PoolHandleType::PosixFd)"
                    .into(),
            });
        }
        let mut fd: c_int = -1;
        // SAFETY: the pool is live; for POSIX fds the driver writes an int through the pointer.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                self.raw,
                self.handle_type.raw(),
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError::InvalidArgument(format!(
                "cuMemPoolExportToShareableHandle returned fd {fd}"
            )));
        }
        // SAFETY: the driver just created this descriptor for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Grants `device` read-write (or read-only) access to the pool's memory. Needed by an
    /// importer before it touches imported pointers; a no-op when the access is already there.
    pub fn set_access(&self, device: &Device, read_write: bool) -> Result<(), CudaError> {
        let wanted = if read_write {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
        };
        let mut location = device_location(device);
        let mut current = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: the pool is live; both pointers are valid locals.
        let r = unsafe { sys::cuMemPoolGetAccess(&mut current, self.raw, &mut location) };
        if r == CUresult::CUDA_SUCCESS && current == wanted {
            return Ok(());
        }
        let desc = sys::CUmemAccessDesc {
            location,
            flags: wanted,
        };
        // SAFETY: the pool is live; `desc` is one valid descriptor.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(self.raw, &desc, 1)
        })
    }

    /// Allocates `bytes` from the pool, ordered on `stream`: the memory may be used by work
    /// enqueued on `stream` after this call (or work ordered after it by events).
    pub fn alloc_async(&self, bytes: usize, stream: &Stream) -> Result<CUdeviceptr, CudaError> {
        if self.imported {
            return Err(CudaError::Unsupported {
                what: "allocating from an imported pool".into(),
                hint: "only the exporting process allocates; import pointers instead".into(),
            });
        }
        if bytes == 0 {
            return Err(CudaError::InvalidArgument("alloc_async of 0 bytes".into()));
        }
        self.ctx.make_current()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: pool and stream are live; the out-pointer is a valid local.
        check("cuMemAllocFromPoolAsync", unsafe {
            sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, self.raw, stream.raw)
        })?;
        Ok(ptr)
    }

    /// Frees `ptr`, ordered on `stream`. For an imported pointer this drops the import only.
    ///
    /// # Safety
    /// `ptr` came from [`MemPool::alloc_async`] or [`MemPool::import_pointer`] on this pool, is
    /// not freed yet, and no work that runs after the free (in stream order) uses it. An exporter
    /// frees only after every importer has freed its import.
    pub unsafe fn free_async(&self, ptr: CUdeviceptr, stream: &Stream) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        // SAFETY: the caller guarantees `ptr` is a live allocation of this pool; stream is live.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr, stream.raw)
        })
    }

    /// The data another process passes to [`MemPool::import_pointer`] to name `ptr`.
    pub fn export_pointer(&self, ptr: CUdeviceptr) -> Result<PointerExport, CudaError> {
        let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
        // SAFETY: the out-pointer is a valid local; the driver validates `ptr` itself.
        check("cuMemPoolExportPointer", unsafe {
            sys::cuMemPoolExportPointer(&mut data, ptr)
        })?;
        Ok(data.reserved)
    }

    /// Maps an allocation exported by [`MemPool::export_pointer`] into this process. Import
    /// each pointer once per process: two imports of one allocation share a mapping, and the
    /// first free unmaps both.
    pub fn import_pointer(&self, export: &PointerExport) -> Result<CUdeviceptr, CudaError> {
        self.ctx.make_current()?;
        let mut data = sys::CUmemPoolPtrExportData { reserved: *export };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the pool is live; `data` is a valid local the driver only reads.
        check("cuMemPoolImportPointer", unsafe {
            sys::cuMemPoolImportPointer(&mut ptr, self.raw, &mut data)
        })?;
        Ok(ptr)
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        // SAFETY: we own the pool handle and destroy it once. Outstanding allocations keep the
        // driver's resources alive until they are freed.
        let r = unsafe { sys::cuMemPoolDestroy(self.raw) };
        log_drop_error("memory pool", "cuMemPoolDestroy", r);
    }
}

/// Copies `bytes` from device memory to host memory, ordered on `stream`.
///
/// # Safety
/// `src` is valid device memory for `bytes`; `dst` is valid for `bytes` writes and stays valid,
/// and unread by the host, until the copy completes (pinned memory makes the copy truly async).
pub unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: CUdeviceptr,
    bytes: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees both ranges; the stream is live.
    check("cuMemcpyDtoHAsync_v2", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, bytes, stream.raw)
    })
}

/// Copies `bytes` from host memory to device memory, ordered on `stream`.
///
/// # Safety
/// `dst` is valid device memory for `bytes` that no concurrent work uses; `src` is valid for
/// `bytes` reads and is neither freed nor written until the copy completes.
pub unsafe fn memcpy_htod_async(
    dst: CUdeviceptr,
    src: *const u8,
    bytes: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees both ranges; the stream is live.
    check("cuMemcpyHtoDAsync_v2", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), bytes, stream.raw)
    })
}

/// Sets `bytes` bytes at `dst` to `value`, ordered on `stream`.
///
/// # Safety
/// `dst` is valid device memory for `bytes` that no concurrent work uses.
pub unsafe fn memset_d8_async(
    dst: CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees the range; the stream is live.
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(dst, value, bytes, stream.raw)
    })
}

/// The condition of [`stream_wait_value64`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitCondition {
    /// Wait until `*ptr >= value` (unsigned; wrap-around aware comparison by the driver).
    Geq,
    /// Wait until `*ptr == value`.
    Eq,
}

/// Enqueues a write of `value` to the 8-byte word at `ptr`, after prior work on `stream`
/// (with a memory fence before the write).
///
/// # Safety
/// `ptr` is valid, 8-byte aligned device (or registered host) memory, usable by stream memory
/// operations (not memory from an IPC-capable pool, which the driver rejects).
pub unsafe fn stream_write_value64(
    stream: &Stream,
    ptr: CUdeviceptr,
    value: u64,
) -> Result<(), CudaError> {
    // SAFETY: `stream` is live (borrowed); the caller guarantees `ptr`.
    unsafe { stream_write_value64_raw(stream.raw, ptr, value) }
}

/// As [`stream_write_value64`], on a stream given by handle.
///
/// # Safety
/// As for [`stream_write_value64`]; `stream` is a live handle of the current context (or
/// `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD`).
pub unsafe fn stream_write_value64_raw(
    stream: CUstream,
    ptr: CUdeviceptr,
    value: u64,
) -> Result<(), CudaError> {
    let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as c_uint;
    // SAFETY: the caller guarantees `ptr` and `stream`.
    check("cuStreamWriteValue64_v2", unsafe {
        sys::cuStreamWriteValue64_v2(stream, ptr, value, flags)
    })
}

/// Makes later work on `stream` wait until the 8-byte word at `ptr` meets `condition`
/// against `value`.
///
/// # Safety
/// As for [`stream_write_value64`]; in addition `ptr` stays valid until the wait completes.
pub unsafe fn stream_wait_value64(
    stream: &Stream,
    ptr: CUdeviceptr,
    value: u64,
    condition: WaitCondition,
) -> Result<(), CudaError> {
    // SAFETY: `stream` is live (borrowed); the caller guarantees `ptr`.
    unsafe { stream_wait_value64_raw(stream.raw, ptr, value, condition) }
}

/// As [`stream_wait_value64`], on a stream given by handle.
///
/// # Safety
/// As for [`stream_wait_value64`]; `stream` is a live handle of the current context (or
/// `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD`).
pub unsafe fn stream_wait_value64_raw(
    stream: CUstream,
    ptr: CUdeviceptr,
    value: u64,
    condition: WaitCondition,
) -> Result<(), CudaError> {
    let flags = match condition {
        WaitCondition::Geq => sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ,
        WaitCondition::Eq => sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ,
    } as c_uint;
    // SAFETY: the caller guarantees `ptr` and `stream`.
    check("cuStreamWaitValue64_v2", unsafe {
        sys::cuStreamWaitValue64_v2(stream, ptr, value, flags)
    })
}

/// Page-locked host memory (`cuMemHostAlloc`, portable across contexts), zeroed at creation.
/// Freed on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: the buffer is plain host memory owned by this value; it hands out only raw pointers
// and `unsafe` slices whose callers take on the aliasing rules.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as for Send; `&self` methods give out no safe mutable access.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes (must be non-zero) of pinned host memory.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<PinnedBuffer, CudaError> {
        if len == 0 {
            return Err(CudaError::InvalidArgument(
                "pinned buffer of 0 bytes".into(),
            ));
        }
        ctx.make_current()?;
        let mut raw: *mut c_void = ptr::null_mut();
        // SAFETY: the context is current; the out-pointer is a valid local.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut raw, len, sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| {
            CudaError::InvalidArgument("cuMemHostAlloc returned a null pointer".into())
        })?;
        // SAFETY: the driver just allocated `len` writable bytes at `ptr`; nothing else uses them.
        unsafe { ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            ptr,
            len,
            ctx: Arc::clone(ctx),
        })
    }

    /// The start of the buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false` (empty buffers are refused); present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for the host to read.
    ///
    /// # Safety
    /// No GPU work that writes the buffer may be in flight while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid and initialised for `len` bytes for the life of `self`; the
        // caller guarantees the GPU does not write it meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, for the host to write.
    ///
    /// # Safety
    /// No GPU work that reads or writes the buffer may be in flight while the slice lives.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; `&mut self` rules out other host borrows.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("dropping pinned buffer: {e}");
        }
        // SAFETY: we allocated this pointer with cuMemHostAlloc and free it once.
        let r = unsafe { sys::cuMemFreeHost(self.ptr.as_ptr().cast::<c_void>()) };
        log_drop_error("pinned buffer", "cuMemFreeHost", r);
    }
}

/// Plain device memory (`cuMemAlloc`), not from a pool. Freed on drop (`cuMemFree`, which waits
/// for work using it on the device).
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<Context>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (must be non-zero); the contents are undefined.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<DeviceBuffer, CudaError> {
        if len == 0 {
            return Err(CudaError::InvalidArgument(
                "device buffer of 0 bytes".into(),
            ));
        }
        ctx.make_current()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the context is current; the out-pointer is a valid local.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len)
        })?;
        Ok(DeviceBuffer {
            ptr,
            len,
            ctx: Arc::clone(ctx),
        })
    }

    /// The device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false` (empty buffers are refused); present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("dropping device buffer: {e}");
        }
        // SAFETY: we allocated this pointer with cuMemAlloc and free it once.
        let r = unsafe { sys::cuMemFree_v2(self.ptr) };
        log_drop_error("device buffer", "cuMemFree_v2", r);
    }
}

impl DeviceBuffer {
    /// The legacy IPC handle of this allocation (`cuIpcGetMemHandle`), which another process
    /// opens with [`IpcMapping::open`]. The handle names the whole allocation, so allocate
    /// exactly what may be shared.
    pub fn ipc_handle(&self) -> Result<IpcMemHandle, CudaError> {
        self.ctx.make_current()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `ptr` is our live cuMemAlloc allocation; the out-pointer is a valid local.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, self.ptr)
        })?;
        Ok(handle.reserved.map(|c| c.to_ne_bytes()[0]))
    }
}

/// Another process's `cuMemAlloc` allocation, opened from its legacy IPC handle
/// (`cuIpcOpenMemHandle_v2` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`). Closed on drop
/// (`cuIpcCloseMemHandle`).
///
/// Drop it only after the work that uses it finished (synchronise the streams first), and
/// before the exporter frees the allocation.
#[derive(Debug)]
pub struct IpcMapping {
    ptr: CUdeviceptr,
    ctx: Arc<Context>,
}

// SAFETY: the mapping is a driver-side record usable from any thread; we only keep the
// address to close it.
unsafe impl Send for IpcMapping {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens a handle made by [`DeviceBuffer::ipc_handle`] in another process. The driver
    /// refuses handles of the calling process. Open each handle once per process.
    pub fn open(ctx: &Arc<Context>, handle: &IpcMemHandle) -> Result<IpcMapping, CudaError> {
        ctx.make_current()?;
        let handle = sys::CUipcMemHandle {
            reserved: handle.map(|b| c_char::from_ne_bytes([b])),
        };
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the context is current; the handle is passed by value; out-pointer is a local.
        check("cuIpcOpenMemHandle_v2", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags)
        })?;
        Ok(IpcMapping {
            ptr,
            ctx: Arc::clone(ctx),
        })
    }

    /// The device address of the allocation's first byte in this process.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("dropping IPC mapping: {e}");
        }
        // SAFETY: opened in `open`, closed once, here; the owner guarantees no work uses it.
        let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        log_drop_error("IPC mapping", "cuIpcCloseMemHandle", r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_the_call_and_code() {
        assert!(check("cuInit", CUresult::CUDA_SUCCESS).is_ok());
        let e = check("cuMemPoolCreate", CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert_eq!(e.driver_code(), Some(CUresult::CUDA_ERROR_INVALID_VALUE));
        let text = e.to_string();
        assert!(text.contains("cuMemPoolCreate"), "{text}");
        assert!(text.contains("CUDA_ERROR_INVALID_VALUE (1)"), "{text}");
    }

    #[test]
    fn stream_mem_op_errors_carry_a_hint() {
        let e = check("cuStreamWaitValue64_v2", CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert!(e.to_string().contains("cuMemAlloc memory"), "{e}");
    }

    #[test]
    fn entry_points_report_a_missing_driver_without_panicking() {
        if driver_present() {
            return; // covered by the GPU tests
        }
        let is_no_driver = |e: CudaError| {
            assert!(
                e.to_string()
                    .starts_with("no CUDA driver found (libcuda.so.1 could not be loaded): "),
                "{e}"
            );
            matches!(e, CudaError::NoDriver(_))
        };
        assert!(is_no_driver(init().unwrap_err()));
        assert!(is_no_driver(driver_version().unwrap_err()));
        assert!(is_no_driver(device_count().unwrap_err()));
        assert!(is_no_driver(Device::get(0).unwrap_err()));
        assert!(is_no_driver(Context::new(0).unwrap_err()));
    }

    #[test]
    fn device_handles_are_thread_safe() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Context>();
        assert_send_sync::<Stream>();
        assert_send_sync::<Event>();
        assert_send_sync::<MemPool>();
        assert_send_sync::<PinnedBuffer>();
        assert_send_sync::<DeviceBuffer>();
        assert_send_sync::<IpcMapping>();
    }

    mod gpu {
        use super::super::*;

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn ipc_event_handle_exports_but_does_not_open_in_its_own_process() {
            let ctx = Context::new(0).unwrap();
            let a = Stream::new(&ctx).unwrap();
            let b = Stream::new(&ctx).unwrap();
            let event = Event::new_ipc(&ctx).unwrap();
            let handle = event.ipc_handle().unwrap();
            assert_ne!(handle, [0u8; 64]);
            // The driver refuses to open an IPC handle in the process that created it
            // (CUDA_ERROR_INVALID_CONTEXT on driver 580); the cross-process test opens it.
            let e = Event::open_ipc(&ctx, &handle).unwrap_err();
            assert!(e.to_string().contains("other process"), "{e}");
            event.record(&a).unwrap();
            b.wait_event(&event).unwrap();
            b.synchronize().unwrap();
            assert!(event.query().unwrap());
            assert!(Event::new_timing(&ctx).unwrap().ipc_handle().is_err());
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn timing_events_measure_elapsed_time() {
            let ctx = Context::new(0).unwrap();
            let s = Stream::new(&ctx).unwrap();
            let (start, end) = (
                Event::new_timing(&ctx).unwrap(),
                Event::new_timing(&ctx).unwrap(),
            );
            let buf = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
            start.record(&s).unwrap();
            // SAFETY: `buf` is a live 1 MiB allocation used by nothing else.
            unsafe { memset_d8_async(buf.ptr(), 7, buf.len(), &s) }.unwrap();
            end.record(&s).unwrap();
            end.synchronize().unwrap();
            assert!(Event::elapsed_ms(&start, &end).unwrap() >= 0.0);
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn stream_memory_operations_work_on_plain_device_memory() {
            let ctx = Context::new(0).unwrap();
            let s = Stream::new(&ctx).unwrap();
            let word = DeviceBuffer::new(&ctx, 8).unwrap();
            let host = PinnedBuffer::new(&ctx, 8).unwrap();
            // SAFETY: `word` and `host` are live 8-byte buffers used only by stream `s`, and
            // the host reads `host` only after synchronize.
            unsafe {
                memset_d8_async(word.ptr(), 0, 8, &s).unwrap();
                stream_write_value64(&s, word.ptr(), 5).unwrap();
                stream_wait_value64(&s, word.ptr(), 5, WaitCondition::Geq).unwrap();
                memcpy_dtoh_async(host.as_ptr(), word.ptr(), 8, &s).unwrap();
            }
            s.synchronize().unwrap();
            // SAFETY: the stream is idle, so nothing writes `host`.
            let bytes: [u8; 8] = unsafe { host.as_slice() }.try_into().unwrap();
            assert_eq!(u64::from_le_bytes(bytes), 5);
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn legacy_ipc_handle_exports_but_does_not_open_in_its_own_process() {
            let ctx = Context::new(0).unwrap();
            let buf = DeviceBuffer::new(&ctx, 2 << 20).unwrap();
            let handle = buf.ipc_handle().unwrap();
            assert_ne!(handle, [0u8; 64]);
            // The driver refuses to open a memory handle in the process that made it; the
            // cross-process integration tests open it.
            assert!(IpcMapping::open(&ctx, &handle).is_err());
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn pool_export_fabric_needs_a_fabric_pool() {
            let ctx = Context::new(0).unwrap();
            let pool = MemPool::new_exportable(&ctx, 64 << 20, PoolHandleType::PosixFd).unwrap();
            assert!(matches!(
                pool.export_fabric(),
                Err(CudaError::Unsupported { .. })
            ));
            assert_eq!(pool.handle_type(), PoolHandleType::PosixFd);
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn pool_exports_an_fd_and_pointers() {
            let ctx = Context::new(0).unwrap();
            let s = Stream::new(&ctx).unwrap();
            let pool = MemPool::new_exportable(&ctx, 64 << 20, PoolHandleType::PosixFd).unwrap();
            let ptr = pool.alloc_async(2 << 20, &s).unwrap();
            let fd = pool.export_fd().unwrap();
            assert!(fd.as_raw_fd() >= 0);
            let export = pool.export_pointer(ptr).unwrap();
            assert_ne!(export, [0u8; 64]);
            // SAFETY: `ptr` came from this pool and nothing uses it after the free.
            unsafe { pool.free_async(ptr, &s) }.unwrap();
            s.synchronize().unwrap();
        }
    }
}

/// Host memory registered with the driver (`cuMemHostRegister`, portable and device-mapped),
/// so that GPU stream memory operations can read and write it. Unregistered on drop; the
/// memory itself stays owned by the caller and must outlive this registration.
#[derive(Debug)]
pub struct HostRegistration {
    host: *mut c_void,
    device_ptr: CUdeviceptr,
    ctx: Arc<Context>,
}

// SAFETY: the registration is a driver-side record usable from any thread; we only keep the
// address to unregister it.
unsafe impl Send for HostRegistration {}
// SAFETY: no method mutates through `&self`.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `len` bytes at `host` (page-aligned, `len` a multiple of the page size).
    ///
    /// # Safety
    /// `host..host + len` is a live mapping that stays mapped until this value is dropped.
    pub unsafe fn new(ctx: &Arc<Context>, host: *mut u8, len: usize) -> Result<Self, CudaError> {
        ctx.make_current()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller guarantees the range is mapped for the registration's life.
        check("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(host.cast::<c_void>(), len, flags as c_uint)
        })?;
        let reg = HostRegistration {
            host: host.cast::<c_void>(),
            device_ptr: 0,
            ctx: Arc::clone(ctx),
        };
        let mut dptr: CUdeviceptr = 0;
        // SAFETY: the range was just registered; the out-pointer is a valid local.
        check("cuMemHostGetDevicePointer_v2", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, reg.host, 0)
        })?;
        let mut reg = reg;
        reg.device_ptr = dptr;
        Ok(reg)
    }

    /// The device address of the registered memory's first byte.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device_ptr
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.ctx.make_current().is_err() {
            return;
        }
        // SAFETY: registered in `new`, unregistered once, here, while still mapped.
        let r = unsafe { sys::cuMemHostUnregister(self.host) };
        log_drop_error("host registration", "cuMemHostUnregister", r);
    }
}
