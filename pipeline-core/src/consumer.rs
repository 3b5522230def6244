//! The consuming side: attach over the socket, receive batches in place, release them.

use std::mem::ManuallyDrop;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::time::{Duration, Instant};

use crate::backend::{BackendKind, ConsumerBackend};
use crate::error::{Error, ProtocolError};
use crate::layout::{
    ConsumerRecord, ControlSegment, LAYOUT_HASH, Mode, PROTOCOL_VERSION, RingLayout,
    USER_HEADER_WORDS, consumer_state, producer_state,
};
use crate::page::{ClaimSegment, ConsumerPage};
use crate::ring;
use crate::sys::{self, IoDeadline};
use crate::tensor::{TensorInfo, Tensors};
use crate::wait::{self, WaitPolicy};
use crate::wire::{self, Message, Role};
use parking_lot::Mutex;

/// Consumer settings.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// How long the whole attach may take, from connect to joined (however the producer
    /// slices its messages).
    pub handshake_timeout: Duration,
    /// Spin and liveness tick: a dead producer is noticed within about one tick.
    pub wait: WaitPolicy,
    /// Uids besides our own whose producers we attach to. A producer is identified by the
    /// uid that listens on the socket (`SO_PEERCRED`), not by the socket's path: anyone who
    /// can create a file there could otherwise feed us.
    pub allowed_producer_uids: Vec<u32>,
    /// Asked while the attach waits (at least every [`sys::INTERRUPT_TICK`], and at once
    /// when a signal arrives); `true` ends the attach with an error of kind
    /// [`std::io::ErrorKind::Interrupted`]. A binding runs its language's signal handlers
    /// here (Ctrl-C).
    pub interrupted: Option<fn() -> bool>,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(5),
            wait: WaitPolicy::default(),
            allowed_producer_uids: Vec::new(),
            interrupted: None,
        }
    }
}

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
        Ok(Consumer {
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
        })
    }
}

/// What a consumer shares with the batches it handed out: a batch is released through it,
/// from any thread, after the consumer itself may be gone. When the last of them goes, the
/// backend's imports are freed and the producer is told goodbye.
struct Link<B: ConsumerBackend> {
    /// Our record in `seg` (see [`Link::record`]).
    record: RecordPtr,
    /// What the producer writes (read-only to us).
    seg: ControlSegment,
    /// The words every consumer may write: the producer's wake word, shared-mode claims.
    claims: ClaimSegment,
    /// Our own progress, which only we and the producer map writable.
    page: ConsumerPage,
    backend: ManuallyDrop<B>,
    conn: UnixStream,
    index: u32,
    /// Our record's generation at attach (see [`Consumer::check_active`]).
    generation: u64,
    layout: RingLayout,
    /// Per slot: the sequence number + 1 of the batch we hold in it, 0 when none.
    held: Box<[AtomicU64]>,
    /// Mirrored batches held (their slots are already released).
    mirrored: AtomicUsize,
    /// An error from releasing a dropped batch, reported by the next `recv`.
    deferred: Mutex<Option<Error>>,
    /// Broadcast: the sequence number this consumer receives next (its cursor, kept here for
    /// releases on other threads); `u64::MAX` in shared mode, where the next is claimed.
    next_cursor: AtomicU64,
}

/// Our consumer record in the control segment (read-only to us: our counters are in our
/// page), looked up once at attach: every batch reads its state and generation, and
/// [`ControlSegment::consumer`] would check the index and work out the offset each time.
struct RecordPtr(std::ptr::NonNull<ConsumerRecord>);

// SAFETY: it points at a `ConsumerRecord`, whose fields are all atomics (so shared access from
// any thread is sound), in the mapping of the `ControlSegment` of the same `Link`, which
// lives (and stays mapped at the same address) as long as the pointer does.
unsafe impl Send for RecordPtr {}
// SAFETY: as for `Send` above: only shared references to atomics are made from it.
unsafe impl Sync for RecordPtr {}

