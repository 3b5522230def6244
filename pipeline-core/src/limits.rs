//! The one rule for a ring's shape: how many slots, how large a batch, how many consumers, and
//! whether the ring fits in the memory it will live in.
//!
//! [`crate::Producer::bind`] checks every ring through here, and so do the front-ends before
//! they start anything (the `gpipe` CLI, the Python package), so that the same input gets the
//! same answer everywhere; a peer's [`crate::RingLayout`] is checked against the same limits.
//! Errors name the setting ([`Setting`]) and say what is wrong in words and units; a front-end
//! spells the setting its own way (`--batch-bytes`, `batch_bytes=`) and keeps the words.
//!
//! The limits:
//!
//! | setting | range | why |
//! | --- | --- | --- |
//! | slots | 1 to [`MAX_SLOTS`] | a ring needs a slot; the control segment grows with each |
//! | batch bytes | 1 byte to [`MAX_SLOT_BYTES`] | a slot is the largest batch rounded up to [`SLOT_ALIGN`] |
//! | max consumers | 1 to [`MAX_CONSUMERS`] | one bit per consumer in a 64-bit word, one reserved |
//!
//! And the memory: the ring, slots × slot capacity, must fit in the memory it lives in
//! ([`check_fits`]): the host memory available now ([`crate::sys::available_memory`]) for the
//! host backend, the GPU's free memory for the CUDA backend. There is no overcommit: every slot
//! counts in full, because the ring writes every slot once it has gone round once, and a
//! written slot stays resident until the ring closes (host slots are shared memory, which only
//! swap can evict; CUDA slots are allocated in full when the ring is made).

use std::fmt;

/// Largest ring gpipe accepts.
pub const MAX_SLOTS: u32 = 4096;
/// Most consumers one ring can have (one bit each in a 64-bit word, bit 63 reserved).
pub const MAX_CONSUMERS: u32 = 63;
/// Slot capacities are rounded up to this (2 MiB), so an export never exposes unrelated memory.
pub const SLOT_ALIGN: u64 = 2 << 20;
/// Largest slot capacity accepted (64 GiB), and so the largest batch.
pub const MAX_SLOT_BYTES: u64 = 64 << 30;

/// A setting of a ring's shape that a limit applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// The number of slots.
    Slots,
    /// The largest batch in bytes (the slot capacity, before rounding up to 2 MiB).
    BatchBytes,
    /// The most consumers at once.
    MaxConsumers,
}

impl Setting {
    /// Its name as a field of [`crate::ProducerConfig`] and a Python keyword argument.
    pub fn name(self) -> &'static str {
        match self {
            Setting::Slots => "slots",
            Setting::BatchBytes => "batch_bytes",
            Setting::MaxConsumers => "max_consumers",
        }
    }
}

/// A setting out of range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeError {
    /// No slots.
    NoSlots,
    /// More slots than [`MAX_SLOTS`].
    TooManySlots(u32),
    /// A batch of 0 bytes.
    EmptyBatch,
    /// A batch larger than [`MAX_SLOT_BYTES`].
    BatchTooLarge(u64),
    /// A slot capacity that is not a multiple of [`SLOT_ALIGN`] (only a peer's layout can
    /// have one: a producer rounds its batch size up).
    UnalignedSlot(u64),
    /// Room for no consumer.
    NoConsumers,
    /// More consumers than [`MAX_CONSUMERS`].
    TooManyConsumers(u32),
}

impl ShapeError {
    /// The setting that is out of range.
    pub fn setting(&self) -> Setting {
        match self {
            ShapeError::NoSlots | ShapeError::TooManySlots(_) => Setting::Slots,
            ShapeError::EmptyBatch
            | ShapeError::BatchTooLarge(_)
            | ShapeError::UnalignedSlot(_) => Setting::BatchBytes,
            ShapeError::NoConsumers | ShapeError::TooManyConsumers(_) => Setting::MaxConsumers,
        }
    }

    /// What is wrong and what to give instead, without the setting's name (a front-end puts
    /// its own spelling of it in front).
    pub fn problem(&self) -> String {
        match self {
            ShapeError::NoSlots => {
                "a ring of 0 slots could hold no batch: give 1 slot or more (8 is usual)".into()
            }
            ShapeError::TooManySlots(n) => {
                format!("{n} slots are more than a ring can have: give at most {MAX_SLOTS} slots")
            }
            ShapeError::EmptyBatch => format!(
                "a batch size of 0 bytes leaves no room for data: give the size of the largest \
                 batch you will publish, from 1 byte to {} (each slot is that size rounded up to \
                 {})",
                human_bytes(MAX_SLOT_BYTES),
                human_bytes(SLOT_ALIGN)
            ),
            ShapeError::BatchTooLarge(b) => format!(
                "a batch of {} is larger than the largest slot a ring can have, {}: give at \
                 most {}",
                human_bytes(*b),
                human_bytes(MAX_SLOT_BYTES),
                human_bytes(MAX_SLOT_BYTES)
            ),
            ShapeError::UnalignedSlot(b) => format!(
                "a slot capacity of {} is not a whole number of {} granules",
                human_bytes(*b),
                human_bytes(SLOT_ALIGN)
            ),
            ShapeError::NoConsumers => {
                "a ring with room for 0 consumers could never be read: give 1 or more".into()
            }
            ShapeError::TooManyConsumers(n) => format!(
                "{n} consumers are more than a ring can hold: give at most {MAX_CONSUMERS} (one \
                 bit per consumer in a 64-bit word, one bit reserved)"
            ),
        }
    }
}

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.setting().name(), self.problem())
    }
}

