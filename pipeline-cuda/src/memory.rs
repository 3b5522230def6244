//! Where the CUDA backend's slots live, per memory path, and how they are shared.
//!
//! Three paths, all with the same ring protocol and the same `ready` events / `finished`
//! timelines (see [`crate::backend`]):
//!
//! * [`MemoryPath::Pool`]: one exportable stream-ordered pool, one allocation per slot; the
//!   consumer imports the pool once and each slot's pointer once.
//! * [`MemoryPath::Vmm`]: one `cuMemCreate` allocation per slot, exported as one shareable handle
//!   per slot; the consumer imports each and maps it into its own address space.
//! * [`MemoryPath::Legacy`]: one `cuMemAlloc` allocation per slot, shared with its legacy IPC
//!   handle (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`).
//!
//! The pool and VMM paths share their handles either as POSIX file descriptors
//! ([`HandleKind::PosixFd`], passed with `SCM_RIGHTS`) or as fabric handles
//! ([`HandleKind::Fabric`], 64 bytes in the export blob; needs an IMEX channel).

use std::collections::HashSet;
use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use pipeline_core::wire::Reader;
use pipeline_core::{BackendError, RingLayout};
use serde::Serialize;

use crate::driver::{
    CUdeviceptr, Context, CudaError, DeviceBuffer, FabricHandle, IpcMapping, IpcMemHandle, MemPool,
    PointerExport, PoolHandleType, Stream,
};
use crate::vmm::{PhysicalAllocation, VmmMapping, allocation_granularity};

/// How the slots' GPU memory is allocated and shared with consumers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryPath {
    /// An exportable stream-ordered memory pool (`cuMemPoolCreate`), one allocation per slot.
    #[default]
    Pool,
    /// Virtual memory management: one `cuMemCreate` allocation per slot, each exported.
    Vmm,
    /// Legacy IPC: one `cuMemAlloc` allocation per slot, shared with `cuIpcGetMemHandle`.
    Legacy,
}

impl MemoryPath {
    /// Every path, in the order `auto` tries them.
    pub const ALL: [MemoryPath; 3] = [MemoryPath::Pool, MemoryPath::Vmm, MemoryPath::Legacy];

    /// The lowercase name: `pool`, `vmm`, `legacy`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryPath::Pool => "pool",
            MemoryPath::Vmm => "vmm",
            MemoryPath::Legacy => "legacy",
        }
    }

    /// Whether the path can share its memory with `handle`.
    pub fn supports(self, handle: HandleKind) -> bool {
        !(self == MemoryPath::Legacy && handle == HandleKind::Fabric)
    }

    /// Value in the export blob.
    pub fn to_wire(self) -> u32 {
        match self {
            MemoryPath::Pool => 1,
            MemoryPath::Vmm => 2,
            MemoryPath::Legacy => 3,
        }
    }

    /// From the export blob's value.
    pub fn from_wire(v: u32) -> Option<MemoryPath> {
        match v {
            1 => Some(MemoryPath::Pool),
            2 => Some(MemoryPath::Vmm),
            3 => Some(MemoryPath::Legacy),
            _ => None,
        }
    }
}

impl fmt::Display for MemoryPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MemoryPath {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "pool" => Ok(MemoryPath::Pool),
            "vmm" => Ok(MemoryPath::Vmm),
            "legacy" | "ipc" => Ok(MemoryPath::Legacy),
            _ => Err(format!(
                "unknown memory path {s:?} (expected pool, vmm or legacy)"
            )),
        }
    }
}

/// How the pool and VMM paths' handles travel to consumers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HandleKind {
    /// POSIX file descriptors, passed over the socket with `SCM_RIGHTS`.
    #[default]
    PosixFd,
    /// Fabric handles (`CUmemFabricHandle`, 64 bytes in the export blob). Need an IMEX channel
    /// (`/dev/nvidia-caps-imex-channels`) and a multi-node NVLink system's IMEX daemon.
    Fabric,
}

impl HandleKind {
    /// Both kinds.
    pub const ALL: [HandleKind; 2] = [HandleKind::PosixFd, HandleKind::Fabric];

    /// The name: `posix_fd` or `fabric`.
    pub fn as_str(self) -> &'static str {
        match self {
            HandleKind::PosixFd => "posix_fd",
            HandleKind::Fabric => "fabric",
        }
    }

    /// The driver handle type.
    pub fn pool_handle_type(self) -> PoolHandleType {
        match self {
            HandleKind::PosixFd => PoolHandleType::PosixFd,
            HandleKind::Fabric => PoolHandleType::Fabric,
        }
    }

    /// Value in the export blob.
    pub fn to_wire(self) -> u32 {
        match self {
            HandleKind::PosixFd => 1,
            HandleKind::Fabric => 2,
        }
    }

    /// From the export blob's value.
    pub fn from_wire(v: u32) -> Option<HandleKind> {
        match v {
            1 => Some(HandleKind::PosixFd),
            2 => Some(HandleKind::Fabric),
            _ => None,
        }
    }
}

