//! Events: ordering-only, timing, and interprocess (IPC) events.

use std::ffi::{c_char, c_uint};
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CUevent, CUresult, CUstream, Context, CudaError, Stream, check, log_drop_error};

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

impl Stream {
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
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we own the event (created or opened) and destroy it once.
        let r = unsafe { sys::cuEventDestroy_v2(self.raw) };
        log_drop_error("event", "cuEventDestroy_v2", r);
    }
}

#[cfg(test)]
mod tests {
    mod gpu {
        use super::super::*;
        use crate::driver::{DeviceBuffer, memset_d8_async};

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
    }
}
