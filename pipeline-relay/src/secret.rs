//! The shared secret both sides of a relay prove they hold.
//!
//! It comes from a file, never from the command line (argv is readable by every user through
//! `/proc/PID/cmdline`). The file must be private to its owner, who must be the user running
//! the relay, so another local user can neither read nor replace it.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The secret shared by the two sides of a relay, read from a private file.
///
/// Deliberately has no `Display` and a `Debug` that prints `SharedSecret(..)`, so the secret
/// cannot end up in a log line or an error message. The bytes are overwritten on drop
/// (best effort: earlier copies made by the allocator are out of reach).
pub struct SharedSecret {
    bytes: Vec<u8>,
}

impl SharedSecret {
    /// The fewest bytes a secret may have, after the trailing newline is removed.
    pub const MIN_LEN: usize = 16;
    /// The largest secret file accepted, in bytes.
    pub const MAX_FILE_LEN: u64 = 4096;

    /// Reads the secret from `path`.
    ///
    /// Refuses, with a [`SecretError`] that says how to fix it, a path that is not a regular
    /// file, a file not owned by the effective uid, a file readable or writable by group or
    /// others (`mode & 0o077 != 0`), a file larger than [`Self::MAX_FILE_LEN`], and a secret
    /// that is empty or shorter than [`Self::MIN_LEN`]. One trailing newline (`\n` or
    /// `\r\n`) is removed, so `echo`-made and `base64`-made files work; every other byte,
    /// whitespace included, is part of the secret.
    pub fn from_file(path: impl AsRef<Path>) -> Result<SharedSecret, SecretError> {
        let path = path.as_ref();
        let fail = |problem| SecretError {
            path: path.to_path_buf(),
            problem,
        };
        // Non-blocking open: a FIFO planted at the path must not hang us before the
        // "not a regular file" check below. It changes nothing for a regular file.
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(nonblock_flag())
            .open(path)
            .map_err(|e| fail(SecretProblem::Open(e)))?;
        // fstat the file we opened, not the path, so the checks and the read see one file.
        let meta = file.metadata().map_err(|e| fail(SecretProblem::Read(e)))?;
        let euid = rustix::process::geteuid().as_raw();
        check_metadata(meta.is_file(), meta.uid(), meta.mode(), meta.len(), euid).map_err(fail)?;
        let bytes = read_capped(file).map_err(fail)?;
        SharedSecret::from_contents(bytes).map_err(fail)
    }

    /// Trims one trailing newline and checks the length.
    fn from_contents(mut bytes: Vec<u8>) -> Result<SharedSecret, SecretProblem> {
        if bytes.ends_with(b"\r\n") {
            bytes.truncate(bytes.len() - 2);
        } else if bytes.ends_with(b"\n") {
            bytes.truncate(bytes.len() - 1);
        }
        // Wrap first, so a refused secret is wiped on drop like an accepted one.
        let secret = SharedSecret { bytes };
        match secret.bytes.len() {
            0 => Err(SecretProblem::Empty),
            n if n < Self::MIN_LEN => Err(SecretProblem::TooShort(n)),
            _ => Ok(secret),
        }
    }

    /// A secret from bytes, for tests of the handshake that need no file.
    #[cfg(test)]
    pub(crate) fn for_test(bytes: &[u8]) -> SharedSecret {
        SharedSecret {
            bytes: bytes.to_vec(),
        }
    }

    /// The secret's bytes: the HMAC key. Crate-private so that no caller can print it.
    pub(crate) fn key(&self) -> &[u8] {
        &self.bytes
    }
}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedSecret(..)")
    }
}

impl Drop for SharedSecret {
    fn drop(&mut self) {
        self.bytes.fill(0);
        // Keeps the compiler from dropping the fill as a dead store.
        std::hint::black_box(&mut self.bytes);
    }
}

fn nonblock_flag() -> i32 {
    // O_NONBLOCK is a small positive constant; the cast cannot change its value.
    rustix::fs::OFlags::NONBLOCK.bits() as i32
}

