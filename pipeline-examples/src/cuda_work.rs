//! The CUDA side of `gpipe`: GPU fill and verify, the single-process ceiling, availability.

use std::sync::Arc;
use std::time::Instant;

use pipeline_core::{Batch, Consumer, Slot, USER_HEADER_WORDS};
use pipeline_cuda::backend::{CudaConsumer, CudaProducer, SyncMode};
use pipeline_cuda::driver::{self, Context, CudaError, DeviceBuffer, Event, PinnedBuffer, Stream};
use pipeline_cuda::kernels::{self, Kernels, VERIFY_RESULT_BYTES, VerifyResult};

use crate::work::{Check, Fill, H_SEQ};

/// Why the CUDA backend cannot be used here, if it cannot.
pub fn usable() -> Result<(), String> {
    if !driver::driver_present() {
        return Err("no CUDA driver (libcuda.so.1) could be loaded".into());
    }
    let report = pipeline_cuda::probe::probe().map_err(|e| e.to_string())?;
    if report.devices.is_empty() {
        return Err("the CUDA driver sees no device".into());
    }
    report
        .auto_memory_path_for(0, pipeline_cuda::backend::HandleKind::PosixFd)
        .map_err(|e| e.to_string())?;
    kernels::ensure_nvrtc().map_err(|e| e.to_string())?;
    Ok(())
}

/// The sync mode `auto` picks for timeline words in `words`. Measured on an H100
/// (docs/benchmarks.md): with the words in host memory, which the GPU polls over PCIe, IPC
/// events were as fast as or faster than semaphores; with the words in device memory,
/// semaphores were the faster (2 MiB, MPS, 1 consumer: 0.86x of the fair ceiling against
/// 0.84x; 4 consumers: 0.80x against 0.70x).
pub fn auto_sync(words: pipeline_cuda::backend::TimelineMemory) -> SyncMode {
    match words {
        pipeline_cuda::backend::TimelineMemory::Device => SyncMode::Semaphore,
        pipeline_cuda::backend::TimelineMemory::Host => SyncMode::Events,
    }
}

/// Producer-side GPU fill: the pattern kernel on the producer's stream.
#[derive(Default)]
pub struct CudaFill {
    kernels: Option<Kernels>,
    /// GPU timeline stamps of some batches' fills (`gpipe bench --gpu-timeline`).
    stamps: Option<StampRecorder>,
}

impl CudaFill {
    /// Also records the GPU start and end of the fills of batches `from..from + count`.
    pub fn with_timeline(from: u64, count: u64) -> Self {
        Self {
            kernels: None,
            stamps: (count > 0).then(|| StampRecorder::new(from, count)),
        }
    }

    /// The recorded fills' (start, end) GPU times in ns, by sequence number from `from`
    /// (zeros for batches never filled); None when not recording. Waits for the GPU.
    pub fn timeline(&mut self) -> Result<Option<Vec<[u64; 2]>>, String> {
        self.stamps.as_mut().map(StampRecorder::read).transpose()
    }
}

impl Fill<CudaProducer> for CudaFill {
    fn fill(
        &mut self,
        slot: &mut Slot<'_, CudaProducer>,
        seq: u64,
        len: u64,
    ) -> Result<[u64; USER_HEADER_WORDS], String> {
        if self.kernels.is_none() {
            self.kernels =
                Some(Kernels::load(slot.backend().context()).map_err(|e| e.to_string())?);
        }
        let k = self.kernels.as_ref().ok_or("kernels not loaded")?;
        let mem = slot.memory();
        if len > mem.capacity {
            return Err(format!(
                "batch of {len} bytes exceeds the slot ({})",
                mem.capacity
            ));
        }
        let stamps = match self.stamps.as_mut() {
            Some(r) => r.ptr_for(mem.stream, seq)?,
            None => 0,
        };
        // SAFETY: the slot is ours between acquire and publish; its stream already waits for
        // the previous holders' finished events; len <= capacity and the pointer is 2 MiB
        // aligned; `stamps` is 0 or this batch's zeroed stamps, used by this launch only.
        unsafe { k.fill_stamped(mem.stream, mem.ptr, len as usize, seq, stamps) }
            .map_err(|e| e.to_string())?;
        let mut h = [0u64; USER_HEADER_WORDS];
        h[H_SEQ] = seq;
        Ok(h)
    }

    fn settle(&mut self, backend: &CudaProducer) -> Result<(), String> {
        backend.stream().synchronize().map_err(|e| e.to_string())
    }
}

/// Results kept on the GPU before they are read back (one host sync per this many batches).
const RESULT_RING: usize = 1024;

struct VerifyState {
    kernels: Kernels,
    results: DeviceBuffer,
    /// Where the extra passes write their results, never read.
    discard: DeviceBuffer,
    host: PinnedBuffer,
    seqs: Vec<u64>,
}

