//! GPU timeline stamps of chosen batches' kernels (`gpipe bench --gpu-timeline`).

use std::sync::Arc;

use pipeline_cuda::driver::{self, Context, CudaError, DeviceBuffer, PinnedBuffer, Stream};

use super::kernels;

/// GPU timeline stamps (start and end of a kernel, the GPU's global timer in ns) of the
/// batches with sequence numbers `from..from + count`, in one device buffer zeroed at first
/// use. Kernels outside the window are not stamped.
pub struct StampRecorder {
    from: u64,
    count: u64,
    buf: Option<(DeviceBuffer, Arc<Context>)>,
}

impl StampRecorder {
    /// A recorder for batches `from..from + count`.
    pub fn new(from: u64, count: u64) -> Self {
        Self {
            from,
            count,
            buf: None,
        }
    }

    /// The stamps of batch `seq` for a kernel about to be launched on `stream` (0: not
    /// recorded). The buffer is made and zeroed on `stream` at first use, before any launch.
    pub fn ptr_for(&mut self, stream: &Stream, seq: u64) -> Result<u64, String> {
        let Some(i) = seq.checked_sub(self.from).filter(|&i| i < self.count) else {
            return Ok(0);
        };
        if self.buf.is_none() {
            let ctx = Arc::clone(stream.context());
            let len = self.count as usize * kernels::STAMP_BYTES;
            let buf = DeviceBuffer::new(&ctx, len).map_err(|e| e.to_string())?;
            // SAFETY: freshly allocated and ours; every stamped launch comes after this memset
            // on the same stream.
            unsafe { driver::memset_d8_async(buf.ptr(), 0, len, stream) }
                .map_err(|e| e.to_string())?;
            self.buf = Some((buf, ctx));
        }
        let (buf, _) = self.buf.as_ref().ok_or("stamp buffer")?;
        Ok(buf.ptr() + i * kernels::STAMP_BYTES as u64)
    }

    /// Every recorded (start, end), by sequence number from `from`; zeros where a batch was
    /// not stamped. Waits for the whole context, so every stamped kernel is done.
    pub fn read(&mut self) -> Result<Vec<[u64; 2]>, String> {
        let Some((buf, ctx)) = self.buf.as_ref() else {
            return Ok(Vec::new());
        };
        let err = |e: CudaError| e.to_string();
        ctx.synchronize().map_err(err)?;
        let len = self.count as usize * kernels::STAMP_BYTES;
        let host = PinnedBuffer::new(ctx, len).map_err(err)?;
        let stream = Stream::new(ctx).map_err(err)?;
        // SAFETY: both buffers hold `len` bytes; every kernel writing `buf` has completed (the
        // context was synchronized); the host reads `host` after the stream's synchronize.
        unsafe { driver::memcpy_dtoh_async(host.as_ptr(), buf.ptr(), len, &stream) }
            .map_err(err)?;
        stream.synchronize().map_err(err)?;
        // SAFETY: the copy above completed; nothing else writes `host`.
        let bytes = unsafe { host.as_slice() };
        Ok(bytes
            .chunks_exact(kernels::STAMP_BYTES)
            .map(|c| {
                let w = |k: usize| {
                    u64::from_le_bytes(c[k * 8..k * 8 + 8].try_into().unwrap_or_default())
                };
                [w(0), w(1)]
            })
            .collect())
    }
}
