//! Ctrl-C and closed pipes, for every subcommand.
//!
//! * SIGINT and SIGTERM set [`STOP`]. Every blocking wait of the CLI gives up control at
//!   least every [`SLICE`] to look at it, so a command answers Ctrl-C within about 0.1 s.
//! * A closed stdout or stderr (`gpipe inspect | head -3`) ends the command quietly with
//!   status [`EXIT_CLOSED_PIPE`], as Unix tools that die of SIGPIPE do. SIGPIPE itself stays
//!   ignored (Rust's default): a write to a consumer's socket that went away must fail with
//!   an error, not kill the producer. Instead, the failed print's panic is recognised, kept
//!   silent, and unwound to `main` (which closes the ring, as on any other way out).

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Set by SIGINT (Ctrl-C) and SIGTERM.
pub static STOP: AtomicBool = AtomicBool::new(false);

/// The longest any wait of the CLI blocks before it looks at [`STOP`].
pub const SLICE: Duration = Duration::from_millis(50);

/// Exit status of a command interrupted before it could do what it was asked (128 + SIGINT,
/// what a shell reports for a process Ctrl-C killed).
pub const EXIT_INTERRUPTED: u8 = 130;

/// Exit status when stdout or stderr was closed under the command (128 + SIGPIPE).
pub const EXIT_CLOSED_PIPE: u8 = 141;

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Installs the SIGINT and SIGTERM handlers, and keeps the panic of a print to a closed pipe
/// silent (the rest of the way out is [`is_closed_pipe`] in `main`).
pub fn install() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to a static atomic, which is async-signal-safe.
        // Installed before the command starts any thread of its own.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !is_closed_pipe(info.payload()) {
            default(info);
        }
    }));
}

/// Whether Ctrl-C (or SIGTERM) came.
pub fn requested() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Says that Ctrl-C ended the command while it was `doing` something, before it could do what
/// it was asked; returns [`EXIT_INTERRUPTED`].
pub fn interrupted(doing: &str) -> std::process::ExitCode {
    eprintln!("gpipe: interrupted while {doing}");
    std::process::ExitCode::from(EXIT_INTERRUPTED)
}

/// Sleeps until `until`, or until Ctrl-C. Returns false if Ctrl-C ended it.
pub fn sleep_until(until: Instant) -> bool {
    loop {
        if requested() {
            return false;
        }
        let Some(left) = until.checked_duration_since(Instant::now()) else {
            return true;
        };
        std::thread::sleep(left.min(SLICE));
    }
}

/// Whether a panic's payload is that of `print!`/`eprint!` failing on a closed pipe
/// ("failed printing to stdout: Broken pipe (os error 32)").
pub fn is_closed_pipe(payload: &(dyn Any + Send)) -> bool {
    let message = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied());
    let broken = std::io::Error::from_raw_os_error(libc::EPIPE).to_string();
    message.is_some_and(|m| m.starts_with("failed printing to std") && m.contains(&broken))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_print_to_a_closed_pipe_counts_as_one() {
        let epipe = std::io::Error::from_raw_os_error(libc::EPIPE);
        let closed: Box<dyn Any + Send> = Box::new(format!("failed printing to stdout: {epipe}"));
        assert!(is_closed_pipe(&*closed));
        let stderr: Box<dyn Any + Send> = Box::new(format!("failed printing to stderr: {epipe}"));
        assert!(is_closed_pipe(&*stderr));
        let other_error = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let full: Box<dyn Any + Send> =
            Box::new(format!("failed printing to stdout: {other_error}"));
        assert!(!is_closed_pipe(&*full));
        let unrelated: Box<dyn Any + Send> = Box::new("index out of bounds");
        assert!(!is_closed_pipe(&*unrelated));
    }

    #[test]
    fn a_sleep_ends_on_time() {
        let t = Instant::now();
        assert!(sleep_until(t + Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(20));
        assert!(sleep_until(t));
    }
}