impl fmt::Display for HandleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HandleKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "posix_fd" | "posix-fd" | "fd" | "posix" => Ok(HandleKind::PosixFd),
            "fabric" => Ok(HandleKind::Fabric),
            _ => Err(format!(
                "unknown handle kind {s:?} (expected posix_fd or fabric)"
            )),
        }
    }
}

/// The most slots the VMM path with POSIX fds shares: one fd per slot, plus the control memfd
/// and the timelines memfd, must fit one `SCM_RIGHTS` message (at most 253 fds).
pub const MAX_VMM_FD_SLOTS: u32 = 250;

/// Where the IMEX channel device nodes live.
pub const IMEX_CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";

/// Whether an IMEX channel device node (`/dev/nvidia-caps-imex-channels/channel*`) exists:
/// fabric handles need one.
pub fn imex_channel_present() -> bool {
    std::fs::read_dir(IMEX_CHANNEL_DIR).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("channel"))
    })
}

/// What to do when fabric handles cannot be used.
pub const FABRIC_HINT: &str = "fabric handles need an IMEX channel \
     (/dev/nvidia-caps-imex-channels) and multi-node NVLink with the IMEX daemon running; on a \
     single host use POSIX fd handles instead";

/// Wraps a driver failure of a fabric-handle step into a [`CudaError::Unsupported`] that says
/// what is missing.
pub(crate) fn fabric_failure(step: &str, e: CudaError) -> CudaError {
    let channel = if imex_channel_present() {
        "an IMEX channel is present"
    } else {
        "no IMEX channel is present"
    };
    CudaError::Unsupported {
        what: format!("fabric handles are not usable here ({step}: {e}; {channel})"),
        hint: FABRIC_HINT.into(),
    }
}

/// How long a consumer's import (attach) took, per step, in microseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ImportTimings {
    /// The memory path the producer uses.
    pub memory: MemoryPath,
    /// The handle kind the producer uses.
    pub handle: HandleKind,
    /// Slots imported.
    pub slots: u32,
    /// Driver init, context, capability check and stream creation.
    pub setup_us: f64,
    /// Pool path: importing the pool and setting its access (0 on the other paths).
    pub pool_import_us: f64,
    /// All slots: pool pointer imports, or VMM import + reserve + map + set access, or legacy
    /// IPC opens.
    pub slot_imports_us: f64,
    /// The slowest single slot of `slot_imports_us`.
    pub slot_import_max_us: f64,
    /// Opening the `ready` IPC events, all slots.
    pub event_opens_us: f64,
    /// Mapping and registering the `finished` timelines.
    pub timelines_us: f64,
    /// The whole import, from the blob's arrival to the reply.
    pub total_us: f64,
}

impl ImportTimings {
    /// Mean time per slot of `slot_imports_us` (0 for no slots).
    pub fn slot_import_mean_us(&self) -> f64 {
        if self.slots == 0 {
            0.0
        } else {
            self.slot_imports_us / f64::from(self.slots)
        }
    }
}

