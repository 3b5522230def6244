//! The CUDA backend of the ring: slots from an IPC-capable stream-ordered memory pool, one
//! `ready` IPC event per slot (the producer's), and one `finished` timeline word per slot per
//! consumer.
//!
//! Ordering (docs/protocol.md): the producer's stream waits until the `finished[c][k]` words of
//! the consumers that had slot k's previous batch reach that batch's generation, runs the fill,
//! records `ready[k]`, and only then is the descriptor published. A consumer's stream waits
//! `ready[k]`, runs its kernels and writes `finished[c][k] = seq + 1` (cuStreamWriteValue64),
//! and only then is the slot released. No host synchronisation happens per batch.
//!
//! Why `finished` is a timeline word and not an IPC event: measured on an H100 (driver
//! 580.159.04, 2026-11-21), when a consumer is SIGKILLed after recording `finished` but before
//! its GPU work ran, a producer stream that waits that event never proceeds, and the producer
//! stalls for good. An event record cannot be completed by anyone else; a timeline word can:
//! on a consumer's death the producer stores a far-future value into its words, which releases
//! every wait on them. The words live in a sealed memfd both processes map and register with
//! the driver (stream memory operations reject memory from IPC-capable pools).
//!
//! ```no_run
//! use pipeline_core::{Consumer, Producer, ProducerConfig};
//! use pipeline_cuda::backend::{CudaConsumer, CudaOptions, CudaProducer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Process A: produce into GPU memory.
//! let mut producer: Producer<CudaProducer> =
//!     Producer::bind("/tmp/gpu.sock", ProducerConfig::default(), CudaOptions::default())?;
//! let mut slot = producer.acquire()?;      // the stream already waits for the consumers
//! let mem = slot.memory();                  // device pointer, capacity, the stream to use
//! // enqueue your fill kernel on mem.stream.raw() writing to mem.ptr ...
//! let _ = (mem.ptr, mem.capacity);
//! slot.publish(1 << 20)?;                   // records `ready`, then publishes
//!
//! // Process B: consume in place.
//! let mut consumer: Consumer<CudaConsumer> = Consumer::attach("/tmp/gpu.sock", CudaOptions::default())?;
//! while let Some(batch) = consumer.recv()? {
//!     let view = batch.data();              // its stream already waits `ready`
//!     // enqueue kernels on view.stream.raw() reading view.ptr .. view.ptr + view.len ...
//!     let _ = (view.ptr, view.len);
//! }                                          // dropping records `finished`, then releases
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use parking_lot::Mutex;
use pipeline_core::wire::Reader;
use pipeline_core::{
    BackendError, BackendKind, ConsumerBackend, Export, ProducerBackend, RingLayout,
};

use crate::driver::{
    self, CUdeviceptr, Context, CudaError, Event, HostRegistration, MemPool, PoolHandleType,
    Stream, WaitCondition,
};
use crate::probe::Capabilities;

const EXPORT_MAGIC: u32 = u32::from_le_bytes(*b"GCU1");
const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"GCF1");
const HANDLE: usize = 64;

/// Options of the CUDA backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaOptions {
    /// Device ordinal. A consumer uses the device whose UUID matches the producer's when
    /// `None`; set it to use another device (peer access).
    pub device: Option<usize>,
}

/// A slot as the producer writes it: device memory and the stream to order work on.
pub struct CudaSlotMut<'a> {
    /// Device pointer of the slot (2 MiB aligned).
    pub ptr: CUdeviceptr,
    /// Capacity in bytes.
    pub capacity: u64,
    /// The producer's stream: it already waits for the slot's previous consumers. Enqueue the
    /// fill here (or make your own stream wait an event recorded here, and this stream wait
    /// yours before publish).
    pub stream: &'a Stream,
}

