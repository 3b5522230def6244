//! The CUDA backend of the ring: slots from an IPC-capable stream-ordered memory pool, one
//! `ready` IPC event per slot (the producer's), one `finished` IPC event per slot per
//! consumer (each consumer's).
//!
//! Ordering (docs/protocol.md): the producer's stream waits the `finished[k]` events of the
//! consumers that had slot k's previous batch, runs the fill, records `ready[k]`, and only then
//! is the descriptor published. A consumer's stream waits `ready[k]`, runs its kernels and
//! records `finished[k]`, and only then is the slot released. No host synchronisation happens
//! per batch.
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

use parking_lot::Mutex;
use pipeline_core::wire::Reader;
use pipeline_core::{
    BackendError, BackendKind, ConsumerBackend, Export, ProducerBackend, RingLayout,
};

use crate::driver::{
    self, CUdeviceptr, Context, CudaError, Event, MemPool, PoolHandleType, Stream,
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
    /// finished[c] = consumer c's finished events, one per slot.
    finished: Mutex<Vec<Option<Vec<Event>>>>,
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
        Ok(Self {
            ctx,
            stream,
            pool,
            pool_fd,
            slots,
            ready,
            export,
            slot_bytes: layout.slot_bytes,
            finished: Mutex::new((0..layout.consumer_capacity).map(|_| None).collect()),
        })
    }

    fn export(&self, _consumer: u32) -> Result<Export, BackendError> {
        Ok(Export {
            blob: self.export.clone(),
            fds: vec![self.pool_fd.try_clone()?],
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
        if n != self.slots.len() {
            return Err(format!(
                "CUDA consumer sent {n} finished events for {} slots",
                self.slots.len()
            )
            .into());
        }
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            let h: [u8; HANDLE] = r.bytes(HANDLE)?.try_into()?;
            events.push(Event::open_ipc(&self.ctx, &h).map_err(be)?);
        }
        r.finish()?;
        let mut f = self.finished.lock();
        let entry = f
            .get_mut(consumer as usize)
            .ok_or("consumer index out of range")?;
        *entry = Some(events);
        Ok(())
    }

    fn detach(&self, consumer: u32, died: bool) {
        // Stop waiting on its events. Waits already enqueued keep their own reference in the
        // driver; a dead consumer's last record either completed or never happened.
        if let Some(e) = self.finished.lock().get_mut(consumer as usize) {
            if e.take().is_some() && died {
                tracing::debug!(consumer, "dropped the finished events of a dead consumer");
            }
        }
    }

    fn wait_finished(&self, slot: u32, holders: u64) -> Result<(), BackendError> {
        if holders == 0 {
            return Ok(());
        }
        let f = self.finished.lock();
        for (c, events) in f.iter().enumerate() {
            if holders & (1u64 << c) == 0 {
                continue;
            }
            if let Some(events) = events {
                self.stream.wait_event(&events[slot as usize]).map_err(be)?;
            }
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
    finished: Vec<Event>,
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
        _consumer: u32,
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
        let [pool_fd] = <[OwnedFd; 1]>::try_from(fds).map_err(|f| {
            format!(
                "CUDA export must carry exactly one pool fd, got {}",
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
        let mut reply = Vec::with_capacity(8 + HANDLE * n as usize);
        reply.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
        reply.extend_from_slice(&n.to_le_bytes());
        let mut finished = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let ev = Event::new_ipc(&ctx).map_err(be)?;
            reply.extend_from_slice(&ev.ipc_handle().map_err(be)?);
            finished.push(ev);
        }
        Ok((
            Self {
                ctx,
                stream,
                pool,
                slots,
                ready,
                finished,
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

    fn signal_finished(&mut self, slot: u32) -> Result<(), BackendError> {
        self.finished[slot as usize]
            .record(&self.stream)
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
