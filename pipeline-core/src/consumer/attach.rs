//! The consumer's side of the attach handshake: connecting (and checking who listens), the
//! Hello/Welcome exchange under one deadline, importing the backend's memory, and the
//! observer's read-only attach for `gpipe inspect`.

use std::mem::ManuallyDrop;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicU64, AtomicUsize};

use crate::backend::{BackendKind, ConsumerBackend};
use crate::error::{Error, ProtocolError};
use crate::layout::{
    ControlSegment, LAYOUT_HASH, Mode, PROTOCOL_VERSION, RingLayout, consumer_state,
};
use crate::page::{ClaimSegment, ConsumerPage};
use crate::ring;
use crate::sys::{self, IoDeadline};
use crate::wire::{self, Message, Role};
use parking_lot::Mutex;

use super::config::ConsumerConfig;
use super::handle::Consumer;
use super::link::{Link, RecordPtr};

/// A connection that received the producer's Welcome but has not imported yet. Lets a caller
/// pick the backend at run time from [`PendingAttach::backend`].
pub struct PendingAttach {
    conn: UnixStream,
    layout: RingLayout,
    index: u32,
    backend: BackendKind,
    seg_fd: OwnedFd,
    claims_fd: OwnedFd,
    page_fd: OwnedFd,
    fds: Vec<OwnedFd>,
    blob: Vec<u8>,
    config: ConsumerConfig,
    /// When the attach must be done.
    deadline: IoDeadline,
}

/// Connects within the attach's deadline and checks who listens: a producer of our own uid,
/// or of one we allow.
fn connect(path: &Path, config: &ConsumerConfig) -> Result<(UnixStream, IoDeadline), Error> {
    let deadline = IoDeadline {
        interrupted: config.interrupted,
        ..IoDeadline::after(config.handshake_timeout)
    };
    let conn = sys::connect_unix(path, deadline).map_err(|e| match e.kind() {
        std::io::ErrorKind::TimedOut => Error::Timeout(
            "the producer to accept the connection (its backlog is full: it is busy or stuck)",
        ),
        std::io::ErrorKind::Interrupted => Error::Os {
            what: "connect to the producer",
            source: e,
        },
        _ => Error::Connect {
            path: path.display().to_string(),
            source: e,
        },
    })?;
    let producer = sys::peer_cred(&conn).map_err(Error::os("read the producer's credentials"))?;
    let ours = sys::effective_uid();
    if producer.uid != ours && !config.allowed_producer_uids.contains(&producer.uid) {
        return Err(ProtocolError::UntrustedProducer(format!(
            "the producer listening on {} runs as uid {}, not as this process's uid {ours}; \
             refusing to attach, since anyone who can create that path could feed us batches \
             (if you trust uid {} there, allow it: `gpipe consume --allow-producer-uid {}`, \
             Python: `Consumer(..., allow_producer_uids=[{}])`)",
            path.display(),
            producer.uid,
            producer.uid,
            producer.uid,
            producer.uid
        ))
        .into());
    }
    Ok((conn, deadline))
}

/// What the producer's Welcome told us, validated.
struct Welcomed {
    layout: RingLayout,
    index: u32,
    backend: BackendKind,
    fds: Vec<OwnedFd>,
    blob: Vec<u8>,
}

