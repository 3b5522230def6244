//! Every operating-system call gpipe makes, in one place: sealed memfds, shared mappings,
//! shared futex waits and wakes, fd passing with `SCM_RIGHTS`, peer credentials and `poll`.
//!
//! The rest of the crate calls these small functions and never `rustix` directly, so the
//! platform surface can be audited here.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

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

/// A memfd that only its creator may write, before anyone else has it: its size is sealed,
/// but not yet its contents. Map the creator's writable view from [`UnsharedMemfd::fd`], then
/// call [`UnsharedMemfd::seal_writes`], and share only the fd that returns.
pub struct UnsharedMemfd(OwnedFd);

impl UnsharedMemfd {
    /// Creates an anonymous memory file of `len` bytes, sealed against shrinking and growing.
    pub fn create(name: &str, len: u64) -> io::Result<Self> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW)?;
        Ok(Self(fd))
    }

    /// The fd, to map the creator's writable view from (only until it is sealed).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    /// Seals the memory against every later write (`F_SEAL_FUTURE_WRITE`), and the seals
    /// themselves (`F_SEAL_SEAL`). Mappings made before stay writable; after it, no `write()`,
    /// no hole punching and no new writable shared mapping (nor `mprotect` of a read-only one
    /// to writable) is allowed through any fd of this memory: a dup, or `/proc/<pid>/fd/N`
    /// reopened read-write. Returns the fd, now safe to hand to processes that must only
    /// read it.
    pub fn seal_writes(self) -> io::Result<OwnedFd> {
        rustix::fs::fcntl_add_seals(&self.0, SealFlags::FUTURE_WRITE | SealFlags::SEAL).map_err(
            |e| {
                io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "could not seal shared memory against writes (F_SEAL_FUTURE_WRITE, \
                         which needs Linux 5.1 or later): {e}"
                    ),
                )
            },
        )?;
        Ok(self.0)
    }
}

/// [`check_sealed_memfd`], and also that nobody can write the memory any more
/// (`F_SEAL_FUTURE_WRITE` or `F_SEAL_WRITE`): what a consumer checks of memory the producer
/// alone writes, so that no other consumer can change what it reads.
pub fn check_write_sealed_memfd(fd: BorrowedFd<'_>, min_len: u64) -> Result<u64, String> {
    let seals = rustix::fs::fcntl_get_seals(fd)
        .map_err(|e| format!("the fd is not a sealable memfd ({e})"))?;
    if !seals.intersects(SealFlags::FUTURE_WRITE | SealFlags::WRITE) {
        return Err(format!(
            "the memfd is not sealed against writes (seals {seals:?}), so any process that \
             attaches could change what this one reads; refusing to map it (the producer \
             must seal it: gpipe producers from this version on do)"
        ));
    }
    check_sealed_memfd(fd, min_len)
}