impl std::error::Error for ShapeError {}

/// Checks a number of slots: 1 to [`MAX_SLOTS`].
pub fn check_slots(slots: u32) -> Result<(), ShapeError> {
    match slots {
        0 => Err(ShapeError::NoSlots),
        n if n > MAX_SLOTS => Err(ShapeError::TooManySlots(n)),
        _ => Ok(()),
    }
}

/// Checks a batch size: 1 byte to [`MAX_SLOT_BYTES`].
pub fn check_batch_bytes(batch_bytes: u64) -> Result<(), ShapeError> {
    match batch_bytes {
        0 => Err(ShapeError::EmptyBatch),
        b if b > MAX_SLOT_BYTES => Err(ShapeError::BatchTooLarge(b)),
        _ => Ok(()),
    }
}

/// Checks a consumer capacity: 1 to [`MAX_CONSUMERS`].
pub fn check_max_consumers(max_consumers: u32) -> Result<(), ShapeError> {
    match max_consumers {
        0 => Err(ShapeError::NoConsumers),
        n if n > MAX_CONSUMERS => Err(ShapeError::TooManyConsumers(n)),
        _ => Ok(()),
    }
}

/// Checks every setting of a ring's shape (the first one out of range is reported).
pub fn check_shape(slots: u32, batch_bytes: u64, max_consumers: u32) -> Result<(), ShapeError> {
    check_slots(slots)?;
    check_batch_bytes(batch_bytes)?;
    check_max_consumers(max_consumers)
}

/// Checks a slot capacity as a ring's layout carries it: a batch size within the limits, and a
/// whole number of [`SLOT_ALIGN`] granules.
pub fn check_slot_bytes(slot_bytes: u64) -> Result<(), ShapeError> {
    check_batch_bytes(slot_bytes)?;
    if slot_bytes % SLOT_ALIGN != 0 {
        return Err(ShapeError::UnalignedSlot(slot_bytes));
    }
    Ok(())
}

/// Rounds a batch size up to the slot granularity (2 MiB); at least one granule.
pub fn round_slot_bytes(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(SLOT_ALIGN).saturating_mul(SLOT_ALIGN)
}

/// Where a ring's slots live, for [`check_fits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory (the host backend's shared memory).
    Host,
    /// The memory of the CUDA device with this ordinal.
    Gpu(usize),
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Memory::Host => f.write_str("available host memory"),
            Memory::Gpu(d) => write!(f, "free memory on GPU {d}"),
        }
    }
}

/// A ring larger than the memory it would live in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DoesNotFit {
    /// Slots in the ring.
    pub slots: u32,
    /// Capacity of each slot in bytes.
    pub slot_bytes: u64,
    /// Bytes of that memory available.
    pub available: u64,
    /// Which memory.
    pub memory: Memory,
}

impl DoesNotFit {
    /// The ring's size, slots × slot capacity.
    pub fn ring_bytes(&self) -> u64 {
        ring_bytes(self.slots, self.slot_bytes)
    }

    /// What is wrong, with the numbers, without what to do (a front-end says that with its
    /// own names of the settings).
    pub fn problem(&self) -> String {
        format!(
            "a ring of {} slots × {} = {} does not fit in {} of {}",
            self.slots,
            human_bytes(self.slot_bytes),
            human_bytes(self.ring_bytes()),
            human_bytes(self.available),
            self.memory
        )
    }
}

impl fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: use fewer slots or a smaller batch size",
            self.problem()
        )
    }
}

impl std::error::Error for DoesNotFit {}

/// Slots × slot capacity (saturating: a ring that large fits nowhere).
pub fn ring_bytes(slots: u32, slot_bytes: u64) -> u64 {
    u64::from(slots).saturating_mul(slot_bytes)
}

/// Checks that a ring of `slots` × `slot_bytes` fits in `available` bytes of `memory`; `None`
/// (the amount could not be read) passes.
pub fn check_fits(
    slots: u32,
    slot_bytes: u64,
    available: Option<u64>,
    memory: Memory,
) -> Result<(), DoesNotFit> {
    match available {
        Some(available) if ring_bytes(slots, slot_bytes) > available => Err(DoesNotFit {
            slots,
            slot_bytes,
            available,
            memory,
        }),
        _ => Ok(()),
    }
}

