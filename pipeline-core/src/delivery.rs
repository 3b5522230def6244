//! How a consumer receives a batch: in place (it reads the producer's slot) or mirrored (a
//! copy into memory of its own is made first, and the producer's slot is released as soon as
//! the copy is done).
//!
//! Mirroring trades one copy for two things: the producer's slot frees early, so a consumer
//! that holds batches for a long time (or reads them several times) no longer holds back the
//! ring, and a consumer on another GPU reads its batch from its own memory instead of over the
//! link each time. [`MirrorTable`] is the bookkeeping every mirroring backend shares: which of
//! the consumer's own buffers holds which batch.

use parking_lot::Mutex;

/// A consumer's choice of delivery (an option of the consumer's backend).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    /// Read the producer's slot where it is (zero copy).
    InPlace,
    /// Copy each batch into a buffer of the consumer's own, then release the producer's slot.
    Mirror,
    /// The backend decides (the CUDA backend: in place on the producer's GPU, mirrored on
    /// another; the host backend: in place).
    #[default]
    Auto,
}

impl Delivery {
    /// The name used on command lines and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Delivery::InPlace => "in-place",
            Delivery::Mirror => "mirror",
            Delivery::Auto => "auto",
        }
    }
}

impl std::fmt::Display for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Delivery {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "in-place" | "inplace" | "in_place" => Ok(Delivery::InPlace),
            "mirror" => Ok(Delivery::Mirror),
            "auto" => Ok(Delivery::Auto),
            other => Err(format!(
                "unknown delivery {other:?}: expected in-place, mirror or auto"
            )),
        }
    }
}

/// Where a consumer uses its batches, as its backend resolved it at attach. The ring records
/// it in the consumer's record of the control segment, for `gpipe inspect`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// The GPU ordinal the consumer uses (as that process numbers its devices); `None` for a
    /// host consumer.
    pub device: Option<u32>,
    /// True when batches are mirrored into the consumer's own memory.
    pub mirror: bool,
}

impl Placement {
    /// The record's encoding: bit 0 set once written, bit 1 mirror, bits 8.. device + 1.
    pub fn encode(self) -> u32 {
        let device = self
            .device
            .map_or(0, |d| d.saturating_add(1).min(0x00ff_ffff));
        1 | (u32::from(self.mirror) << 1) | (device << 8)
    }

    /// The placement a record's word describes; `None` when the consumer did not write one
    /// (an older consumer, or a record not yet attached).
    pub fn decode(word: u32) -> Option<Placement> {
        if word & 1 == 0 {
            return None;
        }
        let device = word >> 8;
        Some(Placement {
            device: device.checked_sub(1),
            mirror: word & 2 != 0,
        })
    }

    /// "in-place" or "mirror".
    pub fn delivery_name(self) -> &'static str {
        if self.mirror { "mirror" } else { "in-place" }
    }
}

/// Which of a mirroring consumer's own buffers holds which batch. A batch takes a free buffer
/// when it is copied and gives it back when the user releases it; the copy into a buffer is
/// ordered after the release of the batch that held it before (the backend's job).
#[derive(Debug)]
pub struct MirrorTable {
    /// Per buffer: the sequence number of the batch in it, if held.
    held: Mutex<Vec<Option<u64>>>,
}

impl MirrorTable {
    /// A table of `buffers` buffers, all free.
    pub fn new(buffers: usize) -> Self {
        Self {
            held: Mutex::new(vec![None; buffers]),
        }
    }

    /// The number of buffers.
    pub fn len(&self) -> usize {
        self.held.lock().len()
    }

    /// True for a table of no buffers.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when every buffer holds a batch.
    pub fn is_full(&self) -> bool {
        self.held.lock().iter().all(Option::is_some)
    }

    /// Buffers holding a batch.
    pub fn in_use(&self) -> usize {
        self.held.lock().iter().filter(|h| h.is_some()).count()
    }

    /// Takes a free buffer for batch `seq`. Prefers the buffer after the one used last, so
    /// that buffers are reused in turn (the oldest release is the likeliest to be complete).
    pub fn take(&self, seq: u64, hint: usize) -> Option<usize> {
        let mut held = self.held.lock();
        let n = held.len();
        if held.contains(&Some(seq)) {
            return None;
        }
        let k = (0..n)
            .map(|i| (hint + i) % n)
            .find(|&k| held[k].is_none())?;
        held[k] = Some(seq);
        Some(k)
    }

    /// The buffer holding batch `seq`.
    pub fn find(&self, seq: u64) -> Option<usize> {
        self.held.lock().iter().position(|h| *h == Some(seq))
    }

    /// Gives back the buffer holding batch `seq`; returns it, or `None` if no buffer held it.
    pub fn give_back(&self, seq: u64) -> Option<usize> {
        let mut held = self.held.lock();
        let k = held.iter().position(|h| *h == Some(seq))?;
        held[k] = None;
        Some(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_names_round_trip() {
        for d in [Delivery::InPlace, Delivery::Mirror, Delivery::Auto] {
            assert_eq!(d.as_str().parse::<Delivery>(), Ok(d));
        }
        let e = "copy".parse::<Delivery>().unwrap_err();
        assert!(e.contains("in-place, mirror or auto"), "{e}");
    }

    #[test]
    fn placements_survive_the_record_word() {
        assert_eq!(Placement::decode(0), None);
        for p in [
            Placement::default(),
            Placement {
                device: Some(0),
                mirror: false,
            },
            Placement {
                device: Some(7),
                mirror: true,
            },
        ] {
            assert_eq!(Placement::decode(p.encode()), Some(p));
        }
    }

    #[test]
    fn buffers_are_taken_in_turn_and_refused_when_all_are_held() {
        let t = MirrorTable::new(3);
        assert_eq!(t.take(10, 0), Some(0));
        assert_eq!(t.take(11, 1), Some(1));
        // A batch already mirrored cannot take a second buffer.
        assert_eq!(t.take(11, 2), None);
        assert_eq!(t.take(12, 2), Some(2));
        assert!(t.is_full());
        assert_eq!(t.take(13, 0), None);
        assert_eq!(t.give_back(11), Some(1));
        assert_eq!(t.give_back(11), None);
        assert_eq!(t.find(12), Some(2));
        // The hint is a preference, not a requirement.
        assert_eq!(t.take(13, 0), Some(1));
        assert_eq!(t.in_use(), 3);
    }
}