/// Consumer-side GPU verification: the verify kernel compares every word with the pattern on
/// the consumer's stream; results are read back every [`RESULT_RING`] batches and at the end.
#[derive(Default)]
pub struct CudaCheck {
    state: Option<VerifyState>,
    bad: Vec<u64>,
    /// The stamped sequence numbers seen.
    stamps: crate::work::StampCheck,
    /// Extra verify passes over each batch after the one whose result counts.
    extra_passes: u32,
    /// GPU timeline stamps of some batches' first verify (`gpipe bench --gpu-timeline`).
    timeline: Option<StampRecorder>,
}

impl CudaCheck {
    /// Reads each batch `passes` times (at least once) on the GPU; the first pass's verdict
    /// counts, the others stand in for a consumer's further work on the batch.
    pub fn with_passes(passes: u32) -> Self {
        Self {
            extra_passes: passes.saturating_sub(1),
            ..Self::default()
        }
    }

    /// Also records the GPU start and end of the first verify of batches `from..from + count`.
    pub fn with_timeline(mut self, from: u64, count: u64) -> Self {
        self.timeline = (count > 0).then(|| StampRecorder::new(from, count));
        self
    }

    fn drain(&mut self, stream: &Stream) -> Result<(), String> {
        let Some(st) = self.state.as_mut() else {
            return Ok(());
        };
        if st.seqs.is_empty() {
            return Ok(());
        }
        let n = st.seqs.len();
        // SAFETY: host and device buffers hold RESULT_RING results; n <= RESULT_RING; the
        // copy is ordered after the verify kernels on the same stream and completes at the
        // synchronize below, before the host reads.
        unsafe {
            driver::memcpy_dtoh_async(
                st.host.as_ptr(),
                st.results.ptr(),
                n * VERIFY_RESULT_BYTES,
                stream,
            )
        }
        .map_err(|e| e.to_string())?;
        stream.synchronize().map_err(|e| e.to_string())?;
        // SAFETY: the copy above completed (stream synchronized); nothing else writes `host`.
        let bytes = unsafe { st.host.as_slice() };
        for (i, &seq) in st.seqs.iter().enumerate() {
            let r: &[u8; VERIFY_RESULT_BYTES] = bytes
                [i * VERIFY_RESULT_BYTES..(i + 1) * VERIFY_RESULT_BYTES]
                .try_into()
                .map_err(|_| "result slice")?;
            if !VerifyResult::from_bytes(r).passed() {
                self.bad.push(seq);
            }
        }
        st.seqs.clear();
        // SAFETY: the results buffer is ours and no kernel uses it until after this memset in
        // stream order.
        unsafe {
            driver::memset_d8_async(
                st.results.ptr(),
                0,
                RESULT_RING * VERIFY_RESULT_BYTES,
                stream,
            )
        }
        .map_err(|e| e.to_string())?;
        Ok(())
    }
}

impl Check<CudaConsumer> for CudaCheck {
    fn check(&mut self, batch: &Batch<CudaConsumer>) -> Result<(), String> {
        let be = batch.backend();
        let stream = be.stream();
        if self.state.is_none() {
            let ctx: &Arc<Context> = be.context();
            let results = DeviceBuffer::new(ctx, RESULT_RING * VERIFY_RESULT_BYTES)
                .map_err(|e| e.to_string())?;
            // SAFETY: freshly allocated, used only on this stream after this memset.
            unsafe {
                driver::memset_d8_async(results.ptr(), 0, RESULT_RING * VERIFY_RESULT_BYTES, stream)
            }
            .map_err(|e| e.to_string())?;
            self.state = Some(VerifyState {
                kernels: Kernels::load(ctx).map_err(|e| e.to_string())?,
                results,
                discard: DeviceBuffer::new(ctx, VERIFY_RESULT_BYTES).map_err(|e| e.to_string())?,
                host: PinnedBuffer::new(ctx, RESULT_RING * VERIFY_RESULT_BYTES)
                    .map_err(|e| e.to_string())?,
                seqs: Vec::with_capacity(RESULT_RING),
            });
        }
        if self
            .state
            .as_ref()
            .is_some_and(|s| s.seqs.len() == RESULT_RING)
        {
            self.drain(stream)?;
        }
        let st = self.state.as_mut().ok_or("verify state")?;
        // The data is the pattern of the sequence number its producer stamped in the header:
        // this ring's own, or behind a relay the upstream ring's (work::StampCheck).
        let stamped = batch.header()[H_SEQ];
        if !self.stamps.ok(batch.seq(), stamped) {
            self.bad.push(batch.seq());
            return Ok(());
        }
        let view = batch.data();
        let out = st.results.ptr() + (st.seqs.len() * VERIFY_RESULT_BYTES) as u64;
        let times = match self.timeline.as_mut() {
            Some(r) => r.ptr_for(view.stream, batch.seq())?,
            None => 0,
        };
        // SAFETY: the batch is published and unreleased; its stream waits `ready`; `out` is a
        // zeroed 24-byte result slot of ours not used by any other pending kernel; `times` is 0
        // or this batch's zeroed stamps, used by this launch only.
        unsafe {
            st.kernels.verify_stamped(
                view.stream,
                view.ptr,
                view.len as usize,
                stamped,
                out,
                times,
            )
        }
        .map_err(|e| e.to_string())?;
        for _ in 0..self.extra_passes {
            // SAFETY: as above; `discard` is a result slot of ours that nothing reads, so
            // concurrent passes adding to it are harmless.
            unsafe {
                st.kernels.verify(
                    view.stream,
                    view.ptr,
                    view.len as usize,
                    stamped,
                    st.discard.ptr(),
                )
            }
            .map_err(|e| e.to_string())?;
        }
        st.seqs.push(batch.seq());
        Ok(())
    }