/// Microseconds since `t`.
pub(crate) fn micros(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

const HANDLE: usize = 64;
const TWO_MIB: u64 = 2 << 20;

/// The path-specific part of the export blob, as bytes and fds (parsed, not yet imported).
pub(crate) enum SlotExport {
    /// The pool's handle, then one pointer export per slot.
    Pool {
        pool: Share,
        pointers: Vec<PointerExport>,
    },
    /// Per slot: a handle to an allocation of `alloc_bytes`.
    Vmm {
        alloc_bytes: u64,
        allocations: Vec<Share>,
    },
    /// Per slot: a legacy IPC handle.
    Legacy { handles: Vec<IpcMemHandle> },
}

/// One shareable handle: an fd (sent with `SCM_RIGHTS`) or fabric bytes (in the blob).
pub(crate) enum Share {
    Fd(OwnedFd),
    Fabric(FabricHandle),
}

fn handle64(r: &mut Reader<'_>) -> Result<[u8; HANDLE], BackendError> {
    Ok(r.bytes(HANDLE)?.try_into()?)
}

impl SlotExport {
    /// How many fds the path sends besides the timelines.
    pub(crate) fn fd_count(memory: MemoryPath, handle: HandleKind, slots: u32) -> usize {
        match (memory, handle) {
            (MemoryPath::Pool, HandleKind::PosixFd) => 1,
            (MemoryPath::Vmm, HandleKind::PosixFd) => slots as usize,
            _ => 0,
        }
    }

    /// Parses the section that `write` produced, with the fds that came with it (the timelines
    /// fd already taken off). Checks counts and sizes; touches no driver.
    pub(crate) fn parse(
        r: &mut Reader<'_>,
        memory: MemoryPath,
        handle: HandleKind,
        slots: u32,
        slot_bytes: u64,
        fds: Vec<OwnedFd>,
    ) -> Result<SlotExport, BackendError> {
        if !memory.supports(handle) {
            return Err(
                format!("CUDA export: the {memory} path cannot use {handle} handles").into(),
            );
        }
        let want = Self::fd_count(memory, handle, slots);
        if fds.len() != want {
            return Err(format!(
                "CUDA {memory} export with {handle} handles must carry {want} memory fds plus \
                 the timelines fd, got {} plus the timelines fd",
                fds.len()
            )
            .into());
        }
        let n = slots as usize;
        let mut fds = fds.into_iter();
        Ok(match memory {
            MemoryPath::Pool => {
                let pool = match handle {
                    HandleKind::PosixFd => Share::Fd(fds.next().ok_or("missing pool fd")?),
                    HandleKind::Fabric => Share::Fabric(handle64(r)?),
                };
                let pointers = (0..n).map(|_| handle64(r)).collect::<Result<Vec<_>, _>>()?;
                SlotExport::Pool { pool, pointers }
            }
            MemoryPath::Vmm => {
                let alloc_bytes = r.u64()?;
                // The allocation is the slot rounded up to the driver's granularity (2 MiB on
                // current GPUs; the importer checks its own); never less than the slot, never
                // a whole lot more.
                if alloc_bytes < slot_bytes
                    || alloc_bytes % TWO_MIB != 0
                    || alloc_bytes - slot_bytes >= 1 << 30
                {
                    return Err(format!(
                        "CUDA vmm export: allocation size {alloc_bytes} does not fit slots of \
                         {slot_bytes} bytes"
                    )
                    .into());
                }
                let allocations = match handle {
                    HandleKind::PosixFd => fds.by_ref().map(Share::Fd).collect(),
                    HandleKind::Fabric => (0..n)
                        .map(|_| handle64(r).map(Share::Fabric))
                        .collect::<Result<Vec<_>, _>>()?,
                };
                SlotExport::Vmm {
                    alloc_bytes,
                    allocations,
                }
            }
            MemoryPath::Legacy => SlotExport::Legacy {
                handles: (0..n).map(|_| handle64(r)).collect::<Result<Vec<_>, _>>()?,
            },
        })
    }
}

/// The export blob's common header (docs/protocol.md, section 7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExportHeader {
    pub(crate) memory: MemoryPath,
    pub(crate) handle: HandleKind,
    pub(crate) sync: SyncMode,
    pub(crate) uuid: [u8; 16],
    pub(crate) slot_count: u32,
    pub(crate) slot_bytes: u64,
}

/// `"GCU1"`.
pub(crate) const EXPORT_MAGIC: u32 = u32::from_le_bytes(*b"GCU1");
/// Version 2 added the memory path and handle kind after the version; version 3 the sync mode.
pub(crate) const EXPORT_VERSION: u32 = 3;

impl ExportHeader {
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&EXPORT_MAGIC.to_le_bytes());
        out.extend_from_slice(&EXPORT_VERSION.to_le_bytes());
        out.extend_from_slice(&self.memory.to_wire().to_le_bytes());
        out.extend_from_slice(&self.handle.to_wire().to_le_bytes());
        out.extend_from_slice(&self.sync.to_wire().to_le_bytes());
        out.extend_from_slice(&self.uuid);
        out.extend_from_slice(&self.slot_count.to_le_bytes());
        out.extend_from_slice(&self.slot_bytes.to_le_bytes());
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<ExportHeader, BackendError> {
        if r.u32()? != EXPORT_MAGIC {
            return Err("CUDA export has a bad magic (not a gpipe CUDA producer)".into());
        }
        let version = r.u32()?;
        if version != EXPORT_VERSION {
            return Err(format!(
                "CUDA export version {version} is not the version {EXPORT_VERSION} this \
                 consumer speaks (producer and consumers must run the same gpipe release)"
            )
            .into());
        }
        let m = r.u32()?;
        let memory = MemoryPath::from_wire(m).ok_or_else(|| {
            format!("CUDA export names memory path {m}, which this consumer does not know")
        })?;
        let h = r.u32()?;
        let handle = HandleKind::from_wire(h).ok_or_else(|| {
            format!("CUDA export names handle kind {h}, which this consumer does not know")
        })?;
        if !memory.supports(handle) {
            return Err(
                format!("CUDA export: the {memory} path cannot use {handle} handles").into(),
            );
        }
        let y = r.u32()?;
        let sync = SyncMode::from_wire(y).ok_or_else(|| {
            format!("CUDA export names sync mode {y}, which this consumer does not know")
        })?;
        Ok(ExportHeader {
            memory,
            handle,
            sync,
            uuid: r.bytes(16)?.try_into()?,
            slot_count: r.u32()?,
            slot_bytes: r.u64()?,
        })
    }
}

/// The producer's slots, per path. Owns the allocations, their mappings and their exports.
pub(crate) enum ProducerSlots {
    Pool {
        pool: MemPool,
        share: ProducerShare,
        ptrs: Vec<CUdeviceptr>,
        exports: Vec<PointerExport>,
    },
    Vmm {
        alloc_bytes: u64,
        maps: Vec<VmmMapping>,
        shares: Vec<ProducerShare>,
    },
    Legacy {
        bufs: Vec<DeviceBuffer>,
        handles: Vec<IpcMemHandle>,
    },
}

