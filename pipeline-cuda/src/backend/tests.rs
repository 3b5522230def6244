//! The CUDA backend's tests: options and exports checked without a driver, and on a GPU the
//! allocations, the per-consumer words and the limits.

use super::*;
use std::os::fd::OwnedFd;

use pipeline_core::wire::Reader;
use pipeline_core::{ConsumerBackend, Export, ProducerBackend, RingLayout};

use crate::driver::Context;
use crate::export::ExportHeader;
use crate::memory::SlotExport;
use crate::memory::{HandleKind, MAX_VMM_FD_SLOTS, MemoryPath};
use crate::sync::RELEASED;
use crate::sync::{SyncMode, TimelineMemory};

use crate::export::HANDLE;
use pipeline_core::Mode;

fn layout(slot_count: u32) -> RingLayout {
    RingLayout {
        slot_count,
        slot_bytes: 2 << 20,
        consumer_capacity: 4,
        mode: Mode::Broadcast,
    }
}

#[test]
fn options_default_to_the_pool_with_posix_fds() {
    let o = CudaOptions::default();
    assert_eq!(
        (o.memory, o.handle),
        (MemoryPath::Pool, HandleKind::PosixFd)
    );
    let o = o
        .with_memory(MemoryPath::Vmm)
        .with_handle(HandleKind::Fabric);
    assert_eq!((o.memory, o.handle), (MemoryPath::Vmm, HandleKind::Fabric));
}

#[test]
fn legacy_with_fabric_is_refused_before_touching_the_driver() {
    let o = CudaOptions::default()
        .with_memory(MemoryPath::Legacy)
        .with_handle(HandleKind::Fabric);
    let e = CudaProducer::create(&layout(2), o).err().unwrap();
    assert!(e.to_string().contains("legacy memory path cannot"), "{e}");
}

#[test]
fn consumers_refuse_a_mismatched_export_before_touching_the_driver() {
    let mut blob = Vec::new();
    ExportHeader {
        memory: MemoryPath::Vmm,
        handle: HandleKind::PosixFd,
        sync: SyncMode::Events,
        uuid: [0; 16],
        slot_count: 2,
        slot_bytes: 2 << 20,
        words: TimelineMemory::Host,
        word_bytes: 0,
    }
    .write(&mut blob);
    blob.extend_from_slice(&(2u64 << 20).to_le_bytes());
    blob.extend_from_slice(&[0; 2 * HANDLE]);
    let memfd = || pipeline_core::sys::sealed_memfd("gpipe-test", 4096).unwrap();
    // A pool-style fd set (one memory fd) for a VMM export of two slots.
    let e = CudaConsumer::import(
        &layout(2),
        0,
        CudaOptions::default(),
        &blob,
        vec![memfd(), memfd()],
    )
    .err()
    .unwrap();
    assert!(
        e.to_string()
            .contains("vmm export with posix_fd handles must carry 2"),
        "{e}"
    );
    // A ring of another shape.
    let e = CudaConsumer::import(&layout(3), 0, CudaOptions::default(), &blob, vec![])
        .err()
        .unwrap();
    assert!(e.to_string().contains("describes 2 slots"), "{e}");
    // Trailing bytes.
    let mut long = blob.clone();
    long.push(0);
    let fds = vec![memfd(), memfd(), memfd()];
    let e = CudaConsumer::import(&layout(2), 0, CudaOptions::default(), &long, fds)
        .err()
        .unwrap();
    assert!(e.to_string().contains("trailing"), "{e}");
}

mod gpu {
    use super::*;
    use crate::driver::{PinnedBuffer, memcpy_dtoh_async, memset_d8_async};
    use crate::memory::imex_channel_present;

