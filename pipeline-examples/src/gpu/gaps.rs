//! `gpipe probe --gpu-gaps`: how long the GPU idles between two kernels with each stream
//! operation of the hot path between them.

use pipeline_cuda::driver::{self, Context, CudaError, DeviceBuffer, Event, PinnedBuffer, Stream};

use super::kernels::{self, Kernels};

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
