//! `max_lead = "auto"`: how far the producer may run ahead of the slowest consumer.

use super::{Choice, LeadRequest, bytes_text};

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

/// `max_lead` for a ring of `slots` slots of batches of `batch_bytes`: as given, or `auto`
/// from the L2 size of the ring's GPU (`l2_bytes`; `None` for a host ring, or a GPU that does
/// not report it, `Err` then).
pub(super) fn resolve(
    request: LeadRequest,
    cuda: bool,
    l2_bytes: Option<u64>,
    batch_bytes: u64,
    slots: u32,
) -> Result<Choice<Option<u32>>, String> {
    match request {
        LeadRequest::Ring => Ok(Choice::given(None)),
        LeadRequest::Batches(n) => Ok(Choice::given(Some(n))),
        LeadRequest::Auto if !cuda => {
            Ok(Choice::auto(None, "the host backend: the ring's own bound"))
        }
        LeadRequest::Auto => {
            let l2 = l2_bytes.ok_or(
                "the GPU does not report its L2 cache size; give a number of batches instead",
            )?;
            let slot = pipeline_core::round_slot_bytes(batch_bytes);
            Ok(Choice::auto(
                l2_max_lead(l2, slot, slots),
                format!(
                    "{} MiB L2, {} per batch, {slots} slots",
                    l2 >> 20,
                    bytes_text(batch_bytes)
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn auto_lead_without_an_l2_size_says_what_to_do() {
        let e = resolve(LeadRequest::Auto, true, None, 8 << 20, 8).unwrap_err();
        assert!(e.contains("L2") && e.contains("number of batches"), "{e}");
        let host = resolve(LeadRequest::Auto, false, None, 8 << 20, 8).unwrap();
        assert_eq!(host.value, None);
        let c = resolve(LeadRequest::Auto, true, Some(50 << 20), 8 << 20, 8).unwrap();
        assert_eq!(c.value, l2_max_lead(50 << 20, 8 << 20, 8));
        assert_eq!(c.reason, "50 MiB L2, 8 MiB per batch, 8 slots");
    }
}
