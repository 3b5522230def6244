//! NVRTC-compiled kernels that fill a batch with gpipe's test pattern and verify it on the GPU.
//!
//! The pattern and checksum match pipeline-core's host definitions exactly. Words are `u64`
//! little-endian; a batch of `len` bytes (a multiple of 8) holds `len / 8` words:
//!
//! ```text
//! pattern_word(seq, i)  = seq * 0x9E3779B97F4A7C15 ^ i * 0xD1B54A32D192ED03 ^ 0x5851F42D4C957F2D
//! checksum_term(w, i)   = rotate_left(w ^ (w >> 29), i & 63)
//! checksum(data)        = wrapping sum over i of checksum_term(word[i], i)
//! ```
//!
//! The source is compiled once per process and architecture (PTX for `compute_XY`, JIT-compiled
//! by the driver when a module is loaded) and loaded per context by [`Kernels::load`]. They are
//! the benchmark's work, not the library's: `gpipe bench`, `produce`, `consume` and `soak` fill
//! and verify with them, and the ceilings, call costs and GPU gaps time them.

use std::collections::HashMap;
use std::ffi::{CString, c_int, c_uint, c_void};
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys;
use cudarc::nvrtc::{self, CompileError, CompileOptions};
use pipeline_cuda::driver::{
    CUdeviceptr, Context, CudaError, Stream, check, ensure_nvrtc, nvrtc_check,
};

/// CUDA C++ source of the `gpipe_fill` and `gpipe_verify` kernels.
pub const KERNEL_SOURCE: &str = r#"
typedef unsigned long long u64;

#define GPIPE_SEQ_MUL 0x9E3779B97F4A7C15ULL
#define GPIPE_IDX_MUL 0xD1B54A32D192ED03ULL
#define GPIPE_XOR     0x5851F42D4C957F2DULL

__device__ __forceinline__ u64 gpipe_pattern_word(u64 seq, u64 i) {
    return (seq * GPIPE_SEQ_MUL) ^ (i * GPIPE_IDX_MUL) ^ GPIPE_XOR;
}

__device__ __forceinline__ u64 gpipe_checksum_term(u64 w, u64 i) {
    u64 x = w ^ (w >> 29);
    unsigned r = (unsigned)(i & 63);
    return (x << r) | (x >> ((64u - r) & 63u));
}

__device__ __forceinline__ u64 gpipe_warp_sum(u64 v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_down_sync(0xffffffffu, v, offset);
    }
    return v;
}

__device__ __forceinline__ u64 gpipe_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// GPU timeline stamps (stamps == 0: none). stamps[0]: when block 0 started; stamps[1]: when the
// last block finished; stamps[2]: blocks finished so far (zero before the launch). The timer
// is the GPU's, shared by every context and process on it, in nanoseconds.
__device__ __forceinline__ void gpipe_stamp_begin(u64* stamps) {
    if (stamps != 0 && blockIdx.x == 0 && threadIdx.x == 0) {
        stamps[0] = gpipe_now();
    }
}

__device__ __forceinline__ void gpipe_stamp_end(u64* stamps) {
    if (stamps == 0) {
        return;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&stamps[2], 1ULL) == (u64)gridDim.x - 1ULL) {
            stamps[1] = gpipe_now();
        }
    }
}

extern "C" __global__ void gpipe_fill(u64* __restrict__ data, u64 nwords, u64 seq, u64* stamps) {
    gpipe_stamp_begin(stamps);
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nwords; i += stride) {
        data[i] = gpipe_pattern_word(seq, i);
    }
    gpipe_stamp_end(stamps);
}

