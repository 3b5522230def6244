//! The messages that follow a rendezvous, on the same TCP connection: each framed and MACed
//! with the session key, bound to its sender's role and to a per-direction counter, so a
//! message cannot be forged, replayed, reordered, dropped unnoticed or reflected back.
//!
//! Frame: `len` u32 (body bytes), `kind` u8, body, then `HMAC-SHA256(K, "msg\0" || role label
//! || counter u64 || kind || len || body)`. Bodies are at most [`MAX_BODY`] bytes. Nothing is
//! encrypted (see docs/security.md).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use hmac::Mac;

use crate::wire::{self, MAC_LEN, Role};

/// The largest message body: a whole slot of the host backend's relay plus its metadata.
pub const MAX_BODY: usize = (1 << 30) + (1 << 20);

/// Once a message has begun, how long each read of the rest may take.
pub const MID_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// True when the peer has closed its end of `stream` (or it failed), checked without blocking,
/// consuming data or changing the socket's mode: the socket polls as hung up, in error or
/// read-hung-up (the peer's FIN, seen even while unread messages of its are still queued), or
/// a peek reads end of file.
pub fn peer_gone(stream: &TcpStream) -> bool {
    use rustix::event::{PollFd, PollFlags};
    let mut fds = [PollFd::new(stream, PollFlags::IN | PollFlags::RDHUP)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&zero)) {
        Ok(0) => false,
        // A signal (Ctrl-C) during the call says nothing about the peer: look again next tick.
        Err(rustix::io::Errno::INTR) => false,
        Err(_) => true,
        Ok(_) => {
            let r = fds[0].revents();
            if r.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::RDHUP) {
                return true;
            }
            let mut b = [0u8; 1];
            matches!(
                rustix::net::recv(
                    stream,
                    &mut b[..],
                    rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT
                ),
                Ok((0, _))
            )
        }
    }
}

/// The two ends of an authenticated rendezvous connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's address.
    pub peer: SocketAddr,
    /// Our address on the connection (the interface the peer is reached through).
    pub local: SocketAddr,
}

/// An authenticated connection to the peer of a rendezvous.
#[derive(Debug)]
pub struct Session {
    stream: TcpStream,
    /// The largest body this side accepts (checked before anything is allocated).
    max_body: usize,
    key: [u8; MAC_LEN],
    role: Role,
    sent: u64,
    received: u64,
    peer: PeerInfo,
}

/// Why a message could not be received.
#[derive(Debug)]
pub enum SessionError {
    /// The peer closed the connection (it exited, or was killed).
    Closed,
    /// No message within the time given.
    Timeout,
    /// The message's MAC does not verify: forged, replayed, reordered or corrupted.
    Tampered,
    /// A length beyond [`MAX_BODY`].
    TooLong(u64),
    /// Another I/O error.
    Io(io::Error),
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Closed => f.write_str("the peer closed the connection"),
            SessionError::Timeout => f.write_str("no message from the peer in time"),
            SessionError::Tampered => f.write_str(
                "a message from the peer failed its MAC (forged, replayed, reordered or corrupted)",
            ),
            SessionError::TooLong(n) => {
                write!(
                    f,
                    "the peer announced a {n}-byte message (at most {MAX_BODY})"
                )
            }
            SessionError::Io(e) => write!(f, "connection to the peer: {e}"),
        }
    }
}

impl std::error::Error for SessionError {}

fn io_error(e: io::Error) -> SessionError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => SessionError::Timeout,
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted => SessionError::Closed,
        _ => SessionError::Io(e),
    }
}

impl Session {
    pub(crate) fn new(stream: TcpStream, key: [u8; MAC_LEN], role: Role, peer: PeerInfo) -> Self {
        Session {
            stream,
            max_body: MAX_BODY,
            key,
            role,
            sent: 0,
            received: 0,
            peer,
        }
    }

    /// The two ends of the connection.
    pub fn peer(&self) -> PeerInfo {
        self.peer
    }

    /// This side's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Accepts bodies of at most `bytes` (and at most [`MAX_BODY`]) from now on: what the
    /// relay expects (a slot and its description), so a peer cannot make this side allocate
    /// more before the MAC is checked.
    pub fn set_max_body(&mut self, bytes: usize) {
        self.max_body = bytes.min(MAX_BODY);
    }

    /// The MAC of a message from `role`, numbered `counter` in its direction.
    fn mac(&self, role: Role, counter: u64, kind: u8, body: &[u8]) -> wire::HmacSha256 {
        let len = (body.len() as u32).to_le_bytes();
        let mut m = wire::mac(
            &self.key,
            &[
                b"msg\0",
                role.mac_label(),
                &counter.to_le_bytes(),
                &[kind],
                &len,
            ],
        );
        m.update(body);
        m
    }

