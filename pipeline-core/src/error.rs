//! Errors. Each names what went wrong and, where there is one, what to do about it.

use std::fmt;
use std::io;

/// An error from a backend (host memory, CUDA, ...). Backends box their own error types.
pub type BackendError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A peer (or a scribbler) broke the protocol: what it sent or wrote does not validate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    /// Protocol versions differ.
    Version {
        /// Ours.
        ours: u32,
        /// The peer's.
        theirs: u32,
    },
    /// A layout constant is out of range or disagrees with the peer's.
    Layout(String),
    /// A handshake message is malformed (bad magic, length, field, or truncated).
    Message(String),
    /// The control segment holds a value that cannot be right (corrupted or scribbled).
    Segment(String),
    /// The peer refused us and said why.
    Refused(String),
    /// The peer closed the connection during the handshake (it exited, was killed, or gave
    /// up); nothing it sent was wrong.
    Hangup(String),
    /// The producer listening on the socket runs as a uid this consumer does not trust.
    UntrustedProducer(String),
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::Version { ours, theirs } => write!(
                f,
                "protocol version mismatch: we speak v{ours}, the peer v{theirs}; run the same gpipe release on both sides"
            ),
            ProtocolError::Layout(m) => write!(f, "bad ring layout: {m}"),
            ProtocolError::Message(m) => write!(f, "malformed handshake message: {m}"),
            ProtocolError::Segment(m) => write!(f, "control segment corrupted: {m}"),
            ProtocolError::Refused(m) => write!(f, "the producer refused the attach: {m}"),
            ProtocolError::Hangup(m) | ProtocolError::UntrustedProducer(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for ProtocolError {}

/// Every error gpipe's core returns.
#[derive(Debug)]
pub enum Error {
    /// A system call failed.
    Os {
        /// What we were doing.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// Could not connect to the producer's socket.
    Connect {
        /// The socket path.
        path: String,
        /// The OS error.
        source: io::Error,
    },
    /// A peer broke the protocol.
    Protocol(ProtocolError),
    /// The backend failed.
    Backend(BackendError),
    /// The peer at the other end runs another backend than this side was built for.
    BackendMismatch {
        /// What this side expected.
        expected: String,
        /// What the producer uses.
        found: String,
    },
    /// The producer died (its socket closed without a clean shutdown).
    ProducerDied,
    /// This consumer was detached by the producer (lag policy or protocol violation).
    Detached(String),
    /// A wait ran past its deadline.
    Timeout(&'static str),
    /// The ring is shut down (returned to a producer after `close`).
    Closed,
    /// An argument is out of range.
    InvalidArgument(String),
    /// The consumer asked for a batch it could never get: it still holds the batch in the
    /// slot the producer must refill first (itself, or through tensors made from it).
    Deadlock {
        /// The held batch.
        seq: u64,
        /// Its slot.
        slot: u32,
        /// Batches this consumer holds in all.
        held: usize,
    },
    /// Mirror delivery: every one of the consumer's own buffers holds a batch it has not
    /// released, so the next batch could not be delivered (it stays in the ring).
    MirrorFull {
        /// The consumer's own buffers.
        buffers: usize,
        /// Batches this consumer holds in all.
        held: usize,
    },
}

impl Error {
    /// Adapter for `map_err` on OS results.
    pub fn os(what: &'static str) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::Os { what, source }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Os { what, source } => write!(f, "{what} failed: {source}"),
            Error::Connect { path, source } => match source.kind() {
                io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => write!(
                    f,
                    "no producer is listening on {path} ({source}): start the producer first (a `Producer` on this path, in Rust or Python, or `gpipe produce --socket {path}`), or check the path"
                ),
                io::ErrorKind::PermissionDenied => write!(
                    f,
                    "cannot connect to {path}: permission denied (the socket is mode 0600 and owned by the producer's user)"
                ),
                _ => write!(f, "cannot connect to {path}: {source}"),
            },
            Error::Protocol(e) => e.fmt(f),
            Error::Backend(e) => write!(f, "backend error: {e}"),
            Error::BackendMismatch { expected, found } => write!(
                f,
                "the producer uses the {found} backend but this consumer was set up for {expected}"
            ),
            Error::ProducerDied => write!(
                f,
                "the producer died (its socket closed without a clean shutdown); batches it had not published are lost"
            ),
            Error::Detached(why) => write!(f, "this consumer was detached by the producer: {why}"),
            Error::Timeout(what) => write!(f, "timed out waiting for {what}"),
            Error::Closed => write!(f, "the ring is shut down"),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::Deadlock { seq, slot, held } => write!(
                f,
                "waiting for the next batch would never end: this consumer still holds batch {seq} in slot {slot} ({held} held in all), and the producer must reuse that slot before it can publish again; release batches (and drop tensors made from them) before asking for more, or give the ring more slots"
            ),
            Error::MirrorFull { buffers, held } => write!(
                f,
                "this consumer mirrors batches into {buffers} buffers of its own and all of them hold a batch not yet released ({held} held in all): release batches (and drop tensors made from them) before asking for more, or give it more mirror buffers; the next batch stays in the ring"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Os { source, .. } | Error::Connect { source, .. } => Some(source),
            Error::Protocol(e) => Some(e),
            Error::Backend(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}

impl From<ProtocolError> for Error {
    fn from(e: ProtocolError) -> Self {
        Error::Protocol(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A consumer that finds no producer may be a Rust program, a Python one or the CLI: the
    /// hint names the path and says to start a producer there, not only with the CLI.
    #[test]
    fn no_producer_hint_fits_every_front_end() {
        for kind in [io::ErrorKind::NotFound, io::ErrorKind::ConnectionRefused] {
            let e = Error::Connect {
                path: "/x/feed.sock".into(),
                source: io::Error::from(kind),
            };
            let msg = e.to_string();
            assert!(
                msg.starts_with("no producer is listening on /x/feed.sock"),
                "{msg}"
            );
            assert!(msg.contains("start the producer first"), "{msg}");
            assert!(msg.contains("a `Producer` on this path"), "{msg}");
            assert!(
                msg.contains("`gpipe produce --socket /x/feed.sock`"),
                "{msg}"
            );
        }
    }
}
