//! The single-process ceilings a `gpipe bench` run on a GPU is measured against: the same
//! fill and verify kernels (or copies) in one process, with no ring between them.

use std::sync::Arc;
use std::time::Instant;

use pipeline_cuda::driver::{self, Context, CudaError, DeviceBuffer, Event, Stream};

use super::kernels::{Kernels, VERIFY_RESULT_BYTES};

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
    let pool = driver::MemPool::new_exportable(
        &ctx,
        (bytes * n) as usize,
        driver::PoolHandleType::PosixFd,
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
