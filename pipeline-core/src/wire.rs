//! Handshake messages on the attach socket.
//!
//! A frame is a 12-byte prefix — magic `"GPW1"` (u32 LE), kind (u16 LE), reserved (u16, zero),
//! body length (u32 LE, at most [`MAX_BODY`]) — then the body. File descriptors travel as
//! `SCM_RIGHTS` with the frame's first byte; each message says how many it carries, and a
//! count that differs from what arrived is an error. [`decode`] is a pure function of bytes,
//! so it can be fuzzed.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::error::{Error, ProtocolError};
use crate::sys::{self, IoDeadline};

/// Frame magic, `"GPW1"`.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"GPW1");
/// Largest body accepted (1 MiB: per-slot export data for 4096 slots fits).
pub const MAX_BODY: usize = 1 << 20;
/// Longest refusal reason.
pub const MAX_REASON: usize = 1024;
/// Consumer index sent to observers.
pub const OBSERVER: u32 = u32::MAX;

/// Who is attaching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Receives batches.
    Consumer,
    /// Only maps the control segment read-only (`gpipe inspect`).
    Observer,
}

/// A handshake message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Consumer → producer, first.
    Hello {
        /// Protocol version.
        version: u32,
        /// Consumer or observer.
        role: Role,
        /// Backend kind it wants (0: whatever the producer uses).
        backend: u32,
    },
    /// Producer → consumer: the ring's constants; fds: the control segment, then (consumers
    /// only) the claim segment and the consumer's own page, then the backend's.
    Welcome {
        /// Protocol version.
        version: u32,
        /// Layout hash of the control segment.
        layout_hash: u64,
        /// The consumer's index ([`OBSERVER`] for observers).
        consumer_index: u32,
        /// Delivery mode.
        mode: u32,
        /// Slots.
        slot_count: u32,
        /// Slot capacity.
        slot_bytes: u64,
        /// Consumer capacity.
        consumer_capacity: u32,
        /// Backend kind.
        backend: u32,
        /// Number of fds attached (the ring's, then the backend's).
        fd_count: u32,
        /// Backend export data (opaque to the core).
        blob: Vec<u8>,
    },
    /// Consumer → producer: imported; the backend's reply (e.g. finished-event handles).
    Ready {
        /// Number of fds attached.
        fd_count: u32,
        /// Backend reply data.
        blob: Vec<u8>,
    },
    /// Producer → consumer: active; the first sequence number it will see.
    Joined {
        /// First sequence number.
        start_seq: u64,
        /// This attach's token ([`crate::ring::claim_token`]): the consumer's index in the low
        /// bits (checked against the index it was given) and a serial unique to the attach.
        claim_token: u64,
    },
    /// Either way: refused, with a reason.
    Reject {
        /// Why.
        reason: String,
    },
    /// Consumer → producer: leaving cleanly.
    Goodbye,
}

impl Message {
    fn kind(&self) -> u16 {
        match self {
            Message::Hello { .. } => 1,
            Message::Welcome { .. } => 2,
            Message::Ready { .. } => 3,
            Message::Joined { .. } => 4,
            Message::Reject { .. } => 5,
            Message::Goodbye => 6,
        }
    }

    /// A short name for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "Hello",
            Message::Welcome { .. } => "Welcome",
            Message::Ready { .. } => "Ready",
            Message::Joined { .. } => "Joined",
            Message::Reject { .. } => "Reject",
            Message::Goodbye => "Goodbye",
        }
    }

    fn fd_count(&self) -> usize {
        match self {
            Message::Welcome { fd_count, .. } | Message::Ready { fd_count, .. } => {
                *fd_count as usize
            }
            _ => 0,
        }
    }
}