/// A batch as a consumer sees it.
pub struct CudaBatchRef<'a> {
    /// Device pointer of the batch.
    pub ptr: CUdeviceptr,
    /// Length in bytes.
    pub len: u64,
    /// The consumer's stream, already ordered after the producer's `ready`. Enqueue your work
    /// here; the release records `finished` on it.
    pub stream: &'a Stream,
}

fn be(e: CudaError) -> BackendError {
    Box::new(e)
}

/// A value past any real generation (sequences are below 2^48) that still compares as
/// "greater or equal" in the driver's wrapping comparison: it releases every wait.
const RELEASED: u64 = 1 << 62;

/// The finished timelines: `capacity × slots` u64 words in a sealed memfd, mapped here and
/// registered with the driver. Word `c * slots + k` holds the generation (`seq + 1`) of the
/// last batch in slot k that consumer c finished.
struct Timelines {
    // Field order matters: the registration must go before the mapping.
    reg: HostRegistration,
    map: MmapRaw,
    fd: OwnedFd,
    slots: u32,
    words: usize,
}

impl Timelines {
    fn bytes(layout: &RingLayout) -> u64 {
        (layout.consumer_capacity as u64 * layout.slot_count as u64 * 8).div_ceil(4096) * 4096
    }

    fn create(ctx: &Arc<Context>, layout: &RingLayout) -> Result<Self, BackendError> {
        let fd = pipeline_core::sys::sealed_memfd("gpipe-finished", Self::bytes(layout))?;
        Self::map(ctx, layout, fd)
    }

    fn map(ctx: &Arc<Context>, layout: &RingLayout, fd: OwnedFd) -> Result<Self, BackendError> {
        let bytes = Self::bytes(layout);
        pipeline_core::sys::check_sealed_memfd(fd.as_fd(), bytes)
            .map_err(|m| format!("finished timelines: {m}"))?;
        let map = MmapOptions::new().len(bytes as usize).map_raw(&fd)?;
        // SAFETY: the mapping is page-aligned, `bytes` long (a page multiple), and owned by
        // this struct, whose field order drops the registration before the mapping.
        let reg =
            unsafe { HostRegistration::new(ctx, map.as_mut_ptr(), bytes as usize) }.map_err(be)?;
        Ok(Self {
            reg,
            map,
            fd,
            slots: layout.slot_count,
            words: (layout.consumer_capacity * layout.slot_count) as usize,
        })
    }

    fn index(&self, consumer: u32, slot: u32) -> usize {
        let i = consumer as usize * self.slots as usize + slot as usize;
        assert!(i < self.words, "timeline index out of range");
        i
    }

    fn device(&self, consumer: u32, slot: u32) -> CUdeviceptr {
        self.reg.device_ptr() + 8 * self.index(consumer, slot) as u64
    }

    fn host(&self, consumer: u32, slot: u32) -> &AtomicU64 {
        let i = self.index(consumer, slot);
        // SAFETY: i < words and the mapping holds words * 8 bytes, 8-aligned (page base); the
        // word is only ever accessed atomically (here) or by the GPU's stream memory ops.
        unsafe { &*(self.map.as_mut_ptr().add(8 * i) as *const AtomicU64) }
    }
}

fn check_capabilities(ctx: &Arc<Context>) -> Result<(), BackendError> {
    let caps = Capabilities::of(ctx.device()).map_err(be)?;
    caps.chosen_path().map_err(be)?;
    Ok(())
}

/// The producer's half.
pub struct CudaProducer {
    ctx: Arc<Context>,
    stream: Stream,
    pool: MemPool,
    pool_fd: OwnedFd,
    slots: Vec<CUdeviceptr>,
    ready: Vec<Event>,
    export: Vec<u8>,
    slot_bytes: u64,
    timelines: Timelines,
    /// Consumers whose timelines the producer waits on (bit c). Held while enqueueing waits,
    /// so no wait on a departed consumer is enqueued after its words were released.
    live: Mutex<u64>,
}

