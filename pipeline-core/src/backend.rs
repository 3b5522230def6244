//! The backend seam: where slot memory lives and how "ready" and "finished" are signalled.
//!
//! The ring calls these hooks in the protocol's order (docs/protocol.md):
//!
//! * producer, per batch: [`ProducerBackend::wait_finished`] (the slot's previous holders are
//!   done) → the user writes through [`ProducerBackend::slot_mut`] →
//!   [`ProducerBackend::signal_ready`] → the ring publishes the descriptor;
//! * consumer, per batch: the ring reads the descriptor → [`ConsumerBackend::wait_ready`] → the
//!   user reads through [`ConsumerBackend::batch_ref`] → [`ConsumerBackend::signal_finished`]
//!   → the ring releases the slot.
//!
//! A backend never sees the ring's internals, only slot indices and consumer indices.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::OnceLock;

use memmap2::{MmapOptions, MmapRaw};

use crate::delivery::{Delivery, MirrorTable, Placement};
use crate::error::BackendError;
use crate::layout::RingLayout;
use crate::sys;

/// Which backend a ring uses (on the wire and in the control segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Slots in a host memfd.
    Host,
    /// Slots in an exportable CUDA memory pool.
    Cuda,
}

impl BackendKind {
    /// Wire value.
    pub fn to_u32(self) -> u32 {
        match self {
            BackendKind::Host => 1,
            BackendKind::Cuda => 2,
        }
    }
    /// From the wire value.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(BackendKind::Host),
            2 => Some(BackendKind::Cuda),
            _ => None,
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// What one side hands the other during the handshake: opaque bytes and file descriptors.
#[derive(Debug, Default)]
pub struct Export {
    /// Backend-defined bytes (validated by the receiving backend).
    pub blob: Vec<u8>,
    /// File descriptors, passed with `SCM_RIGHTS`.
    pub fds: Vec<OwnedFd>,
}

/// The producer's half of a backend.
pub trait ProducerBackend: Send + Sync + Sized + 'static {
    /// Backend-specific options (device, ...).
    type Options;
    /// What the producer writes a batch through.
    type SlotMut<'a>
    where
        Self: 'a;
    /// This backend's kind.
    const KIND: BackendKind;

    /// Allocates the ring's slots.
    fn create(layout: &RingLayout, options: Self::Options) -> Result<Self, BackendError>;
    /// Export data for a consumer that is attaching (called on a handshake thread).
    fn export(&self, consumer: u32) -> Result<Export, BackendError>;
    /// Takes a consumer's reply (e.g. its finished-event handles) before it becomes active.
    fn attach(&self, consumer: u32, reply: &[u8], fds: Vec<OwnedFd>) -> Result<(), BackendError>;
    /// The consumer left (`died == false`) or died: stop waiting on anything of its.
    fn detach(&self, consumer: u32, died: bool);
    /// Orders the producer's next writes to `slot` after the work of the consumers in
    /// `holders` (bit c = consumer c) that had its previous batch, `prev_seq`. The ring has
    /// already seen them release it.
    fn wait_finished(&self, slot: u32, prev_seq: u64, holders: u64) -> Result<(), BackendError>;
    /// [`ProducerBackend::wait_finished`] for each `(slot, prev_seq, holders)`, in order (the
    /// ring under a lead bound orders a batch after two: the batch `max_lead` back and its
    /// slot's previous one). A backend may enqueue them together. The default calls
    /// `wait_finished` for each.
    fn wait_finished_all(&self, waits: &[(u32, u64, u64)]) -> Result<(), BackendError> {
        for &(slot, prev_seq, holders) in waits {
            self.wait_finished(slot, prev_seq, holders)?;
        }
        Ok(())
    }
    /// The slot's memory for writing.
    ///
    /// # Safety
    /// The caller owns `slot` exclusively: no consumer holds it and no other `SlotMut` for it
    /// is alive (the ring guarantees this between `wait_finished` and publish).
    unsafe fn slot_mut(&self, slot: u32) -> Self::SlotMut<'_>;
    /// Bytes of memory the backend holds for the ring now (for leak checks), if it can tell.
    fn memory_in_use(&self) -> Option<u64> {
        None
    }
    /// Marks the producer's writes to batch `seq` in `slot` complete (the ring publishes only
    /// after this).
    fn signal_ready(&self, slot: u32, seq: u64) -> Result<(), BackendError>;
    /// [`ProducerBackend::signal_ready`], with a look ahead: when `next` is
    /// `Some((slot, prev_seq, holders))`, the slot of the producer's next batch is already
    /// released by every holder of its previous batch, and the ring will call
    /// [`ProducerBackend::wait_finished`] for that slot and `prev_seq` before that batch (with
    /// the same holders, or fewer if some departed meanwhile, whose waits pass anyway). A
    /// backend may enqueue that wait now, after the ready signal and together with it (a
    /// GPU backend saves a stream operation per batch), and then let the later call add
    /// nothing. The ring works `next` out only when [`ProducerBackend::looks_ahead`] says it
    /// is used. The default ignores `next`.
    fn signal_ready_then_wait(
        &self,
        slot: u32,
        seq: u64,
        next: Option<(u32, u64, u64)>,
    ) -> Result<(), BackendError> {
        let _ = next;
        self.signal_ready(slot, seq)
    }
    /// Whether [`ProducerBackend::signal_ready_then_wait`] uses its look ahead (default: no).
    fn looks_ahead(&self) -> bool {
        false
    }
    /// The consumer whose work the producer's oldest unfinished wait (from `wait_finished`)
    /// has expected for longer than `limit`, if any. The ring detaches it under the lag
    /// policy `DetachAfter`, as it does a consumer that holds a slot too long: a wait the
    /// producer cannot see from the slot's `pending` word (an asynchronous backend's) must
    /// not stall the ring for good. Only the oldest is named: later waits may be late only
    /// because they queue behind it. Backends whose waits are over when `wait_finished`
    /// returns have none.
    fn overdue(&self, limit: std::time::Duration) -> Option<u32> {
        let _ = limit;
        None
    }
}