fn welcome(conn: &UnixStream, role: Role, deadline: IoDeadline) -> Result<Welcomed, Error> {
    let sent = wire::send_until(
        conn,
        &Message::Hello {
            version: PROTOCOL_VERSION,
            role,
            backend: 0,
        },
        &[],
        deadline,
    );
    // A producer that refuses us (uid check) may answer and close before our Hello is
    // written: its Reject is still readable and says more than the broken pipe.
    let received = wire::recv_until(conn, deadline);
    if let (Err(e), Err(_)) = (&sent, &received) {
        return Err(Error::Os {
            what: "send Hello",
            source: std::io::Error::other(e.to_string()),
        });
    }
    let (msg, fds) = received?;
    match msg {
        Message::Welcome {
            version,
            layout_hash,
            consumer_index,
            mode,
            slot_count,
            slot_bytes,
            consumer_capacity,
            backend,
            blob,
            ..
        } => {
            if version != PROTOCOL_VERSION {
                return Err(ProtocolError::Version {
                    ours: PROTOCOL_VERSION,
                    theirs: version,
                }
                .into());
            }
            if layout_hash != LAYOUT_HASH {
                return Err(ProtocolError::Layout(format!(
                    "layout hash {layout_hash:#x} differs from ours {LAYOUT_HASH:#x}"
                ))
                .into());
            }
            let layout = RingLayout {
                slot_count,
                slot_bytes,
                consumer_capacity,
                mode: Mode::from_u32(mode)
                    .ok_or_else(|| ProtocolError::Layout(format!("unknown mode {mode}")))?,
            };
            layout.validate()?;
            let backend = BackendKind::from_u32(backend)
                .ok_or_else(|| ProtocolError::Message(format!("unknown backend kind {backend}")))?;
            match role {
                Role::Observer if consumer_index != wire::OBSERVER => {
                    return Err(
                        ProtocolError::Message("observer got a consumer index".into()).into(),
                    );
                }
                Role::Consumer if consumer_index >= consumer_capacity => {
                    return Err(ProtocolError::Message(format!(
                        "consumer index {consumer_index} out of range (capacity {consumer_capacity})"
                    ))
                    .into());
                }
                _ => {}
            }
            // The control segment; a consumer also gets the claim segment and its own page.
            let needed = if role == Role::Observer { 1 } else { 3 };
            if fds.len() < needed {
                return Err(ProtocolError::Message(format!(
                    "Welcome carried {} fds; a {} needs at least {needed} (control segment{})",
                    fds.len(),
                    if role == Role::Observer {
                        "observer"
                    } else {
                        "consumer"
                    },
                    if role == Role::Observer {
                        ""
                    } else {
                        ", claim segment, its own page"
                    }
                ))
                .into());
            }
            Ok(Welcomed {
                layout,
                index: consumer_index,
                backend,
                fds,
                blob,
            })
        }
        Message::Reject { reason } => Err(ProtocolError::Refused(reason).into()),
        other => {
            Err(ProtocolError::Message(format!("expected Welcome, got {}", other.name())).into())
        }
    }
}

impl PendingAttach {
    /// Connects to a producer and runs the first half of the handshake.
    pub fn connect(path: impl AsRef<Path>, config: ConsumerConfig) -> Result<Self, Error> {
        let (conn, deadline) = connect(path.as_ref(), &config)?;
        let mut w = welcome(&conn, Role::Consumer, deadline)?;
        let mut fds = w.fds.drain(..3);
        let (seg_fd, claims_fd, page_fd) = match (fds.next(), fds.next(), fds.next()) {
            (Some(a), Some(b), Some(c)) => (a, b, c),
            _ => unreachable!("welcome() checked that a consumer's Welcome carries 3 fds"),
        };
        drop(fds);
        Ok(Self {
            conn,
            layout: w.layout,
            index: w.index,
            backend: w.backend,
            seg_fd,
            claims_fd,
            page_fd,
            fds: w.fds,
            blob: w.blob,
            config,
            deadline,
        })
    }

    /// The producer's backend.
    pub fn backend(&self) -> BackendKind {
        self.backend
    }

