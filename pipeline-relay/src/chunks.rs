//! Chunk progress of a forwarded ring (issue #34): how far a forwarder's copy into each of its
//! slots has got, so that the next hop of a chain or tree can copy chunk i of a batch as soon
//! as chunk i has landed, before the batch is whole and published.
//!
//! A forwarder that chunks makes a *progress board* next to its ring: one 8-byte word per slot
//! in shared memory (`/dev/shm`, named after the ring's socket), written by its copy stream
//! (`cuStreamWriteValue64`; on the host backend, a store) and read by the next hop's copy
//! stream (`cuStreamWaitValue64 >=`; on the host backend, a load) and host.
//!
//! **Encoding.** For batch `seq` (the ring's own sequence number) in a slot, after `c` of its
//! chunks landed, the slot's word holds [`progress`]`(seq, c) = (seq + 1) << 16 | c`. Values
//! only grow in a slot: a slot's next batch is `seq + slots`, above every value of `seq`. So
//! a wait for chunk `c` of `seq` (`word >= progress(seq, c + 1)`) passes only once that chunk
//! of that batch landed, and no value of a partly copied batch reaches the value of the
//! whole batch. `progress(seq, 0)` is written when the batch's copy starts; the next hop's
//! host waits for it before it enqueues waits on the batch's chunks, so a stream never waits
//! on a batch that its writer has not begun (every such wait ends in finite time unless the
//! writer dies). [`RELEASED`] (above every progress value) is written by a reader whose writer
//! died, to free its own stream's waits.
//!
//! **What the board is not.** It never makes a batch visible to a consumer: a forwarder
//! publishes a batch downstream only once it received the whole batch from upstream (the
//! upstream published it) and its own copy completed. A copy started from the board for a
//! batch that never comes (its writer died mid-batch, or the ring closed) is dropped with the
//! slot it was copied into, unpublished.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;

/// Bits of a progress value that count chunks.
pub const CHUNK_BITS: u32 = 16;

/// A value above every progress value (sequences stay below 2^46), which passes every wait.
/// The same value as the CUDA backend's released timeline words.
pub const RELEASED: u64 = 1 << 62;

const MAGIC: u64 = u64::from_le_bytes(*b"gpchunk1");
/// Header words: magic, slot count, slot bytes, chunk bytes, the writer's pid.
const HEADER_WORDS: usize = 8;

/// The progress value of batch `seq` with `chunks` of its chunks landed (see the module).
pub fn progress(seq: u64, chunks: u32) -> u64 {
    debug_assert!(u64::from(chunks) < 1 << CHUNK_BITS);
    ((seq + 1) << CHUNK_BITS) | u64::from(chunks)
}

/// The chunks of `len` bytes in chunks of `chunk` bytes: (offset, length) each.
pub fn chunks(len: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(len - i * chunk)))
}

/// How many chunks of `chunk` bytes a slot of `slot_bytes` has.
pub fn chunk_count(slot_bytes: u64, chunk: u64) -> u32 {
    slot_bytes.div_ceil(chunk.max(1)) as u32
}

/// Where the board of the ring at `socket` lives: `/dev/shm/gpipe-chunks-<hash of the
/// socket's absolute path>` (memory that the driver can register), or next to the socket
/// where there is no `/dev/shm`.
pub fn board_path(socket: &Path) -> PathBuf {
    let abs = socket
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .and_then(|p| p.canonicalize().ok())
        .map(|p| p.join(socket.file_name().unwrap_or_default()))
        .unwrap_or_else(|| socket.to_path_buf());
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        // FNV-1a over the path's bytes: a name of fixed length, the same in every process.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in abs.as_os_str().as_encoded_bytes() {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        shm.join(format!("gpipe-chunks-{h:016x}"))
    } else {
        let mut p = abs.into_os_string();
        p.push(".chunks");
        PathBuf::from(p)
    }
}

/// A ring's progress board, made by its writer (the forwarder producing the ring) or opened
/// by a reader (a forwarder consuming it).
pub struct Board {
    map: MmapRaw,
    path: PathBuf,
    owner: bool,
    slots: u32,
    slot_bytes: u64,
    chunk_bytes: u64,
}

