//! Waiting: spin briefly, then sleep on a shared futex with a timeout, checking liveness on
//! each wake-up. The waker bumps the futex word and calls `futex_wake` only when the sleeper
//! count says someone sleeps, so a peer that keeps up costs no system call.

use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::sys;

/// How long to spin before sleeping, and how often a sleeper wakes to check liveness.
#[derive(Clone, Copy, Debug)]
pub struct WaitPolicy {
    /// Busy-wait this long first (0 = sleep at once).
    pub spin: Duration,
    /// Longest single sleep; liveness is checked after each.
    pub tick: Duration,
}

impl Default for WaitPolicy {
    fn default() -> Self {
        Self {
            spin: Duration::from_micros(100),
            tick: Duration::from_millis(100),
        }
    }
}

/// Waits until `ready` returns `Some`. `word`/`sleepers` are the futex word and the sleeper
/// count of the condition. `on_tick` runs after each wake-up that found nothing and may end
/// the wait with an error (peer died, detached, ...) or a value.
pub fn wait_for<T>(
    policy: WaitPolicy,
    word: &AtomicU32,
    sleepers: &AtomicU32,
    mut ready: impl FnMut() -> Option<T>,
    mut on_tick: impl FnMut() -> Result<Option<T>, Error>,
) -> Result<T, Error> {
    if let Some(v) = ready() {
        return Ok(v);
    }
    if !policy.spin.is_zero() {
        let start = Instant::now();
        let mut i = 0u32;
        loop {
            std::hint::spin_loop();
            if let Some(v) = ready() {
                return Ok(v);
            }
            i = i.wrapping_add(1);
            if i % 64 == 0 && start.elapsed() >= policy.spin {
                break;
            }
        }
    }
    loop {
        let seen = word.load(Ordering::Acquire);
        sleepers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if let Some(v) = ready() {
            sleepers.fetch_sub(1, Ordering::SeqCst);
            return Ok(v);
        }
        sys::futex_wait(word, seen, policy.tick);
        sleepers.fetch_sub(1, Ordering::SeqCst);
        if let Some(v) = ready() {
            return Ok(v);
        }
        if let Some(v) = on_tick()? {
            return Ok(v);
        }
    }
}

/// Wakes sleepers of a condition after the state change was stored: a SeqCst fence, then a
/// futex wake only if the sleeper count is non-zero.
pub fn notify(word: &AtomicU32, sleepers: &AtomicU32, all: bool) {
    fence(Ordering::SeqCst);
    if sleepers.load(Ordering::SeqCst) != 0 {
        word.fetch_add(1, Ordering::Release);
        sys::futex_wake(word, if all { i32::MAX as u32 } else { 1 });
    }
}

/// As [`notify`], where whether anyone sleeps is spread over several words (each consumer's
/// own page): `sleeping` loads them after the fence.
pub fn notify_if(word: &AtomicU32, all: bool, sleeping: impl FnOnce() -> bool) {
    fence(Ordering::SeqCst);
    if sleeping() {
        word.fetch_add(1, Ordering::Release);
        sys::futex_wake(word, if all { i32::MAX as u32 } else { 1 });
    }
}
