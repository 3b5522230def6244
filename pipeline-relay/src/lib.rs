//! # pipeline-relay: gpipe's relay between hosts
//!
//! The relay (`gpipe relay`, [`relay`], docs/relay.md) carries a ring's batches to consumers
//! on another host: over NCCL for a CUDA ring, inline on its TCP connection for a host ring.
//!
//! Before NCCL can connect, the two hosts must agree on an NCCL unique id and the ring's
//! shape. The rendezvous is that step, and needs no GPU: one side **listens**
//! (`--listen ADDR:PORT`), the other **connects** (`--connect ADDR:PORT`), both prove over
//! TCP that they hold the same [`SharedSecret`] (read from a private file, never from the
//! command line), and the listener hands the connector a MACed [`Payload`].
//!
//! TCP has no `SO_PEERCRED`: the secret is the only thing that says who may join. The
//! exchange is mutual HMAC-SHA256 challenge-response with fresh nonces from both sides, bound
//! to each side's role, so a recorded or reflected proof is refused. It does not encrypt:
//! the NCCL unique id crosses the wire in the clear, as do NCCL's own batches later. See
//! `docs/security.md` ("Relay rendezvous and session") and [`wire`] for the bytes. After it,
//! the same connection carries the relay's messages, each MACed ([`session`]).
//!
//! ```
//! use pipeline_relay::{connect, Endpoint, Listener, Payload, SharedSecret};
//! use std::time::Duration;
//! # use std::io::Write;
//! # use std::os::unix::fs::OpenOptionsExt;
//! # let dir = std::env::temp_dir().join(format!("gpipe-relay-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir).unwrap();
//! # let path = dir.join("secret");
//! # let _ = std::fs::remove_file(&path);
//! # std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).unwrap()
//! #     .write_all(b"correct horse battery staple\n").unwrap();
//!
//! // Host A: listen and offer the NCCL unique id and the ring's shape.
//! let secret = SharedSecret::from_file(&path)?;        // a 0600 file of your own
//! let listener = Listener::bind(&"127.0.0.1:0".parse()?)?;
//! let port = listener.local_addr()?.port();
//! let offer = Payload {
//!     nccl_unique_id: [7; 128],                         // from ncclGetUniqueId
//!     slot_bytes: 64 << 20,
//!     slot_count: 8,
//!     world_size: 2,
//!     rank: 1,                                          // the connector's rank
//! };
//! let sent = offer.clone();
//! let host_a = std::thread::spawn(move || listener.accept(&secret, &sent, Duration::from_secs(5)));
//!
//! // Host B: connect with a copy of the same secret file.
//! let secret = SharedSecret::from_file(&path)?;
//! let (got, peer) = connect(&format!("127.0.0.1:{port}").parse()?, &secret, Duration::from_secs(5))?;
//! assert_eq!(got, offer);
//! assert_eq!(host_a.join().unwrap()?.peer, peer.local);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod chunks;
pub mod endpoint;
pub mod fanout;
pub mod forward;
pub mod relay;
pub mod rendezvous;
pub mod secret;
pub mod session;
pub mod wire;

pub use endpoint::{Endpoint, EndpointError, EndpointProblem};
pub use fanout::{
    Fanout, FanoutPlan, Flow, RingNode, plan as plan_fanout, plan_for as plan_fanout_for,
};
pub use forward::{ForwardOptions, run_forwarder};
pub use relay::{
    BenchSide, RelayError, RelayOptions, RelayReport, nccl_bench, run_receiver, run_sender,
};
pub use rendezvous::{Listener, RendezvousError, Stage, connect, connect_session, listen};
pub use secret::{SecretError, SecretProblem, SharedSecret};
pub use session::{PeerInfo, Session, SessionError};
pub use wire::{Payload, PayloadError, Role};