impl ProducerSlots {
    /// Device memory the slots hold: the pool's reservation, or the fixed allocations.
    pub(crate) fn device_bytes(&self, slot_bytes: u64) -> Option<u64> {
        match self {
            ProducerSlots::Pool { pool, .. } => pool.reserved_bytes().ok(),
            ProducerSlots::Vmm {
                alloc_bytes, maps, ..
            } => Some(alloc_bytes * maps.len() as u64),
            ProducerSlots::Legacy { bufs, .. } => Some(slot_bytes * bufs.len() as u64),
        }
    }
}

/// A handle the producer keeps to hand out: an fd it clones per consumer, or fabric bytes.
pub(crate) enum ProducerShare {
    Fd(OwnedFd),
    Fabric(FabricHandle),
}

impl ProducerShare {
    fn of_pool(pool: &MemPool, handle: HandleKind) -> Result<ProducerShare, CudaError> {
        Ok(match handle {
            HandleKind::PosixFd => ProducerShare::Fd(pool.export_fd()?),
            HandleKind::Fabric => ProducerShare::Fabric(
                pool.export_fabric()
                    .map_err(|e| fabric_failure("exporting the pool", e))?,
            ),
        })
    }

    fn of_allocation(
        alloc: &PhysicalAllocation,
        handle: HandleKind,
    ) -> Result<ProducerShare, CudaError> {
        Ok(match handle {
            HandleKind::PosixFd => ProducerShare::Fd(alloc.export_fd()?),
            HandleKind::Fabric => ProducerShare::Fabric(
                alloc
                    .export_fabric()
                    .map_err(|e| fabric_failure("exporting a VMM allocation", e))?,
            ),
        })
    }
}

/// Maps a fabric-handle creation failure to a clear error; other failures pass unchanged.
fn fabric_or(handle: HandleKind, step: &str, e: CudaError) -> CudaError {
    if handle == HandleKind::Fabric && matches!(e, CudaError::Driver { .. }) {
        fabric_failure(step, e)
    } else {
        e
    }
}

impl ProducerSlots {
    /// Allocates and exports the ring's slots on `memory`, sharing them as `handle`.
    pub(crate) fn create(
        ctx: &Arc<Context>,
        stream: &Stream,
        layout: &RingLayout,
        memory: MemoryPath,
        handle: HandleKind,
    ) -> Result<ProducerSlots, CudaError> {
        if !memory.supports(handle) {
            return Err(CudaError::InvalidArgument(format!(
                "the {memory} memory path cannot use {handle} handles (fabric handles apply to \
                 the pool and vmm paths)"
            )));
        }
        let n = layout.slot_count as usize;
        let slot_bytes = usize::try_from(layout.slot_bytes)
            .map_err(|_| CudaError::InvalidArgument("slot size overflows usize".into()))?;
        match memory {
            MemoryPath::Pool => {
                let total = slot_bytes
                    .checked_mul(n)
                    .ok_or_else(|| CudaError::InvalidArgument("ring size overflows".into()))?;
                let pool = MemPool::new_exportable(ctx, total, handle.pool_handle_type())
                    .map_err(|e| fabric_or(handle, "creating a fabric-exportable pool", e))?;
                let share = ProducerShare::of_pool(&pool, handle)?;
                // Built first, so that a failure below frees what was allocated (Drop).
                let mut slots = ProducerSlots::Pool {
                    pool,
                    share,
                    ptrs: Vec::with_capacity(n),
                    exports: Vec::with_capacity(n),
                };
                if let ProducerSlots::Pool {
                    pool,
                    ptrs,
                    exports,
                    ..
                } = &mut slots
                {
                    let mut fill = || -> Result<(), CudaError> {
                        for _ in 0..n {
                            ptrs.push(pool.alloc_async(slot_bytes, stream)?);
                        }
                        // Setup only: the allocations must exist before they are exported.
                        stream.synchronize()?;
                        for &p in ptrs.iter() {
                            exports.push(pool.export_pointer(p)?);
                        }
                        Ok(())
                    };
                    if let Err(e) = fill() {
                        // Let the allocations complete before Drop frees them on its stream.
                        let _ = stream.synchronize();
                        return Err(e);
                    }
                }
                Ok(slots)
            }
            MemoryPath::Vmm => {
                if handle == HandleKind::PosixFd && layout.slot_count > MAX_VMM_FD_SLOTS {
                    return Err(CudaError::InvalidArgument(format!(
                        "the vmm memory path with POSIX fds sends one fd per slot, and one \
                         message carries at most 253 fds: use at most {MAX_VMM_FD_SLOTS} slots \
                         (this ring has {}), or the pool or legacy path",
                        layout.slot_count
                    )));
                }
                let granularity =
                    allocation_granularity(ctx.device(), handle.pool_handle_type())
                        .map_err(|e| fabric_or(handle, "querying the fabric granularity", e))?;
                let alloc_bytes = slot_bytes.next_multiple_of(granularity);
                let align = granularity.max(TWO_MIB as usize);
                let mut maps = Vec::with_capacity(n);
                let mut shares = Vec::with_capacity(n);
                for _ in 0..n {
                    let alloc =
                        PhysicalAllocation::create(ctx, alloc_bytes, handle.pool_handle_type())
                            .map_err(|e| {
                                fabric_or(handle, "creating a fabric-exportable allocation", e)
                            })?;
                    shares.push(ProducerShare::of_allocation(&alloc, handle)?);
                    maps.push(VmmMapping::new(ctx, alloc, align)?);
                }
                Ok(ProducerSlots::Vmm {
                    alloc_bytes: alloc_bytes as u64,
                    maps,
                    shares,
                })
            }
            MemoryPath::Legacy => {
                let mut bufs = Vec::with_capacity(n);
                let mut handles = Vec::with_capacity(n);
                for _ in 0..n {
                    // One allocation per slot, of the slot's size (a multiple of 2 MiB): the
                    // handle exposes this allocation and nothing else.
                    let buf = DeviceBuffer::new(ctx, slot_bytes)?;
                    if buf.ptr() % TWO_MIB != 0 {
                        tracing::warn!(
                            ptr = buf.ptr(),
                            "cuMemAlloc returned a slot that is not 2 MiB aligned"
                        );
                    }
                    handles.push(buf.ipc_handle()?);
                    bufs.push(buf);
                }
                Ok(ProducerSlots::Legacy { bufs, handles })
            }
        }
    }