    fn finish(&mut self, consumer: &Consumer<CudaConsumer>) -> Result<Vec<u64>, String> {
        self.drain(consumer.backend().stream())?;
        Ok(std::mem::take(&mut self.bad))
    }

    fn timeline(&mut self) -> Result<Option<Vec<[u64; 2]>>, String> {
        self.timeline.as_mut().map(StampRecorder::read).transpose()
    }
}

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

/// The single-process ceiling: the same fill and verify kernels on one stream in one process,
/// over `buffers` buffers of `bytes`, `batches` times. Returns batches per second.
pub fn ceiling(bytes: u64, buffers: u32, batches: u64) -> Result<f64, CudaError> {
    lagged_ceiling(bytes, buffers, batches, 0)
}

/// As [`ceiling`], but with the buffers allocated from an IPC-capable (POSIX fd) memory
/// pool like the ring's slots, instead of `cuMemAlloc`: isolates the cost of the memory kind.
pub fn pool_ceiling(bytes: u64, buffers: u32, batches: u64) -> Result<f64, CudaError> {
    let ctx = Context::new(0)?;
    let stream = Stream::new(&ctx)?;
    let k = Kernels::load(&ctx)?;
    let n = buffers.max(1) as u64;
    let pool = pipeline_cuda::driver::MemPool::new_exportable(
        &ctx,
        (bytes * n) as usize,
        pipeline_cuda::driver::PoolHandleType::PosixFd,
    )?;
    let ptrs: Vec<_> = (0..n)
        .map(|_| pool.alloc_async(bytes as usize, &stream))
        .collect::<Result<_, _>>()?;
    let results = DeviceBuffer::new(&ctx, VERIFY_RESULT_BYTES)?;
    let run = |count: u64| -> Result<(), CudaError> {
        for s in 0..count {
            let p = ptrs[(s % n) as usize];
            // SAFETY: pool allocations of `bytes`, used in stream order only.
            unsafe {
                k.fill(&stream, p, bytes as usize, s)?;
                k.verify(&stream, p, bytes as usize, s, results.ptr())?;
            }
        }
        Ok(())
    };
    run(batches.min(64))?;
    stream.synchronize()?;
    let t = Instant::now();
    run(batches)?;
    stream.synchronize()?;
    let rate = batches as f64 / t.elapsed().as_secs_f64();
    for p in ptrs {
        // SAFETY: allocated above from this pool, freed once after all work completed.
        unsafe { pool.free_async(p, &stream)? };
    }
    stream.synchronize()?;
    Ok(rate)
}

/// As [`ceiling`], but each verify reads the buffer filled `lag` batches earlier (so, as in
/// a pipeline `lag` deep, the data has left the L2 cache when it is read back).
pub fn lagged_ceiling(bytes: u64, buffers: u32, batches: u64, lag: u32) -> Result<f64, CudaError> {
    let ctx = Context::new(0)?;
    let stream = Stream::new(&ctx)?;
    let k = Kernels::load(&ctx)?;
    let bufs: Vec<DeviceBuffer> = (0..buffers.max(lag + 1))
        .map(|_| DeviceBuffer::new(&ctx, bytes as usize))
        .collect::<Result<_, _>>()?;
    let results = DeviceBuffer::new(&ctx, VERIFY_RESULT_BYTES)?;
    let (start, end) = (Event::new_timing(&ctx)?, Event::new_timing(&ctx)?);
    let run = |n: u64| -> Result<(), CudaError> {
        for s in 0..n {
            let b = &bufs[(s % bufs.len() as u64) as usize];
            // SAFETY: our own buffers, used in stream order only.
            unsafe { k.fill(&stream, b.ptr(), bytes as usize, s)? };
            if let Some(v) = s.checked_sub(lag as u64) {
                let vb = &bufs[(v % bufs.len() as u64) as usize];
                // SAFETY: as above; buffers > lag, so batch v's buffer is not refilled yet.
                unsafe { k.verify(&stream, vb.ptr(), bytes as usize, v, results.ptr())? };
            }
        }
        Ok(())
    };
    run(batches.min(64))?; // warm-up
    stream.synchronize()?;
    let t = Instant::now();
    start.record(&stream)?;
    run(batches)?;
    end.record(&stream)?;
    end.synchronize()?;
    let ms = Event::elapsed_ms(&start, &end)? as f64;
    let secs = if ms > 0.0 {
        ms / 1e3
    } else {
        t.elapsed().as_secs_f64()
    };
    Ok(batches as f64 / secs)
}