/// The consuming side of a ring. One thread receives; the [`Batch`]es it returns are owned
/// values that may be held several at a time, sent to other threads and released in any
/// order.
pub struct Consumer<B: ConsumerBackend> {
    link: Arc<Link<B>>,
    index: u32,
    layout: RingLayout,
    cursor: u64,
    /// Shared mode: every batch below this was claimed when we last looked (our own hint:
    /// a peer cannot move it).
    hint: u64,
    /// Shared mode: the producer's `requeued` count when we last scanned the whole window.
    seen_requeued: u64,
    last_head: u64,
    config: ConsumerConfig,
    ended: bool,
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

    /// Our consumer index (0..capacity).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The ring's layout.
    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.link.backend
    }

    /// The control segment (mapped read-only: inspection and tests).
    pub fn segment(&self) -> &ControlSegment {
        &self.link.seg
    }

    /// The claim segment every consumer of the ring maps writable (tests).
    pub fn claims(&self) -> &ClaimSegment {
        &self.link.claims
    }

    /// This consumer's own page: its progress as the producer reads it (tests).
    pub fn page(&self) -> &ConsumerPage {
        &self.link.page
    }

    /// Starts a thread that checks the producer's socket every `tick` and, when the producer
    /// died, calls the backend's [`ConsumerBackend::abandon`] at once, without waiting for
    /// the next `recv`. On a GPU, work waiting on the producer's signals (a stream waiting on
    /// `ready`) is then released even while the user is blocked elsewhere, e.g. in a device
    /// synchronize. The thread ends when the ring closes, the producer dies, or the consumer
    /// and all its batches are gone.
    pub fn watch_producer(&self, tick: Duration) -> Result<(), Error> {
        let link = Arc::downgrade(&self.link);
        std::thread::Builder::new()
            .name("gpipe-watch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(tick);
                    let Some(link) = link.upgrade() else { return };
                    let state = link
                        .seg
                        .header()
                        .constants
                        .producer_state
                        .load(Ordering::Acquire);
                    if state == producer_state::CLOSED {
                        return;
                    }
                    if sys::peer_gone(&link.conn) {
                        tracing::warn!("the producer died: releasing waits on its signals");
                        link.backend.abandon();
                        return;
                    }
                }
            })
            .map_err(Error::os("spawn the producer watch thread"))?;
        Ok(())
    }

    /// Checks, without waiting for a batch, whether the producer is still there: `Ok(())`
    /// while it runs or after it closed the ring cleanly, [`Error::Detached`] if it detached
    /// us, [`Error::ProducerDied`] if it died (and then, as `recv` would, the backend releases
    /// the waits on its signals: on a GPU ring with timeline words, every consumer's). For a
    /// process that blocks elsewhere while holding this ring's batches, such as a forwarder
    /// waiting for room in its own ring, whose consumers' GPU work waits on ours.
    pub fn check_producer(&self) -> Result<(), Error> {
        // Detached (our socket was cut by a live producer): not a death, and nothing of the
        // ring's signals may be released.
        self.check_active()?;
        let h = self.link.seg.header();
        if h.constants.producer_state.load(Ordering::Acquire) == producer_state::CLOSED {
            return Ok(());
        }
        if sys::peer_gone(&self.link.conn)
            && h.constants.producer_state.load(Ordering::Acquire) != producer_state::CLOSED
        {
            self.link.backend.abandon();
            return Err(Error::ProducerDied);
        }
        Ok(())
    }

    /// Batches received and not yet released (by this consumer or by batches it handed out).
    pub fn held(&self) -> usize {
        self.link
            .held
            .iter()
            .filter(|h| h.load(Ordering::Acquire) != 0)
            .count()
            + self.link.mirrored.load(Ordering::Acquire)
    }

    /// Receives the next batch. `Ok(None)` means the producer closed the ring cleanly and
    /// everything published has been received. Errors: the producer died, we were detached,
    /// or the control segment holds values that cannot be right.
    pub fn recv(&mut self) -> Result<Option<Batch<B>>, Error> {
        self.recv_until(None)
    }

    /// As [`Consumer::recv`], giving up with [`Error::Timeout`] after `timeout`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Batch<B>>, Error> {
        self.recv_until(Some(Instant::now() + timeout))
    }

    /// As [`Consumer::recv`], giving up with [`Error::Timeout`] at `deadline` (`None`: never).
    pub fn recv_until(&mut self, deadline: Option<Instant>) -> Result<Option<Batch<B>>, Error> {
        if let Some(e) = self.link.deferred.lock().take() {
            return Err(e);
        }
        if self.ended {
            return Ok(None);
        }
        // A consumer that never has to wait (batches always ready) would otherwise not look
        // at its record until then, and go on receiving after the producer detached it.
        self.check_active()?;
        // Mirror delivery with every buffer of ours held: a batch taken now could not be
        // delivered, and would be lost to this consumer.
        if let Some(buffers) = self.link.backend.mirror_full() {
            return Err(Error::MirrorFull {
                buffers,
                held: self.held(),
            });
        }
        let got = match self.layout.mode {
            Mode::Broadcast => self.next_broadcast(deadline),
            Mode::Shared => self.next_shared(deadline),
        };
        let got = match got {
            Ok(g) => g,
            Err(Error::ProducerDied) => {
                self.link.backend.abandon();
                return Err(Error::ProducerDied);
            }
            Err(e) => return Err(e),
        };
        let Some((seq, slot, claim_unrecorded)) = got else {
            self.ended = true;
            return Ok(None);
        };
        let link = &*self.link;
        let desc = link.seg.slot(slot);
        let len = desc.len.load(Ordering::Relaxed);
        let mut header = [0u64; USER_HEADER_WORDS];
        for (h, w) in header.iter_mut().zip(&desc.header) {
            *h = w.load(Ordering::Relaxed);
        }
        if let Err(v) = ring::check_len(seq, slot, len, self.layout.slot_bytes) {
            link.refuse(slot, seq);
            return Err(self.violation(v));
        }
        let tensors = match link.seg.tensor_table(slot).read_tensors(len) {
            Ok(t) => t,
            Err(m) => {
                link.refuse(slot, seq);
                // Rewritten under us after a detach, or corrupt: our record tells which.
                return Err(match self.check_active() {
                    Err(detached) => detached,
                    Ok(()) => ProtocolError::Segment(format!("batch {seq}: {m}")).into(),
                });
            }
        };
        crate::fault::point("consumer.before_wait");
        if let Err(e) = link.backend.wait_ready(slot, seq) {
            link.refuse(slot, seq);
            return Err(Error::Backend(e));
        }
        crate::fault::point("consumer.after_wait");
        let mirrored = match link.backend.mirror(slot, seq, len) {
            Ok(m) => m,
            Err(e) => {
                link.refuse(slot, seq);
                return Err(Error::Backend(e));
            }
        };
        let rec = link.page.header();
        rec.received.fetch_add(1, Ordering::Relaxed);
        if mirrored {
            // The copy is ours and `finished` for the slot is signalled after it: release the
            // slot now. A claim whose token was not recorded is one the producer will not wait
            // for: the copy must be complete first.
            let done = if claim_unrecorded {
                link.backend.complete_now()
            } else {
                Ok(())
            };
            let ok = link.release_slot(slot, seq);
            rec.released.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = done {
                let _ = link.backend.signal_finished(slot, seq);
                return Err(Error::Backend(e));
            }
            if !ok {
                let _ = link.backend.signal_finished(slot, seq);
                return Err(Error::Detached(format!(
                    "batch {seq} was taken back before we released it"
                )));
            }
            link.mirrored.fetch_add(1, Ordering::AcqRel);
        } else {
            link.held[slot as usize].store(seq + 1, Ordering::Release);
        }
        Ok(Some(Batch {
            link: self.link.clone(),
            seq,
            slot,
            len,
            header,
            tensors,
            claim_unrecorded,
            mirrored,
            done: false,
        }))
    }

    /// Before a wait for the producer's next batch: if we hold the batch in the slot the
    /// producer must refill first, the wait could never end.
    fn check_not_self_blocked(&self, head: u64) -> Result<(), Error> {
        let k = ring::slot_of(head, self.layout.slot_count);
        match self.link.held[k as usize].load(Ordering::Acquire) {
            0 => Ok(()),
            s => Err(Error::Deadlock {
                seq: s - 1,
                slot: k,
                held: self.held(),
            }),
        }
    }

    fn load_head(&mut self) -> Result<u64, Error> {
        let head = self.link.seg.header().head.value.load(Ordering::Acquire);
        ring::check_head(self.last_head, head).map_err(|v| self.violation(v))?;
        self.last_head = head;
        Ok(head)
    }

    /// Our record must still say active, and still be ours (see [`Link::check_record`]).
    fn check_active(&self) -> Result<(), Error> {
        self.link.check_record()
    }

    /// What a violation seen in the ring means. The producer marks our record before it
    /// takes our batches back and goes on without us, and what it publishes after that
    /// happens after the mark: a violation seen after it (the head past our cursor by more
    /// than the ring, a slot refilled under us) is the ring going on without us, which makes
    /// it a detach, not corruption. Only with our record still active and ours is the segment
    /// corrupt. Out of line: the per-batch checks that may call it stay small.
    #[cold]
    #[inline(never)]
    fn violation(&self, v: ring::Violation) -> Error {
        if let ring::Violation::Overrun { head, cursor, n } = v
            && let Some(what) = self.page_tampered(cursor)
        {
            return ProtocolError::Segment(format!(
                "head {head} is more than {n} batches past our cursor {cursor}: batches we had \
                 not released were overwritten, because our page says {what}, which this \
                 consumer never wrote: another process wrote our page (a process of this uid \
                 can open it through /proc/<pid>/fd; run consumers that must not be reached \
                 as a user of their own)"
            ))
            .into();
        }
        explain_violation(v, self.check_active())
    }

    /// What our page says that we did not write, if anything: a batch we hold, or one we
    /// never received, shown as released. (Our page is writable by us and
    /// the producer only; a process that can reach our fds can write it too.)
    fn page_tampered(&self, cursor: u64) -> Option<String> {
        let link = &*self.link;
        (0..self.layout.slot_count).find_map(|k| {
            let word = link.page.slot(k).load(Ordering::Acquire);
            match link.held[k as usize].load(Ordering::Acquire) {
                0 => ring::released_seq(word)
                    .filter(|&x| x >= cursor)
                    .map(|x| format!("batch {x} (slot {k}) was released before we received it")),
                h if word == ring::released(h - 1) => Some(format!(
                    "batch {} (slot {k}), which we still hold, was released",
                    h - 1
                )),
                _ => None,
            }
        })
    }

    /// Shared mode: puts batch `seq`, which we claimed in slot `k`, back as unclaimed and
    /// our page as it was (`before`). The producer makes the others look again if it waits.
    fn unclaim(&self, k: u32, seq: u64, before: u64) {
        let link = &*self.link;
        let _ = link.claims.claim(k).compare_exchange(
            ring::claim_word(seq, Some(self.index)),
            ring::claim_word(seq, None),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        link.page.slot(k).store(before, Ordering::Release);
        wait::notify(
            link.claims.space_wake(),
            &link.seg.header().space_sleepers.value,
            false,
        );
    }

    /// Liveness check after a wake-up with nothing to do. `Ok(true)`: the ring is closed.
    fn check_peer(&self, deadline: Option<Instant>) -> Result<bool, Error> {
        let h = self.link.seg.header();
        self.check_active()?;
        if h.constants.producer_state.load(Ordering::Acquire) == producer_state::CLOSED {
            return Ok(true);
        }
        if sys::peer_gone(&self.link.conn) {
            // A clean close may race the hang-up: re-check the state.
            if h.constants.producer_state.load(Ordering::Acquire) == producer_state::CLOSED {
                return Ok(true);
            }
            return Err(Error::ProducerDied);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Error::Timeout("a batch"));
        }
        Ok(false)
    }

    fn next_broadcast(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(u64, u32, bool)>, Error> {
        let c = self.cursor;
        let n = self.layout.slot_count;
        let mut head = self.load_head()?;
        if head <= c {
            self.check_not_self_blocked(head)?;
            let seg = &self.link.seg;
            let h = seg.header();
            let policy = self.config.wait;
            let closed_empty = wait::wait_for(
                policy,
                &h.data_wake.value,
                &self.link.page.header().sleeping.value,
                || (h.head.value.load(Ordering::Acquire) > c).then_some(false),
                || {
                    if self.check_peer(deadline)? {
                        // Closed: anything left? Re-read head after seeing CLOSED.
                        return Ok(Some(h.head.value.load(Ordering::Acquire) <= c));
                    }
                    Ok(None)
                },
            )?;
            if closed_empty {
                return Ok(None);
            }
            head = self.load_head()?;
        }
        ring::check_window(head, c, n).map_err(|v| self.violation(v))?;
        let k = ring::slot_of(c, n);
        let desc = self.link.seg.slot(k);
        let seq = desc.seq.load(Ordering::Acquire);
        let addressed = desc.addressed.load(Ordering::Acquire);
        ring::check_slot(k, seq, c, addressed, self.index).map_err(|v| self.violation(v))?;
        self.cursor = c + 1;
        self.link
            .page
            .header()
            .cursor
            .store(self.cursor, Ordering::Relaxed);
        self.link.next_cursor.store(self.cursor, Ordering::Relaxed);
        Ok(Some((c, k, false)))
    }

    /// Shared mode: claims the oldest unclaimed batch (or one a peer claimed in our name).
    /// The flag is the old protocol's "claim not recorded", always false now: every claim
    /// is recorded in our page before it is made.
    fn next_shared(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(u64, u32, bool)>, Error> {
        let n = self.layout.slot_count;
        let me = self.index;
        loop {
            let head = self.load_head()?;
            let link = &*self.link;
            let (seg, claims, page) = (&link.seg, &link.claims, &link.page);
            let h = seg.header();
            let requeued = h.requeued.value.load(Ordering::Acquire);
            let rescan = requeued != self.seen_requeued;
            let window = ring::live_window(head, n);
            let start = ring::scan_start(head, self.hint, rescan, n);
            for s in start..window.end {
                let k = ring::slot_of(s, n);
                let (claim, mine) = (claims.claim(k), page.slot(k));
                let Some(before) =
                    ring::try_claim(claim, mine, s, me).or_else(|| ring::adopt(claim, mine, s, me))
                else {
                    continue;
                };
                // Detached meanwhile (the producer marks our record before it takes our
                // claims back): this claim is not ours to keep. The fence pairs with the
                // producer's between marking the record and taking claims back, and with its
                // fence between marking a slot as being rewritten and looking at our page.
                std::sync::atomic::fence(Ordering::SeqCst);
                if let Err(e) = self.check_active() {
                    self.unclaim(k, s, before);
                    return Err(e);
                }
                let seq = seg.slot(k).seq.load(Ordering::SeqCst);
                if seq != s {
                    // The slot is being written again (a peer reopened a batch that was
                    // consumed) or holds a newer batch: not ours. Our page as it was.
                    mine.store(before, Ordering::Release);
                    continue;
                }
                let now = h.head.value.load(Ordering::Acquire).max(head);
                if let Err(v) = ring::check_claimed(k, seq, now, n) {
                    self.unclaim(k, s, before);
                    return Err(self.violation(v));
                }
                if s >= self.hint {
                    self.hint = s + 1;
                }
                page.header().cursor.store(seq + 1, Ordering::Relaxed);
                return Ok(Some((seq, k, false)));
            }
            // Everything from `start` on was claimed when we looked.
            self.hint = self.hint.max(window.end);
            if rescan {
                self.seen_requeued = requeued;
            }
            // Nothing claimable: wait for a new batch or a requeue.
            self.check_not_self_blocked(head)?;
            let closed_empty = wait::wait_for(
                self.config.wait,
                &h.data_wake.value,
                &page.header().sleeping.value,
                || {
                    (h.head.value.load(Ordering::Acquire) != head
                        || h.requeued.value.load(Ordering::Acquire) != requeued)
                        .then_some(false)
                },
                || {
                    if self.check_peer(deadline)? {
                        // Closed: done when nothing published is still unclaimed, but for
                        // batches we released ourselves (a peer may reopen their words; we
                        // never take a batch twice).
                        let head = h.head.value.load(Ordering::Acquire);
                        let left = ring::live_window(head, n).any(|s| {
                            let k = ring::slot_of(s, n);
                            claims.claim(k).load(Ordering::Acquire) == ring::claim_word(s, None)
                                && page.slot(k).load(Ordering::Relaxed) != ring::released(s)
                        });
                        return Ok(Some(!left));
                    }
                    Ok(None)
                },
            )?;
            if closed_empty {
                return Ok(None);
            }
        }
    }
}

impl<B: ConsumerBackend> Link<B> {
    /// Our record (`seg.consumer(index)`), without the lookup.
    #[inline]
    fn record(&self) -> &ConsumerRecord {
        // SAFETY: `record` was made from `seg.consumer(index)` at attach; `seg` is ours and
        // keeps its mapping, at the same address, while we live.
        unsafe { self.record.0.as_ref() }
    }

    /// Our record must still say active, and still be ours: the producer marks it when it
    /// detaches us, and a consumer that attaches later may be given our index (and so our
    /// record, active again, with its generation bumped).
    fn check_record(&self) -> Result<(), Error> {
        let rec = self.record();
        let state = rec.state.load(Ordering::Acquire);
        record_verdict(
            state,
            rec.generation.load(Ordering::Relaxed),
            self.generation,
        )
    }

    /// Releases batch `seq` in `slot` (in our page); false if it was taken from us
    /// (broadcast: the producer no longer addresses it to us, which it alone can say; in
    /// shared mode the record check before this call tells).
    fn release_slot(&self, slot: u32, seq: u64) -> bool {
        ring::release(self.page.slot(slot), seq);
        let ok = match self.layout.mode {
            Mode::Broadcast => {
                self.seg.slot(slot).addressed.load(Ordering::Acquire) & ring::bit(self.index) != 0
            }
            Mode::Shared => true,
        };
        let h = self.seg.header();
        wait::notify(self.claims.space_wake(), &h.space_sleepers.value, false);
        ok
    }

    /// Gives back a batch we will not use, so the producer is not stalled by our refusal. We
    /// did no work on it: say so first, or the producer's next write of the slot would wait
    /// for a `finished` signal that never comes.
    fn refuse(&self, slot: u32, seq: u64) {
        let _ = self.backend.signal_finished(slot, seq);
        self.release_slot(slot, seq);
    }

    /// Broadcast: the batch this consumer receives next, `(slot, seq)`, when the producer
    /// has already published it to us (so its ready signal is enqueued), for
    /// [`ConsumerBackend::signal_finished_then_wait`]. Read from the segment, and only used
    /// as a hint: the receive that follows checks the batch as always.
    fn next_published(&self) -> Option<(u32, u64)> {
        let c = self.next_cursor.load(Ordering::Relaxed);
        if c == u64::MAX {
            return None;
        }
        let n = self.layout.slot_count;
        let head = self.seg.header().head.value.load(Ordering::Acquire);
        if head <= c || ring::check_window(head, c, n).is_err() {
            return None;
        }
        let k = ring::slot_of(c, n);
        let desc = self.seg.slot(k);
        let seq = desc.seq.load(Ordering::Acquire);
        let addressed = desc.addressed.load(Ordering::Acquire);
        ring::check_slot(k, seq, c, addressed, self.index)
            .is_ok()
            .then_some((k, c))
    }

    /// The backend's finished signal, then the ring's release. A mirrored batch's slot was
    /// released when it was copied: only the consumer's own buffer is given back.
    fn release_batch(
        &self,
        seq: u64,
        slot: u32,
        claim_unrecorded: bool,
        mirrored: bool,
    ) -> Result<(), Error> {
        if mirrored {
            let r = self.backend.signal_finished(slot, seq);
            self.mirrored.fetch_sub(1, Ordering::AcqRel);
            return r.map_err(Error::Backend);
        }
        let next = if self.backend.looks_ahead() {
            self.next_published()
        } else {
            None
        };
        let mut finished = self.backend.signal_finished_then_wait(slot, seq, next);
        if claim_unrecorded {
            finished = finished.and_then(|()| self.backend.complete_now());
        }
        crate::fault::point("consumer.before_release");
        self.held[slot as usize].store(0, Ordering::Release);
        // Detached, and our index perhaps given to a later consumer: the slot's bit for our
        // index, and the record's counters, are no longer ours to touch.
        let ours = self.check_record().is_ok();
        let ok = ours && self.release_slot(slot, seq);
        crate::fault::point("consumer.after_release");
        if ours {
            self.page.header().released.fetch_add(1, Ordering::Relaxed);
        }
        finished.map_err(Error::Backend)?;
        if !ok {
            return Err(Error::Detached(format!(
                "batch {seq} was taken back before we released it"
            )));
        }
        Ok(())
    }
}

impl<B: ConsumerBackend> Drop for Link<B> {
    fn drop(&mut self) {
        // A producer that died unnoticed (we did not wait since): its signals may never come.
        let closed = self
            .seg
            .header()
            .constants
            .producer_state
            .load(Ordering::Acquire)
            == producer_state::CLOSED;
        if !closed && sys::peer_gone(&self.conn) {
            self.backend.abandon();
        }
        // Importers free first: drop the backend (unmapping/freeing imports) before saying
        // goodbye, so the producer frees its memory only after ours is gone.
        // SAFETY: the backend is never used again: this is the link's drop, and every batch
        // (each holds the link) is gone.
        unsafe { ManuallyDrop::drop(&mut self.backend) };
        let _ = self.conn.set_nonblocking(false);
        let _ = self
            .conn
            .set_write_timeout(Some(Duration::from_millis(200)));
        let _ = wire::send(&self.conn, &Message::Goodbye, &[]);
    }
}

/// A batch received in place: an owned value (`Send`), so several may be held at once and
/// released in any order, from any thread. Dropping it releases it (recording the backend's
/// finished signal first); [`Batch::release`] does the same and reports errors. The consumer
/// stays attached while any of its batches lives.
pub struct Batch<B: ConsumerBackend> {
    link: Arc<Link<B>>,
    seq: u64,
    slot: u32,
    len: u64,
    header: [u64; USER_HEADER_WORDS],
    tensors: Tensors,
    /// Shared mode: claimed but the token not recorded (see `next_shared`).
    claim_unrecorded: bool,
    /// Delivered as a copy in the consumer's own memory; the slot is already released.
    mirrored: bool,
    done: bool,
}

impl<B: ConsumerBackend> Batch<B> {
    /// Sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// Slot index (of the producer's slot it came in; a mirrored batch no longer holds it).
    pub fn slot(&self) -> u32 {
        self.slot
    }
    /// True when the batch is a copy in the consumer's own memory (mirror delivery).
    pub fn is_mirrored(&self) -> bool {
        self.mirrored
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// True for a zero-length batch.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The user header the producer published.
    pub fn header(&self) -> &[u64; USER_HEADER_WORDS] {
        &self.header
    }
    /// The named tensors the producer published, validated to lie within the batch; a batch
    /// published without a table has one: `data`, its bytes as `uint8`.
    pub fn tensors(&self) -> &[TensorInfo] {
        self.tensors.as_slice()
    }
    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors().iter().find(|t| t.name.as_str() == name)
    }
    /// The backend (its stream, ...).
    pub fn backend(&self) -> &B {
        &self.link.backend
    }
    /// The consumer's index in the ring.
    pub fn consumer_index(&self) -> u32 {
        self.link.index
    }
    /// The batch's memory, in place.
    pub fn data(&self) -> B::BatchRef<'_> {
        // SAFETY: the batch is published, validated (len <= slot_bytes) and not released
        // until this Batch is consumed or dropped, which the borrow on `self` outlives.
        unsafe { self.link.backend.batch_ref(self.slot, self.seq, self.len) }
    }
    /// Releases the batch: the backend's finished signal, then the ring's release.
    pub fn release(mut self) -> Result<(), Error> {
        self.done = true;
        self.link
            .release_batch(self.seq, self.slot, self.claim_unrecorded, self.mirrored)
    }
}