    /// Writes the path-specific section of the export blob (see [`SlotExport::parse`]).
    pub(crate) fn write_export(&self, out: &mut Vec<u8>) {
        match self {
            ProducerSlots::Pool { share, exports, .. } => {
                if let ProducerShare::Fabric(f) = share {
                    out.extend_from_slice(f);
                }
                for e in exports {
                    out.extend_from_slice(e);
                }
            }
            ProducerSlots::Vmm {
                alloc_bytes,
                shares,
                ..
            } => {
                out.extend_from_slice(&alloc_bytes.to_le_bytes());
                for s in shares {
                    if let ProducerShare::Fabric(f) = s {
                        out.extend_from_slice(f);
                    }
                }
            }
            ProducerSlots::Legacy { handles, .. } => {
                for h in handles {
                    out.extend_from_slice(h);
                }
            }
        }
    }

    /// Fresh copies of the fds a consumer needs (before the timelines fd).
    pub(crate) fn export_fds(&self) -> std::io::Result<Vec<OwnedFd>> {
        let shares: &[ProducerShare] = match self {
            ProducerSlots::Pool { share, .. } => std::slice::from_ref(share),
            ProducerSlots::Vmm { shares, .. } => shares,
            ProducerSlots::Legacy { .. } => &[],
        };
        shares
            .iter()
            .filter_map(|s| match s {
                ProducerShare::Fd(fd) => Some(fd.try_clone()),
                ProducerShare::Fabric(_) => None,
            })
            .collect()
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        match self {
            ProducerSlots::Pool { ptrs, .. } => ptrs[slot],
            ProducerSlots::Vmm { maps, .. } => maps[slot].ptr(),
            ProducerSlots::Legacy { bufs, .. } => bufs[slot].ptr(),
        }
    }

    /// Frees every slot. Call after the stream finished all work on them and after the
    /// consumers detached; synchronise the stream afterwards (pool frees are stream-ordered).
    pub(crate) fn release(&mut self, stream: &Stream) {
        match self {
            ProducerSlots::Pool { pool, ptrs, .. } => {
                for ptr in ptrs.drain(..) {
                    // SAFETY: each pointer came from alloc_async on this pool and is freed
                    // once (drained), after the stream finished all work that used it.
                    if let Err(e) = unsafe { pool.free_async(ptr, stream) } {
                        tracing::error!("CUDA producer teardown: freeing a slot failed: {e}");
                    }
                }
            }
            // Unmap, release, free the address range; close the exported fds.
            ProducerSlots::Vmm { maps, shares, .. } => {
                maps.clear();
                shares.clear();
            }
            // cuMemFree each slot.
            ProducerSlots::Legacy { bufs, .. } => bufs.clear(),
        }
    }
}

/// A consumer's imported slots, per path.
pub(crate) enum ConsumerSlots {
    Pool {
        pool: MemPool,
        ptrs: Vec<CUdeviceptr>,
    },
    Vmm {
        maps: Vec<VmmMapping>,
    },
    Legacy {
        maps: Vec<IpcMapping>,
    },
}