/// Makes this process not dumpable (`prctl(PR_SET_DUMPABLE, 0)`): other processes of the same
/// uid can then no longer open its fds through `/proc/<pid>/fd`, read or write its memory
/// (`/proc/<pid>/mem`, `process_vm_writev`) or trace it; only `CAP_SYS_PTRACE` (root) can.
/// It also turns off core dumps. It holds until the process ends or `exec`s, and a child
/// made by `fork` inherits it.
pub fn make_not_dumpable() -> io::Result<()> {
    use rustix::process::{DumpableBehavior, set_dumpable_behavior};
    set_dumpable_behavior(DumpableBehavior::NotDumpable)?;
    Ok(())
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

/// The credentials of the process at the other end of a Unix socket, from `SO_PEERCRED`:
/// for a connected client, the process that connected; for the client's view of a listening
/// socket, the process that called `listen`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id in our pid namespace; `None` where the kernel reports 0 because the peer
    /// is in a pid namespace we cannot see into (a sibling container, or our parent's). For
    /// display only: never a liveness or identity signal (the uid is the identity, the
    /// socket's hang-up the liveness).
    pub pid: Option<u32>,
    /// Effective user id (in our user namespace).
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

impl PeerCred {
    /// The pid for logs: the number, or a word saying why there is none.
    pub fn pid_display(&self) -> String {
        pid_display(self.pid)
    }
}

/// A peer's pid for logs and reports (`None`: in a pid namespace we cannot see).
pub fn pid_display(pid: Option<u32>) -> String {
    match pid {
        Some(p) => p.to_string(),
        None => "unknown (another pid namespace)".to_string(),
    }
}

/// Reads the peer's credentials of a connected Unix socket. Works whatever pid the kernel
/// reports, 0 included. (rustix's `socket_peercred` stores the pid in a non-zero type and
/// returns a bogus error, "Success (os error 0)", for a peer in another pid namespace.)
pub fn peer_cred(sock: &UnixStream) -> io::Result<PeerCred> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a valid, writable `ucred` of `len` bytes that outlives the call, and
    // `len` points to its size; the fd is open for the duration (borrowed from `sock`).
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast::<libc::c_void>(),
            &raw mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(io::Error::other(format!(
            "SO_PEERCRED returned {len} bytes, expected {}",
            std::mem::size_of::<libc::ucred>()
        )));
    }
    Ok(PeerCred {
        pid: u32::try_from(cred.pid).ok().filter(|&p| p > 0),
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Our own effective uid.
pub fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// How long a socket operation of the handshake may take, as a whole: not per system call,
/// so a peer that trickles one byte at a time cannot stretch it.
#[derive(Clone, Copy, Debug, Default)]
pub struct IoDeadline {
    /// When the operation must have finished. `None`: no deadline of ours (with no
    /// `interrupted` either, the calls block as the socket's own timeouts say).
    pub at: Option<Instant>,
    /// Asked at least every [`INTERRUPT_TICK`] while waiting, and at once when a signal
    /// interrupts a wait; `true` ends the operation with [`io::ErrorKind::Interrupted`]. A
    /// binding uses it to honour Ctrl-C (it runs the language's signal handlers).
    pub interrupted: Option<fn() -> bool>,
}

/// How often [`IoDeadline::interrupted`] is asked while a socket operation waits.
pub const INTERRUPT_TICK: Duration = Duration::from_millis(20);

impl IoDeadline {
    /// No deadline: block as the socket's timeouts say.
    pub const NONE: IoDeadline = IoDeadline {
        at: None,
        interrupted: None,
    };

    /// A deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        Self {
            at: Instant::now().checked_add(timeout),
            interrupted: None,
        }
    }

    fn blocking(&self) -> bool {
        self.at.is_none() && self.interrupted.is_none()
    }

    /// Time left (`None`: unbounded); an error once the deadline has passed.
    pub fn left(&self) -> io::Result<Option<Duration>> {
        match self.at {
            None => Ok(None),
            Some(at) => {
                let left = at.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the handshake's deadline passed",
                    ))
                } else {
                    Ok(Some(left))
                }
            }
        }
    }

    /// Asks `interrupted`, turning a `true` into an error.
    fn check_interrupt(&self) -> io::Result<()> {
        if self.interrupted.is_some_and(|f| f()) {
            return Err(io::Error::new(
                io::ErrorKind::Interrupted,
                "interrupted (a signal arrived)",
            ));
        }
        Ok(())
    }

    /// Waits until `fd` is readable (or writable), has hung up, or the deadline passes.
    fn wait(&self, fd: BorrowedFd<'_>, writable: bool) -> io::Result<()> {
        let flags = if writable {
            PollFlags::OUT
        } else {
            PollFlags::IN
        };
        loop {
            let left = self.left()?;
            let slice = match (left, self.interrupted.is_some()) {
                (Some(l), true) => l.min(INTERRUPT_TICK),
                (Some(l), false) => l,
                (None, _) => INTERRUPT_TICK,
            };
            let mut pfd = [PollFd::from_borrowed_fd(fd, flags)];
            match rustix::event::poll(&mut pfd, Some(&timespec(slice))) {
                Ok(n) if n > 0 => return Ok(()),
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            self.check_interrupt()?;
        }
    }

    /// Runs one socket call: at once (blocking) when there is no deadline, else without
    /// blocking, waiting for readiness in between. Retries interrupted calls.
    fn run<T>(
        &self,
        sock: &UnixStream,
        writable: bool,
        mut call: impl FnMut(bool) -> Result<T, rustix::io::Errno>,
    ) -> io::Result<T> {
        loop {
            let nonblocking = !self.blocking();
            match call(nonblocking) {
                Ok(v) => return Ok(v),
                Err(rustix::io::Errno::INTR) => self.check_interrupt()?,
                Err(rustix::io::Errno::AGAIN) if nonblocking => {
                    self.wait(sock.as_fd(), writable)?;
                }
                Err(rustix::io::Errno::AGAIN) => {
                    // A blocking call on a socket with SO_RCVTIMEO/SO_SNDTIMEO set.
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the socket's timeout passed",
                    ));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Sends `bytes` and `fds` (the fds with the first byte), all within `deadline`.
pub fn send_with_fds(
    sock: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: IoDeadline,
) -> io::Result<()> {
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} fds in one message; at most {MAX_FDS_PER_MESSAGE}",
                fds.len()
            ),
        ));
    }
    let flags = |nonblocking: bool| {
        if nonblocking {
            SendFlags::NOSIGNAL | SendFlags::DONTWAIT
        } else {
            SendFlags::NOSIGNAL
        }
    };
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut sent = deadline.run(sock, true, |nb| {
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            // Cannot happen: the buffer was sized for these fds.
            return Err(rustix::io::Errno::NOBUFS);
        }
        rustix::net::sendmsg(sock, &[IoSlice::new(bytes)], &mut control, flags(nb))
    })?;
    // The fds went with the first chunk; write the rest plainly.
    while sent < bytes.len() {
        let n = deadline.run(sock, true, |nb| {
            rustix::net::send(sock, &bytes[sent..], flags(nb))
        })?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        sent += n;
    }
    Ok(())
}

