//! Host tests of the rendezvous: real exchanges over 127.0.0.1, scripted hostile peers, and
//! random bytes fed as a peer's messages. Every test that runs two sides runs under a
//! watchdog, so a bug that hangs fails the test instead of the run.

use super::*;
use crate::wire::tests::sample_payload;
use crate::wire::{NONCE_LEN, PAYLOAD_LEN};
use proptest::prelude::*;
use std::io::Cursor;
use std::sync::mpsc;
use std::thread;

const SECRET: &[u8] = b"0123456789abcdef-shared";
const OTHER_SECRET: &[u8] = b"0123456789abcdef-other!";
const SHORT: Duration = Duration::from_millis(400);
const LONG: Duration = Duration::from_secs(5);
/// A watchdog limit well above every timeout used here.
const WATCHDOG: Duration = Duration::from_secs(20);

fn secret(bytes: &[u8]) -> SharedSecret {
    SharedSecret::for_test(bytes)
}

/// Runs `f` on a thread and fails the test if it has not finished within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(value) => value,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("watchdog: still running after {limit:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the test body panicked"),
    }
}

fn loopback() -> Endpoint {
    "127.0.0.1:0".parse().unwrap()
}

fn endpoint_of(addr: SocketAddr) -> Endpoint {
    Endpoint::from_socket_addr(addr)
}

/// Runs a listener with `listener_secret` on a thread and a connector with
/// `connector_secret`; returns both results.
fn exchange(
    listener_secret: &'static [u8],
    connector_secret: &'static [u8],
) -> (
    Result<PeerInfo, RendezvousError>,
    Result<(Payload, PeerInfo), RendezvousError>,
) {
    within(WATCHDOG, move || {
        let listener = Listener::bind(&loopback()).unwrap();
        let addr = listener.local_addr().unwrap();
        let side_a = thread::spawn(move || {
            listener.accept(&secret(listener_secret), &sample_payload(), LONG)
        });
        let side_b = connect(&endpoint_of(addr), &secret(connector_secret), LONG);
        (side_a.join().unwrap(), side_b)
    })
}

#[test]
fn exchange_over_loopback_delivers_the_payload() {
    let (a, b) = exchange(SECRET, SECRET);
    let a = a.unwrap();
    let (payload, b) = b.unwrap();
    assert_eq!(payload, sample_payload());
    assert_eq!(a.peer, b.local);
    assert_eq!(a.local, b.peer);
}

#[test]
fn different_secrets_fail_on_both_sides() {
    for (l, c) in [(SECRET, OTHER_SECRET), (OTHER_SECRET, SECRET)] {
        let (a, b) = exchange(l, c);
        let a = a.unwrap_err();
        let b = b.unwrap_err();
        assert!(matches!(a, RendezvousError::ProofMismatch { .. }), "{a}");
        assert!(matches!(b, RendezvousError::ProofMismatch { .. }), "{b}");
        for e in [a, b] {
            assert!(
                e.to_string().starts_with(
                    "the peer's proof did not match: the two sides use different secret files"
                ),
                "{e}"
            );
        }
    }
}

#[test]
fn connect_waits_for_a_listener_that_starts_later() {
    within(WATCHDOG, || {
        // Find a free port, then leave it closed for a while: the first attempts are refused.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let target: Endpoint = format!("127.0.0.1:{port}").parse().unwrap();
        let late = target.clone();
        let side_a = thread::spawn(move || {
            thread::sleep(Duration::from_millis(300));
            listen(&late, &secret(SECRET), &sample_payload(), LONG)
        });
        let (payload, _) = connect(&target, &secret(SECRET), LONG).unwrap();
        assert_eq!(payload, sample_payload());
        side_a.join().unwrap().unwrap();
    });
}

#[test]
fn nobody_listening_times_out_with_the_last_error() {
    let err = within(WATCHDOG, || {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let start = Instant::now();
        let target = format!("127.0.0.1:{port}").parse().unwrap();
        let err = connect(&target, &secret(SECRET), SHORT).unwrap_err();
        assert!(start.elapsed() < SHORT + Duration::from_secs(1));
        err
    });
    assert!(
        matches!(&err, RendezvousError::ConnectTimeout { last_error: Some(e), .. }
            if e.kind() == io::ErrorKind::ConnectionRefused),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.starts_with("timed out after 400ms connecting to the peer at 127.0.0.1:"),
        "{text}"
    );
    assert!(text.contains("--listen"), "{text}");
}