    /// Sends one message. `timeout` bounds the write (a peer that stopped reading).
    pub fn send(&mut self, kind: u8, body: &[u8], timeout: Duration) -> Result<(), SessionError> {
        if body.len() > MAX_BODY {
            return Err(SessionError::TooLong(body.len() as u64));
        }
        let tag: [u8; MAC_LEN] = self
            .mac(self.role, self.sent, kind, body)
            .finalize()
            .into_bytes()
            .into();
        self.stream
            .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io_error)?;
        let mut head = [0u8; 5];
        head[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
        head[4] = kind;
        self.stream.write_all(&head).map_err(io_error)?;
        self.stream.write_all(body).map_err(io_error)?;
        self.stream.write_all(&tag).map_err(io_error)?;
        self.sent += 1;
        Ok(())
    }

    /// Receives one message: its kind and body. `timeout` bounds the wait for its first byte
    /// (`None`: wait for ever); once a message has begun, the rest must follow within
    /// [`MID_MESSAGE_TIMEOUT`] per read, and a stall there is an error (the stream would be
    /// out of step after it), never a [`SessionError::Timeout`].
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<(u8, Vec<u8>), SessionError> {
        self.stream
            .set_read_timeout(timeout.map(|t| t.max(Duration::from_millis(1))))
            .map_err(io_error)?;
        let mut head = [0u8; 5];
        match self.stream.read(&mut head[..1]) {
            Ok(0) => return Err(SessionError::Closed),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Err(SessionError::Timeout),
            Err(e) => return Err(io_error(e)),
        }
        let mid = |e: io::Error| match io_error(e) {
            SessionError::Timeout => SessionError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer stopped in the middle of a message",
            )),
            other => other,
        };
        self.stream
            .set_read_timeout(Some(MID_MESSAGE_TIMEOUT))
            .map_err(io_error)?;
        self.stream.read_exact(&mut head[1..]).map_err(mid)?;
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len > self.max_body {
            return Err(SessionError::TooLong(len as u64));
        }
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).map_err(mid)?;
        let mut tag = [0u8; MAC_LEN];
        self.stream.read_exact(&mut tag).map_err(mid)?;
        // Compared in constant time.
        self.mac(self.role.peer(), self.received, head[4], &body)
            .verify_slice(&tag)
            .map_err(|_| SessionError::Tampered)?;
        self.received += 1;
        Ok((head[4], body))
    }

    /// True when the peer has closed its end (see [`peer_gone`]).
    pub fn peer_closed(&self) -> bool {
        peer_gone(&self.stream)
    }

    /// A second handle on the connection (to watch it from another thread).
    pub fn try_clone_stream(&self) -> io::Result<TcpStream> {
        self.stream.try_clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (Session, Session) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let c = TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        let info = PeerInfo {
            peer: addr,
            local: addr,
        };
        let key = [9u8; MAC_LEN];
        (
            Session::new(s, key, Role::Listener, info),
            Session::new(c, key, Role::Connector, info),
        )
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn messages_arrive_in_order_and_authenticated() {
        let (mut a, mut b) = pair();
        a.send(1, b"hello", T).unwrap();
        a.send(2, &[], T).unwrap();
        b.send(3, &vec![7u8; 100_000], T).unwrap();
        assert_eq!(b.recv(Some(T)).unwrap(), (1, b"hello".to_vec()));
        assert_eq!(b.recv(Some(T)).unwrap(), (2, Vec::new()));
        let (k, body) = a.recv(Some(T)).unwrap();
        assert_eq!((k, body.len()), (3, 100_000));
        assert!(matches!(
            b.recv(Some(Duration::from_millis(20))),
            Err(SessionError::Timeout)
        ));
    }

    #[test]
    fn a_forged_replayed_or_reflected_message_is_refused() {
        // Forged: right frame, wrong key.
        let (mut a, mut b) = pair();
        a.key = [1u8; MAC_LEN];
        a.send(1, b"x", T).unwrap();
        assert!(matches!(b.recv(Some(T)), Err(SessionError::Tampered)));
        // Replayed: the counter moved on, so the same bytes again do not verify.
        let (mut a, mut b) = pair();
        a.send(1, b"x", T).unwrap();
        b.recv(Some(T)).unwrap();
        a.sent = 0;
        a.send(1, b"x", T).unwrap();
        assert!(matches!(b.recv(Some(T)), Err(SessionError::Tampered)));
        // Reflected: a message MACed as the listener's, arriving at the listener.
        let (mut a, b) = pair();
        let mut mirror = Session::new(b.stream, a.key, Role::Listener, a.peer);
        mirror.send(1, b"x", T).unwrap();
        assert!(matches!(a.recv(Some(T)), Err(SessionError::Tampered)));
    }

    #[test]
    fn a_closed_peer_and_an_absurd_length_are_clear_errors() {
        let (mut a, b) = pair();
        drop(b);
        assert!(matches!(a.recv(Some(T)), Err(SessionError::Closed)));
        let (a, mut b) = pair();
        assert!(!b.peer_closed());
        let mut raw = a.stream.try_clone().unwrap();
        raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
        raw.write_all(&[1]).unwrap();
        assert!(matches!(b.recv(Some(T)), Err(SessionError::TooLong(_))));
        drop((a, raw));
        std::thread::sleep(Duration::from_millis(20));
        assert!(b.peer_closed());
    }
}