/// The single-process ceiling with the two stages overlapped the way the pipeline overlaps
/// them: fills on one stream, verifies on another, `buffers` slots ordered by same-process
/// events. It tells how much of the pipeline's gap is the GPU running two memory-bound
/// kernels at once rather than gpipe. Returns batches per second.
pub fn two_stream_ceiling(bytes: u64, buffers: u32, batches: u64) -> Result<f64, CudaError> {
    let ctx = Context::new(0)?;
    let (fs, vs) = (Stream::new(&ctx)?, Stream::new(&ctx)?);
    let k = Kernels::load(&ctx)?;
    let n = buffers.max(1) as usize;
    let bufs: Vec<DeviceBuffer> = (0..n)
        .map(|_| DeviceBuffer::new(&ctx, bytes as usize))
        .collect::<Result<_, _>>()?;
    let results = DeviceBuffer::new(&ctx, VERIFY_RESULT_BYTES)?;
    let filled: Vec<Event> = (0..n)
        .map(|_| Event::new_ipc(&ctx))
        .collect::<Result<_, _>>()?;
    let verified: Vec<Event> = (0..n)
        .map(|_| Event::new_ipc(&ctx))
        .collect::<Result<_, _>>()?;
    let run = |count: u64| -> Result<(), CudaError> {
        for s in 0..count {
            let i = (s % n as u64) as usize;
            let b = &bufs[i];
            if s >= n as u64 {
                fs.wait_event(&verified[i])?;
            }
            // SAFETY: our own buffers; fills wait the slot's last verify, verifies wait the fill.
            unsafe { k.fill(&fs, b.ptr(), bytes as usize, s)? };
            filled[i].record(&fs)?;
            vs.wait_event(&filled[i])?;
            // SAFETY: as above.
            unsafe { k.verify(&vs, b.ptr(), bytes as usize, s, results.ptr())? };
            verified[i].record(&vs)?;
        }
        Ok(())
    };
    run(batches.min(64))?;
    fs.synchronize()?;
    vs.synchronize()?;
    let t = Instant::now();
    run(batches)?;
    fs.synchronize()?;
    vs.synchronize()?;
    Ok(batches as f64 / t.elapsed().as_secs_f64())
}

/// Two contexts with `dst`'s able to reach `src`'s `cuMemAlloc` memory.
fn peer_pair(src: usize, dst: usize) -> Result<(Arc<Context>, Arc<Context>), CudaError> {
    let (s, d) = (Context::new(src)?, Context::new(dst)?);
    if src != dst {
        d.enable_peer_access(&s)?;
    }
    Ok((s, d))
}

/// The link's single-process copy ceiling: `batches` copies of `bytes` from buffers on GPU
/// `src` into buffers on GPU `dst` by `dst`'s copy engine (`cuMemcpyAsync` on a `dst`
/// stream, peer access enabled), as a mirroring consumer's copies are. Batches per second.
pub fn peer_copy_ceiling(
    bytes: u64,
    src: usize,
    dst: usize,
    buffers: u32,
    batches: u64,
) -> Result<f64, CudaError> {
    let (sc, dc) = peer_pair(src, dst)?;
    let n = buffers.max(1) as usize;
    let from: Vec<DeviceBuffer> = (0..n)
        .map(|_| DeviceBuffer::new(&sc, bytes as usize))
        .collect::<Result<_, _>>()?;
    let to: Vec<DeviceBuffer> = (0..n)
        .map(|_| DeviceBuffer::new(&dc, bytes as usize))
        .collect::<Result<_, _>>()?;
    let stream = Stream::new(&dc)?;
    let run = |count: u64| -> Result<(), CudaError> {
        for s in 0..count {
            let i = (s % n as u64) as usize;
            // SAFETY: our own buffers of `bytes` each, used in stream order only; dst's
            // context has peer access to src's memory.
            unsafe { driver::memcpy_async(to[i].ptr(), from[i].ptr(), bytes as usize, &stream)? };
        }
        Ok(())
    };
    timed(&dc, &stream, batches, run)
}

