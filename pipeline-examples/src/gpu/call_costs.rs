//! `gpipe probe --call-costs`: the host cost of each driver call of the hot path.

use std::time::Instant;

use pipeline_cuda::driver::{self, Context, CudaError, DeviceBuffer, Event, Stream};

use super::kernels::Kernels;

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
