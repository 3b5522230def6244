//! `slots = "auto"`: how deep a ring is when nothing was measured.

use super::{Choice, bytes_text};

/// The ring depths `slots = "auto"` considers without MPS (with MPS it is 8).
pub const AUTO_DEPTHS: [u32; 4] = [8, 16, 32, 64];

/// The depth of a ring with MPS running, on the host backend, or when no depth of
/// [`AUTO_DEPTHS`] fits the budget (the ring's usual depth).
pub const USUAL_DEPTH: u32 = 8;

/// The most slot memory `slots = "auto"` takes by default (2 GiB): on an H100 without MPS a
/// 4 GiB ring (64 x 64 MiB) moved less than a 2 GiB one (32 x 64 MiB).
pub const DEFAULT_DEPTH_BUDGET: u64 = 2 << 30;

/// The depths of [`AUTO_DEPTHS`] whose slots (of `batch_bytes`, rounded as the ring rounds
/// them) fit `budget` bytes; 8 alone when none does. `gpipe bench` measures each of them.
pub fn depths_within(batch_bytes: u64, budget: u64) -> Vec<u32> {
    let slot = pipeline_core::round_slot_bytes(batch_bytes);
    let fit: Vec<u32> = AUTO_DEPTHS
        .iter()
        .copied()
        .filter(|&d| u64::from(d) * slot <= budget)
        .collect();
    if fit.is_empty() {
        vec![USUAL_DEPTH]
    } else {
        fit
    }
}

/// The depth `slots = "auto"` takes without a measurement: 8 with MPS running (handovers
/// are cheap); without it, where the GPU time-slices between the processes and a deeper ring
/// lets each do more per slice, the deepest of [`depths_within`] the budget. Measured on an
/// H100 (docs/benchmarks.md): without MPS a 2 MiB ring moved 2.4x more at 64 slots than at 8,
/// and a 64 MiB one 1.4x more at 32, but less at 64 (4 GiB), hence a budget.
pub fn rule_depth(mps: bool, batch_bytes: u64, budget: u64) -> u32 {
    if mps {
        return USUAL_DEPTH;
    }
    depths_within(batch_bytes, budget)
        .last()
        .copied()
        .unwrap_or(USUAL_DEPTH)
}

/// `slots`: the count given (`Some`), or `auto` resolved for a ring on a GPU (`cuda`) with or
/// without MPS running.
pub(super) fn resolve(
    slots: Option<u32>,
    cuda: bool,
    mps: bool,
    batch_bytes: u64,
    budget: u64,
) -> Choice<u32> {
    match slots {
        Some(n) => Choice::given(n),
        None if !cuda => Choice::auto(USUAL_DEPTH, "the host backend"),
        None if mps => Choice::auto(USUAL_DEPTH, "MPS is running"),
        None => Choice::auto(
            rule_depth(false, batch_bytes, budget),
            format!(
                "MPS is not running: the deepest ring within the {} budget",
                bytes_text(budget)
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_depth_is_eight_with_mps_else_the_deepest_within_the_budget() {
        let mib = 1u64 << 20;
        assert_eq!(rule_depth(true, 2 * mib, 2 << 30), 8);
        assert_eq!(rule_depth(false, 2 * mib, 2 << 30), 64);
        assert_eq!(rule_depth(false, 64 * mib, 2 << 30), 32);
        assert_eq!(rule_depth(false, 256 * mib, 2 << 30), 8);
        // Nothing fits the budget: the ring's usual 8.
        assert_eq!(rule_depth(false, 1 << 30, 1 << 30), 8);
    }

    #[test]
    fn auto_depths_stay_within_the_budget() {
        // 2 MiB slots: 64 x 2 MiB = 128 MiB fits 2 GiB.
        assert_eq!(depths_within(2 << 20, 2 << 30), vec![8, 16, 32, 64]);
        // 64 MiB slots within 2 GiB: 32 x 64 MiB = 2 GiB fits, 64 x does not.
        assert_eq!(depths_within(64 << 20, 2 << 30), vec![8, 16, 32]);
        // A batch of 3 MiB takes a 4 MiB slot.
        assert_eq!(depths_within(3 << 20, 64 << 20), vec![8, 16]);
        // Nothing fits: still 8 (the ring's usual depth).
        assert_eq!(depths_within(1 << 30, 1 << 30), vec![8]);
    }

    #[test]
    fn the_reason_names_the_backend_mps_or_the_budget() {
        assert_eq!(resolve(Some(4), true, false, 1, 1).reason, "given");
        assert_eq!(resolve(None, false, false, 1, 1).reason, "the host backend");
        assert_eq!(resolve(None, true, true, 1, 1).reason, "MPS is running");
        let c = resolve(None, true, false, 2 << 20, DEFAULT_DEPTH_BUDGET);
        assert!(
            c.auto && c.reason.contains("within the 2 GiB budget"),
            "{c:?}"
        );
    }
}
