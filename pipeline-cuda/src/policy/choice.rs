//! One resolved setting and the reason for it ([`Choice`]), and how reasons write sizes
//! ([`bytes_text`]): what every rule of the policy returns.

use serde::Serialize;

/// One resolved setting and why it has that value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Choice<T> {
    /// The value.
    pub value: T,
    /// It came from `auto` (or a front-end's default the rule applies to), not from the
    /// caller.
    pub auto: bool,
    /// Why, in words ("given" when the caller gave it).
    pub reason: String,
}

impl<T> Choice<T> {
    pub(super) fn given(value: T) -> Choice<T> {
        Choice {
            value,
            auto: false,
            reason: "given".into(),
        }
    }

    pub(super) fn auto(value: T, reason: impl Into<String>) -> Choice<T> {
        Choice {
            value,
            auto: true,
            reason: reason.into(),
        }
    }
}

/// Bytes in the largest binary unit that divides them whole: `2 GiB`, `3 MiB`, `4 KiB`,
/// `100 B` (how reasons and the command line write sizes).
pub fn bytes_text(b: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b >= 1 << shift && b % (1 << shift) == 0 {
            return format!("{} {unit}", b >> shift);
        }
    }
    format!("{b} B")
}