impl<B: ConsumerBackend> std::fmt::Debug for Batch<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("seq", &self.seq)
            .field("slot", &self.slot)
            .field("len", &self.len)
            .field("tensors", &self.tensors())
            .finish()
    }
}

impl<B: ConsumerBackend> Drop for Batch<B> {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) =
                self.link
                    .release_batch(self.seq, self.slot, self.claim_unrecorded, self.mirrored)
            {
                tracing::warn!(seq = self.seq, "releasing a dropped batch failed: {e}");
                *self.link.deferred.lock() = Some(e);
            }
        }
    }
}

/// Whether our record (its state and generation) still says that we are its active
/// consumer; if not, the detach that says why. Asked for every batch (on receive and on
/// release): the answer "ours" is two compares inline, and only a record that is no longer
/// ours pays for the call that words the error.
#[inline]
fn record_verdict(state: u32, generation: u64, ours: u64) -> Result<(), Error> {
    if state == consumer_state::ACTIVE && generation == ours {
        Ok(())
    } else {
        Err(record_lost(state))
    }
}

/// The detach that a record no longer ours (see [`record_verdict`]) means: active, it was
/// given to another consumer (its generation is not ours); else it says why.
#[cold]
#[inline(never)]
fn record_lost(state: u32) -> Error {
    match state {
        consumer_state::ACTIVE => Error::Detached(
            "our consumer index was given to a consumer that attached after we were detached"
                .into(),
        ),
        s => Error::Detached(format!("our record says {}", consumer_state::name(s))),
    }
}