/// A byte count for people: `64 GiB`, `21.3 GiB`, `1.5 MiB`, `512 bytes`. Whole multiples of a
/// binary unit are written whole; others with one decimal, or in bytes where one decimal
/// would hide the difference (`64 GiB` and one byte).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    for (shift, unit) in UNITS {
        let one = 1u64 << shift;
        if b < one {
            continue;
        }
        if b % one == 0 {
            return format!("{} {unit}", b >> shift);
        }
        let tenths = (u128::from(b) * 10 + u128::from(one) / 2) / u128::from(one);
        if tenths % 10 != 0 {
            return format!("{}.{} {unit}", tenths / 10, tenths % 10);
        }
        // Close to a whole number of units: two decimals where they tell it apart, else
        // the exact count (a size just past a limit must not read as the limit).
        let hundredths = (u128::from(b) * 100 + u128::from(one) / 2) / u128::from(one);
        if hundredths % 100 != 0 {
            return format!("{}.{:02} {unit}", hundredths / 100, hundredths % 100);
        }
        break;
    }
    if b == 1 {
        "1 byte".into()
    } else {
        format!("{b} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_of_zero_bytes_is_refused() {
        let e = check_shape(8, 0, 16).unwrap_err();
        assert_eq!(e.setting(), Setting::BatchBytes);
        assert!(e.to_string().starts_with("batch_bytes: "), "{e}");
        assert!(e.problem().contains("0 bytes"), "{e}");
        assert_eq!(check_batch_bytes(1), Ok(()));
    }

    #[test]
    fn each_limit_names_its_setting_and_its_bound_in_units() {
        let too_big = check_batch_bytes(MAX_SLOT_BYTES + SLOT_ALIGN).unwrap_err();
        assert_eq!(too_big.setting(), Setting::BatchBytes);
        assert!(
            too_big.problem().contains(&human_bytes(MAX_SLOT_BYTES)),
            "{too_big}"
        );
        assert!(!too_big.problem().contains("multiple"), "{too_big}");
        assert_eq!(check_batch_bytes(MAX_SLOT_BYTES), Ok(()));

        let slots = check_slots(MAX_SLOTS + 1).unwrap_err();
        assert_eq!(slots.setting(), Setting::Slots);
        assert!(
            slots.problem().contains(&format!("at most {MAX_SLOTS}")),
            "{slots}"
        );
        assert!(!slots.problem().contains("..="), "{slots}");
        assert_eq!(check_slots(0), Err(ShapeError::NoSlots));
        assert_eq!(check_slots(MAX_SLOTS), Ok(()));

        let consumers = check_max_consumers(MAX_CONSUMERS + 1).unwrap_err();
        assert_eq!(consumers.setting(), Setting::MaxConsumers);
        assert!(
            consumers
                .problem()
                .contains(&format!("at most {MAX_CONSUMERS}")),
            "{consumers}"
        );
        assert_eq!(check_max_consumers(0), Err(ShapeError::NoConsumers));
        assert_eq!(check_max_consumers(MAX_CONSUMERS), Ok(()));
    }

    #[test]
    fn a_peers_slot_must_be_whole_granules() {
        assert_eq!(check_slot_bytes(SLOT_ALIGN), Ok(()));
        assert_eq!(
            check_slot_bytes(SLOT_ALIGN + 8),
            Err(ShapeError::UnalignedSlot(SLOT_ALIGN + 8))
        );
        assert_eq!(check_slot_bytes(0), Err(ShapeError::EmptyBatch));
    }

    #[test]
    fn a_ring_larger_than_its_memory_is_refused_with_the_numbers() {
        let slot = 3 << 30;
        let available = 8 * slot - 1;
        let e = check_fits(8, slot, Some(available), Memory::Host).unwrap_err();
        assert_eq!(e.ring_bytes(), 8 * slot);
        let text = e.to_string();
        for part in [
            "8 slots".to_string(),
            human_bytes(slot),
            human_bytes(8 * slot),
            human_bytes(available),
            "available host memory".to_string(),
        ] {
            assert!(text.contains(&part), "{part:?} missing from {text:?}");
        }
        assert_eq!(check_fits(8, slot, Some(8 * slot), Memory::Host), Ok(()));
        assert_eq!(check_fits(8, slot, None, Memory::Host), Ok(()));
        let gpu = check_fits(2, SLOT_ALIGN, Some(SLOT_ALIGN), Memory::Gpu(1));
        assert!(
            gpu.unwrap_err()
                .to_string()
                .contains("free memory on GPU 1")
        );
    }

    #[test]
    fn human_bytes_reads_like_a_person_wrote_it() {
        assert_eq!(human_bytes(64 << 30), "64 GiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(2 << 20), "2 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(100), "100 bytes");
        assert_eq!(human_bytes(1), "1 byte");
        // Available memory is rarely a round figure: never a bare count of bytes for it.
        assert_eq!(human_bytes(24_724_041_728), "23.03 GiB");
        assert_eq!(human_bytes(0), "0 bytes");
        // One byte past 64 GiB must not read as "64 GiB" or "64.0 GiB".
        assert_eq!(
            human_bytes((64 << 30) + 1),
            format!("{} bytes", (64u64 << 30) + 1)
        );
        assert_eq!(human_bytes(4096 * (64 << 30)), "256 TiB");
        assert!(human_bytes(22_857_000_000).ends_with(" GiB"));
    }
}