/// The link's single-process read ceiling: the verify kernel on GPU `dst` reading buffers on
/// GPU `src` in place (peer access), as an in-place consumer on `dst` does. Batches per second.
pub fn remote_read_ceiling(
    bytes: u64,
    src: usize,
    dst: usize,
    buffers: u32,
    batches: u64,
) -> Result<f64, CudaError> {
    let (sc, dc) = peer_pair(src, dst)?;
    let n = buffers.max(1) as usize;
    let from: Vec<DeviceBuffer> = (0..n)
        .map(|_| DeviceBuffer::new(&sc, bytes as usize))
        .collect::<Result<_, _>>()?;
    let k = Kernels::load(&dc)?;
    let results = DeviceBuffer::new(&dc, VERIFY_RESULT_BYTES)?;
    let stream = Stream::new(&dc)?;
    let run = |count: u64| -> Result<(), CudaError> {
        for s in 0..count {
            let b = &from[(s % n as u64) as usize];
            // SAFETY: buffers of `bytes` on src, readable from dst by peer access, not written
            // meanwhile; `results` is ours (the counts are not read: only the time matters).
            unsafe { k.verify(&stream, b.ptr(), bytes as usize, s, results.ptr())? };
        }
        Ok(())
    };
    timed(&dc, &stream, batches, run)
}

/// Runs `run(batches.min(64))` to warm up, then times `run(batches)` with events on `stream`.
fn timed(
    ctx: &Arc<Context>,
    stream: &Stream,
    batches: u64,
    run: impl Fn(u64) -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    run(batches.min(64))?;
    stream.synchronize()?;
    let (start, end) = (Event::new_timing(ctx)?, Event::new_timing(ctx)?);
    let t = Instant::now();
    start.record(stream)?;
    run(batches)?;
    end.record(stream)?;
    end.synchronize()?;
    let ms = Event::elapsed_ms(&start, &end)? as f64;
    let secs = if ms > 0.0 {
        ms / 1e3
    } else {
        t.elapsed().as_secs_f64()
    };
    Ok(batches as f64 / secs)
}

/// The fair ceiling of a run: the work the run did per batch, done in one process. One fill
/// of each batch and, per reader (a broadcast consumer; in shared mode the one consumer that
/// gets the batch), `reads[c]` verifies of it, over `buffers` buffers, both on one stream
/// (`spread == false`: fill, then every verify) and spread over streams the way the pipeline
/// spreads them (`spread == true`: fills on one stream, each reader's verifies in order on a
/// stream of its own, ordered by same-process events; a buffer is refilled once all its
/// readers are done). Batches per second.
pub fn fair_ceiling(
    bytes: u64,
    buffers: u32,
    batches: u64,
    reads: &[u32],
    spread: bool,
) -> Result<f64, CudaError> {
    let ctx = Context::new(0)?;
    let k = Kernels::load(&ctx)?;
    let n = buffers.max(1) as usize;
    let reads: Vec<u32> = if reads.is_empty() {
        vec![1]
    } else {
        reads.iter().map(|&r| r.max(1)).collect()
    };
    let v = reads.len();
    let bufs: Vec<DeviceBuffer> = (0..n)
        .map(|_| DeviceBuffer::new(&ctx, bytes as usize))
        .collect::<Result<_, _>>()?;
    let results = DeviceBuffer::new(&ctx, VERIFY_RESULT_BYTES)?;
    let fs = Stream::new(&ctx)?;
    let vs: Vec<Stream> = if spread {
        (0..v)
            .map(|_| Stream::new(&ctx))
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    let filled: Vec<Event> = (0..n)
        .map(|_| Event::new_plain(&ctx))
        .collect::<Result<_, _>>()?;
    let verified: Vec<Vec<Event>> = (0..n)
        .map(|_| (0..v).map(|_| Event::new_plain(&ctx)).collect())
        .collect::<Result<_, _>>()?;
    let run = |count: u64| -> Result<(), CudaError> {
        for s in 0..count {
            let i = (s % n as u64) as usize;
            let p = bufs[i].ptr();
            if !spread {
                // SAFETY: our own buffers, used in stream order only.
                unsafe { k.fill(&fs, p, bytes as usize, s)? };
                for _ in 0..reads.iter().sum::<u32>() {
                    // SAFETY: as above.
                    unsafe { k.verify(&fs, p, bytes as usize, s, results.ptr())? };
                }
                continue;
            }
            if s >= n as u64 {
                for e in &verified[i] {
                    fs.wait_event(e)?;
                }
            }
            // SAFETY: our own buffers; a fill waits for the last verifies of its buffer, and
            // each verify waits for its fill.
            unsafe { k.fill(&fs, p, bytes as usize, s)? };
            filled[i].record(&fs)?;
            for (c, st) in vs.iter().enumerate() {
                st.wait_event(&filled[i])?;
                for _ in 0..reads[c] {
                    // SAFETY: as above.
                    unsafe { k.verify(st, p, bytes as usize, s, results.ptr())? };
                }
                verified[i][c].record(st)?;
            }
        }
        Ok(())
    };
    let sync_all = || -> Result<(), CudaError> {
        fs.synchronize()?;
        for st in &vs {
            st.synchronize()?;
        }
        Ok(())
    };
    run(batches.min(64))?;
    sync_all()?;
    let t = Instant::now();
    run(batches)?;
    sync_all()?;
    Ok(batches as f64 / t.elapsed().as_secs_f64())
}

/// Host cost of one driver call, median and 90th percentile over chunks, in µs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CallCost {
    /// The call, and what it was given.
    pub call: &'static str,
    /// Median over chunks of the mean cost per call in a chunk.
    pub p50_us: f64,
    /// 90th percentile of the same.
    pub p90_us: f64,
}

