//! The consumers' sequence logs (every sequence number each one received, in a file the
//! bench reads after the run), and the exact count of batches lost or duplicated by them.

use std::path::Path;

use pipeline_core::Mode;

/// Reads a sequence log written by [`write_seq_log`] (missing file: empty).
pub fn read_seq_log(path: &Path) -> Vec<u64> {
    std::fs::read(path)
        .map(|b| {
            b.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        })
        .unwrap_or_default()
}

/// Writes a sequence log (u64 little-endian each).
pub fn write_seq_log(path: &Path, seqs: &[u64]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(seqs.len() * 8);
    for s in seqs {
        b.extend_from_slice(&s.to_le_bytes());
    }
    std::fs::write(path, b)
}

/// Batches lost and duplicated over a run.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Tally {
    /// Batches never delivered where they should have been.
    pub lost: u64,
    /// Batches delivered twice to one consumer (broadcast) or to more than one (shared).
    pub duplicated: u64,
}

/// Counts, from each consumer's log of the `published` batches, the batches lost and
/// duplicated: in broadcast per consumer (each must get every batch once), in shared over
/// all of them (each batch must reach exactly one). Each finding is added to `problems`.
pub(super) fn tally(
    mode: Mode,
    logs: &[Vec<u64>],
    published: u64,
    problems: &mut Vec<String>,
) -> Tally {
    let count = |logs: &[&Vec<u64>]| {
        let mut seen = vec![0u32; published as usize];
        for log in logs {
            for &s in log.iter() {
                if (s as usize) < seen.len() {
                    seen[s as usize] += 1;
                }
            }
        }
        Tally {
            lost: seen.iter().filter(|&&c| c == 0).count() as u64,
            duplicated: seen.iter().filter(|&&c| c > 1).count() as u64,
        }
    };
    let mut total = Tally::default();
    match mode {
        Mode::Broadcast => {
            for (i, log) in logs.iter().enumerate() {
                let t = count(&[log]);
                if t.lost > 0 {
                    problems.push(format!("consumer {i} missed {} batches", t.lost));
                }
                if t.duplicated > 0 {
                    problems.push(format!("consumer {i} got {} batches twice", t.duplicated));
                }
                total.lost += t.lost;
                total.duplicated += t.duplicated;
            }
        }
        Mode::Shared => {
            total = count(&logs.iter().collect::<Vec<_>>());
            if total.lost > 0 {
                problems.push(format!("{} batches reached no consumer", total.lost));
            }
            if total.duplicated > 0 {
                problems.push(format!(
                    "{} batches reached more than one consumer",
                    total.duplicated
                ));
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::{Tally, read_seq_log, tally, write_seq_log};
    use pipeline_core::Mode;

    #[test]
    fn a_log_reads_back_as_written_and_a_missing_one_as_empty() {
        let path = std::env::temp_dir().join(format!("gpipe-seq-{}.log", std::process::id()));
        write_seq_log(&path, &[0, 1, 7, u64::MAX]).unwrap();
        assert_eq!(read_seq_log(&path), [0, 1, 7, u64::MAX]);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(read_seq_log(&path), Vec::<u64>::new());
    }

    #[test]
    fn broadcast_counts_each_consumers_losses_and_repeats() {
        let mut problems = Vec::new();
        // Consumer 0 got all 4; consumer 1 missed 2 and got 3 twice.
        let t = tally(
            Mode::Broadcast,
            &[vec![0, 1, 2, 3], vec![0, 1, 3, 3]],
            4,
            &mut problems,
        );
        assert_eq!(
            t,
            Tally {
                lost: 1,
                duplicated: 1
            }
        );
        assert_eq!(
            problems,
            [
                "consumer 1 missed 1 batches",
                "consumer 1 got 1 batches twice"
            ]
        );
    }

    #[test]
    fn shared_wants_each_batch_at_exactly_one_consumer() {
        let mut problems = Vec::new();
        let t = tally(Mode::Shared, &[vec![0, 2], vec![1, 3]], 4, &mut problems);
        assert_eq!((t, problems.len()), (Tally::default(), 0));
        let t = tally(Mode::Shared, &[vec![0, 2], vec![2]], 4, &mut problems);
        assert_eq!(
            t,
            Tally {
                lost: 2,
                duplicated: 1
            }
        );
        assert_eq!(
            problems,
            [
                "2 batches reached no consumer",
                "1 batches reached more than one consumer"
            ]
        );
    }
}