/// A violation with our record's verdict (see [`Consumer::violation`]): "detached" when the
/// record says the producer dropped us, or the batch was not addressed to us; else
/// "corrupted".
fn explain_violation(v: ring::Violation, record: Result<(), Error>) -> Error {
    match (v, record) {
        (_, Err(Error::Detached(why))) => {
            Error::Detached(format!("{why}; the ring went on without us"))
        }
        (v @ ring::Violation::NotAddressed { .. }, _) => Error::Detached(v.to_string()),
        (v, _) => ProtocolError::Segment(v.to_string()).into(),
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

#[cfg(test)]
mod tests {
    use super::{explain_violation, record_verdict};
    use crate::error::Error;
    use crate::layout::consumer_state::{ACTIVE, ATTACHING, DETACHED};
    use crate::ring::Violation;

    fn overrun() -> Violation {
        Violation::Overrun {
            head: 120,
            cursor: 100,
            n: 8,
        }
    }

    #[test]
    fn a_record_is_ours_while_active_with_our_generation() {
        assert!(record_verdict(ACTIVE, 3, 3).is_ok());
        for (state, generation) in [(DETACHED, 3), (ATTACHING, 3), (ACTIVE, 4)] {
            assert!(
                matches!(
                    record_verdict(state, generation, 3),
                    Err(Error::Detached(_))
                ),
                "state {state}, generation {generation}"
            );
        }
    }

    #[test]
    fn a_violation_after_the_producer_dropped_us_is_a_detach_not_corruption() {
        // A consumer stopped (SIGSTOP) between its record check and its head check, then
        // detached under --detach-after-ms: the head is far past its cursor.
        for record in [record_verdict(DETACHED, 3, 3), record_verdict(ACTIVE, 4, 3)] {
            let e = explain_violation(overrun(), record);
            assert!(matches!(e, Error::Detached(_)), "{e}");
            assert!(!e.to_string().contains("corrupt"), "{e}");
        }
        // The same with our record active and ours: the segment cannot be right.
        let e = explain_violation(overrun(), record_verdict(ACTIVE, 3, 3));
        assert!(matches!(e, Error::Protocol(_)), "{e}");
        // Not addressed to us stays a detach, as before.
        let e = explain_violation(Violation::NotAddressed { seq: 7 }, Ok(()));
        assert!(matches!(e, Error::Detached(_)), "{e}");
    }
}