// out[0] += checksum of the data, out[1] += checksum of the expected pattern,
// out[2] += number of words that differ from the pattern. blockDim.x must be a multiple of 32.
extern "C" __global__ void gpipe_verify(const u64* __restrict__ data, u64 nwords, u64 seq,
                                        u64* out, u64* stamps) {
    gpipe_stamp_begin(stamps);
    u64 actual = 0, expected = 0, mismatched = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nwords; i += stride) {
        const u64 w = data[i];
        const u64 p = gpipe_pattern_word(seq, i);
        actual += gpipe_checksum_term(w, i);
        expected += gpipe_checksum_term(p, i);
        mismatched += (w != p) ? 1ULL : 0ULL;
    }
    __shared__ u64 part[3][32];
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    actual = gpipe_warp_sum(actual);
    expected = gpipe_warp_sum(expected);
    mismatched = gpipe_warp_sum(mismatched);
    if (lane == 0) {
        part[0][warp] = actual;
        part[1][warp] = expected;
        part[2][warp] = mismatched;
    }
    __syncthreads();
    if (warp == 0) {
        const unsigned nwarps = (blockDim.x + 31u) >> 5;
        actual = lane < nwarps ? part[0][lane] : 0ULL;
        expected = lane < nwarps ? part[1][lane] : 0ULL;
        mismatched = lane < nwarps ? part[2][lane] : 0ULL;
        actual = gpipe_warp_sum(actual);
        expected = gpipe_warp_sum(expected);
        mismatched = gpipe_warp_sum(mismatched);
        if (lane == 0) {
            atomicAdd(&out[0], actual);
            atomicAdd(&out[1], expected);
            atomicAdd(&out[2], mismatched);
        }
    }
    gpipe_stamp_end(stamps);
}
"#;

/// Threads per block of both kernels.
pub const THREADS_PER_BLOCK: u32 = 256;
/// Words each thread handles at least, before the grid is capped.
const WORDS_PER_THREAD: u64 = 4;
/// Blocks per SM at most; the kernels are grid-stride loops, so more data means more iterations.
const BLOCKS_PER_SM: u32 = 4;
/// Size of one kernel's GPU timeline stamps: start, end (GPU global timer, ns) and a block
/// counter that must be zero before the launch.
pub const STAMP_BYTES: usize = 24;
/// Size of one verify result slot: three `u64` counters (see [`VerifyResult`]).
pub const VERIFY_RESULT_BYTES: usize = 24;

/// The three counters `gpipe_verify` adds into its result slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyResult {
    /// Checksum of the data as found.
    pub actual_checksum: u64,
    /// Checksum of the pattern the data should hold.
    pub expected_checksum: u64,
    /// Number of words that differ from the pattern.
    pub mismatched_words: u64,
}

impl VerifyResult {
    /// Decodes a result slot (three little-endian `u64`s).
    pub fn from_bytes(bytes: &[u8; VERIFY_RESULT_BYTES]) -> VerifyResult {
        let word = |k: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[8 * k..8 * k + 8]);
            u64::from_le_bytes(w)
        };
        VerifyResult {
            actual_checksum: word(0),
            expected_checksum: word(1),
            mismatched_words: word(2),
        }
    }

    /// The data matched the pattern.
    pub fn passed(&self) -> bool {
        self.mismatched_words == 0 && self.actual_checksum == self.expected_checksum
    }
}

/// Number of `u64` words in a batch of `nbytes`, which must be a multiple of 8.
pub fn words_in(nbytes: usize) -> Result<u64, CudaError> {
    if nbytes % 8 != 0 {
        return Err(CudaError::InvalidArgument(format!(
            "batch length {nbytes} is not a multiple of 8 bytes"
        )));
    }
    Ok((nbytes / 8) as u64)
}

/// Grid size for `nwords`: enough blocks for [`WORDS_PER_THREAD`] words per thread, at most
/// [`BLOCKS_PER_SM`] per SM, at least one.
pub fn launch_blocks(nwords: u64, sm_count: u32) -> u32 {
    let per_block = u64::from(THREADS_PER_BLOCK) * WORDS_PER_THREAD;
    let wanted = nwords.div_ceil(per_block);
    let cap = u64::from(sm_count.max(1)) * u64::from(BLOCKS_PER_SM);
    wanted.clamp(1, cap) as u32
}

