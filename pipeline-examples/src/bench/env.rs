//! The environment a CUDA run's processes need: side signals want each process's streams on
//! hardware queues of their own, which under MPS takes `CUDA_DEVICE_MAX_CONNECTIONS`. CUDA
//! reads it when a context is made, so `main` sets it before any thread, and the consumer
//! processes inherit it.

use super::args::BenchCmd;
use crate::args::{BackendArg, SideSignalsArg};

/// What [`set_process_env`] set.
static PROCESS_ENV: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();

/// What [`set_process_env`] set in this process's environment (nothing if it was not called).
pub(super) fn process_env() -> Vec<(String, String)> {
    PROCESS_ENV.get().cloned().unwrap_or_default()
}

/// What a CUDA run's processes need in their environment: side signals (as `--side-signals`
/// resolves for slots of `batch_bytes`) want a process's streams on hardware queues of their
/// own, so `CUDA_DEVICE_MAX_CONNECTIONS=8` where it is unset (measured under MPS, with it
/// set for the producer and the consumers: docs/benchmarks.md). A value the user set is kept.
fn cuda_env(side: SideSignalsArg, batch_bytes: u64) -> Vec<(String, String)> {
    if side.resolve(batch_bytes) && pipeline_cuda::policy::signals::max_connections().is_none() {
        let n = pipeline_cuda::policy::signals::SIDE_SIGNALS_CONNECTIONS;
        vec![("CUDA_DEVICE_MAX_CONNECTIONS".into(), n.to_string())]
    } else {
        Vec::new()
    }
}

/// Sets [`cuda_env`] in this process's environment, which the consumer processes inherit
/// (CUDA reads it when a context is made).
///
/// # Safety
/// No other thread may exist yet (call it first thing in `main`): setting the environment
/// races with any other thread reading it.
pub unsafe fn set_process_env(cmd: &BenchCmd) {
    // SAFETY: the caller guarantees that this is the only thread.
    let vars = unsafe { set_cuda_env(cmd.backend, cmd.side_signals, cmd.ring.batch_bytes) };
    let _ = PROCESS_ENV.set(vars);
}

/// Sets [`cuda_env`] for a CUDA (or auto) backend in this process's environment and returns
/// what it set.
///
/// # Safety
/// As for [`set_process_env`].
pub unsafe fn set_cuda_env(
    backend: BackendArg,
    side: SideSignalsArg,
    batch_bytes: u64,
) -> Vec<(String, String)> {
    if backend == BackendArg::Host {
        return Vec::new();
    }
    let vars = cuda_env(side, batch_bytes);
    for (k, v) in &vars {
        // SAFETY: the caller guarantees that no other thread exists, so nothing reads the
        // environment concurrently.
        unsafe { std::env::set_var(k, v) };
    }
    vars
}

#[cfg(test)]
mod tests {
    use super::cuda_env;
    use crate::args::SideSignalsArg;

    #[test]
    fn eight_queues_go_with_side_signals_only_and_never_override_the_user() {
        let want = if pipeline_cuda::policy::signals::max_connections().is_some() {
            Vec::new() // the user's value is kept
        } else {
            vec![("CUDA_DEVICE_MAX_CONNECTIONS".to_string(), "8".to_string())]
        };
        // Auto: side signals from 16 MiB slots (a 15 MiB batch rounds up to a 16 MiB slot).
        assert_eq!(cuda_env(SideSignalsArg::Auto, 2 << 20), []);
        assert_eq!(cuda_env(SideSignalsArg::Auto, 8 << 20), []);
        assert_eq!(cuda_env(SideSignalsArg::Auto, 15 << 20), want);
        assert_eq!(cuda_env(SideSignalsArg::Auto, 64 << 20), want);
        // Asked for: on at any size, never when off.
        assert_eq!(cuda_env(SideSignalsArg::On, 2 << 20), want);
        assert_eq!(cuda_env(SideSignalsArg::Off, 64 << 20), []);
    }
}
