//! Device capability probe: what each GPU and the driver support, and which path gpipe takes.
//!
//! [`probe`] reads device attributes only; it creates no context and allocates nothing. It
//! returns data ([`ProbeReport`], serializable); `gpipe probe` turns it into text.

use std::fmt;
use std::path::{Path, PathBuf};

use cudarc::driver::sys::CUdevice_attribute as Attr;
use serde::Serialize;

use crate::driver::{self, CudaError, Device};
use crate::memory::{FABRIC_HINT, HandleKind, MemoryPath, imex_channel_present};
use crate::sync::TimelineMemory;

/// Bit of `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES` for POSIX file descriptors.
pub const HANDLE_TYPE_POSIX_FD_BIT: u32 = 0x1;
/// Bit of `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES` for fabric handles.
pub const HANDLE_TYPE_FABRIC_BIT: u32 = 0x8;

/// What one device supports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// UUID in nvidia-smi's form.
    pub uuid: String,
    /// Compute capability `[major, minor]`.
    pub compute_capability: [i32; 2],
    /// Total device memory in bytes.
    pub total_memory_bytes: u64,
    /// Number of streaming multiprocessors.
    pub multiprocessors: u32,
    /// Stream-ordered memory pools (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`).
    pub memory_pools: bool,
    /// Raw `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES` bitmask.
    pub pool_handle_types: u32,
    /// Pools exportable as POSIX file descriptors (bit of `pool_handle_types`).
    pub pool_posix_fd: bool,
    /// Pools exportable as fabric handles (bit of `pool_handle_types`).
    pub pool_fabric: bool,
    /// Virtual memory management (`cuMemCreate`/`cuMemMap`).
    pub virtual_memory_management: bool,
    /// VMM allocations exportable as POSIX file descriptors.
    pub posix_fd_handles: bool,
    /// VMM allocations exportable as fabric handles.
    pub fabric_handles: bool,
    /// Interprocess events (`CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED`).
    pub ipc_events: bool,
    /// 64-bit stream memory operations (`cuStreamWaitValue64`/`cuStreamWriteValue64`), from
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`.
    pub stream_mem_ops_64bit: bool,
    /// Legacy IPC (`cuIpcGetMemHandle`), which needs unified addressing
    /// (`CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`).
    pub legacy_ipc: bool,
    /// `CU_DEVICE_ATTRIBUTE_MPS_ENABLED`: contexts on this device are shared through MPS.
    /// `None` when the driver does not report it.
    pub mps_enabled: Option<bool>,
    /// An IMEX channel device node exists (`/dev/nvidia-caps-imex-channels/channel*`): fabric
    /// handles need one. A host fact, repeated per device.
    pub imex_channel: bool,
    /// Which memory paths (with which handle kinds) gpipe can use on this device.
    pub memory_paths: Vec<PathSupport>,
    /// Attributes the driver would not report, and why.
    pub notes: Vec<String>,
}

/// Whether one memory path with one handle kind is usable on a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathSupport {
    /// The memory path.
    pub memory: MemoryPath,
    /// The handle kind.
    pub handle: HandleKind,
    /// Usable (nothing is missing). Fabric handles can still fail at setup when the IMEX
    /// daemon is not running.
    pub available: bool,
    /// What is missing, when not available.
    pub missing: Vec<&'static str>,
}

impl PathSupport {
    /// A short label: `pool`, `pool+fabric`, `vmm`, `vmm+fabric`, `legacy`.
    pub fn label(&self) -> String {
        path_label(self.memory, self.handle)
    }
}

/// A short label for a path and handle kind: `pool`, `pool+fabric`, `vmm`, `vmm+fabric`,
/// `legacy`.
pub fn path_label(memory: MemoryPath, handle: HandleKind) -> String {
    match handle {
        HandleKind::PosixFd => memory.to_string(),
        HandleKind::Fabric => format!("{memory}+fabric"),
    }
}

/// The transport gpipe uses between producer and consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum TransportPath {
    /// Slots in an exportable stream-ordered pool (POSIX fd); ready/finished as IPC events.
    PoolIpcEvents,
}

impl fmt::Display for TransportPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportPath::PoolIpcEvents => f.write_str("pool + IPC events"),
        }
    }
}

impl Capabilities {
    /// Reads the capabilities of one device. Attributes the driver rejects count as "no" and
    /// are listed in `notes`.
    pub fn of(device: &Device) -> Result<Capabilities, CudaError> {
        let mut notes = Vec::new();
        let mut attr = |a: Attr, label: &str| -> Option<i32> {
            match device.attribute(a) {
                Ok(v) => Some(v),
                Err(e) => {
                    notes.push(format!("{label}: not reported ({e})"));
                    None
                }
            }
        };
        let flag = |v: Option<i32>| v.is_some_and(|v| v != 0);
        let memory_pools = flag(attr(
            Attr::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
            "pools",
        ));
        let pool_handle_types = attr(
            Attr::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES,
            "pool handle types",
        )
        .map_or(0, |v| v as u32);
        let virtual_memory_management = flag(attr(
            Attr::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            "VMM",
        ));
        let posix_fd_handles = flag(attr(
            Attr::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            "POSIX fd handles",
        ));
        let fabric_handles = flag(attr(
            Attr::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
            "fabric handles",
        ));
        let ipc_events = flag(attr(
            Attr::CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED,
            "IPC events",
        ));
        let stream_mem_ops_64bit = flag(attr(
            Attr::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
            "64-bit stream memory ops",
        ));
        let legacy_ipc = flag(attr(
            Attr::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
            "unified addressing",
        ));
        let mps_enabled =
            attr(Attr::CU_DEVICE_ATTRIBUTE_MPS_ENABLED, "MPS enabled").map(|v| v != 0);
        let (major, minor) = device.compute_capability()?;
        let mut caps = Capabilities {
            ordinal: device.ordinal(),
            name: device.name()?,
            uuid: device.uuid_string()?,
            compute_capability: [major, minor],
            total_memory_bytes: device.total_memory()? as u64,
            multiprocessors: device.multiprocessor_count()?,
            memory_pools,
            pool_handle_types,
            pool_posix_fd: memory_pools && pool_handle_types & HANDLE_TYPE_POSIX_FD_BIT != 0,
            pool_fabric: memory_pools && pool_handle_types & HANDLE_TYPE_FABRIC_BIT != 0,
            virtual_memory_management,
            posix_fd_handles,
            fabric_handles,
            ipc_events,
            stream_mem_ops_64bit,
            legacy_ipc,
            mps_enabled,
            imex_channel: imex_channel_present(),
            memory_paths: Vec::new(),
            notes,
        };
        caps.memory_paths = caps.path_support();
        Ok(caps)
    }

    /// Every memory path with every handle kind it can use, and whether this device supports
    /// it (what [`Capabilities::memory_paths`] holds).
    pub fn path_support(&self) -> Vec<PathSupport> {
        let mut all = Vec::new();
        for memory in MemoryPath::ALL {
            for handle in HandleKind::ALL {
                if !memory.supports(handle) {
                    continue;
                }
                let missing = self.missing_for(memory, handle);
                all.push(PathSupport {
                    memory,
                    handle,
                    available: missing.is_empty(),
                    missing,
                });
            }
        }
        all
    }

    /// What `memory` with `handle` needs that this device (or host) lacks (empty: none).
    pub fn missing_for(&self, memory: MemoryPath, handle: HandleKind) -> Vec<&'static str> {
        let mut missing = Vec::new();
        let fabric = handle == HandleKind::Fabric;
        match memory {
            MemoryPath::Pool => {
                if !self.memory_pools {
                    missing.push("memory pools");
                } else if !fabric && !self.pool_posix_fd {
                    missing.push("memory pools with POSIX fd handles");
                } else if fabric && !self.pool_fabric {
                    missing.push("memory pools with fabric handles");
                }
            }
            MemoryPath::Vmm => {
                if !self.virtual_memory_management {
                    missing.push(
                        "virtual memory management \
                         (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)",
                    );
                }
                if !fabric && !self.posix_fd_handles {
                    missing.push(
                        "POSIX fd handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)",
                    );
                }
                if fabric && !self.fabric_handles {
                    missing
                        .push("fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)");
                }
            }
            MemoryPath::Legacy => {
                if fabric {
                    missing.push("fabric handles for legacy IPC (none exist)");
                }
                if !self.legacy_ipc {
                    missing.push("unified addressing for legacy IPC (CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)");
                }
            }
        }
        if fabric && memory.supports(handle) && !self.imex_channel {
            missing.push("an IMEX channel (/dev/nvidia-caps-imex-channels)");
        }
        if !self.stream_mem_ops_64bit {
            missing.push("64-bit stream memory operations (for finished timelines)");
        }
        if !self.ipc_events {
            missing.push("IPC events");
        }
        missing
    }

    /// `Ok` when `memory` with `handle` is usable here, else a [`CudaError::Unsupported`] that
    /// names what is missing.
    pub fn check_path(&self, memory: MemoryPath, handle: HandleKind) -> Result<(), CudaError> {
        if !memory.supports(handle) {
            return Err(CudaError::Unsupported {
                what: format!("the {memory} memory path cannot share memory with {handle} handles"),
                hint: "use POSIX fd handles with it, or the pool or vmm path for fabric handles"
                    .into(),
            });
        }
        let missing = self.missing_for(memory, handle);
        if missing.is_empty() {
            return Ok(());
        }
        let hint = if handle == HandleKind::Fabric {
            FABRIC_HINT.to_string()
        } else {
            let others: Vec<String> = self
                .path_support()
                .iter()
                .filter(|p| p.available)
                .map(PathSupport::label)
                .collect();
            if others.is_empty() {
                "no memory path is usable on this device: use the host backend, or a Linux GPU \
                 and driver with IPC events and 64-bit stream memory operations (WSL has \
                 neither)"
                    .to_string()
            } else {
                format!(
                    "choose another memory path; usable here: {}",
                    others.join(", ")
                )
            }
        };
        Err(CudaError::Unsupported {
            what: format!(
                "device {} ({}) cannot use the {} memory path with {handle} handles; missing: {}",
                self.ordinal,
                self.name,
                memory,
                missing.join(", ")
            ),
            hint,
        })
    }

    /// The first usable memory path with `handle`, in the order pool, vmm, legacy (what
    /// `--memory auto` picks), or an error naming what each lacks.
    pub fn auto_memory_path(&self, handle: HandleKind) -> Result<MemoryPath, CudaError> {
        let mut why = Vec::new();
        for memory in MemoryPath::ALL {
            if !memory.supports(handle) {
                continue;
            }
            let missing = self.missing_for(memory, handle);
            if missing.is_empty() {
                return Ok(memory);
            }
            why.push(format!("{memory}: {}", missing.join(", ")));
        }
        Err(CudaError::Unsupported {
            what: format!(
                "device {} ({}) has no usable memory path with {handle} handles ({})",
                self.ordinal,
                self.name,
                why.join("; ")
            ),
            hint: if handle == HandleKind::Fabric {
                FABRIC_HINT.into()
            } else {
                "use the host backend, or a Linux GPU and driver with IPC events and 64-bit \
                 stream memory operations"
                    .into()
            },
        })
    }

    /// The capabilities gpipe's default CUDA path (pool, POSIX fds) needs that this device
    /// lacks (empty: none). See [`Capabilities::missing_for`] for the other paths.
    pub fn missing(&self) -> Vec<&'static str> {
        self.missing_for(MemoryPath::Pool, HandleKind::PosixFd)
    }

    /// The path gpipe takes on this device, or an error naming what is missing.
    pub fn chosen_path(&self) -> Result<TransportPath, CudaError> {
        let missing = self.missing();
        if missing.is_empty() {
            return Ok(TransportPath::PoolIpcEvents);
        }
        Err(CudaError::Unsupported {
            what: format!(
                "device {} ({}) cannot run gpipe's CUDA path; missing: {}",
                self.ordinal,
                self.name,
                missing.join(", ")
            ),
            hint: "use the host backend, or a Linux GPU and driver with stream-ordered pools \
                   exportable as POSIX fds and IPC events (WSL has neither)"
                .into(),
        })
    }
}

/// Everything [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProbeReport {
    /// `cuDriverGetVersion`: `1000 * major + 10 * minor` (13000 is CUDA 13.0).
    pub driver_version: i32,
    /// NVRTC version as `[major, minor]`, when `libnvrtc` loads.
    pub nvrtc_version: Option<[i32; 2]>,
    /// Why NVRTC is unavailable, when it is.
    pub nvrtc_error: Option<String>,
    /// The MPS control pipe, when one exists. A heuristic: a pipe left by a dead daemon also
    /// counts; the per-device `mps_enabled` attribute is authoritative where reported.
    pub mps_control_pipe: Option<String>,
    /// One entry per visible device.
    pub devices: Vec<Capabilities>,
    /// Every ordered pair of distinct visible devices: whether a consumer on `consumer` can
    /// read a producer's slots on `producer` in place (peer access), and the link's rank.
    pub peers: Vec<PeerLink>,
}

/// Whether a consumer on one device can use a producer's slots on another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerLink {
    /// The producer's device ordinal.
    pub producer: usize,
    /// The consumer's device ordinal.
    pub consumer: usize,
    /// `cuDeviceCanAccessPeer(consumer, producer)`: kernels on `consumer` can access
    /// `producer`'s memory.
    pub can_consume: bool,
    /// The driver's performance rank of the link (`CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`;
    /// a relative value), when the devices can reach each other.
    pub performance_rank: Option<i32>,
}

/// The peer links between every ordered pair of distinct devices among `count`.
fn peer_links(count: usize) -> Result<Vec<PeerLink>, CudaError> {
    let mut links = Vec::new();
    for producer in 0..count {
        for consumer in 0..count {
            if producer == consumer {
                continue;
            }
            let (p, c) = (Device::get(producer)?, Device::get(consumer)?);
            // A query the driver refuses reads as "no peer access" rather than failing the
            // whole probe (which every CUDA bench runs first).
            links.push(PeerLink {
                producer,
                consumer,
                can_consume: c.can_access_peer(&p).unwrap_or(false),
                performance_rank: c.peer_performance_rank(&p).ok().flatten(),
            });
        }
    }
    Ok(links)
}

/// Where the MPS control pipe would be: `$CUDA_MPS_PIPE_DIRECTORY/control`, else
/// `/tmp/nvidia-mps/control`; `Some` only if it exists.
pub fn mps_control_pipe() -> Option<PathBuf> {
    let dir = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from("/tmp/nvidia-mps"), PathBuf::from);
    control_pipe_in(&dir)
}

fn control_pipe_in(dir: &Path) -> Option<PathBuf> {
    let pipe = dir.join("control");
    pipe.exists().then_some(pipe)
}

/// The share of the L2 cache the batches in flight may fill under `max_lead = auto`.
pub const AUTO_LEAD_L2_SHARE: f64 = 0.4;

/// The producer-lead bound `auto` derives from a device's L2 size: as many batches in flight
/// (a lead of L keeps L batches written and not yet consumed, the one a consumer is reading
/// among them) as fit in [`AUTO_LEAD_L2_SHARE`] of the L2, and at least 2 while two batches fit
/// in the whole L2, so that a consumer reads a batch while it is still in the L2 the producer
/// wrote it to. A lead of 1 would stop the producer from writing a batch while a consumer
/// reads the last, and the overlap matters more than the cache. `None` (the ring's own bound,
/// `slots`) when that lead is the whole ring anyway, or when two batches do not fit in the L2.
/// Measured on an H100 (50 MB L2, MPS, one consumer, 8 slots, medians of 5, 2026-11-23):
/// 8 MiB batches ran 80.5k batches/s with a lead of 2, 76.9k with 3, 67.9k with 4 and 66.4k
/// with 8 (the whole ring); 64 MiB ran the same at 2, 4 and 8 (2026-11-22).
pub fn l2_max_lead(l2_bytes: u64, slot_bytes: u64, slots: u32) -> Option<u32> {
    if slot_bytes == 0 || slot_bytes.saturating_mul(2) > l2_bytes {
        return None;
    }
    let fit = ((l2_bytes as f64 * AUTO_LEAD_L2_SHARE) / slot_bytes as f64).floor() as u64;
    let lead = fit.max(2);
    (lead < u64::from(slots)).then_some(lead as u32)
}

/// [`l2_max_lead`] for device `ordinal` and slots of `slot_bytes` (rounded as the ring rounds
/// them), with the L2 size it used.
pub fn auto_max_lead(
    ordinal: usize,
    slot_bytes: u64,
    slots: u32,
) -> Result<(Option<u32>, u64), CudaError> {
    driver::init()?;
    let l2 = Device::get(ordinal)?.l2_cache_bytes()?;
    let slot = pipeline_core::round_slot_bytes(slot_bytes);
    Ok((l2_max_lead(l2, slot, slots), l2))
}

/// Fewest hardware work queues (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 when unset) with which
/// `--timeline-memory auto` takes device memory.
pub const DEVICE_WORDS_MIN_CONNECTIONS: u32 = 8;

/// Where `auto` puts the timeline words, and why: device memory (measured faster on an H100,
/// docs/benchmarks.md) when the device can export `cuMemCreate` memory as POSIX fds and the
/// process keeps CUDA's default of 8 hardware queues (`connections`: the value of
/// `CUDA_DEVICE_MAX_CONNECTIONS`, `None` when unset); host memory otherwise. A dead peer's
/// device words are released by a write on a stream of their own, which must not share a
/// queue with a stream stalled on those words; with fewer queues, streams share them.
pub fn rule_timeline_memory(
    vmm_posix_fd: bool,
    connections: Option<u32>,
) -> (TimelineMemory, String) {
    if !vmm_posix_fd {
        return (
            TimelineMemory::Host,
            "the device cannot share cuMemCreate memory as POSIX fds".into(),
        );
    }
    match connections {
        Some(n) if n < DEVICE_WORDS_MIN_CONNECTIONS => (
            TimelineMemory::Host,
            format!(
                "CUDA_DEVICE_MAX_CONNECTIONS={n}: with fewer than \
                 {DEVICE_WORDS_MIN_CONNECTIONS} hardware queues, a release written to device \
                 words could queue behind the stalled wait it is meant to release"
            ),
        ),
        _ => (
            TimelineMemory::Device,
            "device memory: measured faster on an H100".into(),
        ),
    }
}

/// [`rule_timeline_memory`] for device `ordinal` of `report`, reading
/// `CUDA_DEVICE_MAX_CONNECTIONS` from the environment.
pub fn auto_timeline_memory(report: &ProbeReport, ordinal: usize) -> (TimelineMemory, String) {
    let vmm = report
        .devices
        .iter()
        .find(|d| d.ordinal == ordinal)
        .is_some_and(|d| d.check_path(MemoryPath::Vmm, HandleKind::PosixFd).is_ok());
    rule_timeline_memory(vmm, max_connections())
}

/// Hardware queues a consumer with side signals should have: its stream and the two side
/// streams each on a queue of their own.
pub const SIDE_SIGNALS_CONNECTIONS: u32 = 8;

/// Whether this process's `CUDA_DEVICE_MAX_CONNECTIONS` gives side signals their queues, and
/// if not, what to set. Unset counts as not: CUDA's default is 8 queues without MPS, but
/// under MPS a client's streams were measured sharing queues when it was unset
/// (docs/benchmarks.md: 64 MiB with side signals at 0.934x of the ceiling unset, 0.979x with
/// 8).
pub fn side_signals_connections() -> Result<(), String> {
    side_signals_connections_for(max_connections())
}

/// [`side_signals_connections`] for a given `CUDA_DEVICE_MAX_CONNECTIONS` (None: unset).
pub fn side_signals_connections_for(connections: Option<u32>) -> Result<(), String> {
    match connections {
        Some(n) if n >= SIDE_SIGNALS_CONNECTIONS => Ok(()),
        Some(n) => Err(format!(
            "CUDA_DEVICE_MAX_CONNECTIONS={n}: the side streams may share hardware queues with \
             the batch's stream; {SIDE_SIGNALS_CONNECTIONS} or more lets each have its own"
        )),
        None => Err(format!(
            "CUDA_DEVICE_MAX_CONNECTIONS is unset: under MPS a client's streams then share \
             hardware queues and side signals gain little; set it to \
             {SIDE_SIGNALS_CONNECTIONS} in the consumer's environment"
        )),
    }
}

/// `CUDA_DEVICE_MAX_CONNECTIONS`, when set to a number.
pub fn max_connections() -> Option<u32> {
    std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
}

/// The ring depths `slots = "auto"` considers without MPS (with MPS it is 8).
pub const AUTO_DEPTHS: [u32; 4] = [8, 16, 32, 64];

/// The most slot memory `slots = "auto"` takes by default (2 GiB): on an H100 without MPS a
/// 4 GiB ring (64 x 64 MiB) moved less than a 2 GiB one (32 x 64 MiB).
pub const DEFAULT_DEPTH_BUDGET: u64 = 2 << 30;

/// The depths of [`AUTO_DEPTHS`] whose slots (of `batch_bytes`, rounded as the ring rounds
/// them) fit `budget` bytes; 8 alone when none does.
pub fn depths_within(batch_bytes: u64, budget: u64) -> Vec<u32> {
    let slot = pipeline_core::round_slot_bytes(batch_bytes);
    let fit: Vec<u32> = AUTO_DEPTHS
        .iter()
        .copied()
        .filter(|&d| u64::from(d) * slot <= budget)
        .collect();
    if fit.is_empty() { vec![8] } else { fit }
}

/// The depth `slots = "auto"` takes without a measurement: 8 with MPS running (handovers
/// are cheap); without it, where the GPU time-slices between the processes and a deeper ring
/// lets each do more per slice, the deepest of [`depths_within`] the budget. Measured on an
/// H100 (docs/benchmarks.md): without MPS a 2 MiB ring moved 2.4x more at 64 slots than at 8,
/// and a 64 MiB one 1.4x more at 32, but less at 64 (4 GiB), hence a budget.
pub fn rule_depth(mps: bool, batch_bytes: u64, budget: u64) -> u32 {
    if mps {
        return 8;
    }
    depths_within(batch_bytes, budget)
        .last()
        .copied()
        .unwrap_or(8)
}

/// Probes the driver and every visible device. Returns [`CudaError::NoDriver`] (never panics)
/// when `libcuda` cannot be loaded.
pub fn probe() -> Result<ProbeReport, CudaError> {
    driver::init()?;
    let driver_version = driver::driver_version()?;
    let (nvrtc_version, nvrtc_error) = match driver::nvrtc_version() {
        Ok((major, minor)) => (Some([major, minor]), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let count = driver::device_count()?;
    let devices = (0..count)
        .map(|i| Capabilities::of(&Device::get(i)?))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ProbeReport {
        driver_version,
        nvrtc_version,
        nvrtc_error,
        mps_control_pipe: mps_control_pipe().map(|p| p.display().to_string()),
        devices,
        peers: peer_links(count)?,
    })
}

impl ProbeReport {
    /// The path gpipe takes on device 0, or an error naming what is missing.
    pub fn chosen_path(&self) -> Result<TransportPath, CudaError> {
        self.chosen_path_for(0)
    }

    /// The path gpipe takes on device `ordinal`, or an error naming what is missing.
    pub fn chosen_path_for(&self, ordinal: usize) -> Result<TransportPath, CudaError> {
        match self.devices.iter().find(|d| d.ordinal == ordinal) {
            Some(device) => device.chosen_path(),
            None => Err(CudaError::Unsupported {
                what: format!("no CUDA device {ordinal} ({} visible)", self.devices.len()),
                hint: "check `nvidia-smi` and CUDA_VISIBLE_DEVICES".into(),
            }),
        }
    }

    /// The first usable memory path with `handle` on device `ordinal` (pool, then vmm, then
    /// legacy), or an error naming what is missing.
    pub fn auto_memory_path_for(
        &self,
        ordinal: usize,
        handle: HandleKind,
    ) -> Result<MemoryPath, CudaError> {
        match self.devices.iter().find(|d| d.ordinal == ordinal) {
            Some(device) => device.auto_memory_path(handle),
            None => Err(CudaError::Unsupported {
                what: format!("no CUDA device {ordinal} ({} visible)", self.devices.len()),
                hint: "check `nvidia-smi` and CUDA_VISIBLE_DEVICES".into(),
            }),
        }
    }

    /// Whether MPS looks active: a device reports it, or the control pipe exists (heuristic).
    pub fn mps_active(&self) -> bool {
        self.devices.iter().any(|d| d.mps_enabled == Some(true)) || self.mps_control_pipe.is_some()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn auto_timeline_memory_is_device_unless_vmm_fds_or_queues_are_missing() {
        use crate::sync::TimelineMemory::{Device, Host};
        assert_eq!(rule_timeline_memory(true, None).0, Device);
        assert_eq!(rule_timeline_memory(true, Some(8)).0, Device);
        assert_eq!(rule_timeline_memory(true, Some(32)).0, Device);
        let (m, why) = rule_timeline_memory(true, Some(1));
        assert_eq!(m, Host);
        assert!(why.contains("CUDA_DEVICE_MAX_CONNECTIONS=1"), "{why}");
        let (m, why) = rule_timeline_memory(false, None);
        assert_eq!(m, Host);
        assert!(why.contains("POSIX fds"), "{why}");
    }

    #[test]
    fn side_signals_want_eight_queues_and_say_what_to_set() {
        assert_eq!(side_signals_connections_for(Some(8)), Ok(()));
        assert_eq!(side_signals_connections_for(Some(32)), Ok(()));
        let low = side_signals_connections_for(Some(4)).unwrap_err();
        assert!(low.contains("CUDA_DEVICE_MAX_CONNECTIONS=4"), "{low}");
        let unset = side_signals_connections_for(None).unwrap_err();
        assert!(
            unset.contains("unset") && unset.contains("set it to 8"),
            "{unset}"
        );
    }

    #[test]
    fn auto_lead_keeps_the_batches_in_flight_within_the_l2() {
        let l2 = 50 << 20; // an H100's
        let mib = 1u64 << 20;
        // 8 MiB: 2 batches in flight fit in 40% of 50 MiB (the measured best).
        assert_eq!(l2_max_lead(l2, 8 * mib, 8), Some(2));
        // 12 and 25 MiB: not even 2 fit in 40%, but 2 fit in the whole L2: 2.
        assert_eq!(l2_max_lead(l2, 12 * mib, 8), Some(2));
        assert_eq!(l2_max_lead(l2, 25 * mib, 8), Some(2));
        // 2 MiB: 10 fit, more than the ring holds: the ring's own bound.
        assert_eq!(l2_max_lead(l2, 2 * mib, 8), None);
        assert_eq!(l2_max_lead(l2, 2 * mib, 32), Some(10));
        // 26 and 64 MiB: two do not fit in the L2 at all.
        assert_eq!(l2_max_lead(l2, 26 * mib, 8), None);
        assert_eq!(l2_max_lead(l2, 64 * mib, 8), None);
        // A 2-slot ring is its own bound.
        assert_eq!(l2_max_lead(l2, 8 * mib, 2), None);
        assert_eq!(l2_max_lead(l2, 0, 8), None);
    }

    #[test]
    fn auto_depth_is_eight_with_mps_else_the_deepest_within_the_budget() {
        let mib = 1u64 << 20;
        assert_eq!(rule_depth(true, 2 * mib, 2 << 30), 8);
        assert_eq!(rule_depth(false, 2 * mib, 2 << 30), 64);
        assert_eq!(rule_depth(false, 64 * mib, 2 << 30), 32);
        assert_eq!(rule_depth(false, 256 * mib, 2 << 30), 8);
        // Nothing fits the budget: the ring's usual 8.
        assert_eq!(rule_depth(false, 1 << 30, 1 << 30), 8);
        // Slots are rounded up to 2 MiB: 3 MiB batches take 4 MiB each.
        assert_eq!(depths_within(3 * mib, 64 * mib), vec![8, 16]);
    }

    use super::*;

    fn h100() -> Capabilities {
        Capabilities {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
            compute_capability: [9, 0],
            total_memory_bytes: 80 << 30,
            multiprocessors: 132,
            memory_pools: true,
            pool_handle_types: HANDLE_TYPE_POSIX_FD_BIT | HANDLE_TYPE_FABRIC_BIT,
            pool_posix_fd: true,
            pool_fabric: true,
            virtual_memory_management: true,
            posix_fd_handles: true,
            fabric_handles: true,
            ipc_events: true,
            stream_mem_ops_64bit: true,
            legacy_ipc: true,
            mps_enabled: Some(false),
            imex_channel: false,
            memory_paths: vec![],
            notes: vec![],
        }
        .with_paths()
    }

    impl Capabilities {
        fn with_paths(mut self) -> Self {
            self.memory_paths = self.path_support();
            self
        }
    }

    fn report(devices: Vec<Capabilities>) -> ProbeReport {
        ProbeReport {
            driver_version: 13000,
            nvrtc_version: Some([13, 0]),
            nvrtc_error: None,
            mps_control_pipe: None,
            devices,
            peers: vec![],
        }
    }

    #[test]
    fn full_support_takes_the_pool_path() {
        let r = report(vec![h100()]);
        assert_eq!(r.chosen_path().unwrap(), TransportPath::PoolIpcEvents);
        assert_eq!(
            TransportPath::PoolIpcEvents.to_string(),
            "pool + IPC events"
        );
        assert!(!r.mps_active());
    }

    #[test]
    fn missing_capabilities_are_named() {
        let mut d = h100();
        d.pool_posix_fd = false;
        d.ipc_events = false;
        let e = report(vec![d.clone()]).chosen_path().unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("missing: memory pools with POSIX fd handles, IPC events"),
            "{text}"
        );
        d.memory_pools = false;
        assert_eq!(d.missing(), vec!["memory pools", "IPC events"]);
        assert!(report(vec![]).chosen_path().is_err());
    }

    #[test]
    fn memory_paths_are_listed_per_device() {
        let d = h100();
        let labels: Vec<(String, bool)> = d
            .memory_paths
            .iter()
            .map(|p| (p.label(), p.available))
            .collect();
        assert_eq!(
            labels,
            vec![
                ("pool".into(), true),
                ("pool+fabric".into(), false),
                ("vmm".into(), true),
                ("vmm+fabric".into(), false),
                ("legacy".into(), true),
            ]
        );
        let with_imex = Capabilities {
            imex_channel: true,
            ..d
        }
        .with_paths();
        assert!(with_imex.memory_paths.iter().all(|p| p.available));
        let json = serde_json::to_value(&with_imex).unwrap();
        assert_eq!(json["memory_paths"][3]["memory"], "vmm");
        assert_eq!(json["memory_paths"][3]["handle"], "fabric");
    }

    #[test]
    fn path_checks_name_the_missing_attribute() {
        let mut d = h100();
        d.virtual_memory_management = false;
        d.posix_fd_handles = false;
        let text = d
            .check_path(MemoryPath::Vmm, HandleKind::PosixFd)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
            "{text}"
        );
        assert!(
            text.contains("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
            "{text}"
        );
        assert!(text.contains("usable here: pool, legacy"), "{text}");
        d.check_path(MemoryPath::Legacy, HandleKind::PosixFd)
            .unwrap();
        d.check_path(MemoryPath::Pool, HandleKind::PosixFd).unwrap();

        let text = d
            .check_path(MemoryPath::Pool, HandleKind::Fabric)
            .unwrap_err()
            .to_string();
        assert!(text.contains("IMEX channel"), "{text}");
        assert!(text.contains("multi-node NVLink"), "{text}");
        d.fabric_handles = false;
        let text = d
            .check_path(MemoryPath::Vmm, HandleKind::Fabric)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"),
            "{text}"
        );
        assert!(
            d.check_path(MemoryPath::Legacy, HandleKind::Fabric)
                .is_err()
        );
    }

    #[test]
    fn auto_prefers_pool_then_vmm_then_legacy() {
        let mut d = h100();
        assert_eq!(
            d.auto_memory_path(HandleKind::PosixFd).unwrap(),
            MemoryPath::Pool
        );
        d.memory_pools = false;
        assert_eq!(
            d.auto_memory_path(HandleKind::PosixFd).unwrap(),
            MemoryPath::Vmm
        );
        d.virtual_memory_management = false;
        assert_eq!(
            d.auto_memory_path(HandleKind::PosixFd).unwrap(),
            MemoryPath::Legacy
        );
        d.legacy_ipc = false;
        let text = d
            .auto_memory_path(HandleKind::PosixFd)
            .unwrap_err()
            .to_string();
        assert!(text.contains("pool: memory pools"), "{text}");
        assert!(text.contains("legacy: unified addressing"), "{text}");
        let r = report(vec![h100()]);
        assert!(r.auto_memory_path_for(0, HandleKind::Fabric).is_err());
        assert!(r.auto_memory_path_for(1, HandleKind::PosixFd).is_err());
    }

    #[test]
    fn report_serializes() {
        fn assert_serialize<T: Serialize>(_: &T) {}
        assert_serialize(&report(vec![h100()]));
    }

    #[test]
    fn mps_pipe_heuristic_looks_for_control() {
        let dir = std::env::temp_dir().join(format!("gpipe-mps-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(control_pipe_in(&dir), None);
        std::fs::write(dir.join("control"), b"").unwrap();
        assert_eq!(control_pipe_in(&dir), Some(dir.join("control")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn probe_without_a_driver_is_an_error_not_a_panic() {
        if driver::driver_present() {
            return;
        }
        assert!(matches!(probe(), Err(CudaError::NoDriver(_))));
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn probe_finds_the_pool_path_on_the_gpu() {
        let r = probe().unwrap();
        println!("{r:#?}");
        assert!(!r.devices.is_empty());
        r.chosen_path().unwrap();
    }
}
