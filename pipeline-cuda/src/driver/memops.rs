//! Work on memory ordered on a stream: copies, memset, and the stream memory operations
//! (`cuStreamWriteValue64` / `cuStreamWaitValue64`) that gpipe's timeline words use.

use std::ffi::{c_uint, c_void};

use cudarc::driver::sys;

use super::{CUdeviceptr, CUstream, CudaError, Stream, check};

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

/// Copies `bytes` between device allocations (possibly of two GPUs, by unified addressing;
/// the source must be accessible from the stream's device), ordered on `stream`.
///
/// # Safety
/// `src` is valid device memory for `bytes` reads that nothing writes until the copy
/// completes; `dst` is valid device memory for `bytes` that no concurrent work uses.
pub unsafe fn memcpy_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees both ranges; the stream is live.
    check("cuMemcpyAsync", unsafe {
        sys::cuMemcpyAsync(dst, src, bytes, stream.raw)
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
/// As for [`stream_write_value64`]; `stream` is a live stream handle (a created stream names its own
/// context, as the `&Stream` form relies on), or `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD`
/// with the intended context current.
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
/// As for [`stream_wait_value64`]; `stream` is a live stream handle (a created stream names its own
/// context, as the `&Stream` form relies on), or `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD`
/// with the intended context current.
pub unsafe fn stream_wait_value64_raw(
    stream: CUstream,
    ptr: CUdeviceptr,
    value: u64,
    condition: WaitCondition,
) -> Result<(), CudaError> {
    let flags = wait_flags(condition);
    // SAFETY: the caller guarantees `ptr` and `stream`.
    check("cuStreamWaitValue64_v2", unsafe {
        sys::cuStreamWaitValue64_v2(stream, ptr, value, flags)
    })
}

/// One stream memory operation of a batch ([`stream_mem_ops_raw`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemOp {
    /// Write `value` to the 8-byte word at `ptr`, as [`stream_write_value64`] does.
    Write {
        /// The word.
        ptr: CUdeviceptr,
        /// The value.
        value: u64,
    },
    /// Wait until the 8-byte word at `ptr` meets `condition` against `value`, as
    /// [`stream_wait_value64`] does.
    Wait {
        /// The word.
        ptr: CUdeviceptr,
        /// The value.
        value: u64,
        /// The comparison.
        condition: WaitCondition,
    },
}

/// Most operations one [`stream_mem_ops_raw`] call takes (the driver's limit is 256).
pub const MAX_MEM_OPS: usize = 255;

impl MemOp {
    fn params(self) -> sys::CUstreamBatchMemOpParams {
        // SAFETY: the union and the structs in it are plain C data, for which all-zero bytes
        // are a valid value; starting from zero leaves no byte (padding, the union's tail)
        // undefined.
        let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
        match self {
            MemOp::Write { ptr, value } => {
                // SAFETY: a borrow of a union field; the bytes are zero, valid for every
                // variant, and this is the variant the driver will read (`operation`).
                let w = unsafe { &mut p.writeValue };
                w.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64;
                w.address = ptr;
                w.__bindgen_anon_1.value64 = value;
                w.flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as c_uint;
            }
            MemOp::Wait {
                ptr,
                value,
                condition,
            } => {
                // SAFETY: as above.
                let w = unsafe { &mut p.waitValue };
                w.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_64;
                w.address = ptr;
                w.__bindgen_anon_1.value64 = value;
                w.flags = wait_flags(condition);
            }
        }
        p
    }
}

fn wait_flags(condition: WaitCondition) -> c_uint {
    (match condition {
        WaitCondition::Geq => sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ,
        WaitCondition::Eq => sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ,
    }) as c_uint
}

/// Enqueues `ops` on `stream` as batched stream memory operations (`cuStreamBatchMemOp`),
/// which the driver runs in array order. Measured on an H100 (docs/benchmarks.md), a write
/// and a wait batched into one operation idle the GPU about 1 µs less between two kernels
/// than the same two enqueued one by one, and the host makes one driver call instead of two.
///
/// # Safety
/// As for [`stream_write_value64_raw`] and [`stream_wait_value64_raw`], for every word named.
pub unsafe fn stream_mem_ops_raw(stream: CUstream, ops: &[MemOp]) -> Result<(), CudaError> {
    if ops.is_empty() {
        return Ok(());
    }
    if ops.len() > MAX_MEM_OPS {
        return Err(CudaError::InvalidArgument(format!(
            "{} stream memory operations in one batch; at most {MAX_MEM_OPS}",
            ops.len()
        )));
    }
    // The hot path's batches (a write and a wait or two) stay on the stack.
    let mut small = [MemOp::Write { ptr: 0, value: 0 }.params(); 4];
    let mut large = Vec::new();
    let params = if ops.len() <= small.len() {
        for (p, o) in small.iter_mut().zip(ops) {
            *p = o.params();
        }
        &mut small[..ops.len()]
    } else {
        large.extend(ops.iter().map(|o| o.params()));
        &mut large[..]
    };
    // SAFETY: `params` holds `ops.len()` fully initialised operations, read by the driver
    // during the call only; the caller guarantees the words and `stream`. One call: the
    // driver enqueues all of them or, on an error, none.
    check("cuStreamBatchMemOp_v2", unsafe {
        sys::cuStreamBatchMemOp_v2(stream, params.len() as c_uint, params.as_mut_ptr(), 0)
    })
}

#[cfg(test)]
mod tests {
    mod gpu {
        use super::super::*;
        use crate::driver::{Context, DeviceBuffer, PinnedBuffer};

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
    }
}
