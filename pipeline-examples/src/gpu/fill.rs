//! GPU fill and verify of the test pattern: the CUDA side of `work::Fill` and `work::Check`,
//! used by `gpipe bench`, `produce`, `consume` and `soak`.

use std::sync::Arc;

use pipeline_core::{Batch, Consumer, Slot, USER_HEADER_WORDS};
use pipeline_cuda::backend::{CudaConsumer, CudaProducer};
use pipeline_cuda::driver::{self, Context, DeviceBuffer, PinnedBuffer, Stream};

use super::kernels::{Kernels, VERIFY_RESULT_BYTES, VerifyResult};
use super::stamps::StampRecorder;
use crate::work::{Check, Fill, H_SEQ};

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
