//! `side_signals = "auto"`: whether a CUDA consumer waits for `ready` and writes `finished`
//! on side streams of its own, and the hardware queues those want.

use super::{Choice, bytes_text};

/// Slots of this many bytes and more take side signals unless told otherwise
/// ([`crate::backend::CudaOptions::side_signals`]). Measured on an H100 with MPS
/// (docs/benchmarks.md, 2026-11-23), 1 consumer:
///
/// * Every stream write or wait on a timeline word between two kernels of one stream idles
///   the GPU about 3 µs longer than the kernels alone. An in-process event record, or a wait
///   on a completed one, adds nothing.
/// * From 16 MiB, side signals ran 2-4% faster, and 16-38% faster with
///   `CUDA_DEVICE_MAX_CONNECTIONS=8` in the consumer's environment (64 MiB: 0.98x of the
///   one-process ceiling). Under MPS that variable is needed: unset, a client's streams shared
///   hardware queues.
/// * At 2 and 8 MiB they were slower: the host's driver calls bound those rates, and side
///   signals add four a batch.
pub const SIDE_SIGNALS_AUTO_BYTES: u64 = 16 << 20;

/// Whether `auto` takes side signals for slots of `slot_bytes`.
pub fn side_signals_auto(slot_bytes: u64) -> bool {
    slot_bytes >= SIDE_SIGNALS_AUTO_BYTES
}

/// Hardware queues a consumer with side signals should have: its stream and the two side
/// streams each on a queue of their own.
pub const SIDE_SIGNALS_CONNECTIONS: u32 = 8;

/// Whether this process's `CUDA_DEVICE_MAX_CONNECTIONS` gives side signals their queues, and
/// if not, what to set. Unset counts as not: CUDA's default is 8 queues without MPS, but
/// under MPS a client's streams were measured sharing queues when it was unset
/// (docs/benchmarks.md: 64 MiB with side signals at 0.934x of the ceiling unset, 0.979x with
/// 8).
pub fn side_signals_connections() -> Result<(), String> {
    side_signals_connections_for(max_connections())
}

/// [`side_signals_connections`] for a given `CUDA_DEVICE_MAX_CONNECTIONS` (None: unset).
pub fn side_signals_connections_for(connections: Option<u32>) -> Result<(), String> {
    match connections {
        Some(n) if n >= SIDE_SIGNALS_CONNECTIONS => Ok(()),
        Some(n) => Err(format!(
            "CUDA_DEVICE_MAX_CONNECTIONS={n}: the side streams may share hardware queues with \
             the batch's stream; {SIDE_SIGNALS_CONNECTIONS} or more lets each have its own"
        )),
        None => Err(format!(
            "CUDA_DEVICE_MAX_CONNECTIONS is unset: under MPS a client's streams then share \
             hardware queues and side signals gain little; set it to \
             {SIDE_SIGNALS_CONNECTIONS} in the consumer's environment"
        )),
    }
}

/// `CUDA_DEVICE_MAX_CONNECTIONS`, when set to a number.
pub fn max_connections() -> Option<u32> {
    std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
}

/// Whether a consumer of slots of `slot_bytes` (with `auto` unless `given`) takes side
/// signals; never on the host backend, which has no streams.
pub(super) fn resolve(given: Option<bool>, cuda: bool, slot_bytes: u64) -> Choice<bool> {
    match given {
        _ if !cuda => Choice::auto(false, "the host backend has no streams"),
        Some(on) => Choice::given(on),
        None if side_signals_auto(slot_bytes) => Choice::auto(
            true,
            format!(
                "slots of {} and more: measured faster",
                bytes_text(SIDE_SIGNALS_AUTO_BYTES)
            ),
        ),
        None => Choice::auto(
            false,
            format!(
                "slots below {}: measured slower",
                bytes_text(SIDE_SIGNALS_AUTO_BYTES)
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_signals_want_eight_queues_and_say_what_to_set() {
        assert_eq!(side_signals_connections_for(Some(8)), Ok(()));
        assert_eq!(side_signals_connections_for(Some(32)), Ok(()));
        let low = side_signals_connections_for(Some(4)).unwrap_err();
        assert!(low.contains("CUDA_DEVICE_MAX_CONNECTIONS=4"), "{low}");
        let unset = side_signals_connections_for(None).unwrap_err();
        assert!(
            unset.contains("unset") && unset.contains("set it to 8"),
            "{unset}"
        );
    }

    #[test]
    fn side_signals_from_the_threshold_up_on_a_gpu_only() {
        assert!(resolve(None, true, SIDE_SIGNALS_AUTO_BYTES).value);
        assert!(!resolve(None, true, SIDE_SIGNALS_AUTO_BYTES - 1).value);
        assert!(!resolve(Some(true), false, SIDE_SIGNALS_AUTO_BYTES).value);
    }
}
