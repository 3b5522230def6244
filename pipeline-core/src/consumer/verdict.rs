//! What a consumer concludes when its record, or the ring, is not as it should be: detached by
//! the producer (and why), or a segment that cannot be right.

use crate::error::{Error, ProtocolError};
use crate::layout::consumer_state;
use crate::ring;

/// Whether our record (its state and generation) still says that we are its active
/// consumer; if not, the detach that says why. Asked for every batch (on receive and on
/// release): the answer "ours" is two compares inline, and only a record that is no longer
/// ours pays for the call that words the error.
#[inline]
pub(super) fn record_verdict(state: u32, generation: u64, ours: u64) -> Result<(), Error> {
    if state == consumer_state::ACTIVE && generation == ours {
        Ok(())
    } else {
        Err(record_lost(state))
    }
}

/// The detach that a record no longer ours (see [`record_verdict`]) means: active, it was
/// given to another consumer (its generation is not ours); else it says why.
#[cold]
#[inline(never)]
pub(super) fn record_lost(state: u32) -> Error {
    match state {
        consumer_state::ACTIVE => Error::Detached(
            "our consumer index was given to a consumer that attached after we were detached"
                .into(),
        ),
        s => Error::Detached(format!("our record says {}", consumer_state::name(s))),
    }
}

/// A violation with our record's verdict (see [`Consumer::violation`]): "detached" when the
/// record says the producer dropped us, or the batch was not addressed to us; else
/// "corrupted".
pub(super) fn explain_violation(v: ring::Violation, record: Result<(), Error>) -> Error {
    match (v, record) {
        (_, Err(Error::Detached(why))) => {
            Error::Detached(format!("{why}; the ring went on without us"))
        }
        (v @ ring::Violation::NotAddressed { .. }, _) => Error::Detached(v.to_string()),
        (v, _) => ProtocolError::Segment(v.to_string()).into(),
    }
}

#[cfg(test)]
mod tests {
    use super::{explain_violation, record_verdict};
    use crate::error::Error;
    use crate::layout::consumer_state::{ACTIVE, ATTACHING, DETACHED};
    use crate::ring::Violation;

    fn overrun() -> Violation {
        Violation::Overrun {
            head: 120,
            cursor: 100,
            n: 8,
        }
    }

    #[test]
    fn a_record_is_ours_while_active_with_our_generation() {
        assert!(record_verdict(ACTIVE, 3, 3).is_ok());
        for (state, generation) in [(DETACHED, 3), (ATTACHING, 3), (ACTIVE, 4)] {
            assert!(
                matches!(
                    record_verdict(state, generation, 3),
                    Err(Error::Detached(_))
                ),
                "state {state}, generation {generation}"
            );
        }
    }

    #[test]
    fn a_violation_after_the_producer_dropped_us_is_a_detach_not_corruption() {
        // A consumer stopped (SIGSTOP) between its record check and its head check, then
        // detached under --detach-after-ms: the head is far past its cursor.
        for record in [record_verdict(DETACHED, 3, 3), record_verdict(ACTIVE, 4, 3)] {
            let e = explain_violation(overrun(), record);
            assert!(matches!(e, Error::Detached(_)), "{e}");
            assert!(!e.to_string().contains("corrupt"), "{e}");
        }
        // The same with our record active and ours: the segment cannot be right.
        let e = explain_violation(overrun(), record_verdict(ACTIVE, 3, 3));
        assert!(matches!(e, Error::Protocol(_)), "{e}");
        // Not addressed to us stays a detach, as before.
        let e = explain_violation(Violation::NotAddressed { seq: 7 }, Ok(()));
        assert!(matches!(e, Error::Detached(_)), "{e}");
    }
}
