//! The rendezvous: one TCP connection on which both sides prove they hold the shared secret,
//! then the listener hands the connector the [`Payload`]. The bytes are in [`crate::wire`].
//!
//! Every read and write is bounded by one deadline, `timeout` after the call began, so a
//! silent, dead or unreachable peer gives an error within `timeout`, never a hang.

use crate::endpoint::Endpoint;
use crate::secret::SharedSecret;
use crate::session::Session;
// What the rendezvous returns; defined with the session that holds it.
pub use crate::session::PeerInfo;
use crate::wire::{
    self, HELLO_HEAD_LEN, HELLO_LEN, HelloError, MAC_LEN, Nonce, PAYLOAD_LEN, Payload,
    PayloadError, Role, Tag,
};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// How often [`connect`] retries a refused connection, and [`Listener::accept`] polls.
const CONNECT_RETRY: Duration = Duration::from_millis(100);
const ACCEPT_POLL: Duration = Duration::from_millis(10);

/// A bound rendezvous socket, waiting for one connector.
///
/// [`listen`] is `bind` then `accept`; binding first lets a caller learn the port of
/// `ADDR:0`, or bind before it computes the payload.
#[derive(Debug)]
pub struct Listener {
    socket: TcpListener,
    endpoint: String,
}

impl Listener {
    /// Binds `endpoint` (its first address that binds, if a host name has several).
    pub fn bind(endpoint: &Endpoint) -> Result<Listener, RendezvousError> {
        let name = endpoint.to_string();
        let addrs = endpoint
            .resolve()
            .map_err(|source| RendezvousError::Resolve {
                endpoint: name.clone(),
                source,
            })?;
        let bind_failed = |source| RendezvousError::Bind {
            endpoint: name.clone(),
            source,
        };
        let socket = TcpListener::bind(&addrs[..]).map_err(bind_failed)?;
        // Polled, so that waiting for a connector honours the deadline.
        socket.set_nonblocking(true).map_err(bind_failed)?;
        Ok(Listener {
            socket,
            endpoint: name,
        })
    }

    /// The address bound (with the port the kernel picked for port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Waits for one connector, authenticates it and sends it `payload`; returns once the
    /// connector has acknowledged the payload.
    ///
    /// `timeout` bounds the whole call, waiting for the connector included. A connection
    /// that fails the handshake ends the call with its error (and the other side gets one
    /// too); the caller decides whether to accept again.
    pub fn accept(
        &self,
        secret: &SharedSecret,
        payload: &Payload,
        timeout: Duration,
    ) -> Result<PeerInfo, RendezvousError> {
        // The connection closes when the session is dropped here.
        self.accept_session(secret, payload, timeout)
            .map(|s| s.peer())
    }

    /// As [`Listener::accept`], keeping the connection open as an authenticated
    /// [`Session`] for the messages that follow.
    pub fn accept_session(
        &self,
        secret: &SharedSecret,
        payload: &Payload,
        timeout: Duration,
    ) -> Result<Session, RendezvousError> {
        payload
            .validate()
            .map_err(RendezvousError::InvalidPayload)?;
        let deadline = Instant::now() + timeout;
        let accept_failed = |source| RendezvousError::Accept {
            endpoint: self.endpoint.clone(),
            source,
        };
        let (stream, peer) = loop {
            match self.socket.accept() {
                Ok(pair) => break pair,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionAborted
                    ) =>
                {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(RendezvousError::AcceptTimeout {
                            endpoint: self.endpoint.clone(),
                            after: timeout,
                        });
                    }
                    std::thread::sleep(left.min(ACCEPT_POLL));
                }
                Err(e) => return Err(accept_failed(e)),
            }
        };
        stream.set_nonblocking(false).map_err(accept_failed)?;
        let local = stream.local_addr().map_err(accept_failed)?;
        stream.set_nodelay(true).map_err(accept_failed)?;
        let mut link = Link::new(stream, peer.to_string(), timeout, deadline);
        let key = run_listener_keyed(&mut link, secret, payload, fresh_nonce()?)?;
        Ok(Session::new(
            link.stream,
            key,
            Role::Listener,
            PeerInfo { peer, local },
        ))
    }
}