/// Encodes a message into one frame.
pub fn encode(msg: &Message) -> Vec<u8> {
    let mut body = Vec::new();
    let w = &mut body;
    match msg {
        Message::Hello {
            version,
            role,
            backend,
        } => {
            put32(w, *version);
            put32(
                w,
                match role {
                    Role::Consumer => 1,
                    Role::Observer => 2,
                },
            );
            put32(w, *backend);
        }
        Message::Welcome {
            version,
            layout_hash,
            consumer_index,
            mode,
            slot_count,
            slot_bytes,
            consumer_capacity,
            backend,
            fd_count,
            blob,
        } => {
            put32(w, *version);
            put64(w, *layout_hash);
            put32(w, *consumer_index);
            put32(w, *mode);
            put32(w, *slot_count);
            put64(w, *slot_bytes);
            put32(w, *consumer_capacity);
            put32(w, *backend);
            put32(w, *fd_count);
            put32(w, blob.len() as u32);
            w.extend_from_slice(blob);
        }
        Message::Ready { fd_count, blob } => {
            put32(w, *fd_count);
            put32(w, blob.len() as u32);
            w.extend_from_slice(blob);
        }
        Message::Joined {
            start_seq,
            claim_token,
        } => {
            put64(w, *start_seq);
            put64(w, *claim_token);
        }
        Message::Reject { reason } => {
            let r = truncate_utf8(reason, MAX_REASON);
            put32(w, r.len() as u32);
            w.extend_from_slice(r.as_bytes());
        }
        Message::Goodbye => {}
    }
    let mut frame = Vec::with_capacity(12 + body.len());
    put32(&mut frame, FRAME_MAGIC);
    frame.extend_from_slice(&msg.kind().to_le_bytes());
    frame.extend_from_slice(&0u16.to_le_bytes());
    put32(&mut frame, body.len() as u32);
    frame.extend_from_slice(&body);
    frame
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn put32(w: &mut Vec<u8>, v: u32) {
    w.extend_from_slice(&v.to_le_bytes());
}
fn put64(w: &mut Vec<u8>, v: u64) {
    w.extend_from_slice(&v.to_le_bytes());
}

/// A bounds-checked little-endian reader over untrusted bytes.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Reads `buf`; `what` names the message in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, pos: 0, what }
    }
    fn short(&self, need: usize) -> ProtocolError {
        ProtocolError::Message(format!(
            "{}: truncated at byte {} (needs {need} more, {} left)",
            self.what,
            self.pos,
            self.buf.len() - self.pos
        ))
    }
    /// Next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.buf.len() - self.pos < n {
            return Err(self.short(n));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    /// Next u32.
    pub fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_le_bytes(
            self.bytes(4)?.try_into().unwrap_or([0; 4]),
        ))
    }
    /// Next u64.
    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(
            self.bytes(8)?.try_into().unwrap_or([0; 8]),
        ))
    }
    /// A u32 length, then that many bytes (at most `max`).
    pub fn blob(&mut self, max: usize) -> Result<&'a [u8], ProtocolError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(ProtocolError::Message(format!(
                "{}: length {n} exceeds the limit {max}",
                self.what
            )));
        }
        self.bytes(n)
    }
    /// Fails if bytes are left over.
    pub fn finish(&self) -> Result<(), ProtocolError> {
        if self.pos != self.buf.len() {
            return Err(ProtocolError::Message(format!(
                "{}: {} unexpected trailing bytes",
                self.what,
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

/// Parses the 12-byte frame prefix: returns (kind, body length).
pub fn decode_prefix(p: &[u8; 12]) -> Result<(u16, usize), ProtocolError> {
    let magic = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
    if magic != FRAME_MAGIC {
        return Err(ProtocolError::Message(format!(
            "bad frame magic {magic:#010x}: the peer is not speaking the gpipe protocol"
        )));
    }
    let kind = u16::from_le_bytes([p[4], p[5]]);
    let reserved = u16::from_le_bytes([p[6], p[7]]);
    if reserved != 0 {
        return Err(ProtocolError::Message(format!(
            "reserved frame bits set ({reserved:#x})"
        )));
    }
    let len = u32::from_le_bytes([p[8], p[9], p[10], p[11]]) as usize;
    if len > MAX_BODY {
        return Err(ProtocolError::Message(format!(
            "frame body of {len} bytes exceeds the limit {MAX_BODY}"
        )));
    }
    Ok((kind, len))
}

/// Decodes a whole frame (prefix and body). Pure: safe to fuzz.
pub fn decode(frame: &[u8]) -> Result<Message, ProtocolError> {
    let prefix: &[u8; 12] = frame
        .get(..12)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(|| ProtocolError::Message("frame shorter than its 12-byte prefix".into()))?;
    let (kind, len) = decode_prefix(prefix)?;
    if frame.len() - 12 != len {
        return Err(ProtocolError::Message(format!(
            "frame says {len} body bytes, has {}",
            frame.len() - 12
        )));
    }
    decode_body(kind, &frame[12..])
}

/// Decodes a body of the given kind.
pub fn decode_body(kind: u16, body: &[u8]) -> Result<Message, ProtocolError> {
    let msg = match kind {
        1 => {
            let mut r = Reader::new(body, "Hello");
            let version = r.u32()?;
            let role = match r.u32()? {
                1 => Role::Consumer,
                2 => Role::Observer,
                x => {
                    return Err(ProtocolError::Message(format!("Hello: unknown role {x}")));
                }
            };
            let backend = r.u32()?;
            r.finish()?;
            Message::Hello {
                version,
                role,
                backend,
            }
        }
        2 => {
            let mut r = Reader::new(body, "Welcome");
            let m = Message::Welcome {
                version: r.u32()?,
                layout_hash: r.u64()?,
                consumer_index: r.u32()?,
                mode: r.u32()?,
                slot_count: r.u32()?,
                slot_bytes: r.u64()?,
                consumer_capacity: r.u32()?,
                backend: r.u32()?,
                fd_count: r.u32()?,
                blob: r.blob(MAX_BODY)?.to_vec(),
            };
            r.finish()?;
            m
        }
        3 => {
            let mut r = Reader::new(body, "Ready");
            let m = Message::Ready {
                fd_count: r.u32()?,
                blob: r.blob(MAX_BODY)?.to_vec(),
            };
            r.finish()?;
            m
        }
        4 => {
            let mut r = Reader::new(body, "Joined");
            let m = Message::Joined {
                start_seq: r.u64()?,
                claim_token: r.u64()?,
            };
            r.finish()?;
            m
        }
        5 => {
            let mut r = Reader::new(body, "Reject");
            let reason = r.blob(MAX_REASON)?;
            r.finish()?;
            Message::Reject {
                reason: String::from_utf8(reason.to_vec()).map_err(|_| {
                    ProtocolError::Message("Reject: the reason is not UTF-8".into())
                })?,
            }
        }
        6 => {
            Reader::new(body, "Goodbye").finish()?;
            Message::Goodbye
        }
        k => {
            return Err(ProtocolError::Message(format!("unknown message kind {k}")));
        }
    };
    if msg.fd_count() > sys::MAX_FDS_PER_MESSAGE {
        return Err(ProtocolError::Message(format!(
            "{} announces {} fds; at most {}",
            msg.name(),
            msg.fd_count(),
            sys::MAX_FDS_PER_MESSAGE
        )));
    }
    Ok(msg)
}

/// Sends a message with its fds, blocking as the socket's timeouts say.
pub fn send(sock: &UnixStream, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<(), Error> {
    send_until(sock, msg, fds, IoDeadline::NONE)
}

/// Sends a message with its fds within `deadline` (the whole message, not each write).
pub fn send_until(
    sock: &UnixStream,
    msg: &Message,
    fds: &[BorrowedFd<'_>],
    deadline: IoDeadline,
) -> Result<(), Error> {
    debug_assert_eq!(msg.fd_count(), fds.len());
    sys::send_with_fds(sock, &encode(msg), fds, deadline).map_err(|e| match e.kind() {
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
            Error::Protocol(ProtocolError::Hangup(format!(
                "the peer closed the connection mid-handshake (it exited or refused us) while we sent {}",
                msg.name()
            )))
        }
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout("the peer to read a handshake message (the handshake's deadline passed)")
        }
        _ => Error::Os {
            what: "send handshake message",
            source: e,
        },
    })
}

/// Sends a refusal, ignoring failures (the peer may already be gone). Never blocks: a peer
/// that does not read gets nothing rather than holding us.
pub fn send_reject(sock: &UnixStream, reason: &str) {
    let frame = encode(&Message::Reject {
        reason: reason.to_string(),
    });
    let _ = rustix::net::send(
        sock,
        &frame,
        rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT,
    );
}

/// Receives one message and its fds, blocking as the socket's timeouts say.
pub fn recv(sock: &UnixStream) -> Result<(Message, Vec<OwnedFd>), Error> {
    recv_until(sock, IoDeadline::NONE)
}

fn recv_error(e: std::io::Error, part: &'static str) -> Error {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof if part == "message" => Error::Protocol(
            ProtocolError::Hangup("the peer closed the connection mid-handshake".into()),
        ),
        std::io::ErrorKind::UnexpectedEof => Error::Protocol(ProtocolError::Message(
            "the peer closed the connection mid-message".into(),
        )),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout(if part == "message" {
                "a handshake message (the handshake's deadline passed)"
            } else {
                "the rest of a handshake message (the handshake's deadline passed)"
            })
        }
        _ => Error::Os {
            what: if part == "message" {
                "receive handshake message"
            } else {
                "receive handshake body"
            },
            source: e,
        },
    }
}

/// Receives one message and its fds within `deadline` (the whole message, however the peer
/// slices it). The fd count must match what the message announces.
pub fn recv_until(
    sock: &UnixStream,
    deadline: IoDeadline,
) -> Result<(Message, Vec<OwnedFd>), Error> {
    let mut prefix = [0u8; 12];
    let received =
        sys::recv_with_fds(sock, &mut prefix, deadline).map_err(|e| recv_error(e, "message"))?;
    let (kind, len) = decode_prefix(&prefix)?;
    let mut body = vec![0u8; len];
    sys::recv_exact(sock, &mut body, deadline).map_err(|e| recv_error(e, "body"))?;
    let msg = decode_body(kind, &body)?;
    let fds = received.fds;
    if received.truncated {
        // Asked while the fds that did arrive are still open: they may be what filled the
        // table.
        if sys::fd_table_full(sock.as_fd()) {
            let limit =
                sys::open_file_limit().map_or_else(|| "unlimited".to_string(), |l| l.to_string());
            return Err(Error::Os {
                what: "receive the file descriptors of a handshake message",
                source: std::io::Error::other(format!(
                    "too many open files: {} carries {} file descriptors and this process could \
                     take only {} of them (its open-file limit, ulimit -n, is {limit}); raise the \
                     limit (e.g. `ulimit -n 4096`) or close files",
                    msg.name(),
                    msg.fd_count(),
                    fds.len()
                )),
            });
        }
        return Err(ProtocolError::Message(format!(
            "{} arrived with file descriptors the kernel could not pass on ({} of {} announced \
             arrived): the peer sent more than a message may carry ({}), or this process could \
             not take them",
            msg.name(),
            fds.len(),
            msg.fd_count(),
            sys::MAX_FDS_PER_MESSAGE
        ))
        .into());
    }
    if msg.fd_count() != fds.len() {
        return Err(ProtocolError::Message(format!(
            "{} announces {} fds but {} arrived",
            msg.name(),
            msg.fd_count(),
            fds.len()
        ))
        .into());
    }
    Ok((msg, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello {
                version: 1,
                role: Role::Consumer,
                backend: 0,
            },
            Message::Welcome {
                version: 1,
                layout_hash: 42,
                consumer_index: 3,
                mode: 1,
                slot_count: 8,
                slot_bytes: 2 << 20,
                consumer_capacity: 16,
                backend: 1,
                fd_count: 2,
                blob: vec![1, 2, 3],
            },
            Message::Ready {
                fd_count: 0,
                blob: vec![9; 64],
            },
            Message::Joined {
                start_seq: 77,
                claim_token: (5 << 6) | 3,
            },
            Message::Reject {
                reason: "nope".into(),
            },
            Message::Goodbye,
        ]
    }

    #[test]
    fn roundtrip() {
        for m in samples() {
            assert_eq!(decode(&encode(&m)).unwrap(), m);
        }
    }

    #[test]
    fn rejects_truncation_and_trailing_bytes() {
        for m in samples() {
            let f = encode(&m);
            for cut in 0..f.len() {
                assert!(decode(&f[..cut]).is_err(), "{} cut at {cut}", m.name());
            }
            let mut longer = f.clone();
            longer.push(0);
            assert!(decode(&longer).is_err());
        }
    }

    #[test]
    fn rejects_bad_magic_and_oversized_body() {
        let mut f = encode(&Message::Goodbye);
        f[0] ^= 0xff;
        assert!(decode(&f).unwrap_err().to_string().contains("magic"));
        let mut p = [0u8; 12];
        p[..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        p[4] = 1;
        p[8..].copy_from_slice(&(MAX_BODY as u32 + 1).to_le_bytes());
        assert!(decode_prefix(&p).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn decode_body_never_panics(kind in 0u16..10, body in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = decode_body(kind, &body);
        }
    }
}
