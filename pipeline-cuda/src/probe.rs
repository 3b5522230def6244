//! Device capability probe: what each GPU and the driver support, and which path gpipe takes.
//!
//! [`probe`] reads device attributes only; it creates no context and allocates nothing. It
//! returns data ([`ProbeReport`], serializable); `gpipe probe` turns it into text.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::CUdevice_attribute as Attr;
use serde::{Deserialize, Serialize};

use crate::driver::{self, CudaError, Device};
use crate::memory::{FABRIC_HINT, HandleKind, MemoryPath, imex_channel_present};

/// Bit of `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES` for POSIX file descriptors.
pub const HANDLE_TYPE_POSIX_FD_BIT: u32 = 0x1;
/// Bit of `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES` for fabric handles.
pub const HANDLE_TYPE_FABRIC_BIT: u32 = 0x8;

/// What one device supports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    /// L2 cache size in bytes (`CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE`; what `max_lead = auto`
    /// sizes the batches in flight by). `None` when the driver does not report it.
    #[serde(default)]
    pub l2_cache_bytes: Option<u64>,
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
    /// Which memory paths (with which handle kinds) gpipe can use on this device (derived
    /// from the fields above: not read back from a saved report, see
    /// [`crate::policy::Facts::of`]).
    #[serde(skip_deserializing)]
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
        let l2_cache_bytes = attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "L2 cache size")
            .and_then(|v| u64::try_from(v).ok());
        let (major, minor) = device.compute_capability()?;
        let mut caps = Capabilities {
            ordinal: device.ordinal(),
            name: device.name()?,
            uuid: device.uuid_string()?,
            compute_capability: [major, minor],
            total_memory_bytes: device.total_memory()? as u64,
            multiprocessors: device.multiprocessor_count()?,
            l2_cache_bytes,
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// How many times this process has called [`probe`] (a tool that means to probe once can
/// check it did).
static PROBES: AtomicUsize = AtomicUsize::new(0);

/// How many times this process has called [`probe`].
pub fn probes_run() -> usize {
    PROBES.load(Ordering::Relaxed)
}

/// Probes the driver and every visible device. Returns [`CudaError::NoDriver`] (never panics)
/// when `libcuda` cannot be loaded. It reads many attributes of every device: call it once and
/// pass the report on (as [`crate::policy::Facts::probe`] does).
pub fn probe() -> Result<ProbeReport, CudaError> {
    PROBES.fetch_add(1, Ordering::Relaxed);
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

/// A device and a report for tests that need no GPU: an H100 without MPS.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    pub(crate) fn h100() -> Capabilities {
        Capabilities {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
            compute_capability: [9, 0],
            total_memory_bytes: 80 << 30,
            multiprocessors: 132,
            l2_cache_bytes: Some(50 << 20),
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
        pub(crate) fn with_paths(mut self) -> Self {
            self.memory_paths = self.path_support();
            self
        }
    }

    pub(crate) fn report(devices: Vec<Capabilities>) -> ProbeReport {
        ProbeReport {
            driver_version: 13000,
            nvrtc_version: Some([13, 0]),
            nvrtc_error: None,
            mps_control_pipe: None,
            devices,
            peers: vec![],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::fixtures::{h100, report};

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