/// The consumer's half of a backend. Batches are released from any thread, so its hooks
/// take `&self`.
pub trait ConsumerBackend: Send + Sync + Sized + 'static {
    /// Backend-specific options.
    type Options;
    /// What the consumer reads a batch through.
    type BatchRef<'a>
    where
        Self: 'a;
    /// This backend's kind.
    const KIND: BackendKind;

    /// Imports the producer's export, once, at attach; returns the reply for the producer.
    fn import(
        layout: &RingLayout,
        consumer: u32,
        options: Self::Options,
        blob: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<(Self, Export), BackendError>;
    /// Called once the handshake is over (the producer counts this consumer in) and before
    /// the first batch is received: for work that may take long (page-locking the memory,
    /// say), which the producer's handshake deadline must not bound. An `Err` detaches the
    /// consumer and fails the attach with its message. The default does nothing.
    fn joined(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Orders the consumer's use of batch `seq` in `slot` after the producer's writes to it.
    fn wait_ready(&self, slot: u32, seq: u64) -> Result<(), BackendError>;
    /// The batch's memory: the slot in place, or the consumer's own copy of batch `seq` when
    /// [`ConsumerBackend::mirror`] made one.
    ///
    /// # Safety
    /// `slot` holds (or held, when mirrored) published batch `seq` of `len` bytes
    /// (`len <= slot_bytes`) that this consumer has not released; the reference must not
    /// outlive the release.
    unsafe fn batch_ref(&self, slot: u32, seq: u64, len: u64) -> Self::BatchRef<'_>;
    /// Marks the consumer's use of batch `seq` in `slot` complete (the ring releases only
    /// after this). For a mirrored batch, the user is done with the copy: its buffer may be
    /// reused (the producer's slot was signalled when the copy was made).
    fn signal_finished(&self, slot: u32, seq: u64) -> Result<(), BackendError>;
    /// [`ConsumerBackend::signal_finished`], with a look ahead: when `next` is
    /// `Some((slot, seq))`, batch `seq` is published (its ready signal is enqueued) and is
    /// the next this consumer will receive. A backend may enqueue that batch's
    /// [`ConsumerBackend::wait_ready`] now, after the finished signal and together with it,
    /// and let the later call add nothing. The ring works `next` out (a few reads of the
    /// shared segment) only when [`ConsumerBackend::looks_ahead`] says it is used. The
    /// default ignores `next`.
    fn signal_finished_then_wait(
        &self,
        slot: u32,
        seq: u64,
        next: Option<(u32, u64)>,
    ) -> Result<(), BackendError> {
        let _ = next;
        self.signal_finished(slot, seq)
    }
    /// Whether [`ConsumerBackend::signal_finished_then_wait`] uses its look ahead (default:
    /// no).
    fn looks_ahead(&self) -> bool {
        false
    }
    /// Mirror delivery, called after [`ConsumerBackend::wait_ready`]: copies batch `seq`
    /// (`len` bytes in `slot`) into a buffer of the consumer's own and signals `finished` for
    /// the producer's slot once the copy is done, so the ring can release the slot at once.
    /// Returns false, doing nothing, for a consumer that reads in place (the default).
    fn mirror(&self, slot: u32, seq: u64, len: u64) -> Result<bool, BackendError> {
        let _ = (slot, seq, len);
        Ok(false)
    }
    /// Mirror delivery: `Some(buffers)` when every one of the consumer's `buffers` own
    /// buffers holds a batch the user has not released, so a batch received now could not be
    /// delivered. `None` otherwise, and always for in-place delivery.
    fn mirror_full(&self) -> Option<usize> {
        None
    }
    /// Where this consumer uses its batches, recorded in the control segment at attach.
    fn placement(&self) -> Placement {
        Placement::default()
    }
    /// Waits until the consumer's work so far is complete, not just ordered. Used before
    /// releasing a batch the producer will not wait for (a shared-mode claim whose token
    /// could not be recorded); backends whose work is done when `signal_finished` returns
    /// need nothing.
    fn complete_now(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// The producer died: work waiting for its signals may never run. The backend must not
    /// wait for it at teardown (and may release such waits itself).
    fn abandon(&self) {}
}

/// The host backend: slots in one memfd, written with the CPU through the producer's own
/// mapping and sealed against every other write (`F_SEAL_FUTURE_WRITE`) before any consumer
/// gets it. Ready and finished need no signal beyond the ring's own release/acquire ordering,
/// because host work is done by the time the hook runs.
pub struct HostProducer {
    fd: OwnedFd,
    map: MmapRaw,
    slot_bytes: u64,
    slot_count: u32,
}

/// Options of the host backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostOptions {
    /// Consumer: [`Delivery::Mirror`] copies each batch into memory of the consumer's own and
    /// releases the producer's slot at once; in place otherwise (`Auto` reads in place: on
    /// the host both read the same memory).
    pub delivery: Delivery,
    /// Consumer, mirror delivery: how many batches it may hold at once (its own buffers,
    /// `slot_bytes` each); default: the ring's slot count.
    pub mirror_buffers: Option<u32>,
    /// Consumer: called once with the memory its batches are read from (the slots' mapping,
    /// or its own buffers when it mirrors), after the attach handshake and before the first
    /// batch, so however long it takes is not bounded by the producer's handshake timeout;
    /// what it returns is kept until that memory is unmapped, and dropped just before. For a
    /// page-lock of the memory by a GPU driver, so that copies from the batches to a GPU run
    /// by DMA (gpipe-py's `pin_memory`).
    pub on_map: Option<OnMap>,
}

/// See [`HostOptions::on_map`]: given the memory's first byte and its length, returns what
/// must live as long as that mapping (an `Err` fails the attach with its message).
pub type OnMap = fn(*const u8, usize) -> Result<MapGuard, String>;

/// What [`OnMap`] returns: dropped before the memory it was given is unmapped.
pub type MapGuard = Box<dyn Send + Sync>;

impl HostOptions {
    /// Options for a consumer that mirrors each batch into memory of its own.
    pub fn mirror() -> Self {
        HostOptions {
            delivery: Delivery::Mirror,
            ..HostOptions::default()
        }
    }
}

impl HostProducer {
    /// The memfd holding the slots.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl ProducerBackend for HostProducer {
    type Options = HostOptions;
    type SlotMut<'a> = &'a mut [u8];
    const KIND: BackendKind = BackendKind::Host;

    fn create(layout: &RingLayout, _: HostOptions) -> Result<Self, BackendError> {
        // Before allocating anything: a ring larger than the memory left would be made (a
        // memfd is sparse) and fail page by page as it is written, or bring in the OOM killer.
        crate::limits::check_fits(
            layout.slot_count,
            layout.slot_bytes,
            sys::available_memory(),
            crate::limits::Memory::Host,
        )?;
        let total = layout
            .slot_bytes
            .checked_mul(layout.slot_count as u64)
            .ok_or("ring size overflows")?;
        // Our writable view first, then the seal: from here on nobody (a consumer holding a
        // dup, or reopening it through /proc) can write the slots or map them writable.
        let unshared = sys::UnsharedMemfd::create("gpipe-slots", total)?;
        let map = MmapOptions::new()
            .len(total as usize)
            .map_raw(&unshared.fd())?;
        let fd = unshared.seal_writes()?;
        Ok(Self {
            fd,
            map,
            slot_bytes: layout.slot_bytes,
            slot_count: layout.slot_count,
        })
    }

    fn export(&self, _consumer: u32) -> Result<Export, BackendError> {
        Ok(Export {
            blob: Vec::new(),
            fds: vec![self.fd.try_clone()?],
        })
    }

    fn attach(&self, _: u32, reply: &[u8], fds: Vec<OwnedFd>) -> Result<(), BackendError> {
        if !reply.is_empty() || !fds.is_empty() {
            return Err("host consumer sent unexpected reply data".into());
        }
        Ok(())
    }

    fn detach(&self, _: u32, _: bool) {}

    fn wait_finished(&self, _: u32, _: u64, _: u64) -> Result<(), BackendError> {
        Ok(())
    }

    unsafe fn slot_mut(&self, slot: u32) -> &mut [u8] {
        assert!(slot < self.slot_count);
        // SAFETY: slot < slot_count so the range lies inside the mapping of
        // slot_count * slot_bytes bytes; the caller guarantees exclusive ownership of the slot
        // (no consumer reads it and no other reference to it exists) for the borrow's life.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.map
                    .as_mut_ptr()
                    .add(slot as usize * self.slot_bytes as usize),
                self.slot_bytes as usize,
            )
        }
    }

    fn signal_ready(&self, _: u32, _: u64) -> Result<(), BackendError> {
        Ok(())
    }
}