impl CudaProducer {
    /// The CUDA context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
    /// The producer's stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
}

impl ProducerBackend for CudaProducer {
    type Options = CudaOptions;
    type SlotMut<'a> = CudaSlotMut<'a>;
    const KIND: BackendKind = BackendKind::Cuda;

    fn create(layout: &RingLayout, options: CudaOptions) -> Result<Self, BackendError> {
        driver::init().map_err(be)?;
        let ctx = Context::new(options.device.unwrap_or(0)).map_err(be)?;
        check_capabilities(&ctx)?;
        let stream = Stream::new(&ctx).map_err(be)?;
        let total = layout
            .slot_bytes
            .checked_mul(layout.slot_count as u64)
            .ok_or("ring size overflows")?;
        let pool =
            MemPool::new_exportable(&ctx, total as usize, PoolHandleType::PosixFd).map_err(be)?;
        let pool_fd = pool.export_fd().map_err(be)?;
        let mut slots = Vec::with_capacity(layout.slot_count as usize);
        let mut ready = Vec::with_capacity(layout.slot_count as usize);
        let mut export = Vec::new();
        export.extend_from_slice(&EXPORT_MAGIC.to_le_bytes());
        export.extend_from_slice(&1u32.to_le_bytes());
        export.extend_from_slice(&ctx.device().uuid().map_err(be)?);
        export.extend_from_slice(&layout.slot_count.to_le_bytes());
        export.extend_from_slice(&layout.slot_bytes.to_le_bytes());
        for _ in 0..layout.slot_count {
            let ptr = pool
                .alloc_async(layout.slot_bytes as usize, &stream)
                .map_err(be)?;
            slots.push(ptr);
        }
        // Setup only: the allocations must exist before they are exported.
        stream.synchronize().map_err(be)?;
        for &ptr in &slots {
            let ev = Event::new_ipc(&ctx).map_err(be)?;
            export.extend_from_slice(&pool.export_pointer(ptr).map_err(be)?);
            export.extend_from_slice(&ev.ipc_handle().map_err(be)?);
            ready.push(ev);
        }
        let timelines = Timelines::create(&ctx, layout)?;
        Ok(Self {
            ctx,
            stream,
            pool,
            pool_fd,
            slots,
            ready,
            export,
            slot_bytes: layout.slot_bytes,
            timelines,
            live: Mutex::new(0),
        })
    }

    fn export(&self, _consumer: u32) -> Result<Export, BackendError> {
        Ok(Export {
            blob: self.export.clone(),
            fds: vec![self.pool_fd.try_clone()?, self.timelines.fd.try_clone()?],
        })
    }

    fn attach(&self, consumer: u32, reply: &[u8], fds: Vec<OwnedFd>) -> Result<(), BackendError> {
        if !fds.is_empty() {
            return Err("CUDA consumer reply must carry no fds".into());
        }
        let mut r = Reader::new(reply, "CUDA consumer reply");
        if r.u32()? != REPLY_MAGIC {
            return Err("CUDA consumer reply has a bad magic".into());
        }
        let n = r.u32()? as usize;
        r.finish()?;
        if n != self.slots.len() {
            return Err(format!("CUDA consumer imported {n} slots of {}", self.slots.len()).into());
        }
        let mut live = self.live.lock();
        // A previous holder of this index may still have waits in our stream (released by
        // its departure): let them pass before its words go back to zero.
        self.stream.synchronize().map_err(be)?;
        for k in 0..self.slots.len() as u32 {
            self.timelines.host(consumer, k).store(0, Ordering::Release);
        }
        *live |= 1u64 << consumer;
        Ok(())
    }

    fn detach(&self, consumer: u32, died: bool) {
        let mut live = self.live.lock();
        *live &= !(1u64 << consumer);
        // Release every wait on its words, now and later: a dead consumer's last writes may
        // never happen.
        for k in 0..self.slots.len() as u32 {
            self.timelines
                .host(consumer, k)
                .store(RELEASED, Ordering::Release);
        }
        if died {
            tracing::debug!(
                consumer,
                "released the finished timelines of a dead consumer"
            );
        }
    }