impl ConsumerSlots {
    /// Imports every slot of `export` once, recording the time per step in `timings`.
    /// Imports every slot once. `read_only`: map VMM slots read-only (the pool and legacy
    /// paths cannot be).
    pub(crate) fn import(
        ctx: &Arc<Context>,
        export: SlotExport,
        timings: &mut ImportTimings,
        read_only: bool,
    ) -> Result<ConsumerSlots, BackendError> {
        let mut slot_times = Vec::new();
        let slots = match export {
            SlotExport::Pool { pool, pointers } => {
                let t = Instant::now();
                let pool = match pool {
                    Share::Fd(fd) => MemPool::import_fd(ctx, fd.as_fd())?,
                    Share::Fabric(f) => MemPool::import_fabric(ctx, &f)
                        .map_err(|e| fabric_failure("importing the pool", e))?,
                };
                pool.set_access(ctx.device(), true)?;
                timings.pool_import_us = micros(t);
                // Import each allocation once: a second import of the same allocation would
                // share the mapping and the first free would unmap both.
                let mut seen = HashSet::new();
                if !pointers.iter().all(|p| seen.insert(*p)) {
                    return Err("the producer exported one pool allocation for two slots".into());
                }
                let mut ptrs = Vec::with_capacity(pointers.len());
                for p in &pointers {
                    let t = Instant::now();
                    match pool.import_pointer(p) {
                        Ok(ptr) => ptrs.push(ptr),
                        Err(e) => {
                            free_pool_ptrs(&pool, &mut ptrs, "partial imports");
                            return Err(e.into());
                        }
                    }
                    slot_times.push(micros(t));
                }
                ConsumerSlots::Pool { pool, ptrs }
            }
            SlotExport::Vmm {
                alloc_bytes,
                allocations,
            } => {
                let handle = match allocations.first() {
                    Some(Share::Fabric(_)) => HandleKind::Fabric,
                    _ => HandleKind::PosixFd,
                };
                let granularity = allocation_granularity(ctx.device(), handle.pool_handle_type())?;
                let size = usize::try_from(alloc_bytes)?;
                if size % granularity != 0 {
                    return Err(format!(
                        "CUDA vmm export: allocation size {alloc_bytes} is not a multiple of \
                         this device's granularity {granularity}"
                    )
                    .into());
                }
                let align = granularity.max(TWO_MIB as usize);
                // Fabric handles name their allocation: refuse one named twice. (Fds cannot be
                // compared; a VMM allocation mapped twice is two independent mappings, so an
                // aliasing producer harms only its own data, never our teardown.)
                let mut seen = HashSet::new();
                let fabric_unique = allocations.iter().all(|s| match s {
                    Share::Fabric(f) => seen.insert(*f),
                    Share::Fd(_) => true,
                });
                if !fabric_unique {
                    return Err("the producer exported one VMM allocation for two slots".into());
                }
                let mut maps = Vec::with_capacity(allocations.len());
                for share in allocations {
                    let t = Instant::now();
                    let alloc = match share {
                        Share::Fd(fd) => PhysicalAllocation::import_fd(ctx, fd.as_fd(), size)?,
                        Share::Fabric(f) => PhysicalAllocation::import_fabric(ctx, &f, size)
                            .map_err(|e| fabric_failure("importing a VMM allocation", e))?,
                    };
                    maps.push(VmmMapping::with_access(ctx, alloc, align, read_only)?);
                    slot_times.push(micros(t));
                }
                ConsumerSlots::Vmm { maps }
            }
            SlotExport::Legacy { handles } => {
                let mut seen = HashSet::new();
                if !handles.iter().all(|h| seen.insert(*h)) {
                    return Err("the producer exported one legacy IPC handle for two slots".into());
                }
                let mut ptrs = HashSet::new();
                let mut maps = Vec::with_capacity(handles.len());
                for h in &handles {
                    let t = Instant::now();
                    let map = IpcMapping::open(ctx, h)?;
                    slot_times.push(micros(t));
                    if !ptrs.insert(map.ptr()) {
                        return Err(
                            "two legacy IPC handles of the producer opened to one allocation"
                                .into(),
                        );
                    }
                    maps.push(map);
                }
                ConsumerSlots::Legacy { maps }
            }
        };
        timings.slot_imports_us = slot_times.iter().sum();
        timings.slot_import_max_us = slot_times.iter().copied().fold(0.0, f64::max);
        Ok(slots)
    }

    /// The device address of slot `slot` in this process.
    pub(crate) fn ptr(&self, slot: usize) -> CUdeviceptr {
        match self {
            ConsumerSlots::Pool { ptrs, .. } => ptrs[slot],
            ConsumerSlots::Vmm { maps } => maps[slot].ptr(),
            ConsumerSlots::Legacy { maps } => maps[slot].ptr(),
        }
    }

    /// Number of slots.
    pub(crate) fn len(&self) -> usize {
        match self {
            ConsumerSlots::Pool { ptrs, .. } => ptrs.len(),
            ConsumerSlots::Vmm { maps } => maps.len(),
            ConsumerSlots::Legacy { maps } => maps.len(),
        }
    }

    /// Drops every import: pool pointers freed (stream-ordered), VMM mappings unmapped,
    /// released and their address ranges freed, legacy handles closed. Call after the stream
    /// finished all work on them; synchronise the stream afterwards.
    pub(crate) fn release(&mut self, stream: &Stream) {
        match self {
            ConsumerSlots::Pool { pool, ptrs } => {
                for ptr in ptrs.drain(..) {
                    // SAFETY: each pointer was imported once from this pool and is freed once
                    // (drained), after the stream finished all our work on it.
                    if let Err(e) = unsafe { pool.free_async(ptr, stream) } {
                        tracing::error!("CUDA consumer teardown: freeing an import failed: {e}");
                    }
                }
            }
            ConsumerSlots::Vmm { maps } => maps.clear(),
            ConsumerSlots::Legacy { maps } => maps.clear(),
        }
    }
}

