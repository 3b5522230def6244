//! Every operating-system call gpipe makes, in one place: sealed memfds, shared mappings,
//! shared futex waits and wakes, fd passing with `SCM_RIGHTS`, peer credentials and `poll`.
//!
//! The rest of the crate calls these small functions and never `rustix` directly, so the
//! platform surface can be audited here.

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use rustix::thread::futex;

/// The most file descriptors one message may carry (the kernel's `SCM_MAX_FD` is 253).
pub const MAX_FDS_PER_MESSAGE: usize = 253;

/// Creates an anonymous memory file of `len` bytes, sealed so that nobody can shrink or grow
/// it afterwards (a peer can therefore never make our mapping fault with `SIGBUS`).
pub fn sealed_memfd(name: &str, len: u64) -> io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

/// Checks that a memfd received from a peer cannot change size under us and holds at least
/// `min_len` bytes. Returns its actual length.
pub fn check_sealed_memfd(fd: BorrowedFd<'_>, min_len: u64) -> Result<u64, String> {
    let seals = rustix::fs::fcntl_get_seals(fd)
        .map_err(|e| format!("the fd is not a sealable memfd ({e})"))?;
    if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
        return Err(format!(
            "the memfd is not sealed against resizing (seals {seals:?}); refusing to map it"
        ));
    }
    let st = rustix::fs::fstat(fd).map_err(|e| format!("fstat failed: {e}"))?;
    let len = u64::try_from(st.st_size).map_err(|_| "negative file size".to_string())?;
    if len < min_len {
        return Err(format!(
            "the memfd holds {len} bytes, the layout needs {min_len}"
        ));
    }
    Ok(len)
}

fn timespec(d: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    }
}

/// Sleeps on a futex word in shared memory while it still holds `expected`, for at most
/// `timeout`. Spurious wake-ups, interrupts and timeouts all simply return: callers re-check
/// their condition.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = timespec(timeout);
    // Flags::empty() is a *shared* futex (not FUTEX_PRIVATE): the word lives in a mapping
    // that other processes wait on too.
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

/// Wakes up to `count` waiters of a shared futex word.
pub fn futex_wake(word: &AtomicU32, count: u32) {
    let _ = futex::wake(word, futex::Flags::empty(), count);
}

/// The credentials of the process at the other end of a Unix socket, from `SO_PEERCRED`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id (in our pid namespace; 0 if the peer is in another one).
    pub pid: u32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// Reads the peer's credentials of a connected Unix socket.
pub fn peer_cred(sock: &UnixStream) -> io::Result<PeerCred> {
    let c = rustix::net::sockopt::socket_peercred(sock)?;
    Ok(PeerCred {
        pid: c.pid.as_raw_nonzero().get() as u32,
        uid: c.uid.as_raw(),
        gid: c.gid.as_raw(),
    })
}

/// Our own effective uid.
pub fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Sends `bytes` and `fds` in one `sendmsg`; the fds travel with the first byte.
pub fn send_with_fds(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} fds in one message; at most {MAX_FDS_PER_MESSAGE}",
                fds.len()
            ),
        ));
    }
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("ancillary buffer too small"));
    }
    let mut sent = rustix::net::sendmsg(
        sock,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    // The fds went with the first chunk; write the rest plainly.
    while sent < bytes.len() {
        let n = rustix::net::send(sock, &bytes[sent..], SendFlags::NOSIGNAL)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        sent += n;
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and any fds that came with them. Fails if the sender
/// passed more fds than [`MAX_FDS_PER_MESSAGE`] (the kernel then truncates and we refuse).
pub fn recv_with_fds(sock: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<OwnedFd>> {
    let mut space =
        vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_MESSAGE))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "peer sent more file descriptors than a message may carry",
        ));
    }
    if msg.bytes == 0 && !buf.is_empty() {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let mut got = msg.bytes;
    let mut s = sock;
    while got < buf.len() {
        let n = s.read(&mut buf[got..])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(fds)
}

/// What `poll` said of one fd.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    /// Data (or a connection) is waiting.
    pub readable: bool,
    /// The peer hung up or the fd is in error.
    pub hangup: bool,
}

/// Polls `fds` for input for at most `timeout`; returns one [`Readiness`] per fd.
pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout: Duration) -> io::Result<Vec<Readiness>> {
    let mut pfds: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::from_borrowed_fd(fd.as_fd(), PollFlags::IN))
        .collect();
    let ts = timespec(timeout);
    match rustix::event::poll(&mut pfds, Some(&ts)) {
        Ok(_) => {}
        Err(rustix::io::Errno::INTR) => return Ok(vec![Readiness::default(); fds.len()]),
        Err(e) => return Err(e.into()),
    }
    Ok(pfds
        .iter()
        .map(|p| {
            let r = p.revents();
            Readiness {
                readable: r.contains(PollFlags::IN),
                hangup: r.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL),
            }
        })
        .collect())
}

/// True when the peer of a connected stream socket has closed its end (or died). Does not
/// consume data. One `poll` system call.
pub fn peer_gone(sock: &UnixStream) -> bool {
    match poll_readable(&[sock.as_fd()], Duration::ZERO) {
        Ok(r) => {
            if r[0].hangup {
                return true;
            }
            if r[0].readable {
                // Readable with zero bytes pending means EOF.
                let mut b = [0u8; 1];
                return matches!(
                    rustix::net::recv(sock, &mut b, RecvFlags::PEEK | RecvFlags::DONTWAIT),
                    Ok((0, _))
                );
            }
            false
        }
        Err(_) => true,
    }
}

/// A self-pipe to wake a thread sleeping in [`poll_readable`].
pub struct Waker {
    rx: OwnedFd,
    tx: OwnedFd,
}

impl Waker {
    /// Creates the pipe (both ends close-on-exec, the read end non-blocking).
    pub fn new() -> io::Result<Self> {
        let (rx, tx) = rustix::pipe::pipe_with(
            rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK,
        )?;
        Ok(Self { rx, tx })
    }
    /// The end to poll.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.rx.as_fd()
    }
    /// Makes the poll return.
    pub fn wake(&self) {
        let _ = rustix::io::write(&self.tx, &[1]);
    }
    /// Empties the pipe after a wake-up.
    pub fn drain(&self) {
        let mut b = [0u8; 64];
        while matches!(rustix::io::read(&self.rx, &mut b), Ok(n) if n > 0) {}
    }
}

/// Sets the file mode of a path (used for the socket file: 0600).
pub fn chmod(path: &std::path::Path, mode: u32) -> io::Result<()> {
    rustix::fs::chmod(path, rustix::fs::Mode::from_raw_mode(mode))?;
    Ok(())
}

/// True if a process with this pid exists (signal 0). Used for display only, never for
/// liveness decisions (pids are reused; the socket is the liveness signal).
pub fn pid_exists(pid: u32) -> bool {
    // The pid may come from shared memory: only a positive i32 names one process (0 and
    // negative values would address process groups or every process).
    match i32::try_from(pid).ok().filter(|&p| p > 0) {
        Some(p) => rustix::process::Pid::from_raw(p)
            .is_some_and(|p| rustix::process::test_kill_process(p).is_ok()),
        None => false,
    }
}