/// Reads at most one byte more than allowed, so a file that grew since `fstat` is caught
/// without reading all of it.
fn read_capped(file: File) -> Result<Vec<u8>, SecretProblem> {
    let mut bytes = Vec::new();
    file.take(SharedSecret::MAX_FILE_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(SecretProblem::Read)?;
    let len = bytes.len() as u64;
    if len > SharedSecret::MAX_FILE_LEN {
        // Wipe what was read of a too-large file before refusing it.
        drop(SharedSecret { bytes });
        return Err(SecretProblem::TooLarge(len));
    }
    Ok(bytes)
}

/// The checks on the file's metadata, kept apart from the file so that tests can cover
/// every case (another owner needs root to set up for real).
pub(crate) fn check_metadata(
    is_file: bool,
    owner: u32,
    mode: u32,
    len: u64,
    euid: u32,
) -> Result<(), SecretProblem> {
    if !is_file {
        return Err(SecretProblem::NotAFile);
    }
    if owner != euid {
        return Err(SecretProblem::Owner { owner, euid });
    }
    if mode & 0o077 != 0 {
        return Err(SecretProblem::Mode(mode & 0o7777));
    }
    if len > SharedSecret::MAX_FILE_LEN {
        return Err(SecretProblem::TooLarge(len));
    }
    Ok(())
}

/// A secret file that could not be used: which file, and what is wrong with it.
#[derive(Debug)]
pub struct SecretError {
    /// The path given.
    pub path: PathBuf,
    /// What is wrong.
    pub problem: SecretProblem,
}

/// What is wrong with a secret file.
#[derive(Debug)]
pub enum SecretProblem {
    /// It could not be opened (missing, or no permission).
    Open(io::Error),
    /// It could not be read.
    Read(io::Error),
    /// It is a directory, FIFO, device or socket, not a regular file.
    NotAFile,
    /// It belongs to another user.
    Owner {
        /// The file's owner.
        owner: u32,
        /// Our effective uid.
        euid: u32,
    },
    /// Group or others have some permission on it; the value is the mode's permission bits.
    Mode(u32),
    /// It is larger than [`SharedSecret::MAX_FILE_LEN`]; the value is its size.
    TooLarge(u64),
    /// It is empty (or holds only a newline).
    Empty,
    /// The secret is shorter than [`SharedSecret::MIN_LEN`]; the value is its length.
    TooShort(usize),
}

const MAKE_ONE: &str = "make one with `(umask 077; head -c 32 /dev/urandom | base64 > FILE)` \
                        and copy it to the other host the same way";

impl fmt::Display for SecretError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path.display();
        write!(f, "secret file {path}: ")?;
        match &self.problem {
            SecretProblem::Open(e) if e.kind() == io::ErrorKind::NotFound => {
                write!(f, "it does not exist: {MAKE_ONE}")
            }
            SecretProblem::Open(e) => write!(f, "cannot open it: {e}"),
            SecretProblem::Read(e) => write!(f, "cannot read it: {e}"),
            SecretProblem::NotAFile => write!(f, "not a regular file"),
            SecretProblem::Owner { owner, euid } => write!(
                f,
                "it is owned by uid {owner}, not by the user running this (uid {euid}): \
                 the secret must be your own file (`chown {euid} {path}`)"
            ),
            SecretProblem::Mode(mode) => write!(
                f,
                "its mode is {mode:04o}, so group or others may read or change it: \
                 run `chmod 600 {path}`"
            ),
            SecretProblem::TooLarge(len) => write!(
                f,
                "it is {len} bytes; a secret file holds at most {} bytes",
                SharedSecret::MAX_FILE_LEN
            ),
            SecretProblem::Empty => write!(f, "it is empty: {MAKE_ONE}"),
            SecretProblem::TooShort(n) => write!(
                f,
                "the secret is {n} bytes, fewer than the {} required: {MAKE_ONE}",
                SharedSecret::MIN_LEN
            ),
        }
    }
}