/// Listens on `endpoint` for one connector, authenticates it and sends it `payload`.
///
/// Same as [`Listener::bind`] then [`Listener::accept`]; `timeout` bounds the accept and
/// handshake.
pub fn listen(
    endpoint: &Endpoint,
    secret: &SharedSecret,
    payload: &Payload,
    timeout: Duration,
) -> Result<PeerInfo, RendezvousError> {
    Listener::bind(endpoint)?.accept(secret, payload, timeout)
}

/// Connects to the listener at `endpoint`, authenticates both ways and receives the payload.
///
/// A refused connection is retried every 100 ms until `timeout` has passed since the call,
/// so the listener may start after the connector. `timeout` bounds the whole call except
/// the resolution of a host name, which is the system resolver's (give an IP address where
/// that matters).
pub fn connect(
    endpoint: &Endpoint,
    secret: &SharedSecret,
    timeout: Duration,
) -> Result<(Payload, PeerInfo), RendezvousError> {
    // The connection closes when the session is dropped here.
    connect_session(endpoint, secret, timeout).map(|(p, s)| (p, s.peer()))
}

/// As [`connect`], keeping the connection open as an authenticated [`Session`].
pub fn connect_session(
    endpoint: &Endpoint,
    secret: &SharedSecret,
    timeout: Duration,
) -> Result<(Payload, Session), RendezvousError> {
    if endpoint.port() == 0 {
        return Err(RendezvousError::PortZero {
            endpoint: endpoint.to_string(),
        });
    }
    let deadline = Instant::now() + timeout;
    let name = endpoint.to_string();
    let addrs = endpoint
        .resolve()
        .map_err(|source| RendezvousError::Resolve {
            endpoint: name.clone(),
            source,
        })?;
    let mut last_error = None;
    let (stream, peer) = 'connected: loop {
        for addr in &addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(addr, left) {
                Ok(stream) => break 'connected (stream, *addr),
                Err(e) => last_error = Some(e),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RendezvousError::ConnectTimeout {
                endpoint: name,
                after: timeout,
                last_error,
            });
        }
        std::thread::sleep(left.min(CONNECT_RETRY));
    };
    let setup_failed = |source| RendezvousError::Io {
        peer: peer.to_string(),
        stage: Stage::SendHello,
        source,
    };
    let local = stream.local_addr().map_err(setup_failed)?;
    stream.set_nodelay(true).map_err(setup_failed)?;
    let mut link = Link::new(stream, peer.to_string(), timeout, deadline);
    let (payload, key) = run_connector_keyed(&mut link, secret, fresh_nonce()?)?;
    Ok((
        payload,
        Session::new(link.stream, key, Role::Connector, PeerInfo { peer, local }),
    ))
}

fn fresh_nonce() -> Result<Nonce, RendezvousError> {
    let mut nonce = [0u8; wire::NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(RendezvousError::Random)?;
    Ok(nonce)
}

/// Where in the exchange something happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Sending our hello.
    SendHello,
    /// Receiving the peer's hello.
    RecvHello,
    /// Sending our proof.
    SendProof,
    /// Receiving the peer's proof.
    RecvProof,
    /// Sending the payload (listener).
    SendPayload,
    /// Receiving the payload (connector).
    RecvPayload,
    /// Sending the ack (connector).
    SendAck,
    /// Receiving the ack (listener).
    RecvAck,
}

impl Stage {
    fn what(self) -> &'static str {
        match self {
            Stage::SendHello => "our hello",
            Stage::RecvHello => "its hello",
            Stage::SendProof => "our proof",
            Stage::RecvProof => "its proof",
            Stage::SendPayload => "the payload",
            Stage::RecvPayload => "the payload",
            Stage::SendAck => "our ack of the payload",
            Stage::RecvAck => "its ack of the payload",
        }
    }

    fn sending(self) -> bool {
        matches!(
            self,
            Stage::SendHello | Stage::SendProof | Stage::SendPayload | Stage::SendAck
        )
    }

    /// Why a peer most likely hung up at this point.
    fn hang_up_hint(self) -> &'static str {
        match self {
            Stage::RecvHello | Stage::SendHello => {
                "it may not be a gpipe relay, or it refused the connection; see its error"
            }
            Stage::RecvProof | Stage::SendProof => "it refused our hello; see its error",
            Stage::RecvPayload | Stage::SendPayload => {
                "it refused our proof or gave up; see its error"
            }
            Stage::RecvAck | Stage::SendAck => "it refused the payload; see its error",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = if self.sending() {
            "sending"
        } else {
            "receiving"
        };
        write!(f, "{verb} {}", self.what())
    }
}

