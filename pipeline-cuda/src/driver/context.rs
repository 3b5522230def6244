//! Devices, their primary contexts, and streams.

use std::ffi::{c_char, c_int, c_uint};
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CUdevice_attribute, CUevent, CUstream, CudaError, check, init, log_drop_error};

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

    /// Whether kernels on this device can read and write `peer`'s memory (peer access, over
    /// NVLink or PCIe). Always true for the device itself.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool, CudaError> {
        if peer.raw == self.raw {
            return Ok(true);
        }
        let mut can: c_int = 0;
        // SAFETY: both handles came from cuDeviceGet after init(); the out-pointer is a
        // valid local.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.raw, peer.raw)
        })?;
        Ok(can != 0)
    }

    /// The driver's relative performance rank of the link from this device to `peer`
    /// (`CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`), or None when the two cannot reach each
    /// other.
    pub fn peer_performance_rank(&self, peer: &Device) -> Result<Option<i32>, CudaError> {
        if peer.raw == self.raw || !self.can_access_peer(peer)? {
            return Ok(None);
        }
        let mut rank: c_int = 0;
        // SAFETY: both handles came from cuDeviceGet after init(); the out-pointer is a
        // valid local.
        check("cuDeviceGetP2PAttribute", unsafe {
            sys::cuDeviceGetP2PAttribute(
                &mut rank,
                sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK,
                self.raw,
                peer.raw,
            )
        })?;
        Ok(Some(rank))
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

    /// L2 cache size in bytes.
    pub fn l2_cache_bytes(&self) -> Result<u64, CudaError> {
        let n = self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?;
        Ok(u64::try_from(n).unwrap_or(0))
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

    /// Lets this context's kernels and copies reach `peer`'s `cuMemAlloc` memory
    /// (`cuCtxEnablePeerAccess`); already enabled is not an error. Pool and VMM memory need
    /// their own access settings instead.
    pub fn enable_peer_access(&self, peer: &Context) -> Result<(), CudaError> {
        self.make_current()?;
        // SAFETY: both contexts are retained primary contexts; flags must be 0.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.raw, 0) };
        if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check("cuCtxEnablePeerAccess", r)
    }

    /// The device's free and total memory in bytes, as the driver sees them now
    /// (`cuMemGetInfo`): free counts every process's allocations, not only this context's.
    pub fn memory_info(&self) -> Result<(u64, u64), CudaError> {
        self.make_current()?;
        let (mut free, mut total): (usize, usize) = (0, 0);
        // SAFETY: the context is current on this thread; both out-pointers are valid locals.
        check("cuMemGetInfo_v2", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
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

/// A non-blocking stream (`CU_STREAM_NON_BLOCKING`). Destroyed on drop.
#[derive(Debug)]
pub struct Stream {
    // Read by the event, pool and memops wrappers next door.
    pub(super) raw: sys::CUstream,
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

    /// Creates a non-blocking stream with the device's highest priority: where blocks of
    /// several streams wait for the same SMs, the scheduler starts this stream's first. For
    /// transfers that run SM kernels (NCCL) beside compute that fills the GPU.
    pub fn new_high_priority(ctx: &Arc<Context>) -> Result<Stream, CudaError> {
        ctx.make_current()?;
        let (mut least, mut greatest): (c_int, c_int) = (0, 0);
        // SAFETY: the context is current; both out-pointers are valid locals.
        check("cuCtxGetStreamPriorityRange", unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
        })?;
        let mut raw: sys::CUstream = ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        // SAFETY: the context is current; the out-pointer is a valid local; `greatest` is a
        // priority the driver just reported for this context.
        check("cuStreamCreateWithPriority", unsafe {
            sys::cuStreamCreateWithPriority(&mut raw, flags, greatest)
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

    /// True when all work enqueued on the stream has completed (`cuStreamQuery`).
    pub fn query(&self) -> Result<bool, CudaError> {
        // SAFETY: `self.raw` is a live stream.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(CudaError::driver("cuStreamQuery", r)),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: we created the stream and destroy it once; pending work still completes.
        let r = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        log_drop_error("stream", "cuStreamDestroy_v2", r);
    }
}

pub(crate) fn device_location(device: &Device) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device.raw,
    }
}