impl Board {
    fn bytes(slots: u32) -> usize {
        ((HEADER_WORDS + slots as usize) * 8).div_ceil(4096) * 4096
    }

    /// Makes the board of the ring at `socket` (replacing a stale one), every slot at 0.
    pub fn create(
        socket: &Path,
        slots: u32,
        slot_bytes: u64,
        chunk_bytes: u64,
    ) -> io::Result<Board> {
        if chunk_bytes == 0
            || u64::from(chunk_count(slot_bytes, chunk_bytes)) >= 1 << CHUNK_BITS
            || slot_bytes.div_ceil(chunk_bytes.max(1)) >= 1 << CHUNK_BITS
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "chunks of {chunk_bytes} bytes cut a slot of {slot_bytes} bytes into more \
                     than {} chunks: use chunks of at least {} bytes",
                    (1u64 << CHUNK_BITS) - 1,
                    slot_bytes.div_ceil((1 << CHUNK_BITS) - 1)
                ),
            ));
        }
        let path = board_path(socket);
        let _ = std::fs::remove_file(&path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        file.set_len(Self::bytes(slots) as u64)?;
        let map = MmapRaw::map_raw(&file)?;
        let board = Board {
            map,
            path,
            owner: true,
            slots,
            slot_bytes,
            chunk_bytes,
        };
        let h = board.header();
        h[1].store(u64::from(slots), Ordering::Relaxed);
        h[2].store(slot_bytes, Ordering::Relaxed);
        h[3].store(chunk_bytes, Ordering::Relaxed);
        h[4].store(u64::from(std::process::id()), Ordering::Relaxed);
        // Written last: a reader trusts the header only once it sees the magic.
        h[0].store(MAGIC, Ordering::Release);
        Ok(board)
    }

    /// Opens the board of the ring at `socket`, if its writer made one for a ring of
    /// `slots` × `slot_bytes` and is alive (None otherwise: the reader then copies whole
    /// batches).
    pub fn open(socket: &Path, slots: u32, slot_bytes: u64) -> Option<Board> {
        let path = board_path(socket);
        let file: File = OpenOptions::new().read(true).write(true).open(&path).ok()?;
        let meta = file.metadata().ok()?;
        // Only a board of our own user, which no one else can write: a forged board could
        // start our copies before the bytes landed.
        if meta.uid() != rustix::process::geteuid().as_raw()
            || meta.mode() & 0o077 != 0
            || meta.len() < Self::bytes(slots) as u64
        {
            return None;
        }
        let map = MmapRaw::map_raw(&file).ok()?;
        let mut board = Board {
            map,
            path,
            owner: false,
            slots,
            slot_bytes,
            chunk_bytes: 0,
        };
        let h = board.header();
        let ok = h[0].load(Ordering::Acquire) == MAGIC
            && h[1].load(Ordering::Relaxed) == u64::from(slots)
            && h[2].load(Ordering::Relaxed) == slot_bytes
            && Path::new(&format!("/proc/{}", h[4].load(Ordering::Relaxed))).exists();
        let chunk = h[3].load(Ordering::Relaxed);
        if !ok || chunk == 0 || chunk_count(slot_bytes, chunk) as u64 > (1 << CHUNK_BITS) - 1 {
            return None;
        }
        board.chunk_bytes = chunk;
        Some(board)
    }

    fn header(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is at least HEADER_WORDS + slots words long (checked or made
        // so), page-aligned, and lives as long as `self`; other processes touch it only
        // through atomic 8-byte accesses.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<AtomicU64>(), HEADER_WORDS) }
    }

    fn word(&self, slot: u32) -> &AtomicU64 {
        assert!(
            slot < self.slots,
            "slot {slot} of a board of {} slots",
            self.slots
        );
        // SAFETY: as in `header`; slot < slots keeps the word inside the mapping.
        unsafe {
            &*self
                .map
                .as_ptr()
                .cast::<AtomicU64>()
                .add(HEADER_WORDS + slot as usize)
        }
    }

    /// The chunk size the writer uses.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// How many chunks a slot has.
    pub fn chunk_count(&self) -> u32 {
        chunk_count(self.slot_bytes, self.chunk_bytes)
    }

    /// The progress value of `slot` now (host backend, and a CUDA reader's host).
    pub fn load(&self, slot: u32) -> u64 {
        self.word(slot).load(Ordering::Acquire)
    }

    /// Stores a progress value (host backend writer): after the chunk's bytes, which it
    /// releases to the reader's acquiring load.
    pub fn store(&self, slot: u32, value: u64) {
        self.word(slot).store(value, Ordering::Release);
    }

    /// Frees every wait on the board (a reader whose writer died, so that its own copy
    /// stream drains; the copies that pass then are never published).
    pub fn release_all(&self) {
        for k in 0..self.slots {
            self.word(k).store(RELEASED, Ordering::Release);
        }
    }

    /// The board's first byte and its length (for `cuMemHostRegister`), and the offset of
    /// `slot`'s word in it.
    pub fn raw(&self) -> (*mut u8, usize) {
        (self.map.as_mut_ptr(), self.map.len())
    }

    /// The byte offset of `slot`'s word from the board's first byte.
    pub fn offset(&self, slot: u32) -> u64 {
        assert!(slot < self.slots);
        ((HEADER_WORDS + slot as usize) * 8) as u64
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_board_is_found_by_its_rings_socket_and_checked_against_the_ring() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("ring-1.sock");
        let w = Board::create(&sock, 4, 64 << 20, 16 << 20).unwrap();
        let r = Board::open(&sock, 4, 64 << 20).expect("the board");
        assert_eq!((r.chunk_bytes(), r.chunk_count()), (16 << 20, 4));
        w.store(2, progress(6, 1));
        assert_eq!(r.load(2), progress(6, 1));
        // Another ring shape, or another socket: not this board.
        assert!(Board::open(&sock, 8, 64 << 20).is_none());
        assert!(Board::open(&dir.path().join("ring-2.sock"), 4, 64 << 20).is_none());
        // A board that others could write is not trusted.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(board_path(&sock), std::fs::Permissions::from_mode(0o622))
            .unwrap();
        assert!(Board::open(&sock, 4, 64 << 20).is_none());
        std::fs::set_permissions(board_path(&sock), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        assert!(Board::open(&sock, 4, 64 << 20).is_some());
        drop(w);
        assert!(
            Board::open(&sock, 4, 64 << 20).is_none(),
            "removed with its writer"
        );
    }

    #[test]
    fn a_board_refuses_more_chunks_than_a_progress_value_counts() {
        let dir = tempfile::tempdir().unwrap();
        let e = Board::create(&dir.path().join("r.sock"), 4, 1 << 30, 1024)
            .err()
            .expect("2^20 chunks refused");
        assert!(e.to_string().contains("at least 16385 bytes"), "{e}");
        assert!(Board::create(&dir.path().join("r.sock"), 4, 1 << 30, 16385).is_ok());
    }

    #[test]
    fn chunks_cover_a_batch_once_in_order() {
        let v: Vec<_> = chunks(10, 4).collect();
        assert_eq!(v, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(0, 4).count(), 0);
        assert_eq!(chunk_count(10, 4), 3);
    }

    proptest! {
        /// In one slot, batches come `slots` apart: every progress value of a later batch is
        /// above every value of an earlier one, a partly copied batch stays below its whole
        /// value, and RELEASED is above all of them.
        #[test]
        fn progress_only_grows_in_a_slot_and_a_partial_batch_is_never_whole(
            seq in 0u64..(1 << 40),
            slots in 1u64..64,
            n in 1u32..1000,
            c in 0u32..1000,
        ) {
            let c = c % n;
            prop_assert!(progress(seq, c) < progress(seq, n));
            prop_assert!(progress(seq, c) < progress(seq, c + 1));
            prop_assert!(progress(seq, n) < progress(seq + slots, 0));
            prop_assert!(progress(seq + slots, n) < RELEASED);
        }
    }
}