/// Why a rendezvous failed. The `Display` says what went wrong, with whom, and what to do.
#[derive(Debug)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The payload given to [`listen`] has a field out of range.
    InvalidPayload(PayloadError),
    /// [`connect`] was given port 0.
    PortZero {
        /// The address given.
        endpoint: String,
    },
    /// The host name did not resolve.
    Resolve {
        /// The address given.
        endpoint: String,
        /// The resolver's error.
        source: io::Error,
    },
    /// The listening socket could not be bound.
    Bind {
        /// The address given.
        endpoint: String,
        /// The error.
        source: io::Error,
    },
    /// Accepting a connection failed.
    Accept {
        /// The address listened on.
        endpoint: String,
        /// The error.
        source: io::Error,
    },
    /// No connector came within the timeout.
    AcceptTimeout {
        /// The address listened on.
        endpoint: String,
        /// The timeout.
        after: Duration,
    },
    /// The listener could not be reached within the timeout.
    ConnectTimeout {
        /// The address connected to.
        endpoint: String,
        /// The timeout.
        after: Duration,
        /// The error of the last attempt, if one failed rather than ran out of time.
        last_error: Option<io::Error>,
    },
    /// The peer did not send (or take) a message within the timeout.
    Timeout {
        /// The peer's address.
        peer: String,
        /// The timeout.
        after: Duration,
        /// What we were waiting for.
        stage: Stage,
    },
    /// The peer closed the connection in the middle of the exchange.
    Closed {
        /// The peer's address.
        peer: String,
        /// What we were receiving or sending.
        stage: Stage,
        /// Bytes of the message received before the close (0 when sending).
        got: usize,
        /// Bytes the message has.
        expected: usize,
    },
    /// Another I/O error on the connection (reset, unreachable).
    Io {
        /// The peer's address.
        peer: String,
        /// What we were receiving or sending.
        stage: Stage,
        /// The error.
        source: io::Error,
    },
    /// The peer's first bytes are not the relay's magic: another program.
    BadMagic {
        /// The peer's address.
        peer: String,
        /// The 8 bytes received.
        got: [u8; 8],
    },
    /// The peer speaks another protocol version.
    Version {
        /// The peer's address.
        peer: String,
        /// Its version.
        theirs: u16,
    },
    /// The peer's hello names our own role.
    SameRole {
        /// The peer's address.
        peer: String,
        /// The role it claims.
        role: Role,
    },
    /// The peer's hello breaks the format: unknown role, non-zero reserved bytes.
    Malformed {
        /// The peer's address.
        peer: String,
        /// What is wrong.
        what: String,
    },
    /// The peer sent our own nonce back.
    Reflected {
        /// The peer's address.
        peer: String,
    },
    /// The peer's proof is not the one a holder of our secret would send.
    ProofMismatch {
        /// The peer's address.
        peer: String,
    },
    /// The listener announced a payload of the wrong size.
    PayloadLength {
        /// The peer's address.
        peer: String,
        /// The length it announced.
        got: u32,
    },
    /// The payload's MAC does not match: it was changed on the way.
    PayloadTampered {
        /// The peer's address.
        peer: String,
    },
    /// The payload is authentic but has a field out of range.
    BadPayload {
        /// The peer's address.
        peer: String,
        /// What is wrong.
        problem: PayloadError,
    },
    /// The connector's ack does not match the payload sent.
    AckMismatch {
        /// The peer's address.
        peer: String,
    },
    /// The OS random number generator failed.
    Random(getrandom::Error),
}