/// The newest virtual architecture NVRTC supports that the device can run, as `(major, minor)`.
fn target_arch(device: (i32, i32)) -> Result<(i32, i32), CudaError> {
    let wanted = device.0 * 10 + device.1;
    let mut count: c_int = 0;
    // SAFETY: NVRTC is loaded (checked by the caller); out-pointer is a valid local.
    let r = unsafe { nvrtc::sys::nvrtcGetNumSupportedArchs(&mut count) };
    nvrtc_check("listing architectures", r)?;
    let mut archs: Vec<c_int> = vec![0; usize::try_from(count).unwrap_or(0)];
    if !archs.is_empty() {
        // SAFETY: `archs` has room for the `count` entries NVRTC writes.
        let r = unsafe { nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
        nvrtc_check("listing architectures", r)?;
    }
    let best = archs.iter().copied().filter(|&a| a <= wanted).max();
    match best {
        Some(a) => Ok((a / 10, a % 10)),
        None => Err(CudaError::Unsupported {
            what: format!(
                "NVRTC supports no architecture at or below the device's compute {}.{}",
                device.0, device.1
            ),
            hint: "use an NVRTC release that still supports this GPU".into(),
        }),
    }
}

/// Compiled PTX images by target architecture.
type PtxCache = Mutex<HashMap<(i32, i32), Arc<Vec<u8>>>>;

/// PTX (NUL-terminated) for the device's compute capability, compiled once per process.
fn ptx_for(device: (i32, i32)) -> Result<Arc<Vec<u8>>, CudaError> {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    ensure_nvrtc()?;
    let arch = target_arch(device)?;
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(ptx) = cache.get(&arch) {
        return Ok(Arc::clone(ptx));
    }
    let arch_flag = format!("--gpu-architecture=compute_{}{}", arch.0, arch.1);
    let what = format!("compiling gpipe kernels for compute_{}{}", arch.0, arch.1);
    let opts = CompileOptions {
        options: vec![arch_flag],
        name: Some("gpipe_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, opts).map_err(|e| {
        let message = match e {
            CompileError::CompileError { nvrtc, log, .. } => {
                format!("{nvrtc:?}: {}", log.to_string_lossy())
            }
            other => format!("{other:?}"),
        };
        CudaError::Nvrtc {
            what: what.clone(),
            message,
        }
    })?;
    let mut bytes = ptx
        .as_bytes()
        .ok_or_else(|| CudaError::Nvrtc {
            what,
            message: "NVRTC returned no PTX image".into(),
        })?
        .to_vec();
    if bytes.last() != Some(&0) {
        bytes.push(0);
    }
    let ptx = Arc::new(bytes);
    cache.insert(arch, Arc::clone(&ptx));
    Ok(ptx)
}

/// The fill and verify kernels, loaded into one context. Unloaded on drop.
#[derive(Debug)]
pub struct Kernels {
    module: sys::CUmodule,
    fill: sys::CUfunction,
    verify: sys::CUfunction,
    sm_count: u32,
    ctx: Arc<Context>,
}

// SAFETY: module and function handles may be used from any thread (the driver serialises
// launches); `Kernels` only passes them to thread-safe driver calls.
unsafe impl Send for Kernels {}
// SAFETY: as for Send; all methods take `&self`.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Compiles (once per process) and loads the kernels into `ctx`.
    pub fn load(ctx: &Arc<Context>) -> Result<Kernels, CudaError> {
        let device = ctx.device();
        let ptx = ptx_for(device.compute_capability()?)?;
        let sm_count = device.multiprocessor_count()?;
        ctx.make_current()?;
        let mut module: sys::CUmodule = ptr::null_mut();
        // SAFETY: the context is current; `ptx` is a NUL-terminated PTX image alive for the call.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast::<c_void>())
        })?;
        let mut kernels = Kernels {
            module,
            fill: ptr::null_mut(),
            verify: ptr::null_mut(),
            sm_count,
            ctx: Arc::clone(ctx),
        };
        kernels.fill = kernels.function("gpipe_fill")?;
        kernels.verify = kernels.function("gpipe_verify")?;
        Ok(kernels)
    }

    fn function(&self, name: &str) -> Result<sys::CUfunction, CudaError> {
        let cname = CString::new(name)
            .map_err(|_| CudaError::InvalidArgument(format!("kernel name {name:?}")))?;
        let mut f: sys::CUfunction = ptr::null_mut();
        // SAFETY: the module is loaded; `cname` is NUL-terminated and outlives the call.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut f, self.module, cname.as_ptr())
        })?;
        Ok(f)
    }

    /// Number of SMs the launch configuration is sized for (the tests size their checks by it).
    #[cfg(test)]
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Launches `f` with one-dimensional grid-stride configuration for `nwords`.
    ///
    /// # Safety
    /// `params` must match `f`'s parameter list, and every pointer argument must be valid for
    /// what the kernel does with it.
    unsafe fn launch(
        &self,
        f: sys::CUfunction,
        stream: &Stream,
        nwords: u64,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        if stream.context().raw() != self.ctx.raw() {
            return Err(CudaError::InvalidArgument(
                "stream belongs to another context than the kernels".into(),
            ));
        }
        self.ctx.make_current()?;
        let blocks = launch_blocks(nwords, self.sm_count);
        // SAFETY: `f` belongs to our loaded module; the caller guarantees `params`; the stream
        // is live and in our context; no dynamic shared memory and no `extra` are passed.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f,
                blocks as c_uint,
                1,
                1,
                THREADS_PER_BLOCK as c_uint,
                1,
                1,
                0,
                stream.raw(),
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }

    /// Enqueues `gpipe_fill`: writes `pattern_word(seq, i)` to every word of the `nbytes` at
    /// `ptr`. `nbytes` must be a multiple of 8; 0 enqueues nothing.
    ///
    /// # Safety
    /// `ptr` is 8-byte aligned device memory, valid for `nbytes` writes in stream order, that no
    /// unordered work reads or writes meanwhile.
    pub unsafe fn fill(
        &self,
        stream: &Stream,
        ptr: CUdeviceptr,
        nbytes: usize,
        seq: u64,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's guarantees; no stamps.
        unsafe { self.fill_stamped(stream, ptr, nbytes, seq, 0) }
    }

    /// As [`Kernels::fill`], also writing the kernel's GPU start and end times (the GPU's
    /// global timer, ns, shared by every process on the device) into `stamps` (0: none): see
    /// [`STAMP_BYTES`].
    ///
    /// # Safety
    /// As for [`Kernels::fill`]; `stamps` is 0 or 8-byte aligned device memory valid for
    /// [`STAMP_BYTES`], whose third word is zero, not used by unordered work meanwhile.
    pub unsafe fn fill_stamped(
        &self,
        stream: &Stream,
        ptr: CUdeviceptr,
        nbytes: usize,
        seq: u64,
        stamps: CUdeviceptr,
    ) -> Result<(), CudaError> {
        let mut nwords = words_in(nbytes)?;
        if nwords == 0 {
            return Ok(());
        }
        let (mut data, mut seq, mut stamps) = (ptr, seq, stamps);
        let mut params = [
            (&mut data as *mut u64).cast::<c_void>(),
            (&mut nwords as *mut u64).cast::<c_void>(),
            (&mut seq as *mut u64).cast::<c_void>(),
            (&mut stamps as *mut u64).cast::<c_void>(),
        ];
        // SAFETY: gpipe_fill takes (u64*, u64, u64, u64*), matching `params`; the caller
        // guarantees the memory. The driver copies the arguments before cuLaunchKernel returns.
        unsafe { self.launch(self.fill, stream, nwords, &mut params) }
    }

    /// Enqueues `gpipe_verify` over the `nbytes` at `ptr` against sequence `seq`, adding its
    /// counters into the [`VERIFY_RESULT_BYTES`]-byte slot at `out` (zero it first; decode it
    /// with [`VerifyResult::from_bytes`]). `nbytes` must be a multiple of 8.
    ///
    /// # Safety
    /// `ptr` is 8-byte aligned device memory valid for `nbytes` reads in stream order; `out` is
    /// 8-byte aligned device memory valid for 24 bytes of atomic adds, not used by unordered
    /// work meanwhile.
    pub unsafe fn verify(
        &self,
        stream: &Stream,
        ptr: CUdeviceptr,
        nbytes: usize,
        seq: u64,
        out: CUdeviceptr,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's guarantees; no stamps.
        unsafe { self.verify_stamped(stream, ptr, nbytes, seq, out, 0) }
    }

    /// As [`Kernels::verify`], with GPU timeline stamps as in [`Kernels::fill_stamped`].
    ///
    /// # Safety
    /// As for [`Kernels::verify`] and, for `stamps`, [`Kernels::fill_stamped`].
    pub unsafe fn verify_stamped(
        &self,
        stream: &Stream,
        ptr: CUdeviceptr,
        nbytes: usize,
        seq: u64,
        out: CUdeviceptr,
        stamps: CUdeviceptr,
    ) -> Result<(), CudaError> {
        let mut nwords = words_in(nbytes)?;
        if nwords == 0 {
            return Ok(());
        }
        let (mut data, mut seq, mut out, mut stamps) = (ptr, seq, out, stamps);
        let mut params = [
            (&mut data as *mut u64).cast::<c_void>(),
            (&mut nwords as *mut u64).cast::<c_void>(),
            (&mut seq as *mut u64).cast::<c_void>(),
            (&mut out as *mut u64).cast::<c_void>(),
            (&mut stamps as *mut u64).cast::<c_void>(),
        ];
        // SAFETY: gpipe_verify takes (const u64*, u64, u64, u64*, u64*), matching `params`; the
        // caller guarantees the ranges. The driver copies the arguments before returning.
        unsafe { self.launch(self.verify, stream, nwords, &mut params) }
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!("unloading gpipe kernels: {e}");
        }
        // SAFETY: we loaded the module and unload it once; its functions are not used after.
        let r = unsafe { sys::cuModuleUnload(self.module) };
        if let Err(e) = check("cuModuleUnload", r) {
            tracing::warn!("unloading gpipe kernels: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_has_the_exact_pattern_constants() {
        for constant in [
            "0x9E3779B97F4A7C15ULL",
            "0xD1B54A32D192ED03ULL",
            "0x5851F42D4C957F2DULL",
        ] {
            assert!(KERNEL_SOURCE.contains(constant), "{constant}");
        }
        assert!(KERNEL_SOURCE.contains("x ^ (w >> 29)") || KERNEL_SOURCE.contains("w ^ (w >> 29)"));
        assert!(KERNEL_SOURCE.contains("i & 63"));
        assert!(KERNEL_SOURCE.contains("extern \"C\" __global__ void gpipe_fill("));
        assert!(KERNEL_SOURCE.contains("extern \"C\" __global__ void gpipe_verify("));
    }

    #[test]
    fn lengths_must_be_whole_words() {
        assert_eq!(words_in(0).unwrap(), 0);
        assert_eq!(words_in(2 << 20).unwrap(), 1 << 18);
        assert!(matches!(words_in(12), Err(CudaError::InvalidArgument(_))));
    }

    #[test]
    fn grid_is_bounded_and_non_empty() {
        assert_eq!(launch_blocks(1, 132), 1);
        assert_eq!(launch_blocks(1024, 132), 1);
        assert_eq!(launch_blocks(1025, 132), 2);
        assert_eq!(launch_blocks(2 << 17, 132), 256); // 2 MiB
        assert_eq!(launch_blocks(8 << 20, 132), 528); // 64 MiB: capped at 4 per SM
        assert_eq!(launch_blocks(u64::MAX, 0), 4);
    }

    #[test]
    fn verify_result_decodes_little_endian_words() {
        let mut bytes = [0u8; VERIFY_RESULT_BYTES];
        bytes[0..8].copy_from_slice(&7u64.to_le_bytes());
        bytes[8..16].copy_from_slice(&7u64.to_le_bytes());
        let ok = VerifyResult::from_bytes(&bytes);
        assert!(ok.passed());
        bytes[16..24].copy_from_slice(&3u64.to_le_bytes());
        let bad = VerifyResult::from_bytes(&bytes);
        assert_eq!(bad.mismatched_words, 3);
        assert!(!bad.passed());
    }

    mod gpu {
        use super::super::*;
        use pipeline_cuda::driver::{
            DeviceBuffer, Event, MemPool, PinnedBuffer, PoolHandleType, memcpy_dtoh_async,
            memset_d8_async,
        };
        use std::os::fd::{AsRawFd, BorrowedFd};
        use std::time::{Duration, Instant};

        // Host reference, the same definition as pipeline-core's.
        fn pattern_word(seq: u64, i: u64) -> u64 {
            seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03)
                ^ 0x5851_F42D_4C95_7F2D
        }
        fn checksum_term(w: u64, i: u64) -> u64 {
            (w ^ (w >> 29)).rotate_left((i & 63) as u32)
        }
        fn expected_checksum(seq: u64, nwords: u64) -> u64 {
            (0..nwords).fold(0u64, |acc, i| {
                acc.wrapping_add(checksum_term(pattern_word(seq, i), i))
            })
        }

        /// Zeroes `results`, verifies, copies the slot back and waits.
        fn run_verify(
            kernels: &Kernels,
            stream: &Stream,
            ptr: CUdeviceptr,
            nbytes: usize,
            seq: u64,
            results: &DeviceBuffer,
            host: &PinnedBuffer,
        ) -> VerifyResult {
            // SAFETY: `ptr` holds `nbytes` live bytes; `results` and `host` are live 24-byte
            // buffers used only by `stream`; the host reads `host` after synchronize.
            unsafe {
                memset_d8_async(results.ptr(), 0, VERIFY_RESULT_BYTES, stream).unwrap();
                kernels
                    .verify(stream, ptr, nbytes, seq, results.ptr())
                    .unwrap();
                memcpy_dtoh_async(host.as_ptr(), results.ptr(), VERIFY_RESULT_BYTES, stream)
                    .unwrap();
            }
            stream.synchronize().unwrap();
            // SAFETY: the stream is idle, so nothing writes `host`.
            let bytes = unsafe { host.as_slice() };
            VerifyResult::from_bytes(bytes.try_into().unwrap())
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn stamped_kernels_record_their_gpu_start_and_end_in_stream_order() {
            let ctx = Context::new(0).unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let kernels = Kernels::load(&ctx).unwrap();
            let nbytes = 64 << 20;
            let data = DeviceBuffer::new(&ctx, nbytes).unwrap();
            let results = DeviceBuffer::new(&ctx, VERIFY_RESULT_BYTES).unwrap();
            let stamps = DeviceBuffer::new(&ctx, 2 * STAMP_BYTES).unwrap();
            let host = PinnedBuffer::new(&ctx, 2 * STAMP_BYTES).unwrap();
            // SAFETY: our own buffers, used only on `stream`; the stamps are zeroed first and
            // read on the host after synchronize.
            unsafe {
                memset_d8_async(stamps.ptr(), 0, 2 * STAMP_BYTES, &stream).unwrap();
                memset_d8_async(results.ptr(), 0, VERIFY_RESULT_BYTES, &stream).unwrap();
                kernels
                    .fill_stamped(&stream, data.ptr(), nbytes, 7, stamps.ptr())
                    .unwrap();
                let second = stamps.ptr() + STAMP_BYTES as u64;
                kernels
                    .verify_stamped(&stream, data.ptr(), nbytes, 7, results.ptr(), second)
                    .unwrap();
                memcpy_dtoh_async(host.as_ptr(), stamps.ptr(), 2 * STAMP_BYTES, &stream).unwrap();
            }
            stream.synchronize().unwrap();
            // SAFETY: the stream is idle, so nothing writes `host`.
            let b = unsafe { host.as_slice() };
            let w: Vec<u64> = b
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let blocks = u64::from(launch_blocks((nbytes / 8) as u64, kernels.sm_count()));
            // Every block counted itself; the fill ran, then the verify, each taking some time
            // (64 MiB: tens of µs on any GPU that runs this, under a second).
            assert_eq!((w[2], w[5]), (blocks, blocks), "{w:?}");
            assert!(w[0] > 0 && w[0] < w[1], "fill: {w:?}");
            assert!(w[1] <= w[3] && w[3] < w[4], "verify after fill: {w:?}");
            assert!(w[4] - w[0] < 1_000_000_000, "{w:?}");
            // Unstamped launches of the same kernels still verify.
            let host_r = PinnedBuffer::new(&ctx, VERIFY_RESULT_BYTES).unwrap();
            let r = run_verify(&kernels, &stream, data.ptr(), nbytes, 7, &results, &host_r);
            assert!(r.passed(), "{r:?}");
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn fill_then_verify_in_a_pool_allocation() {
            let ctx = Context::new(0).unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let kernels = Kernels::load(&ctx).unwrap();
            let pool = MemPool::new_exportable(&ctx, 64 << 20, PoolHandleType::PosixFd).unwrap();
            let nbytes = 2 << 20;
            let ptr = pool.alloc_async(nbytes, &stream).unwrap();
            let results = DeviceBuffer::new(&ctx, VERIFY_RESULT_BYTES).unwrap();
            let host = PinnedBuffer::new(&ctx, VERIFY_RESULT_BYTES).unwrap();
            let seq = 42;
            // SAFETY: `ptr` is a live 2 MiB pool allocation used only by `stream`.
            unsafe { kernels.fill(&stream, ptr, nbytes, seq) }.unwrap();
            let r = run_verify(&kernels, &stream, ptr, nbytes, seq, &results, &host);
            assert!(r.passed(), "{r:?}");
            assert_eq!(
                r.expected_checksum,
                expected_checksum(seq, (nbytes / 8) as u64)
            );

            // Wrong sequence: every word differs.
            let r = run_verify(&kernels, &stream, ptr, nbytes, seq + 1, &results, &host);
            assert_eq!(r.mismatched_words, (nbytes / 8) as u64);

            // Corrupt word 5: exactly one mismatch.
            // SAFETY: bytes 40..48 lie inside the allocation; only `stream` uses it.
            unsafe { memset_d8_async(ptr + 40, 0xFF, 8, &stream) }.unwrap();
            let r = run_verify(&kernels, &stream, ptr, nbytes, seq, &results, &host);
            assert_eq!(r.mismatched_words, 1);
            assert_ne!(r.actual_checksum, r.expected_checksum);

            // SAFETY: `ptr` came from this pool; nothing uses it after the free.
            unsafe { pool.free_async(ptr, &stream) }.unwrap();
            stream.synchronize().unwrap();
        }

        const CHILD_ENV: &str = "GPIPE_TEST_IPC_CHILD";

        fn hex(bytes: &[u8]) -> String {
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        }
        fn unhex64(s: &str) -> [u8; 64] {
            let mut out = [0u8; 64];
            for (k, byte) in out.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&s[2 * k..2 * k + 2], 16).unwrap();
            }
            out
        }

        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn another_process_imports_the_pool_pointer_and_event() {
            let ctx = Context::new(0).unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let kernels = Kernels::load(&ctx).unwrap();
            let pool = MemPool::new_exportable(&ctx, 64 << 20, PoolHandleType::PosixFd).unwrap();
            let nbytes = 1 << 20;
            let seq = 7;
            let ptr = pool.alloc_async(nbytes, &stream).unwrap();
            // SAFETY: `ptr` is a live 1 MiB pool allocation used only by `stream`.
            unsafe { kernels.fill(&stream, ptr, nbytes, seq) }.unwrap();
            let ready = Event::new_ipc(&ctx).unwrap();
            ready.record(&stream).unwrap();

            let fd = pool.export_fd().unwrap();
            rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::empty()).unwrap();
            let value = format!(
                "{} {} {} {} {}",
                fd.as_raw_fd(),
                hex(&pool.export_pointer(ptr).unwrap()),
                hex(&ready.ipc_handle().unwrap()),
                nbytes,
                seq
            );
            let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "gpu::kernels::tests::gpu::ipc_child",
                    "--exact",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_ENV, value)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            drop(fd);
            let deadline = Instant::now() + Duration::from_secs(120);
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                if Instant::now() > deadline {
                    child.kill().unwrap();
                    panic!("child did not finish within 120 s");
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let out = std::io::read_to_string(child.stdout.take().unwrap()).unwrap();
            assert!(status.success(), "child failed: {out}");
            assert!(out.contains("1 passed"), "child ran no test: {out}");

            // The importer has freed its mapping and exited; now the exporter frees.
            // SAFETY: `ptr` came from this pool; nothing uses it after the free.
            unsafe { pool.free_async(ptr, &stream) }.unwrap();
            stream.synchronize().unwrap();
        }

        /// The importing side of the test above; does nothing when run on its own.
        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn ipc_child() {
            let Ok(value) = std::env::var(CHILD_ENV) else {
                return;
            };
            let parts: Vec<&str> = value.split(' ').collect();
            let raw_fd: i32 = parts[0].parse().unwrap();
            let export = unhex64(parts[1]);
            let event = unhex64(parts[2]);
            let nbytes: usize = parts[3].parse().unwrap();
            let seq: u64 = parts[4].parse().unwrap();

            let ctx = Context::new(0).unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let kernels = Kernels::load(&ctx).unwrap();
            // SAFETY: the parent cleared CLOEXEC on this descriptor, so it is open in this
            // process, and nothing here closes it while the borrow lives.
            let fd = unsafe { BorrowedFd::borrow_raw(raw_fd) };
            let pool = MemPool::import_fd(&ctx, fd).unwrap();
            pool.set_access(ctx.device(), true).unwrap();
            let ptr = pool.import_pointer(&export).unwrap();
            let ready = Event::open_ipc(&ctx, &event).unwrap();
            stream.wait_event(&ready).unwrap();
            let results = DeviceBuffer::new(&ctx, VERIFY_RESULT_BYTES).unwrap();
            let host = PinnedBuffer::new(&ctx, VERIFY_RESULT_BYTES).unwrap();
            let r = run_verify(&kernels, &stream, ptr, nbytes, seq, &results, &host);
            assert!(r.passed(), "{r:?}");
            assert_eq!(
                r.expected_checksum,
                expected_checksum(seq, (nbytes / 8) as u64)
            );
            // SAFETY: `ptr` is this process's one import of the allocation; nothing uses it
            // after the free.
            unsafe { pool.free_async(ptr, &stream) }.unwrap();
            stream.synchronize().unwrap();
        }
    }
}
