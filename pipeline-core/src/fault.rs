//! Fault injection for the test suite: with `GPIPE_FAULT=<point>:<n>` in its environment, a
//! process SIGKILLs itself the n-th time it reaches `<point>`, so tests can kill a peer at an
//! exact protocol step. Points: `consumer.before_wait`, `consumer.after_wait`,
//! `consumer.before_release` (finished signalled, not released), `consumer.after_release`,
//! `producer.before_publish` (ready signalled, not published), `producer.after_publish`.
//! Without the variable a point costs one relaxed load and a branch: the points sit on every
//! batch's path.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

static SPEC: OnceLock<Option<(String, u64)>> = OnceLock::new();
static HITS: AtomicU64 = AtomicU64::new(0);
/// Whether `GPIPE_FAULT` names a point: not read yet, no, or yes.
static ARMED: AtomicU8 = AtomicU8::new(UNKNOWN);
const UNKNOWN: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

fn spec() -> &'static Option<(String, u64)> {
    SPEC.get_or_init(|| {
        let v = std::env::var("GPIPE_FAULT").ok()?;
        let (point, n) = v.rsplit_once(':')?;
        Some((point.to_string(), n.parse().ok()?))
    })
}

/// Marks a protocol step; kills the process here if the environment asks for it.
#[inline]
pub fn point(name: &str) {
    if ARMED.load(Ordering::Relaxed) != OFF {
        slow_point(name);
    }
}

#[cold]
#[inline(never)]
fn slow_point(name: &str) {
    let spec = spec();
    ARMED.store(if spec.is_some() { ON } else { OFF }, Ordering::Relaxed);
    if let Some((p, n)) = spec {
        if p == name && HITS.fetch_add(1, Ordering::Relaxed) + 1 == *n {
            tracing::warn!("GPIPE_FAULT: killing this process at {name}");
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    }
}