impl std::error::Error for SecretError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.problem {
            SecretProblem::Open(e) | SecretProblem::Read(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    /// Writes `contents` to a new file in `dir` with exactly `mode`.
    fn secret_file(dir: &Path, name: &str, contents: &[u8], mode: u32) -> PathBuf {
        let path = dir.join(name);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .unwrap();
        file.write_all(contents).unwrap();
        // Set the mode explicitly: the umask only ever removes bits at creation.
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    fn problem(path: &Path) -> SecretProblem {
        SharedSecret::from_file(path).unwrap_err().problem
    }

    #[test]
    fn a_private_file_is_read_and_one_trailing_newline_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let p = secret_file(dir.path(), "s", b"0123456789abcdef\n", 0o600);
        assert_eq!(
            SharedSecret::from_file(&p).unwrap().key(),
            b"0123456789abcdef"
        );
        let p = secret_file(dir.path(), "crlf", b"0123456789abcdef\r\n", 0o400);
        assert_eq!(
            SharedSecret::from_file(&p).unwrap().key(),
            b"0123456789abcdef"
        );
        // Only one newline goes; the rest is part of the secret.
        let p = secret_file(dir.path(), "two", b"0123456789abcdef\n\n", 0o600);
        assert_eq!(
            SharedSecret::from_file(&p).unwrap().key(),
            b"0123456789abcdef\n"
        );
        let p = secret_file(dir.path(), "raw", &[0u8; 16], 0o600);
        assert_eq!(SharedSecret::from_file(&p).unwrap().key(), &[0u8; 16]);
    }

    #[test]
    fn group_or_other_permissions_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for (i, mode) in [0o640, 0o604, 0o620, 0o602, 0o644, 0o666, 0o610, 0o601]
            .into_iter()
            .enumerate()
        {
            let p = secret_file(dir.path(), &format!("m{i}"), b"0123456789abcdef", mode);
            let err = SharedSecret::from_file(&p).unwrap_err();
            assert!(
                matches!(err.problem, SecretProblem::Mode(m) if m == mode),
                "{mode:o}: {err}"
            );
            let text = err.to_string();
            assert!(text.contains(&format!("{mode:04o}")), "{text}");
            assert!(text.contains("chmod 600"), "{text}");
        }
    }

    #[test]
    fn sizes_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = secret_file(dir.path(), "empty", b"", 0o600);
        assert!(matches!(problem(&p), SecretProblem::Empty));
        let p = secret_file(dir.path(), "nl", b"\n", 0o600);
        assert!(matches!(problem(&p), SecretProblem::Empty));
        let p = secret_file(dir.path(), "short", b"0123456789abcde\n", 0o600);
        assert!(matches!(problem(&p), SecretProblem::TooShort(15)));
        let big = vec![b'x'; 4097];
        let p = secret_file(dir.path(), "big", &big, 0o600);
        assert!(matches!(problem(&p), SecretProblem::TooLarge(4097)));
        let p = secret_file(dir.path(), "max", &big[..4096], 0o600);
        assert_eq!(SharedSecret::from_file(&p).unwrap().key().len(), 4096);
    }

    #[test]
    fn missing_files_and_directories_are_refused_with_a_hint() {
        let dir = tempfile::tempdir().unwrap();
        let err = SharedSecret::from_file(dir.path().join("nope")).unwrap_err();
        assert!(matches!(err.problem, SecretProblem::Open(_)));
        assert!(err.to_string().contains("does not exist"), "{err}");
        assert!(err.to_string().contains("umask 077"), "{err}");
        let sub = dir.path().join("d");
        fs::create_dir(&sub).unwrap();
        fs::set_permissions(&sub, fs::Permissions::from_mode(0o700)).unwrap();
        assert!(matches!(problem(&sub), SecretProblem::NotAFile));
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fifo");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &path,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        assert!(matches!(problem(&path), SecretProblem::NotAFile));
    }

    #[test]
    fn another_owner_is_refused() {
        assert!(matches!(
            check_metadata(true, 0, 0o600, 32, 1000),
            Err(SecretProblem::Owner {
                owner: 0,
                euid: 1000
            })
        ));
        assert!(check_metadata(true, 1000, 0o100600, 32, 1000).is_ok());
        // For real when we can chown (the tests often run as root in containers).
        let euid = rustix::process::geteuid().as_raw();
        if euid == 0 {
            let dir = tempfile::tempdir().unwrap();
            let p = secret_file(dir.path(), "theirs", b"0123456789abcdef", 0o600);
            std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
            let err = SharedSecret::from_file(&p).unwrap_err();
            assert!(matches!(
                err.problem,
                SecretProblem::Owner {
                    owner: 65534,
                    euid: 0
                }
            ));
            assert!(err.to_string().contains("owned by uid 65534"), "{err}");
        }
    }

    #[test]
    fn the_secret_is_never_printed() {
        let s = SharedSecret::for_test(b"very-secret-bytes-here");
        assert_eq!(format!("{s:?}"), "SharedSecret(..)");
        assert_eq!(format!("{s:#?}"), "SharedSecret(..)");
        let dir = tempfile::tempdir().unwrap();
        let p = secret_file(dir.path(), "short", b"hunter2", 0o600);
        let err = SharedSecret::from_file(&p).unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
        assert!(!format!("{err:?}").contains("hunter2"));
    }
}