impl fmt::Display for RendezvousError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use RendezvousError as E;
        match self {
            E::InvalidPayload(p) => write!(f, "the payload to send is invalid: {p}"),
            E::PortZero { endpoint } => write!(
                f,
                "cannot connect to {endpoint}: port 0 only means \"any port\" when listening; \
                 give the port the listener uses"
            ),
            E::Resolve { endpoint, source } => {
                write!(
                    f,
                    "cannot resolve {endpoint}: {source}; check the host name"
                )
            }
            E::Bind { endpoint, source } => write!(
                f,
                "cannot listen on {endpoint}: {source}; pick another port, or an address of \
                 this host"
            ),
            E::Accept { endpoint, source } => {
                write!(f, "accepting a connection on {endpoint} failed: {source}")
            }
            E::AcceptTimeout { endpoint, after } => write!(
                f,
                "timed out after {after:?} waiting for a peer to connect to {endpoint}: \
                 start the other side with --connect to this host's address, and check that \
                 no firewall blocks the port"
            ),
            E::ConnectTimeout {
                endpoint,
                after,
                last_error,
            } => {
                write!(
                    f,
                    "timed out after {after:?} connecting to the peer at {endpoint}"
                )?;
                if let Some(e) = last_error {
                    write!(f, " (last attempt: {e})")?;
                }
                write!(
                    f,
                    ": start the other side with --listen {endpoint}, and check the address \
                     and any firewall"
                )
            }
            E::Timeout { peer, after, stage } if stage.sending() => write!(
                f,
                "timed out after {after:?} waiting for the peer at {peer} to take {}: \
                 it is stuck or the network is down",
                stage.what()
            ),
            E::Timeout { peer, after, stage } => write!(
                f,
                "timed out after {after:?} waiting for the peer at {peer} to send {}: \
                 it is not a gpipe relay, or it is stuck, or the network dropped the connection",
                stage.what()
            ),
            E::Closed {
                peer,
                stage,
                got,
                expected,
            } => {
                write!(f, "the peer at {peer} closed the connection")?;
                if stage.sending() {
                    write!(f, " while we were {stage}")?;
                } else {
                    write!(
                        f,
                        " after {got} of the {expected} bytes of {}",
                        stage.what()
                    )?;
                }
                write!(f, ": {}", stage.hang_up_hint())
            }
            E::Io {
                peer,
                stage,
                source,
            } => write!(
                f,
                "connection to the peer at {peer} failed while {stage}: {source} ({})",
                stage.hang_up_hint()
            ),
            E::BadMagic { peer, got } => write!(
                f,
                "the peer at {peer} is not a gpipe relay (bad magic \"{}\"): check the address \
                 and port",
                got.escape_ascii()
            ),
            E::Version { peer, theirs } => write!(
                f,
                "the peer at {peer} is a version {theirs} peer, this is version {}: run the \
                 same gpipe version on both hosts",
                wire::VERSION
            ),
            E::SameRole { peer, role } => write!(
                f,
                "the peer at {peer} is also a {role}: one side must use --listen, the other \
                 --connect"
            ),
            E::Malformed { peer, what } => {
                write!(f, "the peer at {peer} sent a malformed hello: {what}")
            }
            E::Reflected { peer } => write!(
                f,
                "the peer at {peer} sent our own nonce back: a reflected message, refused \
                 (something on the path is not a gpipe relay)"
            ),
            E::ProofMismatch { peer } => write!(
                f,
                "the peer's proof did not match: the two sides use different secret files \
                 (peer {peer}); copy the same secret file to both hosts"
            ),
            E::PayloadLength { peer, got } => write!(
                f,
                "the peer at {peer} announced a payload of {got} bytes, expected {PAYLOAD_LEN}: \
                 a different or corrupt relay"
            ),
            E::PayloadTampered { peer } => write!(
                f,
                "the payload from the peer at {peer} failed its MAC check: it was changed on \
                 the way; refused"
            ),
            E::BadPayload { peer, problem } => {
                write!(f, "the peer at {peer} sent an invalid payload: {problem}")
            }
            E::AckMismatch { peer } => write!(
                f,
                "the peer at {peer} acknowledged a different payload than we sent: it was \
                 changed on the way; refused"
            ),
            E::Random(e) => write!(f, "the OS random number generator failed: {e}"),
        }
    }
}

impl std::error::Error for RendezvousError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        use RendezvousError as E;
        match self {
            E::Resolve { source, .. }
            | E::Bind { source, .. }
            | E::Accept { source, .. }
            | E::Io { source, .. } => Some(source),
            E::ConnectTimeout {
                last_error: Some(e),
                ..
            } => Some(e),
            E::InvalidPayload(p) | E::BadPayload { problem: p, .. } => Some(p),
            _ => None,
        }
    }
}

/// Setting the per-call timeouts of a stream; a trait so that tests can run the exchange
/// over bytes in memory.
pub(crate) trait Timeouts {
    fn set_timeouts(&mut self, limit: Duration) -> io::Result<()>;
}