/// Measures the host cost of each driver call the hot path makes, on device 0, in this
/// process (under MPS when the daemon runs): chunks of calls timed on the host with the
/// stream drained between chunks, so that no call waits for room in the stream's queue.
pub fn call_costs() -> Result<Vec<CallCost>, CudaError> {
    const CHUNK: u32 = 128;
    const CHUNKS: usize = 200;
    let ctx = Context::new(0)?;
    let stream = Stream::new(&ctx)?;
    let k = Kernels::load(&ctx)?;
    let buf = DeviceBuffer::new(&ctx, 256)?;
    let word = DeviceBuffer::new(&ctx, 8)?;
    let ipc = Event::new_ipc(&ctx)?;
    ipc.record(&stream)?;
    stream.synchronize()?;
    let mut out = Vec::new();
    let mut time = |call: &'static str,
                    f: &mut dyn FnMut(u64) -> Result<(), CudaError>|
     -> Result<(), CudaError> {
        let mut per: Vec<f64> = Vec::with_capacity(CHUNKS);
        for c in 0..=CHUNKS {
            let t = Instant::now();
            for i in 0..CHUNK {
                f(c as u64 * CHUNK as u64 + i as u64)?;
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / CHUNK as f64;
            stream.synchronize()?;
            if c > 0 {
                per.push(us); // the first chunk warms up
            }
        }
        per.sort_by(f64::total_cmp);
        out.push(CallCost {
            call,
            p50_us: per[per.len() / 2],
            p90_us: per[per.len() * 9 / 10],
        });
        Ok(())
    };
    // Every closure below uses our own buffer, word and event, in stream order on our stream
    // only; the stream is drained before they are dropped.
    // SAFETY: as just said.
    time("cuLaunchKernel (fill kernel, 256 bytes)", &mut |i| unsafe {
        k.fill(&stream, buf.ptr(), 256, i)
    })?;
    // SAFETY: as above.
    time("cuStreamWriteValue64 (device word)", &mut |i| unsafe {
        driver::stream_write_value64(&stream, word.ptr(), i + 1)
    })?;
    time(
        "cuStreamWaitValue64 (device word, already reached)",
        // SAFETY: as above.
        &mut |_| unsafe {
            driver::stream_wait_value64(&stream, word.ptr(), 0, driver::WaitCondition::Geq)
        },
    )?;
    time("cuEventRecord (IPC event)", &mut |_| ipc.record(&stream))?;
    time("cuEventQuery (IPC event)", &mut |_| ipc.query().map(|_| ()))?;
    time("cuStreamWaitEvent (IPC event, completed)", &mut |_| {
        stream.wait_event(&ipc)
    })?;
    stream.synchronize()?;
    Ok(out)
}

/// GPU time between two kernels with one hot-path operation between them, in µs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuGap {
    /// What ran between the two kernels, and on which streams.
    pub case: &'static str,
    /// Median over the repetitions of (second kernel's start − first kernel's end).
    pub p50_us: f64,
    /// 90th percentile of the same.
    pub p90_us: f64,
    /// Mean of the same (the GPU timer ticks in steps of up to a µs; the mean smooths that).
    pub mean_us: f64,
    /// The smallest: below 0 would mean the second kernel started before the first ended,
    /// an ordering the operation between them failed to keep.
    pub min_us: f64,
}

