//! The test pattern `gpipe bench` writes and verifies: a function of the batch's sequence
//! number and each 8-byte word's index, so stale, torn or misplaced data changes the checksum.
//! The CUDA kernels in pipeline-cuda compute exactly the same words and checksum.

/// User header word holding the checksum of a pattern batch (as `gpipe produce` publishes it
/// and `gpipe consume --verify` checks it).
pub const HEADER_CHECKSUM: usize = 0;
/// User header word holding a pattern batch's sequence number.
pub const HEADER_SEQ: usize = 1;

/// Word `i` of batch `seq` (stored little-endian).
#[inline(always)]
pub fn pattern_word(seq: u64, i: u64) -> u64 {
    seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ 0x5851_F42D_4C95_7F2D
}

/// One word's contribution to the checksum: position-dependent, so swapped words differ.
#[inline(always)]
pub fn checksum_term(w: u64, i: u64) -> u64 {
    (w ^ (w >> 29)).rotate_left((i & 63) as u32)
}

/// Fills `data` (its length a multiple of 8) with batch `seq`'s pattern; returns its checksum.
pub fn fill(data: &mut [u8], seq: u64) -> u64 {
    let mut sum = 0u64;
    for (i, chunk) in data.chunks_exact_mut(8).enumerate() {
        let w = pattern_word(seq, i as u64);
        chunk.copy_from_slice(&w.to_le_bytes());
        sum = sum.wrapping_add(checksum_term(w, i as u64));
    }
    sum
}

/// The checksum of `data` (trailing bytes past a multiple of 8 are ignored).
pub fn checksum(data: &[u8]) -> u64 {
    let mut sum = 0u64;
    for (i, chunk) in data.chunks_exact(8).enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        sum = sum.wrapping_add(checksum_term(u64::from_le_bytes(b), i as u64));
    }
    sum
}

/// The checksum batch `seq` of `len` bytes must have, computed without touching memory.
pub fn expected_checksum(seq: u64, len: u64) -> u64 {
    (0..len / 8).fold(0u64, |s, i| {
        s.wrapping_add(checksum_term(pattern_word(seq, i), i))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_and_checksum_agree() {
        let mut buf = vec![0u8; 4096];
        let c = fill(&mut buf, 7);
        assert_eq!(c, checksum(&buf));
        assert_eq!(c, expected_checksum(7, 4096));
        assert_ne!(c, expected_checksum(8, 4096));
    }

    #[test]
    fn detects_stale_torn_and_swapped_words() {
        let mut buf = vec![0u8; 4096];
        let c = fill(&mut buf, 100);
        let mut torn = buf.clone();
        fill(&mut torn[..2048], 100 - 8);
        assert_ne!(checksum(&torn), c);
        let mut swapped = buf.clone();
        swapped[0..8].copy_from_slice(&buf[80..88]);
        swapped[80..88].copy_from_slice(&buf[0..8]);
        assert_ne!(checksum(&swapped), c);
    }
}