impl Timeouts for TcpStream {
    fn set_timeouts(&mut self, limit: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(limit))?;
        self.set_write_timeout(Some(limit))
    }
}

/// A connection with a deadline: each read and write may take only what is left of it.
pub(crate) struct Link<S> {
    stream: S,
    peer: String,
    timeout: Duration,
    deadline: Instant,
}

impl<S: Read + Write + Timeouts> Link<S> {
    pub(crate) fn new(stream: S, peer: String, timeout: Duration, deadline: Instant) -> Link<S> {
        Link {
            stream,
            peer,
            timeout,
            deadline,
        }
    }

    /// What is left of the deadline, or the timeout error.
    fn left(&self, stage: Stage) -> Result<Duration, RendezvousError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out(stage));
        }
        Ok(left)
    }

    fn timed_out(&self, stage: Stage) -> RendezvousError {
        RendezvousError::Timeout {
            peer: self.peer.clone(),
            after: self.timeout,
            stage,
        }
    }

    fn failed(&self, stage: Stage, source: io::Error) -> RendezvousError {
        match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => self.timed_out(stage),
            _ => RendezvousError::Io {
                peer: self.peer.clone(),
                stage,
                source,
            },
        }
    }

    fn recv(&mut self, buf: &mut [u8], stage: Stage) -> Result<(), RendezvousError> {
        let mut got = 0;
        while got < buf.len() {
            let left = self.left(stage)?;
            self.stream
                .set_timeouts(left)
                .map_err(|e| self.failed(stage, e))?;
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(RendezvousError::Closed {
                        peer: self.peer.clone(),
                        stage,
                        got,
                        expected: buf.len(),
                    });
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.failed(stage, e)),
            }
        }
        Ok(())
    }

    fn send(&mut self, buf: &[u8], stage: Stage) -> Result<(), RendezvousError> {
        let mut sent = 0;
        while sent < buf.len() {
            let left = self.left(stage)?;
            self.stream
                .set_timeouts(left)
                .map_err(|e| self.failed(stage, e))?;
            match self.stream.write(&buf[sent..]) {
                Ok(0) => {
                    return Err(RendezvousError::Closed {
                        peer: self.peer.clone(),
                        stage,
                        got: 0,
                        expected: buf.len(),
                    });
                }
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.failed(stage, e)),
            }
        }
        Ok(())
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }
}

/// Sends our hello, receives and checks the peer's; returns its nonce.
fn exchange_hellos<S: Read + Write + Timeouts>(
    link: &mut Link<S>,
    us: Role,
    nonce: &Nonce,
) -> Result<Nonce, RendezvousError> {
    link.send(&wire::hello(us, nonce), Stage::SendHello)?;
    let hello_error = |link: &Link<S>, e: HelloError| {
        let peer = link.peer();
        match e {
            HelloError::BadMagic(got) => RendezvousError::BadMagic { peer, got },
            HelloError::Version(theirs) => RendezvousError::Version { peer, theirs },
            HelloError::SameRole(role) => RendezvousError::SameRole { peer, role },
            HelloError::Reflected => RendezvousError::Reflected { peer },
            HelloError::UnknownRole(code) => RendezvousError::Malformed {
                peer,
                what: format!("unknown role {code}"),
            },
            HelloError::NonZero => RendezvousError::Malformed {
                peer,
                what: "reserved bytes are not zero".to_string(),
            },
        }
    };
    // Magic and version first: whatever follows them may differ in another version.
    let mut head = [0u8; HELLO_HEAD_LEN];
    link.recv(&mut head, Stage::RecvHello)
        .map_err(|e| whole_hello(e, 0))?;
    wire::check_hello_head(&head).map_err(|e| hello_error(link, e))?;
    let mut rest = [0u8; HELLO_LEN - HELLO_HEAD_LEN];
    link.recv(&mut rest, Stage::RecvHello)
        .map_err(|e| whole_hello(e, HELLO_HEAD_LEN))?;
    wire::parse_hello_rest(&rest, us, nonce).map_err(|e| hello_error(link, e))
}

/// Counts a hello read in two parts as one message in a `Closed` error.
fn whole_hello(e: RendezvousError, before: usize) -> RendezvousError {
    match e {
        RendezvousError::Closed {
            peer, stage, got, ..
        } => RendezvousError::Closed {
            peer,
            stage,
            got: got + before,
            expected: HELLO_LEN,
        },
        other => other,
    }
}

