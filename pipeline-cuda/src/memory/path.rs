//! The memory paths ([`MemoryPath`]) and how their handles travel ([`HandleKind`]): the names
//! the options, the probe, the export blob and each path's code share.

use serde::Serialize;

use crate::driver::PoolHandleType;

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

crate::names::named_enum!(MemoryPath, "memory path", [
    Pool = "pool" (1) [],
    Vmm = "vmm" (2) [],
    Legacy = "legacy" (3) ["ipc"],
]);

impl MemoryPath {
    /// Whether the path can share its memory with `handle`.
    pub fn supports(self, handle: HandleKind) -> bool {
        !(self == MemoryPath::Legacy && handle == HandleKind::Fabric)
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

crate::names::named_enum!(HandleKind, "handle kind", [
    PosixFd = "posix_fd" (1) ["posix-fd", "fd", "posix"],
    Fabric = "fabric" (2) [],
]);

impl HandleKind {
    /// The driver handle type.
    pub fn pool_handle_type(self) -> PoolHandleType {
        match self {
            HandleKind::PosixFd => PoolHandleType::PosixFd,
            HandleKind::Fabric => PoolHandleType::Fabric,
        }
    }
}

/// 2 MiB: the slot alignment, and the unit VMM allocations are rounded to.
pub(crate) const TWO_MIB: u64 = 2 << 20;

#[cfg(test)]
mod tests {
    use super::*;

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
}