    /// Parses a producer's export the way a consumer does, without importing.
    fn parse(export: Export, memory: MemoryPath, slots: u32) {
        let mut r = Reader::new(&export.blob, "test export");
        let h = ExportHeader::read(&mut r).unwrap();
        assert_eq!((h.memory, h.handle), (memory, HandleKind::PosixFd));
        assert_eq!((h.slot_count, h.slot_bytes), (slots, 2 << 20));
        let mut fds = export.fds;
        fds.pop().unwrap();
        SlotExport::parse(&mut r, memory, h.handle, slots, 2 << 20, fds).unwrap();
        r.bytes(slots as usize * HANDLE).unwrap();
        r.finish().unwrap();
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn every_path_allocates_writable_slots_and_exports_them() {
        for (memory, memory_fds) in [
            (MemoryPath::Pool, 1),
            (MemoryPath::Vmm, 3),
            (MemoryPath::Legacy, 0),
        ] {
            let options = CudaOptions::default().with_memory(memory);
            let p = CudaProducer::create(&layout(3), options).unwrap();
            assert_eq!(p.memory_path(), memory);
            let export = p.export(0).unwrap();
            assert_eq!(export.fds.len(), memory_fds + 1, "{memory}");
            parse(export, memory, 3);
            let host = PinnedBuffer::new(p.context(), 16).unwrap();
            for k in 0..3 {
                // SAFETY: no consumer is attached, so the producer owns every slot.
                let slot = unsafe { p.slot_mut(k) };
                assert_eq!(slot.ptr % (2 << 20), 0, "{memory} slot {k}");
                // SAFETY: the slot is live device memory of `capacity` bytes used only by
                // the producer's stream; the host reads `host` after synchronize.
                unsafe {
                    memset_d8_async(slot.ptr, k as u8 + 1, slot.capacity as usize, slot.stream)
                        .unwrap();
                    memcpy_dtoh_async(
                        host.as_ptr(),
                        slot.ptr + slot.capacity - 16,
                        16,
                        slot.stream,
                    )
                    .unwrap();
                }
                p.signal_ready(k, 0).unwrap();
                p.stream().synchronize().unwrap();
                // SAFETY: the stream is idle.
                assert_eq!(unsafe { host.as_slice() }, &[k as u8 + 1; 16]);
            }
            drop(p);
        }
    }

    /// The inode of an fd.
    fn inode(fd: &OwnedFd) -> u64 {
        rustix::fs::fstat(fd).unwrap().st_ino as u64
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn each_consumer_is_sent_only_its_own_finished_words() {
        for sync in SyncMode::ALL {
            let options = CudaOptions::default().with_sync(sync);
            let p = CudaProducer::create(&layout(3), options).unwrap();
            // Every export (one per attach) carries fresh words of its own, last; none
            // is ever sent twice, not even to a later holder of the same index.
            let mut seen = std::collections::HashSet::new();
            for c in [0u32, 1, 2, 3, 0, 0, 3] {
                let export = p.export(c).unwrap();
                let words = export.fds.last().unwrap();
                assert!(seen.insert(inode(words)), "index {c} got words sent before");
                // One row of 3 words (a page), not every consumer's.
                let size = rustix::fs::fstat(words).unwrap().st_size;
                assert_eq!(size, 4096, "{sync}");
            }
            // Nothing is waited on before an attach installs the words; after, the
            // producer reads the installed ones, and a departure releases them.
            assert_eq!(p.timelines.device(2, 1), None);
            p.timelines.install(2).unwrap();
            assert_eq!(p.timelines.load(2, 1), Some(0));
            assert!(
                p.timelines.install(2).is_err(),
                "installed twice from one export"
            );
            p.timelines.store_all(2, RELEASED);
            assert_eq!(p.timelines.load(2, 0), Some(RELEASED));
            assert_eq!(p.timelines.load(1, 0), None);
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_ring_larger_than_the_gpus_free_memory_is_refused_before_allocating() {
        let ctx = Context::new(0).unwrap();
        let (free, _total) = ctx.memory_info().unwrap();
        // The fewest of the largest slots that do not fit in what is free now.
        let slot_bytes = pipeline_core::limits::MAX_SLOT_BYTES;
        let slots = u32::try_from(free / slot_bytes + 1).unwrap();
        let ring = RingLayout {
            slot_count: slots,
            slot_bytes,
            ..layout(1)
        };
        for memory in [MemoryPath::Pool, MemoryPath::Vmm, MemoryPath::Legacy] {
            let options = CudaOptions::default().with_memory(memory);
            if !memory.supports(options.handle) {
                continue;
            }
            let e = CudaProducer::create(&ring, options).err().unwrap();
            let too_large = e
                .downcast_ref::<pipeline_core::limits::DoesNotFit>()
                .unwrap_or_else(|| panic!("{memory}: not refused for its size: {e}"));
            assert_eq!(too_large.memory, pipeline_core::limits::Memory::Gpu(0));
            assert!(e.to_string().contains("free memory on GPU 0"), "{e}");
        }
        let (free_after, _) = ctx.memory_info().unwrap();
        assert!(
            free_after + slot_bytes > free,
            "memory was allocated: {free} then {free_after}"
        );
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn vmm_with_posix_fds_refuses_more_slots_than_a_welcome_can_carry() {
        let options = CudaOptions::default().with_memory(MemoryPath::Vmm);
        let e = CudaProducer::create(&layout(MAX_VMM_FD_SLOTS + 1), options)
            .err()
            .unwrap();
        let most = format!("at most {MAX_VMM_FD_SLOTS} slots");
        assert!(e.to_string().contains(&most), "{e}");
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn fabric_without_an_imex_channel_fails_at_setup_naming_it() {
        if imex_channel_present() {
            eprintln!("an IMEX channel exists here; nothing to check");
            return;
        }
        for memory in [MemoryPath::Pool, MemoryPath::Vmm] {
            let options = CudaOptions::default()
                .with_memory(memory)
                .with_handle(HandleKind::Fabric);
            let e = CudaProducer::create(&layout(1), options).err().unwrap();
            let text = e.to_string();
            assert!(text.contains("/dev/nvidia-caps-imex-channels"), "{text}");
            assert!(text.contains("multi-node NVLink"), "{text}");
        }
    }
}
