//! The producer's socket file: created so that exactly one of several producers started on
//! one path at once wins, never reachable with looser permissions than asked, and removed at
//! the end only if it is still the one this producer created.
//!
//! Every step that looks at the path and then changes it (replacing a stale socket, linking
//! the new one into place, removing it at the end) runs under a lock file next to the socket,
//! `.<name>.lock`, held with `flock` for those few system calls only and removed when let go.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::sys;

/// How long to wait for another producer's setup (or teardown) on the same path.
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The socket file a producer created: its device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SocketFile {
    dev: u64,
    ino: u64,
}

impl SocketFile {
    fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

/// The lock file of a socket path, held while the path is looked at and changed.
struct PathLock {
    path: PathBuf,
    fd: Option<OwnedFd>,
}

impl PathLock {
    fn acquire(socket: &Path) -> Result<Self, Error> {
        let path = sibling(socket, "lock")?;
        let deadline = Instant::now() + LOCK_TIMEOUT;
        loop {
            match sys::try_lock_file(&path) {
                Ok(Some(fd)) => {
                    return Ok(Self { path, fd: Some(fd) });
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(Error::InvalidArgument(format!(
                        "cannot create the lock file {} next to the socket: {e}; the socket's \
                         directory must be writable by the producer",
                        path.display()
                    )));
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::InvalidArgument(format!(
                    "another process has held {} for over {LOCK_TIMEOUT:?} (a producer starting \
                     or stopping on the same socket path); try again, or remove the file if no \
                     producer is running",
                    path.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for PathLock {
    fn drop(&mut self) {
        // Removed while still held: a process that opened it before sees, once it gets the
        // lock, that the path no longer names its file, and tries again.
        let _ = std::fs::remove_file(&self.path);
        drop(self.fd.take());
    }
}

/// `dir/.<name>.<what>` for a socket `dir/<name>`.
fn sibling(socket: &Path, what: &str) -> Result<PathBuf, Error> {
    let name = socket.file_name().ok_or_else(|| {
        Error::InvalidArgument(format!("{} is not a file path", socket.display()))
    })?;
    Ok(directory(socket).join(format!(".{}.{what}", name.to_string_lossy())))
}

fn directory(socket: &Path) -> &Path {
    socket
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Binds the listening socket at `path` with file mode `mode`. It is bound under a temporary
/// name, given its mode, then hard-linked into place, which fails if the path exists: the
/// socket is never reachable with looser permissions, and of producers started at once on one
/// path exactly one wins. A stale socket (nobody accepts on it) is replaced; a live one, or
/// any other file, is left alone. Returns the listener (non-blocking) and the file created.
pub(crate) fn listen(path: &Path, mode: u32) -> Result<(UnixListener, SocketFile), Error> {
    let _lock = PathLock::acquire(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            if !meta.file_type().is_socket() {
                return Err(Error::InvalidArgument(format!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                )));
            }
            match UnixStream::connect(path) {
                Ok(_) => {
                    return Err(Error::InvalidArgument(format!(
                        "another producer is already listening on {}",
                        path.display()
                    )));
                }
                // Only a refusal says that nobody listens: a full backlog, a permission
                // denied (another user's socket) or anything else may be a live producer.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!("removing stale socket {}", path.display());
                    std::fs::remove_file(path).map_err(Error::os("remove the stale socket"))?;
                }
                Err(e) => {
                    return Err(Error::InvalidArgument(format!(
                        "{} exists and connecting to it failed ({e}), which does not show that \
                         nobody listens on it; refusing to replace it (remove it if no producer \
                         uses it)",
                        path.display()
                    )));
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(Error::Os {
                what: "look at the socket path",
                source: e,
            });
        }
    }
    // Unique even between producers in sibling pid namespaces, which may share a pid.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = sibling(path, &format!("{}.{nanos}.tmp", std::process::id()))?;
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(|e| Error::Os {
        what: "bind the attach socket",
        source: e,
    })?;
    let placed = (|| -> Result<SocketFile, Error> {
        sys::chmod(&tmp, mode).map_err(Error::os("chmod the attach socket"))?;
        let meta = std::fs::symlink_metadata(&tmp).map_err(Error::os("stat the attach socket"))?;
        std::fs::hard_link(&tmp, path).map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Error::InvalidArgument(format!(
                    "another producer took {} at the same moment",
                    path.display()
                ))
            } else {
                Error::Os {
                    what: "link the attach socket into place",
                    source: e,
                }
            }
        })?;
        Ok(SocketFile::of(&meta))
    })();
    let _ = std::fs::remove_file(&tmp);
    let file = placed?;
    listener
        .set_nonblocking(true)
        .map_err(Error::os("set the socket non-blocking"))?;
    Ok((listener, file))
}

/// Removes the socket at `path` if it is still `file`, the one this producer created: not a
/// socket another producer put there after ours was removed.
pub(crate) fn remove(path: &Path, file: SocketFile) {
    let lock = match PathLock::acquire(path) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("leaving the socket {} in place: {e}", path.display());
            return;
        }
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if SocketFile::of(&meta) == file => {
            let _ = std::fs::remove_file(path);
        }
        Ok(_) => tracing::info!(
            "{} is no longer the socket this producer created (another producer's?): left in place",
            path.display()
        ),
        Err(_) => {}
    }
    drop(lock);
}

/// Warns when the users a producer lets attach cannot reach its socket: the directory must
/// let them search it.
pub(crate) fn warn_if_unreachable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let dir = directory(path);
    if let Ok(meta) = std::fs::metadata(dir) {
        if meta.permissions().mode() & 0o011 == 0 {
            tracing::warn!(
                "other users are allowed to attach, but the socket's directory {} is mode {:o}: \
                 they cannot reach the socket through it; give them search permission \
                 (chmod o+x or g+x) or put the socket in a directory they can reach",
                dir.display(),
                meta.permissions().mode() & 0o777
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "gpipe-socket-file-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_producer_removes_only_the_socket_it_created() {
        let d = dir("own");
        let path = d.join("ring.sock");
        let (a, file_a) = listen(&path, 0o600).unwrap();
        // Someone removes A's socket and a second producer binds the path.
        std::fs::remove_file(&path).unwrap();
        let (_b, file_b) = listen(&path, 0o600).unwrap();
        assert_ne!(file_a, file_b);
        // A stops: B's socket must stay.
        drop(a);
        remove(&path, file_a);
        assert!(path.exists(), "A removed B's socket");
        remove(&path, file_b);
        assert!(!path.exists());
        // No lock or temporary file is left behind.
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn of_producers_started_at_once_exactly_one_wins() {
        let d = dir("race");
        let path = d.join("ring.sock");
        for round in 0..20 {
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let (p, b) = (path.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        b.wait();
                        listen(&p, 0o600)
                    })
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let won: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
            assert_eq!(won.len(), 1, "round {round}: {} producers won", won.len());
            for r in &results {
                if let Err(e) = r {
                    assert!(e.to_string().contains("already listening"), "{e}");
                }
            }
            let file = won[0].1;
            drop(results);
            remove(&path, file);
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_stale_socket_is_replaced_and_other_files_are_not() {
        let d = dir("stale");
        let path = d.join("ring.sock");
        let (l, _) = listen(&path, 0o600).unwrap();
        drop(l); // the producer died without removing its socket
        let (_l2, _) = listen(&path, 0o600).unwrap();
        let other = d.join("data.txt");
        std::fs::write(&other, b"keep").unwrap();
        let e = listen(&other, 0o600).unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&other).unwrap(), b"keep");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