/// The host backend's consumer half: the slots mapped read-only.
pub struct HostConsumer {
    /// [`HostOptions::on_map`]'s guard, made in [`ConsumerBackend::joined`]. Declared
    /// first: dropped before the mappings.
    guard: OnceLock<MapGuard>,
    on_map: Option<OnMap>,
    map: MmapRaw,
    slot_bytes: u64,
    slot_count: u32,
    /// Mirror delivery: the consumer's own buffers and which batch each holds.
    mirror: Option<HostMirror>,
}

/// A host consumer's own buffers (anonymous memory, `slot_bytes` each).
struct HostMirror {
    map: MmapRaw,
    table: MirrorTable,
    /// The buffer after the one taken last.
    next: std::sync::atomic::AtomicUsize,
}

impl HostConsumer {
    /// The first byte of `slot` in the producer's memory (read-only). What a forwarder that
    /// chunks copies from before the batch in it is published (pipeline-relay's `chunks`);
    /// reading it is right only once something orders the read after the producer's writes.
    ///
    /// # Panics
    /// If `slot` is not a slot of the ring.
    pub fn slot_ptr(&self, slot: u32) -> *const u8 {
        assert!(slot < self.slot_count);
        // SAFETY: slot < slot_count keeps the offset inside the mapping of
        // slot_count * slot_bytes bytes.
        unsafe {
            self.map
                .as_ptr()
                .add(slot as usize * self.slot_bytes as usize)
        }
    }
}