#[test]
fn nobody_connecting_times_out_the_listener() {
    let err = within(WATCHDOG, || {
        let start = Instant::now();
        let err = listen(&loopback(), &secret(SECRET), &sample_payload(), SHORT).unwrap_err();
        assert!(start.elapsed() < SHORT + Duration::from_secs(1));
        err
    });
    assert!(
        matches!(err, RendezvousError::AcceptTimeout { .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("timed out after 400ms waiting for a peer to connect")
    );
}

#[test]
fn a_peer_that_says_nothing_times_out_the_listener() {
    let err = within(WATCHDOG, || {
        let listener = Listener::bind(&loopback()).unwrap();
        let addr = listener.local_addr().unwrap();
        // Connects, then stays silent and keeps the connection open.
        let silent = TcpStream::connect(addr).unwrap();
        let start = Instant::now();
        let err = listener
            .accept(&secret(SECRET), &sample_payload(), SHORT)
            .unwrap_err();
        assert!(start.elapsed() < SHORT + Duration::from_secs(1));
        drop(silent);
        err
    });
    assert!(
        matches!(
            err,
            RendezvousError::Timeout {
                stage: Stage::RecvHello,
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.starts_with("timed out after 400ms waiting for the peer at 127.0.0.1:"),
        "{text}"
    );
    assert!(text.contains("to send its hello"), "{text}");
}

#[test]
fn a_listener_that_says_nothing_times_out_the_connector() {
    let err = within(WATCHDOG, || {
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        let start = Instant::now();
        // The kernel completes the connection from the backlog; nobody ever speaks.
        let err = connect(&endpoint_of(addr), &secret(SECRET), SHORT).unwrap_err();
        assert!(start.elapsed() < SHORT + Duration::from_secs(1));
        drop(silent);
        err
    });
    assert!(
        matches!(
            err,
            RendezvousError::Timeout {
                stage: Stage::RecvHello,
                ..
            }
        ),
        "{err}"
    );
}

/// Accepts one connection on a `Listener` (on a thread) while `peer` plays the connector
/// over a raw stream; returns the listener's result and what `peer` returned.
fn against_listener<T: Send + 'static>(
    peer: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (Result<PeerInfo, RendezvousError>, T) {
    within(WATCHDOG, move || {
        let listener = Listener::bind(&loopback()).unwrap();
        let addr = listener.local_addr().unwrap();
        let side_a =
            thread::spawn(move || listener.accept(&secret(SECRET), &sample_payload(), LONG));
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(LONG)).unwrap();
        let out = peer(stream);
        (side_a.join().unwrap(), out)
    })
}

/// Runs `connect` against `peer`, which plays the listener over a raw accepted stream.
fn against_connector<T: Send + 'static>(
    peer: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (Result<(Payload, PeerInfo), RendezvousError>, T) {
    within(WATCHDOG, move || {
        let socket = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        let side_a = thread::spawn(move || {
            let (stream, _) = socket.accept().unwrap();
            stream.set_read_timeout(Some(LONG)).unwrap();
            peer(stream)
        });
        let result = connect(&endpoint_of(addr), &secret(SECRET), LONG);
        (result, side_a.join().unwrap())
    })
}

/// Sends `bytes`, then reads until the other side closes (so our close never resets data
/// it has not read yet).
fn say_and_wait(mut stream: TcpStream, bytes: &[u8]) {
    stream.write_all(bytes).unwrap();
    let mut sink = Vec::new();
    let _ = stream.read_to_end(&mut sink);
}

fn read_hello(stream: &mut TcpStream) -> Nonce {
    let mut hello = [0u8; HELLO_LEN];
    stream.read_exact(&mut hello).unwrap();
    hello[16..].try_into().unwrap()
}

fn listener_error(bytes: &'static [u8]) -> RendezvousError {
    against_listener(move |s| say_and_wait(s, bytes))
        .0
        .unwrap_err()
}

#[test]
fn another_program_gets_a_bad_magic_error() {
    let err = listener_error(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(matches!(err, RendezvousError::BadMagic { got, .. } if &got == b"GET / HT"));
    let text = err.to_string();
    assert!(
        text.contains("is not a gpipe relay (bad magic \"GET / HT\")"),
        "{text}"
    );
    // The connector side, against an SSH-like server that speaks first.
    let (err, ()) = against_connector(|s| say_and_wait(s, b"SSH-2.0-OpenSSH_9.6\r\n"));
    assert!(matches!(err.unwrap_err(), RendezvousError::BadMagic { .. }));
}

#[test]
fn another_version_is_named_in_the_error() {
    let mut v2 = wire::hello(Role::Connector, &[1; NONCE_LEN]);
    v2[8..10].copy_from_slice(&2u16.to_le_bytes());
    let v2: &'static [u8] = Box::leak(Box::new(v2));
    let err = listener_error(&v2[..HELLO_HEAD_LEN]);
    assert!(
        matches!(err, RendezvousError::Version { theirs: 2, .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains("version 2 peer, this is version 1"), "{text}");
    let (err, ()) = against_connector(move |s| say_and_wait(s, v2));
    assert!(matches!(
        err.unwrap_err(),
        RendezvousError::Version { theirs: 2, .. }
    ));
}

#[test]
fn truncated_messages_say_how_far_they_got() {
    let hello = wire::hello(Role::Connector, &[1; NONCE_LEN]);
    let leaked: &'static [u8; HELLO_LEN] = Box::leak(Box::new(hello));
    let first_20 = &leaked[..20];
    // Sends 20 bytes of a hello, then closes its sending half (and waits for ours).
    let (result, ()) = against_listener(move |mut s| {
        s.write_all(first_20).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = s.read_to_end(&mut Vec::new());
    });
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            RendezvousError::Closed {
                stage: Stage::RecvHello,
                got: 20,
                expected: 48,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("after 20 of the 48 bytes of its hello"),
        "{err}"
    );

    // A listener that proves itself, then hangs up halfway through the payload.
    let (result, ()) = against_connector(|mut s| {
        let theirs = read_hello(&mut s);
        let ours = [3u8; NONCE_LEN];
        s.write_all(&wire::hello(Role::Listener, &ours)).unwrap();
        s.write_all(&wire::proof(SECRET, Role::Listener, &ours, &theirs))
            .unwrap();
        let key = wire::session_key(SECRET, &ours, &theirs);
        let msg = wire::payload_message(&key, &sample_payload().encode());
        s.write_all(&msg[..100]).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = s.read_to_end(&mut Vec::new());
    });
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            RendezvousError::Closed {
                stage: Stage::RecvPayload,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn malformed_hellos_are_refused() {
    let mut same = wire::hello(Role::Listener, &[1; NONCE_LEN]);
    let err = listener_error(Box::leak(Box::new(same)));
    assert!(
        matches!(
            err,
            RendezvousError::SameRole {
                role: Role::Listener,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("one side must use --listen"),
        "{err}"
    );
    same[10] = 9;
    let err = listener_error(Box::leak(Box::new(same)));
    assert!(matches!(err, RendezvousError::Malformed { .. }), "{err}");
    let mut reserved = wire::hello(Role::Connector, &[1; NONCE_LEN]);
    reserved[13] = 1;
    let err = listener_error(Box::leak(Box::new(reserved)));
    assert!(
        err.to_string().contains("reserved bytes are not zero"),
        "{err}"
    );
}

#[test]
fn a_reflected_hello_or_proof_is_refused() {
    // Send the listener's own hello back with the role changed: same nonce.
    let (result, ()) = against_listener(|mut s| {
        let mut hello = [0u8; HELLO_LEN];
        s.read_exact(&mut hello).unwrap();
        hello[10] = 2;
        say_and_wait(s, &hello);
    });
    let err = result.unwrap_err();
    assert!(matches!(err, RendezvousError::Reflected { .. }), "{err}");

    // A fresh nonce, then the listener's own proof sent back as ours.
    let (result, ()) = against_listener(|mut s| {
        read_hello(&mut s);
        s.write_all(&wire::hello(Role::Connector, &[4; NONCE_LEN]))
            .unwrap();
        let mut proof = [0u8; MAC_LEN];
        s.read_exact(&mut proof).unwrap();
        say_and_wait(s, &proof);
    });
    let err = result.unwrap_err();
    assert!(
        matches!(err, RendezvousError::ProofMismatch { .. }),
        "{err}"
    );
}

#[test]
fn a_replayed_proof_is_refused() {
    // A connector proof recorded in an earlier session (another listener nonce).
    let (result, ()) = against_listener(|mut s| {
        read_hello(&mut s);
        let ours = [5u8; NONCE_LEN];
        s.write_all(&wire::hello(Role::Connector, &ours)).unwrap();
        let earlier_listener_nonce = [6u8; NONCE_LEN];
        let old = wire::proof(SECRET, Role::Connector, &ours, &earlier_listener_nonce);
        say_and_wait(s, &old);
    });
    let err = result.unwrap_err();
    assert!(
        matches!(err, RendezvousError::ProofMismatch { .. }),
        "{err}"
    );
}

/// Plays a listener that holds the secret and sends `message(key, theirs)` as the payload
/// message; returns the connector's result.
fn connector_given(
    message: impl FnOnce(&[u8; MAC_LEN]) -> Vec<u8> + Send + 'static,
) -> RendezvousError {
    let (result, ()) = against_connector(move |mut s| {
        let theirs = read_hello(&mut s);
        let ours = [3u8; NONCE_LEN];
        s.write_all(&wire::hello(Role::Listener, &ours)).unwrap();
        s.write_all(&wire::proof(SECRET, Role::Listener, &ours, &theirs))
            .unwrap();
        let key = wire::session_key(SECRET, &ours, &theirs);
        say_and_wait(s, &message(&key));
    });
    result.unwrap_err()
}

#[test]
fn a_tampered_payload_is_refused() {
    for at in [
        0,
        4,
        4 + 130,
        4 + PAYLOAD_LEN - 1,
        4 + PAYLOAD_LEN,
        4 + PAYLOAD_LEN + 31,
    ] {
        let err = connector_given(move |key| {
            let mut msg = wire::payload_message(key, &sample_payload().encode());
            msg[at] ^= 0x01;
            msg
        });
        if at < 4 {
            assert!(
                matches!(err, RendezvousError::PayloadLength { got: 153, .. }),
                "{err}"
            );
        } else {
            assert!(
                matches!(err, RendezvousError::PayloadTampered { .. }),
                "{at}: {err}"
            );
            assert!(err.to_string().contains("failed its MAC check"), "{err}");
        }
    }
    // A payload MACed with another session's key (a replay) fails the same way.
    let err = connector_given(|_| {
        let old = wire::session_key(SECRET, &[8; NONCE_LEN], &[9; NONCE_LEN]);
        wire::payload_message(&old, &sample_payload().encode())
    });
    assert!(
        matches!(err, RendezvousError::PayloadTampered { .. }),
        "{err}"
    );
}

#[test]
fn an_authentic_payload_out_of_range_is_refused() {
    let err = connector_given(|key| {
        let mut bad = sample_payload();
        bad.rank = 5;
        wire::payload_message(key, &bad.encode())
    });
    assert!(
        matches!(
            err,
            RendezvousError::BadPayload {
                problem: PayloadError::RankOutOfRange { .. },
                ..
            }
        ),
        "{err}"
    );
    // And the listener refuses to send one.
    let mut bad = sample_payload();
    bad.world_size = 1;
    bad.rank = 0;
    let err = Listener::bind(&loopback())
        .unwrap()
        .accept(&secret(SECRET), &bad, SHORT)
        .unwrap_err();
    assert!(matches!(
        err,
        RendezvousError::InvalidPayload(PayloadError::WorldTooSmall(1))
    ));
}

#[test]
fn a_wrong_or_missing_ack_fails_the_listener() {
    let play = |ack: Option<[u8; MAC_LEN]>| {
        against_listener(move |mut s| {
            let theirs = read_hello(&mut s);
            let ours = [5u8; NONCE_LEN];
            s.write_all(&wire::hello(Role::Connector, &ours)).unwrap();
            s.write_all(&wire::proof(SECRET, Role::Connector, &ours, &theirs))
                .unwrap();
            let mut rest = [0u8; MAC_LEN + 4 + PAYLOAD_LEN + MAC_LEN];
            s.read_exact(&mut rest).unwrap();
            match ack {
                Some(ack) => say_and_wait(s, &ack),
                None => drop(s),
            }
        })
        .0
        .unwrap_err()
    };
    let err = play(Some([0; MAC_LEN]));
    assert!(matches!(err, RendezvousError::AckMismatch { .. }), "{err}");
    let err = play(None);
    assert!(
        matches!(
            err,
            RendezvousError::Closed {
                stage: Stage::RecvAck,
                got: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("it refused the payload"), "{err}");
}

#[test]
fn connect_refuses_port_zero() {
    let err = connect(&"127.0.0.1:0".parse().unwrap(), &secret(SECRET), SHORT).unwrap_err();
    assert!(matches!(err, RendezvousError::PortZero { .. }), "{err}");
}

/// A stream whose peer's bytes are scripted: reads come from `input`, then end of file;
/// writes are kept.
struct Scripted {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for Scripted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // A byte or a few at a time, like a network that splits messages anywhere.
        let n = buf.len().min(7);
        self.input.read(&mut buf[..n])
    }
}

impl Write for Scripted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Timeouts for Scripted {
    fn set_timeouts(&mut self, _: Duration) -> io::Result<()> {
        Ok(())
    }
}

fn scripted(input: Vec<u8>) -> Link<Scripted> {
    let stream = Scripted {
        input: Cursor::new(input),
        output: Vec::new(),
    };
    Link::new(stream, "scripted".to_string(), LONG, Instant::now() + LONG)
}

const OURS: Nonce = [0xA5; NONCE_LEN];
const THEIRS: Nonce = [0x5A; NONCE_LEN];

/// What a peer that knows the secret would send before the part under test, `depth` steps
/// deep: nothing, magic and version, a whole hello, hello and proof.
fn honest_prefix(depth: u8, peer_role: Role) -> Vec<u8> {
    let hello = wire::hello(peer_role, &THEIRS);
    match depth {
        0 => Vec::new(),
        1 => hello[..HELLO_HEAD_LEN].to_vec(),
        2 => hello.to_vec(),
        _ => {
            let mut out = hello.to_vec();
            out.extend_from_slice(&wire::proof(SECRET, peer_role, &THEIRS, &OURS));
            out
        }
    }
}

#[test]
fn scripted_honest_peers_complete_the_exchange() {
    // The connector's whole script, computed ahead: it fixes both nonces.
    let mut input = honest_prefix(3, Role::Connector);
    let key = wire::session_key(SECRET, &OURS, &THEIRS);
    input.extend_from_slice(&wire::ack(&key, &sample_payload().encode()));
    let mut link = scripted(input);
    run_listener(&mut link, &secret(SECRET), &sample_payload(), OURS).unwrap();
    assert_eq!(
        link.stream.output.len(),
        HELLO_LEN + MAC_LEN + 4 + PAYLOAD_LEN + MAC_LEN
    );

    let mut input = honest_prefix(3, Role::Listener);
    let key = wire::session_key(SECRET, &THEIRS, &OURS);
    input.extend_from_slice(&wire::payload_message(&key, &sample_payload().encode()));
    let mut link = scripted(input);
    let payload = run_connector(&mut link, &secret(SECRET), OURS).unwrap();
    assert_eq!(payload, sample_payload());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random bytes as the connector's messages, after an honest prefix of random depth:
    /// the listener returns an error, never panics and never accepts.
    #[test]
    fn random_bytes_never_pass_the_listener(
        depth in 0u8..4,
        tail in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        let mut input = honest_prefix(depth, Role::Connector);
        input.extend_from_slice(&tail);
        let mut link = scripted(input);
        prop_assert!(run_listener(&mut link, &secret(SECRET), &sample_payload(), OURS).is_err());
    }

    /// The same for the connector.
    #[test]
    fn random_bytes_never_pass_the_connector(
        depth in 0u8..4,
        tail in proptest::collection::vec(any::<u8>(), 0..300),
        fix_length in any::<bool>(),
    ) {
        let mut input = honest_prefix(depth, Role::Listener);
        if depth == 3 && fix_length {
            // Get past the length check, to the MAC and field checks.
            input.extend_from_slice(&(PAYLOAD_LEN as u32).to_le_bytes());
        }
        input.extend_from_slice(&tail);
        let mut link = scripted(input);
        let result = run_connector(&mut link, &secret(SECRET), OURS);
        prop_assert!(result.is_err());
        // Every error can be shown.
        let _ = result.unwrap_err().to_string();
    }
}
