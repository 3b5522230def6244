//! `sync = "auto"` (how `ready` is signalled) and `timeline_memory = "auto"` (where the
//! timeline words live).

use super::Choice;
use crate::sync::{SyncMode, TimelineMemory};

/// Fewest hardware work queues (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 when unset) with which
/// `timeline_memory = auto` takes device memory.
pub const DEVICE_WORDS_MIN_CONNECTIONS: u32 = 8;

/// Where `auto` puts the timeline words, and why: device memory (measured faster on an H100,
/// docs/benchmarks.md) when the device can export `cuMemCreate` memory as POSIX fds and the
/// process keeps CUDA's default of 8 hardware queues (`connections`: the value of
/// `CUDA_DEVICE_MAX_CONNECTIONS`, `None` when unset); host memory otherwise. A dead peer's
/// device words are released by a write on a stream of their own, which must not share a
/// queue with a stream stalled on those words; with fewer queues, streams share them.
pub fn rule_timeline_memory(
    vmm_posix_fd: bool,
    connections: Option<u32>,
) -> (TimelineMemory, String) {
    if !vmm_posix_fd {
        return (
            TimelineMemory::Host,
            "the device cannot share cuMemCreate memory as POSIX fds".into(),
        );
    }
    match connections {
        Some(n) if n < DEVICE_WORDS_MIN_CONNECTIONS => (
            TimelineMemory::Host,
            format!(
                "CUDA_DEVICE_MAX_CONNECTIONS={n}: with fewer than \
                 {DEVICE_WORDS_MIN_CONNECTIONS} hardware queues, a release written to device \
                 words could queue behind the stalled wait it is meant to release"
            ),
        ),
        _ => (
            TimelineMemory::Device,
            "device memory: measured faster on an H100".into(),
        ),
    }
}

/// The sync mode `auto` picks, and why. With `ready_survives_producer` (a front-end's input,
/// see [`super::FrontEnd`]): timeline words always, which a consumer releases itself when the
/// producer dies (an IPC event recorded by a dead process may never complete). Otherwise by
/// where the words are, as measured on an H100 (docs/benchmarks.md): with the words in host
/// memory, which the GPU polls over PCIe, IPC events were as fast as or faster than
/// semaphores; with the words in device memory, semaphores were the faster (2 MiB, MPS,
/// 1 consumer: 0.86x of the fair ceiling against 0.84x; 4 consumers: 0.80x against 0.70x).
pub fn rule_sync(words: TimelineMemory, ready_survives_producer: bool) -> (SyncMode, &'static str) {
    if ready_survives_producer {
        return (
            SyncMode::Semaphore,
            "timeline words, which consumers release themselves when the producer dies",
        );
    }
    match words {
        TimelineMemory::Device => (
            SyncMode::Semaphore,
            "timeline words in device memory: semaphores measured faster there",
        ),
        TimelineMemory::Host => (
            SyncMode::Events,
            "timeline words in host memory: IPC events measured as fast or faster there",
        ),
    }
}

/// `timeline_memory`: as given, or `auto` by [`rule_timeline_memory`].
pub(super) fn resolve_words(
    given: Option<TimelineMemory>,
    vmm_posix_fd: bool,
    connections: Option<u32>,
) -> Choice<TimelineMemory> {
    match given {
        Some(w) => Choice::given(w),
        None => {
            let (w, why) = rule_timeline_memory(vmm_posix_fd, connections);
            Choice::auto(w, why)
        }
    }
}

/// `sync`: as given, or `auto` by [`rule_sync`].
pub(super) fn resolve_sync(
    given: Option<SyncMode>,
    words: TimelineMemory,
    ready_survives_producer: bool,
) -> Choice<SyncMode> {
    match given {
        Some(s) => Choice::given(s),
        None => {
            let (s, why) = rule_sync(words, ready_survives_producer);
            Choice::auto(s, why)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_timeline_memory_is_device_unless_vmm_fds_or_queues_are_missing() {
        use TimelineMemory::{Device, Host};
        assert_eq!(rule_timeline_memory(true, None).0, Device);
        assert_eq!(rule_timeline_memory(true, Some(8)).0, Device);
        assert_eq!(rule_timeline_memory(true, Some(32)).0, Device);
        let (m, why) = rule_timeline_memory(true, Some(1));
        assert_eq!(m, Host);
        assert!(why.contains("CUDA_DEVICE_MAX_CONNECTIONS=1"), "{why}");
        let (m, why) = rule_timeline_memory(false, None);
        assert_eq!(m, Host);
        assert!(why.contains("POSIX fds"), "{why}");
    }

    #[test]
    fn auto_sync_follows_the_words_unless_ready_must_survive_the_producer() {
        use TimelineMemory::{Device, Host};
        assert_eq!(rule_sync(Device, false).0, SyncMode::Semaphore);
        assert_eq!(rule_sync(Host, false).0, SyncMode::Events);
        assert_eq!(rule_sync(Host, true).0, SyncMode::Semaphore);
        assert_eq!(rule_sync(Device, true).0, SyncMode::Semaphore);
        assert!(resolve_sync(Some(SyncMode::Events), Device, true).reason == "given");
    }
}
