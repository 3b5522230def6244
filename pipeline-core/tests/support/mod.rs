//! What several integration tests of this crate share (`mod support;` in each).

use std::path::PathBuf;
use std::time::Duration;

/// Ends the whole test process with a message if it is still running after `limit`: a test
/// that hangs fails instead of holding CI up.
pub fn watchdog(file: &'static str, limit: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!("{file}: a test took longer than {limit:?}; aborting");
        std::process::exit(101);
    });
}

/// A socket path of its own for test `name` of `file` in this process.
pub fn socket(file: &str, name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gpipe-{file}-{name}-{}.sock", std::process::id()))
}