impl ConsumerBackend for HostConsumer {
    type Options = HostOptions;
    type BatchRef<'a> = &'a [u8];
    const KIND: BackendKind = BackendKind::Host;

    fn import(
        layout: &RingLayout,
        _consumer: u32,
        options: HostOptions,
        blob: &[u8],
        mut fds: Vec<OwnedFd>,
    ) -> Result<(Self, Export), BackendError> {
        if !blob.is_empty() || fds.len() != 1 {
            return Err(format!(
                "host export must be exactly one memfd and no data (got {} fds, {} bytes)",
                fds.len(),
                blob.len()
            )
            .into());
        }
        let fd = fds.pop().ok_or("missing slot memfd")?;
        let total = layout
            .slot_bytes
            .checked_mul(layout.slot_count as u64)
            .ok_or("ring size overflows")?;
        sys::check_write_sealed_memfd(fd.as_fd(), total)
            .map_err(|m| format!("slot memory: {m}"))?;
        // Read-only, and sealed by the producer against writes: no consumer can write what the
        // others read, through this mapping (mprotect) or any other.
        let map = MmapOptions::new()
            .len(total as usize)
            .map_raw_read_only(&fd)?;
        let mirror = match options.delivery {
            Delivery::Mirror => {
                let buffers = options.mirror_buffers.unwrap_or(layout.slot_count);
                if buffers == 0 {
                    return Err("mirror delivery needs at least one buffer of its own".into());
                }
                let bytes = layout
                    .slot_bytes
                    .checked_mul(u64::from(buffers))
                    .ok_or("mirror buffers overflow")?;
                let own = MmapOptions::new().len(bytes as usize).map_anon()?;
                Some(HostMirror {
                    map: MmapRaw::from(own),
                    table: MirrorTable::new(buffers as usize),
                    next: std::sync::atomic::AtomicUsize::new(0),
                })
            }
            Delivery::InPlace | Delivery::Auto => None,
        };
        Ok((
            Self {
                guard: OnceLock::new(),
                on_map: options.on_map,
                map,
                slot_bytes: layout.slot_bytes,
                slot_count: layout.slot_count,
                mirror,
            },
            Export::default(),
        ))
    }