/// Connects a Unix stream socket to `path` within `deadline`: a producer whose listen backlog
/// is full is retried rather than waited on without bound. The socket returned is blocking
/// and close-on-exec.
pub fn connect_unix(path: &std::path::Path, deadline: IoDeadline) -> io::Result<UnixStream> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new(path)?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    loop {
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => break,
            Err(rustix::io::Errno::INTR) => deadline.check_interrupt()?,
            // A Unix socket's backlog is full: nothing tells us when it drains.
            Err(rustix::io::Errno::AGAIN) => {
                deadline.left()?;
                deadline.check_interrupt()?;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
    rustix::io::ioctl_fionbio(&fd, false)?;
    Ok(UnixStream::from(fd))
}

/// File descriptors that came with a message.
#[derive(Debug, Default)]
pub struct ReceivedFds {
    /// The fds received (close-on-exec).
    pub fds: Vec<OwnedFd>,
    /// The kernel could not hand over every fd that was sent (`MSG_CTRUNC`): this process's
    /// fd table is full, or the sender passed more than [`MAX_FDS_PER_MESSAGE`].
    pub truncated: bool,
}

/// Receives exactly `buf.len()` bytes within `deadline`, and any fds that came with the first
/// of them.
pub fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
    deadline: IoDeadline,
) -> io::Result<ReceivedFds> {
    let mut space =
        vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_MESSAGE))];
    let mut received = ReceivedFds::default();
    let got = deadline.run(sock, false, |nb| {
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let flags = if nb {
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT
        } else {
            RecvFlags::CMSG_CLOEXEC
        };
        let msg = rustix::net::recvmsg(sock, &mut [IoSliceMut::new(buf)], &mut control, flags)?;
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                received.fds.extend(rights);
            }
        }
        received.truncated |= msg.flags.contains(ReturnFlags::CTRUNC);
        Ok(msg.bytes)
    })?;
    if got == 0 && !buf.is_empty() {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    recv_exact(sock, &mut buf[got..], deadline)?;
    Ok(received)
}

/// Receives exactly `buf.len()` bytes within `deadline` (no fds).
pub fn recv_exact(sock: &UnixStream, buf: &mut [u8], deadline: IoDeadline) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = deadline.run(sock, false, |nb| {
            let flags = if nb {
                RecvFlags::DONTWAIT
            } else {
                RecvFlags::empty()
            };
            rustix::net::recv(sock, &mut buf[got..], flags).map(|(n, _)| n)
        })?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(())
}

/// True when this process cannot open another fd (`EMFILE`: its open-file limit is
/// reached); checked by duplicating `probe` and closing the copy at once.
pub fn fd_table_full(probe: BorrowedFd<'_>) -> bool {
    matches!(
        rustix::io::fcntl_dupfd_cloexec(probe, 0),
        Err(rustix::io::Errno::MFILE)
    )
}

/// This process's limit on open files (`ulimit -n`, the soft limit), if it has one.
pub fn open_file_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
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