/// Frees pool pointers (allocations or imports) that no work has used, or whose work is done:
/// those of a setup that failed half-way. Normal teardown goes through `release`.
fn free_pool_ptrs(pool: &MemPool, ptrs: &mut Vec<CUdeviceptr>, what: &str) {
    if ptrs.is_empty() {
        return;
    }
    let stream = match Stream::new(pool.context()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("CUDA: cannot free {what}: {e}");
            return;
        }
    };
    for ptr in ptrs.drain(..) {
        // SAFETY: each pointer came from this pool (allocated or imported once), no work in
        // flight uses it (the caller's setup failed before any, or its stream is idle), and
        // it is freed once (drained).
        if let Err(e) = unsafe { pool.free_async(ptr, &stream) } {
            tracing::error!("CUDA: freeing {what} failed: {e}");
        }
    }
    if let Err(e) = stream.synchronize() {
        tracing::error!("CUDA: freeing {what}: {e}");
    }
}

impl Drop for ProducerSlots {
    fn drop(&mut self) {
        // Only a setup that failed half-way gets here with pool slots left (`release` drains
        // them); VMM mappings and legacy buffers free themselves.
        if let ProducerSlots::Pool { pool, ptrs, .. } = self {
            free_pool_ptrs(pool, ptrs, "the slots of a failed setup");
        }
    }
}