    /// The ring's layout.
    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    /// Imports with backend `B` and finishes the handshake.
    pub fn finish<B: ConsumerBackend>(self, options: B::Options) -> Result<Consumer<B>, Error> {
        let Self {
            conn,
            layout,
            index,
            backend,
            seg_fd,
            claims_fd,
            page_fd,
            fds,
            blob,
            config,
            deadline,
        } = self;
        if backend != B::KIND {
            wire::send_reject(
                &conn,
                &format!("consumer built for the {} backend", B::KIND),
            );
            return Err(Error::BackendMismatch {
                expected: B::KIND.to_string(),
                found: backend.to_string(),
            });
        }
        let opened = ControlSegment::open(seg_fd, layout).and_then(|seg| {
            let claims = ClaimSegment::open(claims_fd, &layout)?;
            let page = ConsumerPage::open(page_fd, &layout)?;
            Ok((seg, claims, page))
        });
        let (seg, claims, page) = match opened {
            Ok(s) => s,
            Err(e) => {
                wire::send_reject(&conn, &e.to_string());
                return Err(e);
            }
        };
        let (be, reply) = match B::import(&layout, index, options, &blob, fds) {
            Ok(x) => x,
            Err(e) => {
                wire::send_reject(&conn, &format!("import failed: {e}"));
                return Err(Error::Backend(e));
            }
        };
        let reply_fds: Vec<_> = reply.fds.iter().map(std::os::fd::AsFd::as_fd).collect();
        let sent = wire::send_until(
            &conn,
            &Message::Ready {
                fd_count: reply_fds.len() as u32,
                blob: reply.blob.clone(),
            },
            &reply_fds,
            deadline,
        );
        // As with Hello: a producer that refuses us while we import (it is closing, say)
        // may have stopped reading; its Reject is still readable and says why.
        let received = wire::recv_until(&conn, deadline);
        let received = match (sent, received) {
            (Err(e), Err(_)) => return Err(e),
            (Err(e), Ok((msg, _))) if !matches!(msg, Message::Reject { .. }) => return Err(e),
            (_, r) => r?,
        };
        let (start, claim_token) = match received {
            (
                Message::Joined {
                    start_seq,
                    claim_token,
                },
                _,
            ) => (start_seq, claim_token),
            (Message::Reject { reason }, _) => return Err(ProtocolError::Refused(reason).into()),
            (other, _) => {
                return Err(ProtocolError::Message(format!(
                    "expected Joined, got {}",
                    other.name()
                ))
                .into());
            }
        };
        let rec = seg.consumer(index);
        if rec.state.load(Ordering::Acquire) != consumer_state::ACTIVE {
            return Err(ProtocolError::Segment(format!(
                "our record {index} is not active after Joined"
            ))
            .into());
        }
        if ring::token_index(claim_token) != index {
            return Err(ProtocolError::Message(format!(
                "Joined carries a claim token for consumer {}, but we are consumer {index}",
                ring::token_index(claim_token)
            ))
            .into());
        }
        // Which attach to this record is ours: a later consumer given our index (after the
        // producer detached us) bumps it. Read after the Acquire of ACTIVE above, which the
        // producer stores after the bump.
        let generation = rec.generation.load(Ordering::Relaxed);
        page.header()
            .placement
            .store(be.placement().encode(), Ordering::Release);
        page.header().cursor.store(start, Ordering::Relaxed);
        let _ = conn.set_nonblocking(true);
        let head = seg.header().head.value.load(Ordering::Acquire);
        let record = RecordPtr(std::ptr::NonNull::from(rec));
        let consumer = Consumer {
            link: Arc::new(Link {
                record,
                seg,
                claims,
                page,
                backend: ManuallyDrop::new(be),
                conn,
                index,
                generation,
                layout,
                held: (0..layout.slot_count).map(|_| AtomicU64::new(0)).collect(),
                mirrored: AtomicUsize::new(0),
                deferred: Mutex::new(None),
                next_cursor: AtomicU64::new(match layout.mode {
                    Mode::Broadcast => start,
                    Mode::Shared => u64::MAX,
                }),
            }),
            index,
            layout,
            cursor: start,
            hint: 0,
            seen_requeued: 0,
            last_head: head.min(start),
            config,
            ended: false,
        };
        // The backend's slow work, after the handshake: its deadline is the producer's too.
        // A failure detaches us as any drop does.
        if let Err(e) = consumer.link.backend.joined() {
            drop(consumer);
            return Err(Error::Backend(e));
        }
        Ok(consumer)
    }
}

/// Attaches read-only as an observer and returns the mapped control segment (for
/// `gpipe inspect`). The producer keeps no state for observers.
pub fn observe(
    path: impl AsRef<Path>,
    config: ConsumerConfig,
) -> Result<(ControlSegment, BackendKind), Error> {
    let (conn, deadline) = connect(path.as_ref(), &config)?;
    let mut w = welcome(&conn, Role::Observer, deadline)?;
    let seg = ControlSegment::open(w.fds.remove(0), w.layout)?;
    Ok((seg, w.backend))
}

impl<B: ConsumerBackend> Consumer<B> {
    /// Attaches to the producer listening at `path`.
    pub fn attach(path: impl AsRef<Path>, options: B::Options) -> Result<Self, Error> {
        Self::attach_with(path, ConsumerConfig::default(), options)
    }

    /// Attaches with explicit settings.
    pub fn attach_with(
        path: impl AsRef<Path>,
        config: ConsumerConfig,
        options: B::Options,
    ) -> Result<Self, Error> {
        PendingAttach::connect(path, config)?.finish(options)
    }
}