    fn wait_finished(&self, slot: u32, prev_seq: u64, holders: u64) -> Result<(), BackendError> {
        if holders == 0 {
            return Ok(());
        }
        let live = self.live.lock();
        for c in 0..64u32 {
            if holders & *live & (1u64 << c) == 0 {
                continue;
            }
            // SAFETY: the word is in our registered timelines, mapped for our lifetime; the
            // stream is ours.
            unsafe {
                driver::stream_wait_value64(
                    &self.stream,
                    self.timelines.device(c, slot),
                    prev_seq + 1,
                    WaitCondition::Geq,
                )
            }
            .map_err(be)?;
        }
        Ok(())
    }

    unsafe fn slot_mut(&self, slot: u32) -> CudaSlotMut<'_> {
        CudaSlotMut {
            ptr: self.slots[slot as usize],
            capacity: self.slot_bytes,
            stream: &self.stream,
        }
    }

    fn signal_ready(&self, slot: u32) -> Result<(), BackendError> {
        self.ready[slot as usize].record(&self.stream).map_err(be)
    }
}

impl Drop for CudaProducer {
    fn drop(&mut self) {
        // The ring closes only after consumers detached (or its drain timeout passed), so the
        // importers have freed their imports; our stream already waits their last `finished`.
        if let Err(e) = self.stream.synchronize() {
            tracing::error!("CUDA producer teardown: stream synchronize failed: {e}");
        }
        for &ptr in &self.slots {
            // SAFETY: each pointer came from alloc_async on this pool, is freed once, here,
            // after the stream finished all work that used it.
            if let Err(e) = unsafe { self.pool.free_async(ptr, &self.stream) } {
                tracing::error!("CUDA producer teardown: freeing a slot failed: {e}");
            }
        }
        if let Err(e) = self.stream.synchronize() {
            tracing::error!("CUDA producer teardown: stream synchronize failed: {e}");
        }
    }
}

/// The consumer's half.
pub struct CudaConsumer {
    ctx: Arc<Context>,
    stream: Stream,
    pool: MemPool,
    slots: Vec<CUdeviceptr>,
    ready: Vec<Event>,
    timelines: Timelines,
    index: u32,
    slot_bytes: u64,
}

impl CudaConsumer {
    /// The CUDA context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
    /// The consumer's stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
}

fn pick_device(uuid: &[u8; 16], options: &CudaOptions) -> Result<usize, BackendError> {
    if let Some(d) = options.device {
        return Ok(d);
    }
    for d in 0..driver::device_count().map_err(be)? {
        if driver::Device::get(d).map_err(be)?.uuid().map_err(be)? == *uuid {
            return Ok(d);
        }
    }
    Err(
        "the producer's GPU is not visible to this consumer (check CUDA_VISIBLE_DEVICES), \
         or choose a device explicitly"
            .into(),
    )
}

impl ConsumerBackend for CudaConsumer {
    type Options = CudaOptions;
    type BatchRef<'a> = CudaBatchRef<'a>;
    const KIND: BackendKind = BackendKind::Cuda;