impl Drop for ConsumerSlots {
    fn drop(&mut self) {
        // As for ProducerSlots: only an attach that failed after the imports gets here with
        // pool imports left.
        if let ConsumerSlots::Pool { pool, ptrs } = self {
            free_pool_ptrs(pool, ptrs, "the imports of a failed attach");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> OwnedFd {
        pipeline_core::sys::sealed_memfd("gpipe-test", 4096).unwrap()
    }

    fn header(memory: MemoryPath, handle: HandleKind) -> ExportHeader {
        ExportHeader {
            memory,
            handle,
            sync: SyncMode::Events,
            uuid: [7; 16],
            slot_count: 3,
            slot_bytes: 4 << 20,
        }
    }

    #[test]
    fn names_parse_and_print() {
        for m in MemoryPath::ALL {
            assert_eq!(m.to_string().parse::<MemoryPath>().unwrap(), m);
            assert_eq!(MemoryPath::from_wire(m.to_wire()), Some(m));
        }
        for h in HandleKind::ALL {
            assert_eq!(h.to_string().parse::<HandleKind>().unwrap(), h);
            assert_eq!(HandleKind::from_wire(h.to_wire()), Some(h));
        }
        assert!("auto".parse::<MemoryPath>().is_err());
        assert_eq!(MemoryPath::default(), MemoryPath::Pool);
        assert_eq!(HandleKind::default(), HandleKind::PosixFd);
        assert!(!MemoryPath::Legacy.supports(HandleKind::Fabric));
        assert!(MemoryPath::Vmm.supports(HandleKind::Fabric));
    }

    #[test]
    fn header_round_trips_and_names_mismatches() {
        let h = header(MemoryPath::Vmm, HandleKind::Fabric);
        let mut blob = Vec::new();
        h.write(&mut blob);
        assert_eq!(blob.len(), 48);
        assert_eq!(ExportHeader::read(&mut Reader::new(&blob, "t")).unwrap(), h);

        let mut old = blob.clone();
        old[4..8].copy_from_slice(&1u32.to_le_bytes());
        let e = ExportHeader::read(&mut Reader::new(&old, "t")).unwrap_err();
        assert!(e.to_string().contains("version 1"), "{e}");

        let mut bad = blob.clone();
        bad[8..12].copy_from_slice(&9u32.to_le_bytes());
        let e = ExportHeader::read(&mut Reader::new(&bad, "t")).unwrap_err();
        assert!(e.to_string().contains("memory path 9"), "{e}");

        let mut legacy_fabric = Vec::new();
        header(MemoryPath::Legacy, HandleKind::Fabric).write(&mut legacy_fabric);
        let e = ExportHeader::read(&mut Reader::new(&legacy_fabric, "t")).unwrap_err();
        assert!(
            e.to_string().contains("legacy path cannot use fabric"),
            "{e}"
        );
    }

    #[test]
    fn sections_parse_with_the_right_fds() {
        // Pool + fd: one pool fd, per slot a pointer export.
        let blob = vec![1u8; 3 * 64];
        let s = SlotExport::parse(
            &mut Reader::new(&blob, "t"),
            MemoryPath::Pool,
            HandleKind::PosixFd,
            3,
            4 << 20,
            vec![memfd()],
        )
        .unwrap();
        assert!(
            matches!(s, SlotExport::Pool { pool: Share::Fd(_), ref pointers } if pointers.len() == 3)
        );

        // Pool + fabric: the pool's fabric handle first, no fds.
        let blob = vec![2u8; 4 * 64];
        let mut r = Reader::new(&blob, "t");
        let s = SlotExport::parse(
            &mut r,
            MemoryPath::Pool,
            HandleKind::Fabric,
            3,
            4 << 20,
            vec![],
        )
        .unwrap();
        r.finish().unwrap();
        assert!(matches!(
            s,
            SlotExport::Pool {
                pool: Share::Fabric(_),
                ..
            }
        ));

        // VMM + fd: allocation size, one fd per slot.
        let blob = (4u64 << 20).to_le_bytes();
        let mut r = Reader::new(&blob, "t");
        let fds = vec![memfd(), memfd(), memfd()];
        let s = SlotExport::parse(
            &mut r,
            MemoryPath::Vmm,
            HandleKind::PosixFd,
            3,
            4 << 20,
            fds,
        )
        .unwrap();
        r.finish().unwrap();
        assert!(matches!(s, SlotExport::Vmm { alloc_bytes, ref allocations }
            if alloc_bytes == 4 << 20 && allocations.len() == 3));

        // VMM + fabric: allocation size, then a fabric handle per slot.
        let mut blob = (6u64 << 20).to_le_bytes().to_vec();
        blob.extend_from_slice(&[3u8; 3 * 64]);
        let mut r = Reader::new(&blob, "t");
        let s = SlotExport::parse(
            &mut r,
            MemoryPath::Vmm,
            HandleKind::Fabric,
            3,
            4 << 20,
            vec![],
        )
        .unwrap();
        r.finish().unwrap();
        assert!(matches!(s, SlotExport::Vmm { .. }));

        // Legacy: per slot an IPC handle, no fds.
        let blob = vec![4u8; 3 * 64];
        let mut r = Reader::new(&blob, "t");
        let s = SlotExport::parse(
            &mut r,
            MemoryPath::Legacy,
            HandleKind::PosixFd,
            3,
            4 << 20,
            vec![],
        )
        .unwrap();
        r.finish().unwrap();
        assert!(matches!(s, SlotExport::Legacy { ref handles } if handles.len() == 3));
    }

    #[test]
    fn sections_refuse_wrong_fds_and_sizes() {
        let blob = (4u64 << 20).to_le_bytes();
        let e = SlotExport::parse(
            &mut Reader::new(&blob, "t"),
            MemoryPath::Vmm,
            HandleKind::PosixFd,
            3,
            4 << 20,
            vec![memfd()],
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("must carry 3 memory fds"), "{e}");

        let blob = (2u64 << 20).to_le_bytes();
        let e = SlotExport::parse(
            &mut Reader::new(&blob, "t"),
            MemoryPath::Vmm,
            HandleKind::Fabric,
            3,
            4 << 20,
            vec![],
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("does not fit slots"), "{e}");

        let blob = vec![0u8; 3 * 64];
        let e = SlotExport::parse(
            &mut Reader::new(&blob, "t"),
            MemoryPath::Legacy,
            HandleKind::PosixFd,
            3,
            4 << 20,
            vec![memfd()],
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("must carry 0 memory fds"), "{e}");
    }

    #[test]
    fn fabric_failures_name_the_imex_channel() {
        let e = fabric_failure(
            "creating",
            CudaError::InvalidArgument("driver said no".into()),
        );
        let text = e.to_string();
        assert!(text.contains("/dev/nvidia-caps-imex-channels"), "{text}");
        assert!(text.contains("multi-node NVLink"), "{text}");
        assert!(text.contains("driver said no"), "{text}");
    }

    #[test]
    fn vmm_fd_slot_limit_leaves_room_for_the_other_fds() {
        // control memfd + slots + timelines memfd fit one SCM_RIGHTS message.
        const { assert!(MAX_VMM_FD_SLOTS as usize + 2 <= pipeline_core::sys::MAX_FDS_PER_MESSAGE) };
    }
}

/// How `ready` is signalled across processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// One IPC event per slot, recorded by the producer, waited by consumers.
    #[default]
    Events,
    /// One timeline word per slot in host-mapped shared memory: the producer's stream writes
    /// the batch's generation (`cuStreamWriteValue64`), consumers' streams wait for
    /// `value >= generation` (`cuStreamWaitValue64`). No event handles; a consumer whose
    /// producer died can release its own waits.
    Semaphore,
}

impl SyncMode {
    /// Both modes.
    pub const ALL: [SyncMode; 2] = [SyncMode::Events, SyncMode::Semaphore];

    pub(crate) fn to_wire(self) -> u32 {
        match self {
            SyncMode::Events => 1,
            SyncMode::Semaphore => 2,
        }
    }

    pub(crate) fn from_wire(v: u32) -> Option<Self> {
        match v {
            1 => Some(SyncMode::Events),
            2 => Some(SyncMode::Semaphore),
            _ => None,
        }
    }
}

impl fmt::Display for SyncMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SyncMode::Events => "events",
            SyncMode::Semaphore => "semaphore",
        })
    }
}

impl FromStr for SyncMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "events" => Ok(SyncMode::Events),
            "semaphore" => Ok(SyncMode::Semaphore),
            _ => Err(format!("unknown sync mode {s:?}: use events or semaphore")),
        }
    }
}