/// Opens (creating it, mode 0600) the lock file at `path` and takes an exclusive `flock` on
/// it without waiting. `Ok(None)`: another process holds it, or it was removed or replaced
/// between our open and our lock (its holder let go of it): try again. The lock lasts as long
/// as the returned fd is open.
pub fn try_lock_file(path: &std::path::Path) -> io::Result<Option<OwnedFd>> {
    use rustix::fs::{FlockOperation, Mode, OFlags};
    let fd = rustix::fs::open(
        path,
        OFlags::CREATE | OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::from_raw_mode(0o600),
    )?;
    match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) | Err(rustix::io::Errno::INTR) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let ours = rustix::fs::fstat(&fd)?;
    match rustix::fs::lstat(path) {
        Ok(now) if now.st_dev == ours.st_dev && now.st_ino == ours.st_ino => Ok(Some(fd)),
        Ok(_) | Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
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

/// Host memory this process can still take, in bytes: the kernel's estimate of what can be
/// allocated without swapping (`MemAvailable` in `/proc/meminfo`), or less where the
/// process's memory cgroup (a container's limit) leaves less. `None` when neither can be read.
///
/// `MemAvailable` counts reclaimable page cache as available but not shared memory, which is
/// what a host ring is (a memfd is shmem: once written, only swap can evict it), and a memfd's
/// pages are charged to the cgroup of the process that writes them.
pub fn available_memory() -> Option<u64> {
    let host = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| meminfo_available(&t));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| cgroup_headroom(&t, std::path::Path::new("/sys/fs/cgroup")));
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn meminfo_available(meminfo: &str) -> Option<u64> {
    let rest = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// The least headroom (limit − usage + inactive file pages, which the kernel reclaims first)
/// of the process's memory cgroup and its ancestors, from the lines of `/proc/self/cgroup`
/// and the cgroup filesystem mounted at `root`. v2 (`0::/path`) and v1 (`N:memory:/path`).
/// Inside a cgroup namespace or a container the path may not exist under `root`: then the
/// mount's own top level is the process's cgroup.
fn cgroup_headroom(own: &str, root: &std::path::Path) -> Option<u64> {
    // (directory under root, limit file, usage file, memory.stat key of inactive file pages)
    let v2 = ("", "memory.max", "memory.current", "inactive_file");
    let v1 = (
        "memory",
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        "total_inactive_file",
    );
    let mut least: Option<u64> = None;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (sub, limit_file, usage_file, inactive_key) = if controllers.is_empty() {
            v2
        } else if controllers.split(',').any(|c| c == "memory") {
            v1
        } else {
            continue;
        };
        let base = root.join(sub);
        let mut dir = base.join(path.trim_start_matches('/'));
        if !dir.is_dir() {
            dir = base.clone();
        }
        // From the process's cgroup up to the mount's top level: any of them may set the limit.
        loop {
            let read_u64 = |file: &str| -> Option<u64> {
                std::fs::read_to_string(dir.join(file))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            // "max" (v2) does not parse; v1 writes a huge number for no limit.
            if let (Some(limit), Some(usage)) = (read_u64(limit_file), read_u64(usage_file))
                && limit < 1 << 60
            {
                let inactive = std::fs::read_to_string(dir.join("memory.stat"))
                    .ok()
                    .and_then(|stat| {
                        stat.lines().find_map(|l| {
                            l.strip_prefix(inactive_key)?
                                .strip_prefix(' ')?
                                .trim()
                                .parse::<u64>()
                                .ok()
                        })
                    })
                    .unwrap_or(0);
                let headroom = limit
                    .saturating_sub(usage)
                    .saturating_add(inactive)
                    .min(limit);
                least = Some(least.map_or(headroom, |l| l.min(headroom)));
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    least
}

#[cfg(test)]
mod memory_tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   22000000 kB\n";
        assert_eq!(meminfo_available(text), Some(22_000_000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
        // This machine's own file has the line.
        assert!(available_memory().is_some());
    }

    #[test]
    fn a_cgroup_limit_below_the_host_counts() {
        let root = std::env::temp_dir().join(format!("gpipe-cgroup-test-{}", std::process::id()));
        let leaf = root.join("box/job");
        std::fs::create_dir_all(&leaf).unwrap();
        let gib = 1u64 << 30;
        // The job has no limit of its own; its parent allows 4 GiB, of which 3 GiB are in use
        // and 512 MiB of that is inactive page cache.
        std::fs::write(leaf.join("memory.max"), "max\n").unwrap();
        std::fs::write(leaf.join("memory.current"), format!("{}\n", gib)).unwrap();
        std::fs::write(root.join("box/memory.max"), format!("{}\n", 4 * gib)).unwrap();
        std::fs::write(root.join("box/memory.current"), format!("{}\n", 3 * gib)).unwrap();
        std::fs::write(
            root.join("box/memory.stat"),
            format!("anon 1\ninactive_file {}\nactive_file 2\n", gib / 2),
        )
        .unwrap();
        let headroom = cgroup_headroom("0::/box/job\n", &root);
        // A path that does not exist under the mount (another namespace's view): the top level.
        let top = cgroup_headroom("0::/elsewhere\n", &root);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(headroom, Some(gib + gib / 2));
        assert_eq!(top, None);
    }
}