/// Synchronizes its streams when dropped (errors ignored: it runs on the way out).
struct DrainOnDrop<'a>(&'a [&'a Stream]);

impl Drop for DrainOnDrop<'_> {
    fn drop(&mut self) {
        for s in self.0 {
            let _ = s.synchronize();
        }
    }
}

/// What sits between the two stamped kernels of one [`gpu_gaps`] case.
#[derive(Clone, Copy)]
enum Between {
    Nothing,
    WriteDevice,
    WriteHost,
    WaitDeviceReached,
    WaitHostReached,
    WriteWaitDevice,
    WriteWaitDeviceBatched,
    RecordIpc,
    WaitIpcDone,
    RecordPlain,
    WaitPlainDone,
    OffloadWrite,
    OffloadWriteWaitDevice,
    HandDevice,
    HandHost,
    HandIpc,
    HandPlain,
}

/// Measures on the GPU, in this process (under MPS when its daemon runs), how long the GPU
/// idles between two small kernels (fills of 2 MiB) with each of the hot path's stream
/// operations between them: on one stream, and handed from one stream to another (the
/// second stream already waiting). Each repetition is preceded by a long fill on the first
/// stream, so the host has enqueued everything before the GPU gets there: the gaps are the
/// GPU's own, not the host's.
pub fn gpu_gaps(reps: usize) -> Result<Vec<GpuGap>, CudaError> {
    use Between::*;
    const SMALL: usize = 2 << 20;
    const LONG: usize = 64 << 20;
    let cases: [(&'static str, Between); 17] = [
        ("kernel, kernel (one stream)", Nothing),
        ("kernel, write device word, kernel", WriteDevice),
        ("kernel, write host word, kernel", WriteHost),
        (
            "kernel, wait device word (reached), kernel",
            WaitDeviceReached,
        ),
        ("kernel, wait host word (reached), kernel", WaitHostReached),
        ("kernel, write + wait device words, kernel", WriteWaitDevice),
        (
            "kernel, write + wait device words in one batched operation, kernel",
            WriteWaitDeviceBatched,
        ),
        ("kernel, record IPC event, kernel", RecordIpc),
        ("kernel, wait IPC event (completed), kernel", WaitIpcDone),
        ("kernel, record plain event, kernel", RecordPlain),
        (
            "kernel, wait plain event (completed), kernel",
            WaitPlainDone,
        ),
        (
            "kernel, record plain event (a side stream waits it, writes device word), kernel",
            OffloadWrite,
        ),
        (
            "kernel, record plain event (side stream writes), wait device word (reached), kernel",
            OffloadWriteWaitDevice,
        ),
        (
            "handover: write device word / other stream waits",
            HandDevice,
        ),
        ("handover: write host word / other stream waits", HandHost),
        ("handover: IPC event / other stream waits", HandIpc),
        ("handover: plain event / other stream waits", HandPlain),
    ];
    let reps = reps.max(2);
    let ctx = Context::new(0)?;
    let a = Stream::new(&ctx)?;
    let b = Stream::new(&ctx)?;
    let k = Kernels::load(&ctx)?;
    let small = DeviceBuffer::new(&ctx, SMALL)?;
    let long = DeviceBuffer::new(&ctx, LONG)?;
    let stamp_len = 2 * reps * kernels::STAMP_BYTES;
    let stamps = DeviceBuffer::new(&ctx, stamp_len)?;
    let host_stamps = PinnedBuffer::new(&ctx, stamp_len)?;
    let dword = DeviceBuffer::new(&ctx, 8)?;
    // Pinned host memory is addressed by the same pointer on the GPU: with unified addressing
    // (every 64-bit Linux process on the GPUs CUDA 13 supports) `cuMemHostAlloc` memory is
    // reachable from every device at its host address.
    let hword = PinnedBuffer::new(&ctx, 8)?;
    let hword_ptr = hword.as_ptr() as u64;
    let ipc = Event::new_ipc(&ctx)?;
    let plain = Event::new_plain(&ctx)?;
    let back = Event::new_plain(&ctx)?;
    let side = Stream::new(&ctx)?;
    let done = Event::new_plain(&ctx)?;
    done.record(&side)?;
    // SAFETY: our own word, on our stream, before any use of it.
    unsafe { driver::memset_d8_async(dword.ptr(), 0, 8, &a) }?;
    ipc.record(&a)?;
    a.synchronize()?;
    // Declared after every buffer and event, so dropped before them: on any return, early
    // ones included, the streams are drained before what they use is freed.
    let streams = [&a, &b, &side];
    let _drain = DrainOnDrop(&streams);
    let mut value = 0u64;
    let mut out = Vec::new();
    for (case, between) in cases {
        // Every buffer, word and event below is ours and used only on `a`, `b` and `side` in
        // the order enqueued here; `b`'s waits are each satisfied by a write or record enqueued
        // on `a` just before them, and `side` waits only on records made on `a`, so nothing
        // waits forever.
        // SAFETY: as just said; every stream is drained before the host reads the stamps, and
        // `_drain` drains them before anything is freed on every path out.
        unsafe {
            driver::memset_d8_async(stamps.ptr(), 0, stamp_len, &a)?;
            a.synchronize()?;
            for i in 0..reps {
                let s1 = stamps.ptr() + (2 * i * kernels::STAMP_BYTES) as u64;
                let s2 = s1 + kernels::STAMP_BYTES as u64;
                k.fill(&a, long.ptr(), LONG, i as u64)?;
                k.fill_stamped(&a, small.ptr(), SMALL, i as u64, s1)?;
                let mut second = &a;
                match between {
                    Nothing => {}
                    WriteDevice => {
                        value += 1;
                        driver::stream_write_value64(&a, dword.ptr(), value)?;
                    }
                    WriteHost => {
                        value += 1;
                        driver::stream_write_value64(&a, hword_ptr, value)?;
                    }
                    WaitDeviceReached => {
                        driver::stream_wait_value64(&a, dword.ptr(), 0, driver::WaitCondition::Geq)?
                    }
                    WaitHostReached => {
                        driver::stream_wait_value64(&a, hword_ptr, 0, driver::WaitCondition::Geq)?
                    }
                    WriteWaitDevice => {
                        value += 1;
                        driver::stream_write_value64(&a, dword.ptr(), value)?;
                        driver::stream_wait_value64(&a, dword.ptr(), 0, driver::WaitCondition::Geq)?
                    }
                    WriteWaitDeviceBatched => {
                        value += 1;
                        let (ptr, condition) = (dword.ptr(), driver::WaitCondition::Geq);
                        let ops = [
                            driver::MemOp::Write { ptr, value },
                            driver::MemOp::Wait {
                                ptr,
                                value: 0,
                                condition,
                            },
                        ];
                        driver::stream_mem_ops_raw(a.raw(), &ops)?
                    }
                    RecordIpc => ipc.record(&a)?,
                    WaitIpcDone => a.wait_event(&ipc)?,
                    RecordPlain => plain.record(&a)?,
                    WaitPlainDone => a.wait_event(&done)?,
                    OffloadWrite | OffloadWriteWaitDevice => {
                        plain.record(&a)?;
                        side.wait_event(&plain)?;
                        value += 1;
                        driver::stream_write_value64(&side, dword.ptr(), value)?;
                        if matches!(between, OffloadWriteWaitDevice) {
                            let (w, geq) = (dword.ptr(), driver::WaitCondition::Geq);
                            driver::stream_wait_value64(&a, w, 0, geq)?
                        }
                    }
                    HandDevice | HandHost => {
                        let w = if matches!(between, HandDevice) {
                            dword.ptr()
                        } else {
                            hword_ptr
                        };
                        value += 1;
                        driver::stream_write_value64(&a, w, value)?;
                        driver::stream_wait_value64(&b, w, value, driver::WaitCondition::Geq)?;
                        second = &b;
                    }
                    HandIpc | HandPlain => {
                        let e = if matches!(between, HandIpc) {
                            &ipc
                        } else {
                            &plain
                        };
                        e.record(&a)?;
                        b.wait_event(e)?;
                        second = &b;
                    }
                }
                k.fill_stamped(second, small.ptr(), SMALL, i as u64, s2)?;
                if !std::ptr::eq(second, &a) {
                    // The next repetition's fills on `a` follow this one's second kernel.
                    back.record(&b)?;
                    a.wait_event(&back)?;
                }
            }
            a.synchronize()?;
            b.synchronize()?;
            side.synchronize()?;
            driver::memcpy_dtoh_async(host_stamps.as_ptr(), stamps.ptr(), stamp_len, &a)?;
            a.synchronize()?;
        }
        // SAFETY: the copy above completed; nothing else writes `host_stamps`.
        let bytes = unsafe { host_stamps.as_slice() };
        let word = |i: usize, w: usize| {
            let at = i * kernels::STAMP_BYTES + w * 8;
            u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default())
        };
        // The first repetition warms up.
        let mut gaps: Vec<f64> = (1..reps)
            .map(|i| word(2 * i + 1, 0) as f64 - word(2 * i, 1) as f64)
            .map(|ns| ns / 1e3)
            .collect();
        gaps.sort_by(f64::total_cmp);
        out.push(GpuGap {
            case,
            p50_us: gaps[gaps.len() / 2],
            p90_us: gaps[gaps.len() * 9 / 10],
            mean_us: gaps.iter().sum::<f64>() / gaps.len() as f64,
            min_us: gaps[0],
        });
    }
    Ok(out)
}