/// Sends our proof, receives the peer's and checks it.
fn exchange_proofs<S: Read + Write + Timeouts>(
    link: &mut Link<S>,
    secret: &SharedSecret,
    us: Role,
    ours: &Nonce,
    theirs: &Nonce,
) -> Result<(), RendezvousError> {
    let proof = wire::proof(secret.key(), us, ours, theirs);
    link.send(&proof, Stage::SendProof)?;
    let mut tag: Tag = [0; MAC_LEN];
    link.recv(&mut tag, Stage::RecvProof)?;
    // The peer's proof is made from its point of view: its role, its nonce first.
    if !wire::proof_ok(secret.key(), us.peer(), theirs, ours, &tag) {
        return Err(RendezvousError::ProofMismatch { peer: link.peer() });
    }
    Ok(())
}

/// The listener's side of the exchange, on a connected stream.
#[cfg(test)]
pub(crate) fn run_listener<S: Read + Write + Timeouts>(
    link: &mut Link<S>,
    secret: &SharedSecret,
    payload: &Payload,
    nonce: Nonce,
) -> Result<(), RendezvousError> {
    run_listener_keyed(link, secret, payload, nonce).map(|_| ())
}

/// The listener's side of the exchange, on a connected stream; returns the session key.
pub(crate) fn run_listener_keyed<S: Read + Write + Timeouts>(
    link: &mut Link<S>,
    secret: &SharedSecret,
    payload: &Payload,
    nonce: Nonce,
) -> Result<[u8; MAC_LEN], RendezvousError> {
    let theirs = exchange_hellos(link, Role::Listener, &nonce)?;
    exchange_proofs(link, secret, Role::Listener, &nonce, &theirs)?;
    let key = wire::session_key(secret.key(), &nonce, &theirs);
    let bytes = payload.encode();
    link.send(&wire::payload_message(&key, &bytes), Stage::SendPayload)?;
    let mut tag: Tag = [0; MAC_LEN];
    link.recv(&mut tag, Stage::RecvAck)?;
    if !wire::ack_ok(&key, &bytes, &tag) {
        return Err(RendezvousError::AckMismatch { peer: link.peer() });
    }
    Ok(key)
}

/// The connector's side of the exchange, on a connected stream.
#[cfg(test)]
pub(crate) fn run_connector<S: Read + Write + Timeouts>(
    link: &mut Link<S>,
    secret: &SharedSecret,
    nonce: Nonce,
) -> Result<Payload, RendezvousError> {
    run_connector_keyed(link, secret, nonce).map(|(p, _)| p)
}

/// The connector's side of the exchange, on a connected stream; returns the payload and the
/// session key.
pub(crate) fn run_connector_keyed<S: Read + Write + Timeouts>(
    link: &mut Link<S>,
    secret: &SharedSecret,
    nonce: Nonce,
) -> Result<(Payload, [u8; MAC_LEN]), RendezvousError> {
    let theirs = exchange_hellos(link, Role::Connector, &nonce)?;
    exchange_proofs(link, secret, Role::Connector, &nonce, &theirs)?;
    let key = wire::session_key(secret.key(), &theirs, &nonce);
    let mut length = [0u8; 4];
    link.recv(&mut length, Stage::RecvPayload)?;
    let length = u32::from_le_bytes(length);
    // Checked before reading on: the length is fixed in this version.
    if length as usize != PAYLOAD_LEN {
        return Err(RendezvousError::PayloadLength {
            peer: link.peer(),
            got: length,
        });
    }
    let mut bytes = [0u8; PAYLOAD_LEN];
    link.recv(&mut bytes, Stage::RecvPayload)?;
    let mut tag: Tag = [0; MAC_LEN];
    link.recv(&mut tag, Stage::RecvPayload)?;
    if !wire::payload_ok(&key, &bytes, &tag) {
        return Err(RendezvousError::PayloadTampered { peer: link.peer() });
    }
    let payload = Payload::decode(&bytes).map_err(|problem| RendezvousError::BadPayload {
        peer: link.peer(),
        problem,
    })?;
    link.send(&wire::ack(&key, &bytes), Stage::SendAck)?;
    Ok((payload, key))
}

#[cfg(test)]
mod tests;
