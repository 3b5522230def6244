//! The export blob a CUDA producer sends each consumer at attach (docs/protocol.md, section 7):
//! the common header ([`ExportHeader`]), then the memory path's section ([`SlotExport`]), with
//! the fds that travel beside it. Reading and writing of each part sit side by side here.
//!
//! The blob is read with pipeline-core's bounds-checked [`Reader`], which every handshake
//! message of the ring shares.

use std::os::fd::OwnedFd;

use pipeline_core::BackendError;
use pipeline_core::wire::Reader;

use crate::memory::{
    HandleKind, MemoryPath, ProducerShare, ProducerSlots, Share, SlotExport, TWO_MIB,
};
use crate::sync::{SyncMode, TimelineMemory};

pub(crate) const HANDLE: usize = 64;

/// The magic that opens a consumer's reply to the export (its Ready blob).
pub(crate) const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"GCF1");

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
    /// Where the timeline words are.
    pub(crate) words: TimelineMemory,
    /// Bytes of each device-memory timeline allocation (0 for host words).
    pub(crate) word_bytes: u64,
}

/// `"GCU1"`.
pub(crate) const EXPORT_MAGIC: u32 = u32::from_le_bytes(*b"GCU1");
/// Version 2 added the memory path and handle kind after the version; version 3 the sync mode;
/// version 4 sends each consumer its own `finished` words (one row) instead of everyone's;
/// version 5 adds where the timeline words live (host or device memory) and their size.
pub(crate) const EXPORT_VERSION: u32 = 5;

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
        out.extend_from_slice(&self.words.to_wire().to_le_bytes());
        out.extend_from_slice(&self.word_bytes.to_le_bytes());
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
        let uuid = r.bytes(16)?.try_into()?;
        let slot_count = r.u32()?;
        let slot_bytes = r.u64()?;
        let w = r.u32()?;
        let words = TimelineMemory::from_wire(w).ok_or_else(|| {
            format!("CUDA export names timeline memory {w}, which this consumer does not know")
        })?;
        let word_bytes = r.u64()?;
        if (words == TimelineMemory::Device) != (word_bytes > 0) {
            return Err(format!(
                "CUDA export: {word_bytes} bytes of {words} timeline words do not fit together"
            )
            .into());
        }
        Ok(ExportHeader {
            memory,
            handle,
            sync,
            uuid,
            slot_count,
            slot_bytes,
            words,
            word_bytes,
        })
    }
}

impl ProducerSlots {
    /// Writes the path-specific section of the export blob (see [`SlotExport::parse`]).
    pub(crate) fn write_export(&self, out: &mut Vec<u8>) {
        match self {
            ProducerSlots::Pool(slots) => {
                if let ProducerShare::Fabric(f) = &slots.share {
                    out.extend_from_slice(f);
                }
                for e in &slots.exports {
                    out.extend_from_slice(e);
                }
            }
            ProducerSlots::Vmm(slots) => {
                out.extend_from_slice(&slots.alloc_bytes.to_le_bytes());
                for s in &slots.shares {
                    if let ProducerShare::Fabric(f) = s {
                        out.extend_from_slice(f);
                    }
                }
            }
            ProducerSlots::Legacy(slots) => {
                for h in &slots.handles {
                    out.extend_from_slice(h);
                }
            }
        }
    }

    /// Fresh copies of the fds a consumer needs (before the timelines fd).
    pub(crate) fn export_fds(&self) -> std::io::Result<Vec<OwnedFd>> {
        let shares: &[ProducerShare] = match self {
            ProducerSlots::Pool(slots) => std::slice::from_ref(&slots.share),
            ProducerSlots::Vmm(slots) => &slots.shares,
            ProducerSlots::Legacy(_) => &[],
        };
        shares
            .iter()
            .filter_map(|s| match s {
                ProducerShare::Fd(fd) => Some(fd.try_clone()),
                ProducerShare::Fabric(_) => None,
            })
            .collect()
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
            words: TimelineMemory::Host,
            word_bytes: 0,
        }
    }

    #[test]
    fn header_round_trips_and_names_mismatches() {
        let h = header(MemoryPath::Vmm, HandleKind::Fabric);
        let mut blob = Vec::new();
        h.write(&mut blob);
        assert_eq!(blob.len(), 60);
        assert_eq!(ExportHeader::read(&mut Reader::new(&blob, "t")).unwrap(), h);

        // Device words carry their allocation's size; a size that does not fit the kind is
        // refused, as is a kind this consumer does not know.
        let d = ExportHeader {
            words: TimelineMemory::Device,
            word_bytes: 2 << 20,
            ..header(MemoryPath::Pool, HandleKind::PosixFd)
        };
        let mut dev = Vec::new();
        d.write(&mut dev);
        assert_eq!(ExportHeader::read(&mut Reader::new(&dev, "t")).unwrap(), d);
        let mut zero = dev.clone();
        zero[52..60].copy_from_slice(&0u64.to_le_bytes());
        let e = ExportHeader::read(&mut Reader::new(&zero, "t")).unwrap_err();
        assert!(e.to_string().contains("do not fit together"), "{e}");
        let mut unknown = dev.clone();
        unknown[48..52].copy_from_slice(&7u32.to_le_bytes());
        let e = ExportHeader::read(&mut Reader::new(&unknown, "t")).unwrap_err();
        assert!(e.to_string().contains("timeline memory 7"), "{e}");

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
}