    fn import(
        layout: &RingLayout,
        consumer: u32,
        options: CudaOptions,
        blob: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<(Self, Export), BackendError> {
        let mut r = Reader::new(blob, "CUDA export");
        if r.u32()? != EXPORT_MAGIC || r.u32()? != 1 {
            return Err("CUDA export has a bad magic or version".into());
        }
        let uuid: [u8; 16] = r.bytes(16)?.try_into()?;
        let n = r.u32()?;
        let slot_bytes = r.u64()?;
        if n != layout.slot_count || slot_bytes != layout.slot_bytes {
            return Err(format!(
                "CUDA export describes {n} slots of {slot_bytes} bytes; the ring has {} of {}",
                layout.slot_count, layout.slot_bytes
            )
            .into());
        }
        let mut exports = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let p: [u8; HANDLE] = r.bytes(HANDLE)?.try_into()?;
            let e: [u8; HANDLE] = r.bytes(HANDLE)?.try_into()?;
            exports.push((p, e));
        }
        r.finish()?;
        let [pool_fd, timeline_fd] = <[OwnedFd; 2]>::try_from(fds).map_err(|f| {
            format!(
                "CUDA export must carry a pool fd and a timeline fd, got {} fds",
                f.len()
            )
        })?;
        driver::init().map_err(be)?;
        let ctx = Context::new(pick_device(&uuid, &options)?).map_err(be)?;
        check_capabilities(&ctx)?;
        let stream = Stream::new(&ctx).map_err(be)?;
        let pool = MemPool::import_fd(&ctx, pool_fd.as_fd()).map_err(be)?;
        drop(pool_fd);
        pool.set_access(ctx.device(), true).map_err(be)?;
        // Import each allocation once: a second import of the same allocation would share the
        // mapping and the first free would unmap both.
        let mut seen: HashMap<[u8; HANDLE], CUdeviceptr> = HashMap::new();
        let mut slots = Vec::with_capacity(n as usize);
        let mut ready = Vec::with_capacity(n as usize);
        for (p, e) in &exports {
            if seen.contains_key(p) {
                return Err("the producer exported one allocation for two slots".into());
            }
            let ptr = pool.import_pointer(p).map_err(be)?;
            seen.insert(*p, ptr);
            slots.push(ptr);
            ready.push(Event::open_ipc(&ctx, e).map_err(be)?);
        }
        let timelines = Timelines::map(&ctx, layout, timeline_fd)?;
        let mut reply = Vec::with_capacity(8);
        reply.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
        reply.extend_from_slice(&n.to_le_bytes());
        Ok((
            Self {
                ctx,
                stream,
                pool,
                slots,
                ready,
                timelines,
                index: consumer,
                slot_bytes,
            },
            Export {
                blob: reply,
                fds: Vec::new(),
            },
        ))
    }

    fn wait_ready(&mut self, slot: u32) -> Result<(), BackendError> {
        self.stream
            .wait_event(&self.ready[slot as usize])
            .map_err(be)
    }

    unsafe fn batch_ref(&self, slot: u32, len: u64) -> CudaBatchRef<'_> {
        debug_assert!(len <= self.slot_bytes);
        CudaBatchRef {
            ptr: self.slots[slot as usize],
            len,
            stream: &self.stream,
        }
    }

    fn signal_finished(&mut self, slot: u32, seq: u64) -> Result<(), BackendError> {
        // SAFETY: the word is in our registered timelines, mapped for our lifetime; the
        // stream is ours.
        unsafe {
            driver::stream_write_value64(
                &self.stream,
                self.timelines.device(self.index, slot),
                seq + 1,
            )
        }
        .map_err(be)
    }
}

impl Drop for CudaConsumer {
    fn drop(&mut self) {
        // Importers free first: finish our work, free every imported pointer, and only then
        // (when the core sends Goodbye after this drop) may the producer free its memory.
        if let Err(e) = self.stream.synchronize() {
            tracing::error!("CUDA consumer teardown: stream synchronize failed: {e}");
        }
        for &ptr in &self.slots {
            // SAFETY: each pointer was imported once from this pool and is freed once, after
            // the stream finished all our work on it.
            if let Err(e) = unsafe { self.pool.free_async(ptr, &self.stream) } {
                tracing::error!("CUDA consumer teardown: freeing an import failed: {e}");
            }
        }
        if let Err(e) = self.stream.synchronize() {
            tracing::error!("CUDA consumer teardown: stream synchronize failed: {e}");
        }
    }
}