    fn joined(&self) -> Result<(), BackendError> {
        let Some(f) = self.on_map else {
            return Ok(());
        };
        let read = self.mirror.as_ref().map_or(&self.map, |m| &m.map);
        let guard = f(read.as_ptr(), read.len()).map_err(|m| format!("slot memory: {m}"))?;
        // joined runs once per consumer (at its attach): the cell is empty
        let first = self.guard.set(guard).is_ok();
        debug_assert!(first, "HostConsumer::joined ran twice");
        Ok(())
    }

    fn wait_ready(&self, _: u32, _: u64) -> Result<(), BackendError> {
        Ok(())
    }

    unsafe fn batch_ref(&self, slot: u32, seq: u64, len: u64) -> &[u8] {
        assert!(len <= self.slot_bytes);
        if let Some((m, k)) = self
            .mirror
            .as_ref()
            .and_then(|m| m.table.find(seq).map(|k| (m, k)))
        {
            // SAFETY: k < buffers, so the range lies inside our own mapping; the buffer holds
            // batch `seq` until the caller releases it, and nothing writes it meanwhile
            // (`mirror` writes only a buffer it has just taken free).
            return unsafe {
                std::slice::from_raw_parts(
                    m.map.as_ptr().add(k * self.slot_bytes as usize),
                    len as usize,
                )
            };
        }
        // SAFETY: `slot_ptr` checks slot < slot_count and len <= slot_bytes keeps the range
        // inside the mapping; the caller guarantees the batch is published and unreleased, so
        // the producer does not write it while the reference lives.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(slot), len as usize) }
    }

    fn signal_finished(&self, _: u32, seq: u64) -> Result<(), BackendError> {
        if let Some(m) = &self.mirror {
            m.table.give_back(seq);
        }
        Ok(())
    }

    fn mirror(&self, slot: u32, seq: u64, len: u64) -> Result<bool, BackendError> {
        let Some(m) = &self.mirror else {
            return Ok(false);
        };
        if len > self.slot_bytes {
            return Err(format!("batch {seq} of {len} bytes exceeds the slot").into());
        }
        let hint = m.next.load(std::sync::atomic::Ordering::Relaxed);
        let k = m.table.take(seq, hint).ok_or_else(|| {
            format!(
                "every one of the consumer's {} mirror buffers holds a batch",
                m.table.len()
            )
        })?;
        m.next.store(
            (k + 1) % m.table.len(),
            std::sync::atomic::Ordering::Relaxed,
        );
        // SAFETY: the source is the published, unreleased slot (inside the read-only mapping:
        // `slot_ptr` checks the slot, len <= slot_bytes); the destination is buffer k of our
        // own mapping, which we just took free, so no reference to it lives.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.slot_ptr(slot),
                m.map.as_mut_ptr().add(k * self.slot_bytes as usize),
                len as usize,
            );
        }
        Ok(true)
    }

    fn mirror_full(&self) -> Option<usize> {
        let m = self.mirror.as_ref()?;
        m.table.is_full().then(|| m.table.len())
    }

    fn placement(&self) -> Placement {
        Placement {
            device: None,
            mirror: self.mirror.is_some(),
        }
    }
}
