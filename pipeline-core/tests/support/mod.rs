//! What several integration tests of this crate share (`mod support;` in each).

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pipeline_core::wire::{self, Message, Role};

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

/// Says Hello as a consumer of protocol `version` to the producer at `sock` (a handshake done
/// by hand, 5 s read timeout) and returns the connection, the producer's answer and its fds.
pub fn hello(sock: &Path, version: u32) -> (UnixStream, Message, Vec<OwnedFd>) {
    let conn = UnixStream::connect(sock).expect("connect to the producer");
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Message::Hello {
        version,
        role: Role::Consumer,
        backend: 0,
    };
    wire::send(&conn, &hello, &[]).expect("send Hello");
    let (msg, fds) = wire::recv(&conn).expect("receive the producer's answer to Hello");
    (conn, msg, fds)
}

/// A new shared mapping of the first `len` bytes of `fd` with protection `prot`, as a
/// hostile peer would try to make; the caller unmaps it.
pub fn map_shared(
    fd: BorrowedFd<'_>,
    len: usize,
    prot: rustix::mm::ProtFlags,
) -> rustix::io::Result<*mut std::ffi::c_void> {
    // SAFETY: a fresh mapping chosen by the kernel; it aliases nothing of ours.
    unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            rustix::mm::MapFlags::SHARED,
            fd,
            0,
        )
    }
}
