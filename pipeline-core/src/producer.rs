//! The producer: owns the ring, the attach socket and the supervisor thread that watches
//! consumers.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::backend::ProducerBackend;
use crate::error::{Error, ProtocolError};
use crate::layout::{
    self, ControlSegment, MAX_SEQ, Mode, PROTOCOL_VERSION, RingLayout, USER_HEADER_WORDS,
    consumer_state, producer_state,
};
use crate::page::{ClaimSegment, ConsumerPage};
use crate::ring;
use crate::socket_file::{self, SocketFile};
use crate::sys::{self, IoDeadline};
use crate::tensor::{self, TensorInfo};
use crate::wait::{self, WaitPolicy};
use crate::wire::{self, Message, Role};

/// What the producer does when a live consumer stops releasing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LagPolicy {
    /// Wait for it (back-pressure): the ring runs at the pace of the slowest consumer.
    #[default]
    Block,
    /// Detach a consumer that holds a slot the producer needs for longer than this, or whose
    /// work on a released batch the backend has waited on for longer than this (CUDA: its
    /// `finished` signal, which a consumer may never give, e.g. when a peer forged its claim).
    DetachAfter(Duration),
}

/// Producer settings.
#[derive(Clone, Debug)]
pub struct ProducerConfig {
    /// Slots in the ring.
    pub slots: u32,
    /// Largest batch in bytes; slot capacity is this rounded up to 2 MiB.
    pub batch_bytes: u64,
    /// Delivery mode.
    pub mode: Mode,
    /// Most consumers at once (at most 63).
    pub max_consumers: u32,
    /// Spin and liveness tick for waits. A dead consumer is detected when its socket closes
    /// (at once); `wait.tick` bounds how late a waiting producer notices.
    pub wait: WaitPolicy,
    /// Per-message timeout of the attach handshake.
    pub handshake_timeout: Duration,
    /// Uids besides our own allowed to attach.
    pub allowed_uids: Vec<u32>,
    /// Gids whose members may attach.
    pub allowed_gids: Vec<u32>,
    /// What to do with a consumer that stops releasing.
    pub lag: LagPolicy,
    /// On close, how long to wait for consumers to drain and detach.
    pub drain_timeout: Duration,
    /// The producer never writes batch `s` before every consumer that got batch
    /// `s - max_lead` has released it (and, on the GPU, finished with it): at most `max_lead`
    /// batches are in flight, written but not yet consumed. `None` (the default) or a value
    /// of at least `slots`: the ring's own bound, `slots`. A bound below `slots` keeps the
    /// data in flight small enough to stay in a GPU's L2 cache while the ring keeps its other
    /// slots for consumers that hold batches a while.
    pub max_lead: Option<u32>,
    /// Leave the process dumpable. By default [`Producer::bind`] makes it not dumpable
    /// (`prctl(PR_SET_DUMPABLE, 0)`), so that another process of the same uid cannot open
    /// the producer's read-write fds through `/proc/<pid>/fd` (docs/security.md). That also
    /// means no core dumps and no debugger, profiler or `/proc/<pid>/mem` access by the same
    /// uid without `CAP_SYS_PTRACE`, for the whole process, until it ends or `exec`s. Set this
    /// to keep those (while debugging, say).
    pub keep_dumpable: bool,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        Self {
            slots: 8,
            batch_bytes: 8 << 20,
            mode: Mode::Broadcast,
            max_consumers: 16,
            wait: WaitPolicy::default(),
            handshake_timeout: Duration::from_secs(2),
            allowed_uids: Vec::new(),
            allowed_gids: Vec::new(),
            lag: LagPolicy::Block,
            drain_timeout: Duration::from_secs(5),
            max_lead: None,
            keep_dumpable: false,
        }
    }
}

impl ProducerConfig {
    /// The ring layout these settings give.
    pub fn layout(&self) -> RingLayout {
        RingLayout {
            slot_count: self.slots,
            slot_bytes: layout::round_slot_bytes(self.batch_bytes),
            consumer_capacity: self.max_consumers,
            mode: self.mode,
        }
    }
}

/// Counters of the producer's life, for reports.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct ProducerStats {
    /// Batches published.
    pub published: u64,
    /// Consumers that completed the handshake.
    pub attached: u64,
    /// Consumers that left cleanly.
    pub left: u64,
    /// Consumers that died.
    pub died: u64,
    /// Consumers detached by the lag policy or for protocol violations.
    pub detached: u64,
    /// Attach attempts refused (uid, version, capacity, garbage).
    pub refused: u64,
    /// Shared mode: batches put back for other consumers after their claimer died.
    pub requeued: u64,
}

/// What holds the producer back ([`Producer::held_back`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldBack {
    /// The batch the producer waits to write.
    pub seq: u64,
    /// The slot it waits for.
    pub slot: u32,
    /// When the producer began to wait for it.
    pub since: Instant,
    /// The consumers holding that slot.
    pub holders: Vec<Holder>,
}

/// A consumer holding a slot the producer waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    /// Its index in the ring.
    pub index: u32,
    /// Its process id, where the producer can see it (`None`: another pid namespace).
    pub pid: Option<u32>,
}

#[derive(Default)]
struct Counters {
    attached: AtomicU64,
    left: AtomicU64,
    died: AtomicU64,
    detached: AtomicU64,
    refused: AtomicU64,
    requeued: AtomicU64,
}

struct Member {
    conn: Arc<UnixStream>,
    /// For logs only (`None`: in a pid namespace we cannot see).
    pid: Option<u32>,
}

struct Members {
    /// Attached consumers by index.
    conns: Vec<Option<Member>>,
    /// Indices reserved by handshakes in progress (and by departures whose backend detach
    /// is still running).
    reserved: u64,
    /// Per index: the handshake in progress that reserved it, and since when. One that has
    /// waited long for its Ready gives its index up to a newcomer when the ring is full
    /// ([`Shared::reserve_index`]): a pending handshake does not hold a consumer slot.
    handshaking: Vec<Option<(Arc<Attaching>, Instant)>>,
    /// Active consumers (bit per index); mirrored in `Shared::active`.
    active: u64,
    /// Sequence number the producer publishes next (only changed under this lock).
    head: u64,
}

struct Shared<B> {
    seg: ControlSegment,
    /// The words every consumer may write (the producer's futex word, shared-mode claims).
    claims: ClaimSegment,
    /// Per consumer index: the page of its current (or last) attach. Replaced, under the
    /// members lock, only when a new consumer at the index activates; `pages_epoch` is
    /// bumped then, before the consumer's bit enters `active`.
    pages: Mutex<Vec<Option<Arc<ConsumerPage>>>>,
    pages_epoch: AtomicU64,
    /// Per slot (shared mode): `seq + 1` of its batch if a claimer that has since departed
    /// had released it (its page is no longer looked at).
    consumed: Vec<AtomicU64>,
    backend: B,
    layout: RingLayout,
    config: ProducerConfig,
    members: Mutex<Members>,
    active: AtomicU64,
    /// Per consumer index: the first sequence number its current holder receives (set under
    /// the members lock at activation). A holder of an older batch in a slot was another
    /// consumer that used the same index.
    joined_at: Vec<AtomicU64>,
    /// Per consumer index (shared mode): the claim token of its current holder, unique to
    /// that attach ([`ring::claim_token`]). A slot's `claimer` names a holder only if it
    /// equals this: the index's holder may have claimed a batch published before it joined,
    /// while an older token is a previous holder of the index.
    claim_tokens: Vec<AtomicU64>,
    /// Held (shared) by the producer from choosing a slot's holders until the backend has
    /// enqueued its waits on them, and taken (exclusive, briefly) after an index is reserved,
    /// before the backend reuses the index's signals: holders chosen while the index's
    /// previous consumer was still active are never waited for on its successor's signals.
    holders_gate: RwLock<()>,
    closing: AtomicBool,
    stop_supervisor: AtomicBool,
    waker: sys::Waker,
    counters: Counters,
}

/// A connection whose handshake runs on its own thread.
struct Attaching {
    conn: UnixStream,
    /// When it was accepted: the handshake's deadline counts from here.
    accepted: Instant,
    /// Set (under the members lock) once the consumer is active.
    joined: AtomicBool,
    /// Set once its Ready arrived (it is importing no more; it will not be taken over).
    ready: AtomicBool,
    /// Set (under the members lock) when a newcomer took its index over; it then never
    /// activates.
    taken_over: AtomicBool,
}

/// Handshakes in progress at once, at most: beyond, connections wait in the listen backlog
/// (each handshake holds a thread and a socket until its deadline).
const MAX_HANDSHAKES: usize = 64;

/// How a consumer went away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Departure {
    Left,
    Died,
    Detached,
}

impl<B: ProducerBackend> Shared<B> {
    fn shared_mode(&self) -> bool {
        self.layout.mode == Mode::Shared
    }

    /// Removes consumer `idx`: clears or requeues its claims, tells the backend, wakes
    /// everyone who might be waiting on it.
    fn depart(&self, idx: u32, how: Departure, why: &str) {
        self.depart_if(idx, None, how, why);
    }

    /// As [`Shared::depart`], but only if the consumer at `idx` is still the attach whose
    /// claim token is `token` (when given): not a consumer that took the index since.
    fn depart_if(&self, idx: u32, token: Option<u64>, how: Departure, why: &str) {
        let mut requeued = 0u64;
        let pid;
        let page = self.pages.lock()[idx as usize].clone();
        {
            let mut m = self.members.lock();
            if token.is_some_and(|t| self.claim_tokens[idx as usize].load(Ordering::Acquire) != t) {
                return;
            }
            let Some(member) = m.conns[idx as usize].take() else {
                return;
            };
            pid = member.pid;
            let state = match how {
                Departure::Left => consumer_state::LEFT,
                Departure::Died => consumer_state::DEAD,
                Departure::Detached => consumer_state::DETACHED,
            };
            // Its last counters, for `gpipe inspect`: they are final once it is gone.
            if let Some(page) = page.as_ref() {
                self.fold_counters_of(idx, page);
            }
            self.seg.consumer(idx).state.store(state, Ordering::Release);
            // Pairs with the fence a shared consumer makes between a claim and reading its
            // record: either our reclaim below sees its claim, or it sees this state.
            std::sync::atomic::fence(Ordering::SeqCst);
            for k in 0..self.layout.slot_count {
                if !self.shared_mode() {
                    // It no longer receives what it had not released: the batch is no
                    // longer addressed to it (it sees that if it comes back to it).
                    self.seg
                        .slot(k)
                        .addressed
                        .fetch_and(!ring::bit(idx), Ordering::AcqRel);
                    continue;
                }
                // What its page says it released counts as consumed from now on (its page
                // is no longer looked at), whatever the claim word says; its other claims go
                // back as unclaimed.
                let word = self.claims.claim(k);
                let progress = page
                    .as_ref()
                    .map_or(0, |p| p.slot(k).load(Ordering::Acquire));
                if let Some(r) = ring::released_seq(progress)
                    && r == self.seg.slot(k).seq.load(Ordering::Acquire)
                {
                    self.consumed[k as usize].store(r + 1, Ordering::Release);
                }
                let w = word.load(Ordering::Acquire);
                if ring::claim_owner(w) != Some(idx) || w == ring::NO_BATCH {
                    continue;
                }
                let s = ring::claim_seq(w);
                if progress == ring::released(s) {
                    // Not in its index's name any more: a later consumer at the index
                    // would take it for a claim made in its name.
                    let _ = word.compare_exchange(
                        w,
                        ring::claim_word(s, Some(ring::DEPARTED)),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    );
                } else if word
                    .compare_exchange(
                        w,
                        ring::claim_word(s, None),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    requeued += 1;
                }
            }
            if requeued > 0 {
                self.seg
                    .header()
                    .requeued
                    .value
                    .fetch_add(1, Ordering::AcqRel);
            }
            // Only now leave the active set: from here on its page is not looked at.
            m.active &= !ring::bit(idx);
            self.active.store(m.active, Ordering::Release);
            // Keep the index from being handed out until the backend has let go of it.
            m.reserved |= ring::bit(idx);
        }
        self.backend.detach(idx, how == Departure::Died);
        self.members.lock().reserved &= !ring::bit(idx);
        let counter = match how {
            Departure::Left => &self.counters.left,
            Departure::Died => &self.counters.died,
            Departure::Detached => &self.counters.detached,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.counters
            .requeued
            .fetch_add(requeued, Ordering::Relaxed);
        match how {
            Departure::Left => tracing::info!(consumer = idx, pid, "consumer left"),
            _ => tracing::warn!(
                consumer = idx,
                pid,
                requeued,
                "consumer {}: {why}; its slots were taken back",
                if how == Departure::Died {
                    "died"
                } else {
                    "detached"
                }
            ),
        }
        self.wake_producer();
        if requeued > 0 {
            self.wake_consumers();
        }
        if how == Departure::Detached {
            // Close its socket so it notices at once.
            self.waker.wake();
        }
    }

    /// Wakes a producer thread asleep waiting for a slot.
    fn wake_producer(&self) {
        wait::notify(
            self.claims.space_wake(),
            &self.seg.header().space_sleepers.value,
            true,
        );
    }

    /// Wakes every consumer asleep waiting for data (off the hot path: unconditionally).
    fn wake_consumers(&self) {
        let w = &self.seg.header().data_wake.value;
        std::sync::atomic::fence(Ordering::SeqCst);
        w.fetch_add(1, Ordering::Release);
        sys::futex_wake(w, i32::MAX as u32);
    }

    /// Copies each active consumer's counters from its page into its record, where
    /// `gpipe inspect` reads them.
    fn fold_counters(&self) {
        let active = self.active.load(Ordering::Acquire);
        let pages = self.pages.lock();
        for c in ring::members(active) {
            if let Some(page) = pages[c as usize].as_ref() {
                self.fold_counters_of(c, page);
            }
        }
    }

    /// Copies consumer `c`'s counters from its page into its record.
    fn fold_counters_of(&self, c: u32, page: &ConsumerPage) {
        let (p, r) = (page.header(), self.seg.consumer(c));
        r.cursor
            .store(p.cursor.load(Ordering::Relaxed), Ordering::Relaxed);
        r.received
            .store(p.received.load(Ordering::Relaxed), Ordering::Relaxed);
        r.released
            .store(p.released.load(Ordering::Relaxed), Ordering::Relaxed);
        r.placement
            .store(p.placement.load(Ordering::Relaxed), Ordering::Release);
    }

    fn uid_allowed(&self, cred: &sys::PeerCred) -> bool {
        cred.uid == sys::effective_uid()
            || self.config.allowed_uids.contains(&cred.uid)
            || self.config.allowed_gids.contains(&cred.gid)
    }

    /// Runs the attach handshake with one connection (on its own thread). The whole
    /// handshake, however the peer slices its messages, ends by the handshake timeout after
    /// the accept.
    fn handshake(self: &Arc<Self>, attaching: &Arc<Attaching>) {
        let conn = &attaching.conn;
        let deadline = IoDeadline {
            at: attaching
                .accepted
                .checked_add(self.config.handshake_timeout),
            interrupted: None,
        };
        // The peer's pid, where the kernel can tell it, is for the logs only: a peer in a
        // pid namespace we cannot see (another container) has none, and attaches all the
        // same. Its uid is what identifies it.
        let cred = match sys::peer_cred(conn) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("attach: cannot read the peer's credentials (SO_PEERCRED): {e}");
                wire::send_reject(
                    conn,
                    &format!("the producer cannot read this connection's credentials: {e}"),
                );
                return;
            }
        };
        let pid = cred.pid_display();
        if !self.uid_allowed(&cred) {
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(uid = cred.uid, pid, "attach refused: uid not allowed");
            wire::send_reject(
                conn,
                &format!(
                    "uid {} is not allowed to attach (the producer runs as uid {}; allow it with --allow-uid)",
                    cred.uid,
                    sys::effective_uid()
                ),
            );
            return;
        }
        if let Err(e) = self.handshake_inner(attaching, cred, deadline) {
            // Closing cuts the reading side of handshakes in progress: say why.
            let e = match e {
                Error::Protocol(ProtocolError::Hangup(_))
                    if self.closing.load(Ordering::Acquire) =>
                {
                    Error::Closed
                }
                _ if attaching.taken_over.load(Ordering::Acquire) => {
                    ProtocolError::Refused(format!(
                        "the ring is full and this attach had not finished after {:?}: a newer \
                         one took its place (raise --max-consumers, or make the import faster)",
                        self.takeover_after()
                    ))
                    .into()
                }
                e => e,
            };
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            match e {
                // Routine: a consumer killed or stopped while attaching, or one arriving
                // as the ring closes.
                Error::Closed | Error::Protocol(ProtocolError::Hangup(_)) => {
                    tracing::info!(pid, "attach abandoned: {e}")
                }
                _ => tracing::warn!(pid, "attach failed: {e}"),
            }
            // A refusal of ours reads "the producer refused the attach: …" on the other side.
            let reason = match &e {
                Error::Protocol(ProtocolError::Refused(why)) => why.clone(),
                e => e.to_string(),
            };
            wire::send_reject(conn, &reason);
        }
    }

    /// How long a handshake may wait for its Ready before a newcomer may take its index over
    /// when the ring is full: a quarter of the handshake timeout.
    fn takeover_after(&self) -> Duration {
        self.config.handshake_timeout / 4
    }

    /// Reserves a consumer index for a handshake. The ring's capacity counts attached
    /// consumers: while every index is taken but some only by handshakes in progress, waits
    /// (until `deadline`) for one to finish, and takes over the index of one that has waited
    /// for its Ready longer than [`Shared::takeover_after`] (a peer that trickles its Ready,
    /// or never sends it, holds no slot for long).
    fn reserve_index(
        &self,
        attaching: &Arc<Attaching>,
        deadline: IoDeadline,
    ) -> Result<u32, Error> {
        loop {
            let (attached, in_progress) = {
                let mut m = self.members.lock();
                if self.closing.load(Ordering::Acquire) {
                    return Err(Error::Closed);
                }
                let attached = m
                    .conns
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.is_some())
                    .fold(0u64, |a, (i, _)| a | ring::bit(i as u32));
                let taken = m.reserved | attached;
                if let Some(idx) =
                    (0..self.layout.consumer_capacity).find(|&i| taken & ring::bit(i) == 0)
                {
                    m.reserved |= ring::bit(idx);
                    m.handshaking[idx as usize] = Some((attaching.clone(), Instant::now()));
                    return Ok(idx);
                }
                if attached.count_ones() >= self.layout.consumer_capacity {
                    return Err(ProtocolError::Refused(format!(
                        "the ring is full: {} consumers attached (raise --max-consumers)",
                        self.layout.consumer_capacity
                    ))
                    .into());
                }
                // The oldest handshake still waiting for its Ready, if it waited long enough.
                let limit = self.takeover_after();
                let oldest = m
                    .handshaking
                    .iter()
                    .flatten()
                    .filter(|(a, _)| {
                        !a.ready.load(Ordering::Acquire)
                            && !a.joined.load(Ordering::Acquire)
                            && !a.taken_over.load(Ordering::Acquire)
                    })
                    .min_by_key(|(_, since)| *since)
                    .filter(|(_, since)| since.elapsed() >= limit)
                    .map(|(a, _)| a.clone());
                if let Some(victim) = oldest {
                    // It never activates now (checked under this lock); cutting its socket
                    // ends its handshake at once, which frees the index.
                    victim.taken_over.store(true, Ordering::Release);
                    let _ = victim.conn.shutdown(std::net::Shutdown::Both);
                    tracing::info!(
                        "the ring is full: an attach that waited over {limit:?} for its Ready gives its place to a newer one"
                    );
                }
                (
                    attached.count_ones(),
                    m.handshaking.iter().flatten().count(),
                )
            };
            if deadline.left().is_err() {
                return Err(ProtocolError::Refused(format!(
                    "the ring is full: {attached} consumers attached and {in_progress} attaches in progress, none of which finished within the handshake timeout (raise --max-consumers)"
                ))
                .into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// `joined` is set, under the members lock, when the consumer becomes active.
    fn handshake_inner(
        self: &Arc<Self>,
        attaching: &Arc<Attaching>,
        cred: sys::PeerCred,
        deadline: IoDeadline,
    ) -> Result<(), Error> {
        let conn = &attaching.conn;
        let joined = &attaching.joined;
        let (hello, fds) = wire::recv_until(conn, deadline)?;
        let Message::Hello {
            version,
            role,
            backend,
        } = hello
        else {
            return Err(
                ProtocolError::Message(format!("expected Hello, got {}", hello.name())).into(),
            );
        };
        drop(fds);
        if version != PROTOCOL_VERSION {
            return Err(ProtocolError::Version {
                ours: PROTOCOL_VERSION,
                theirs: version,
            }
            .into());
        }
        if backend != 0 && backend != B::KIND.to_u32() {
            return Err(Error::BackendMismatch {
                expected: crate::BackendKind::from_u32(backend)
                    .map(|k| k.to_string())
                    .unwrap_or_else(|| format!("unknown backend {backend}")),
                found: B::KIND.to_string(),
            });
        }
        if self.closing.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let welcome = |index: u32, fd_count: u32, blob: Vec<u8>| Message::Welcome {
            version: PROTOCOL_VERSION,
            layout_hash: layout::LAYOUT_HASH,
            consumer_index: index,
            mode: self.layout.mode.to_u32(),
            slot_count: self.layout.slot_count,
            slot_bytes: self.layout.slot_bytes,
            consumer_capacity: self.layout.consumer_capacity,
            backend: B::KIND.to_u32(),
            fd_count,
            blob,
        };
        if role == Role::Observer {
            return wire::send_until(
                conn,
                &welcome(wire::OBSERVER, 1, Vec::new()),
                &[self.seg.fd()],
                deadline,
            );
        }
        // Reserve an index. `close` waits for reserved indices, and no index is reserved
        // once it has begun (checked under the same lock): every attach either finishes in
        // time to be drained or is refused.
        let idx = self.reserve_index(attaching, deadline)?;
        // The index's previous consumer is gone; wait out any holders chosen while it was
        // still active, so that none of them is waited for on the signals we reuse for the
        // new one.
        drop(self.holders_gate.write());
        let rec = self.seg.consumer(idx);
        rec.state
            .store(consumer_state::ATTACHING, Ordering::Release);
        // 0 where the peer's pid is not visible (another pid namespace): display only.
        rec.pid.store(cred.pid.unwrap_or(0), Ordering::Relaxed);
        let result = self
            .attach_reserved(attaching, idx, &welcome, deadline)
            .and_then(|(conn_arc, page)| {
                let mut m = self.members.lock();
                // Closing began while this attach ran: refuse it rather than join a closed
                // ring (the supervisor may already have cut its socket). Checked under the lock
                // the supervisor takes to cut sockets, so one of the two sees the other.
                if self.closing.load(Ordering::Acquire) {
                    return Err(Error::Closed);
                }
                // A newcomer took this index over (its socket is cut): never activate.
                if attaching.taken_over.load(Ordering::Acquire) {
                    return Err(ProtocolError::Hangup("taken over".into()).into());
                }
                joined.store(true, Ordering::Release);
                // Activate under the lock so that no publish races the join point.
                let start = m.head;
                self.joined_at[idx as usize].store(start, Ordering::Release);
                // Counted here, under the lock: the count is the serial in the claim token.
                let serial = self.counters.attached.fetch_add(1, Ordering::Relaxed) + 1;
                let token = ring::claim_token(idx, serial);
                self.claim_tokens[idx as usize].store(token, Ordering::Release);
                rec.join_seq.store(start, Ordering::Relaxed);
                rec.cursor.store(start, Ordering::Relaxed);
                rec.received.store(0, Ordering::Relaxed);
                rec.released.store(0, Ordering::Relaxed);
                rec.placement.store(0, Ordering::Relaxed);
                rec.generation.fetch_add(1, Ordering::Relaxed);
                rec.state.store(consumer_state::ACTIVE, Ordering::Release);
                // Its page before its bit: whoever sees the bit sees the new epoch.
                self.pages.lock()[idx as usize] = Some(page);
                self.pages_epoch.fetch_add(1, Ordering::AcqRel);
                m.active |= ring::bit(idx);
                self.active.store(m.active, Ordering::Release);
                m.conns[idx as usize] = Some(Member {
                    conn: conn_arc.clone(),
                    pid: cred.pid,
                });
                m.handshaking[idx as usize] = None;
                m.reserved &= !(1 << idx);
                Ok((conn_arc, start, token))
            });
        match result {
            Ok((conn_arc, start, token)) => {
                tracing::info!(
                    consumer = idx,
                    pid = cred.pid_display(),
                    start,
                    "consumer attached"
                );
                // If this send fails the consumer is gone, or did not read in time (it is
                // cut off: the supervisor sees the hang-up).
                if wire::send_until(
                    &conn_arc,
                    &Message::Joined {
                        start_seq: start,
                        claim_token: token,
                    },
                    &[],
                    deadline,
                )
                .is_err()
                {
                    let _ = conn_arc.shutdown(std::net::Shutdown::Both);
                }
                self.waker.wake();
                Ok(())
            }
            Err(e) => {
                // Before the index can be reserved again: a late detach would release the
                // words of the next consumer to take it.
                rec.state.store(consumer_state::DETACHED, Ordering::Release);
                self.backend.detach(idx, true);
                let mut m = self.members.lock();
                m.handshaking[idx as usize] = None;
                m.reserved &= !(1 << idx);
                Err(e)
            }
        }
    }

    fn attach_reserved(
        &self,
        attaching: &Attaching,
        idx: u32,
        welcome: &dyn Fn(u32, u32, Vec<u8>) -> Message,
        deadline: IoDeadline,
    ) -> Result<(Arc<UnixStream>, Arc<ConsumerPage>), Error> {
        let conn = &attaching.conn;
        // A fresh page for every attach: no earlier consumer of this index holds it.
        let page = Arc::new(ConsumerPage::create(&self.layout)?);
        let export = self.backend.export(idx).map_err(Error::Backend)?;
        let mut fds: Vec<BorrowedFd<'_>> = vec![self.seg.fd(), self.claims.fd(), page.fd()];
        fds.extend(export.fds.iter().map(|f| f.as_fd()));
        wire::send_until(
            conn,
            &welcome(idx, fds.len() as u32, export.blob),
            &fds,
            deadline,
        )?;
        let (ready, fds) = wire::recv_until(conn, deadline)?;
        attaching.ready.store(true, Ordering::Release);
        match ready {
            Message::Ready { blob, .. } => {
                self.backend
                    .attach(idx, &blob, fds)
                    .map_err(Error::Backend)?;
            }
            Message::Reject { reason } => {
                return Err(ProtocolError::Message(format!(
                    "the consumer gave up during import: {reason}"
                ))
                .into());
            }
            other => {
                return Err(ProtocolError::Message(format!(
                    "expected Ready, got {}",
                    other.name()
                ))
                .into());
            }
        }
        Ok((
            Arc::new(conn.try_clone().map_err(Error::os("dup socket"))?),
            page,
        ))
    }

    /// Closing: no attach may complete now. Ends the reads of handshakes in progress rather
    /// than let a slow peer hold `close` up to the handshake timeout (the Reject that follows
    /// still reaches the peer). Under the lock under which an attach checks `closing` and
    /// activates, so a consumer that has joined is never cut.
    fn cut_handshakes(&self, attaching: &[(JoinHandle<()>, Arc<Attaching>)]) {
        let _m = self.members.lock();
        for (_, a) in attaching {
            if !a.joined.load(Ordering::Acquire) {
                let _ = a.conn.shutdown(std::net::Shutdown::Read);
            }
        }
    }

    /// The supervisor: accepts connections and watches attached consumers' sockets.
    fn supervise(self: Arc<Self>, listener: UnixListener) {
        let tick = self.config.wait.tick;
        // Bytes of a Goodbye frame received so far, per connection.
        let mut partial: std::collections::HashMap<usize, Vec<u8>> = Default::default();
        // Handshakes in progress, with their connections: on the way out they are cut short
        // and joined, so that none outlives `close` (holding fds, or the backend).
        let mut attaching: Vec<(JoinHandle<()>, Arc<Attaching>)> = Vec::new();
        let mut accept = AcceptBackoff::default();
        while !self.stop_supervisor.load(Ordering::Acquire) {
            let snapshot: Vec<(u32, Arc<UnixStream>)> = {
                let m = self.members.lock();
                m.conns
                    .iter()
                    .enumerate()
                    .filter_map(|(i, c)| c.as_ref().map(|c| (i as u32, c.conn.clone())))
                    .collect()
            };
            // New connections wait in the listen backlog while accepting fails (backing off)
            // or while the most handshakes at once are in progress (each one's end wakes us).
            let paused = accept.paused_for();
            let listening = paused.is_none() && attaching.len() < MAX_HANDSHAKES;
            let base = if listening { 2 } else { 1 };
            let mut fds: Vec<BorrowedFd<'_>> = vec![self.waker.fd()];
            if listening {
                fds.push(listener.as_fd());
            }
            fds.extend(snapshot.iter().map(|(_, c)| c.as_fd()));
            let ready = match sys::poll_readable(&fds, paused.map_or(tick, |p| p.min(tick))) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("supervisor poll failed: {e}");
                    std::thread::sleep(tick);
                    continue;
                }
            };
            if ready[0].readable {
                self.waker.drain();
            }
            if listening && ready[1].readable {
                while attaching.len() < MAX_HANDSHAKES {
                    match listener.accept() {
                        Ok((conn, _)) => {
                            accept.succeeded();
                            let me = self.clone();
                            let conn = Arc::new(Attaching {
                                conn,
                                accepted: Instant::now(),
                                joined: AtomicBool::new(false),
                                ready: AtomicBool::new(false),
                                taken_over: AtomicBool::new(false),
                            });
                            let theirs = conn.clone();
                            let spawned = std::thread::Builder::new()
                                .name("gpipe-attach".into())
                                .spawn(move || {
                                    me.handshake(&theirs);
                                    // The supervisor may be waiting for a handshake to end.
                                    me.waker.wake();
                                });
                            match spawned {
                                Ok(h) => attaching.push((h, conn)),
                                Err(e) => {
                                    // The connection closes (dropped): its peer sees why
                                    // below, the log says it once per spell.
                                    wire::send_reject(
                                        &conn.conn,
                                        &format!("the producer cannot start a handshake: {e}"),
                                    );
                                    accept.failed(&e, "start a handshake thread", attaching.len());
                                    break;
                                }
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            accept.failed(&e, "accept attach connections", attaching.len());
                            break;
                        }
                    }
                }
            }
            for (i, (idx, conn)) in snapshot.iter().enumerate() {
                let r = ready[i + base];
                // Read before acting on a hang-up: a clean exit sends Goodbye, then closes.
                if r.readable {
                    let buf = partial.entry(Arc::as_ptr(conn) as usize).or_default();
                    match read_goodbye(conn, buf) {
                        Some(Ok(())) => self.depart(*idx, Departure::Left, "left"),
                        Some(Err((how, why))) => self.depart(*idx, how, &why),
                        None => {}
                    }
                } else if r.hangup {
                    self.depart(*idx, Departure::Died, "its socket hung up");
                }
            }
            if let LagPolicy::DetachAfter(limit) = self.config.lag {
                // Asked under the members lock, under which a new consumer at an index
                // activates only after its backend attach forgot the old one's waits: the
                // index named is the attach whose token we note, and only it is detached.
                let named = {
                    let m = self.members.lock();
                    self.backend
                        .overdue(limit)
                        .filter(|&c| m.active & ring::bit(c) != 0)
                        .map(|c| (c, self.claim_tokens[c as usize].load(Ordering::Acquire)))
                };
                if let Some((c, token)) = named {
                    self.depart_if(
                        c,
                        Some(token),
                        Departure::Detached,
                        &format!(
                            "the producer waited over {limit:?} for its work on a batch to finish (lag policy detach-after)"
                        ),
                    );
                }
            }
            self.fold_counters();
            partial.retain(|k, _| snapshot.iter().any(|(_, c)| Arc::as_ptr(c) as usize == *k));
            attaching.retain(|(h, _)| !h.is_finished());
            if self.closing.load(Ordering::Acquire) {
                self.cut_handshakes(&attaching);
            }
        }
        // None outlives `close` (holding fds, or the backend). `closing` is set before we
        // are stopped, but the loop may have read it unset last time round: cut again.
        self.cut_handshakes(&attaching);
        for (h, _) in attaching {
            let _ = h.join();
        }
    }
}

/// The supervisor's response to failing accepts (`EMFILE` when the process is out of file
/// descriptors, say): it stops accepting for a while, doubling the pause up to a second, and
/// logs the cause once per spell of failures rather than once per attempt.
#[derive(Default)]
struct AcceptBackoff {
    /// When the current spell of failures began, and how many failures it has seen.
    failing: Option<(Instant, u64)>,
    /// No accepts before this.
    paused_until: Option<Instant>,
    pause: Duration,
}

impl AcceptBackoff {
    const FIRST_PAUSE: Duration = Duration::from_millis(10);
    const MOST_PAUSE: Duration = Duration::from_secs(1);

    /// How long accepting stays paused, if it is.
    fn paused_for(&self) -> Option<Duration> {
        let left = self.paused_until?.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    fn failed(&mut self, e: &std::io::Error, what: &str, handshakes: usize) {
        match &mut self.failing {
            Some((_, n)) => *n += 1,
            None => {
                let cause = if e.raw_os_error() == Some(rustix::io::Errno::MFILE.raw_os_error()) {
                    format!(
                        "this process has as many files open as its limit allows (ulimit -n: {}; {handshakes} handshakes in progress); raise the limit",
                        sys::open_file_limit()
                            .map_or_else(|| "unlimited".to_string(), |l| l.to_string())
                    )
                } else if e.raw_os_error() == Some(rustix::io::Errno::NFILE.raw_os_error()) {
                    "the whole system is out of file descriptors (fs.file-max)".to_string()
                } else {
                    format!("{handshakes} handshakes in progress")
                };
                tracing::warn!(
                    "cannot {what}: {e} ({cause}); new attaches wait in the socket's backlog, retried with a pause of up to {:?} (logged once until it recovers)",
                    Self::MOST_PAUSE
                );
                self.failing = Some((Instant::now(), 1));
                self.pause = Self::FIRST_PAUSE;
            }
        }
        self.paused_until = Some(Instant::now() + self.pause);
        self.pause = (self.pause * 2).min(Self::MOST_PAUSE);
    }

    fn succeeded(&mut self) {
        if let Some((since, n)) = self.failing.take() {
            tracing::info!(
                "accepting attach connections again after {n} failed attempts over {:?}",
                since.elapsed()
            );
        }
        self.paused_until = None;
    }
}

/// After attaching, a consumer may only say Goodbye: a 12-byte frame with an empty body.
/// Reads what is there without blocking and keeps partial bytes in `buf`, so a peer that
/// trickles bytes cannot hold up the supervisor. `None`: nothing complete yet.
fn read_goodbye(conn: &UnixStream, buf: &mut Vec<u8>) -> Option<Result<(), (Departure, String)>> {
    let mut chunk = [0u8; 12];
    let want = 12 - buf.len();
    match rustix::net::recv(conn, &mut chunk[..want], rustix::net::RecvFlags::DONTWAIT) {
        Ok((0, _)) => return Some(Err((Departure::Died, "its socket closed".into()))),
        Ok((n, _)) => buf.extend_from_slice(&chunk[..n.min(want)]),
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => return None,
        Err(e) => return Some(Err((Departure::Died, format!("its socket failed: {e}")))),
    }
    if buf.len() < 12 {
        return None;
    }
    let mut prefix = [0u8; 12];
    prefix.copy_from_slice(buf);
    Some(match wire::decode_prefix(&prefix) {
        Ok((6, 0)) => Ok(()),
        Ok((kind, len)) => Err((
            Departure::Detached,
            format!(
                "sent a message of kind {kind} ({len} bytes) after attaching; only Goodbye is allowed"
            ),
        )),
        Err(e) => Err((Departure::Detached, e.to_string())),
    })
}

/// The producing side of a ring. Not `Sync`: one thread acquires and publishes.
pub struct Producer<B: ProducerBackend> {
    shared: Arc<Shared<B>>,
    head: u64,
    holders: Vec<u64>,
    /// This thread's copy of the consumers' pages (`Shared::pages`), refreshed when the
    /// epoch moves: the hot path reads pages without a lock.
    pages: std::cell::RefCell<PageCache>,
    /// The epoch `pages` was copied at (checked without borrowing it, on every publish and
    /// every slot check).
    pages_seen: std::cell::Cell<u64>,
    supervisor: Option<JoinHandle<()>>,
    socket_path: PathBuf,
    /// The socket file we created: removed at the end only if the path still names it.
    socket_file: SocketFile,
    closed: bool,
    /// The batch the producer has been waiting to get a slot for, and since when: the lag
    /// policy's clock, kept across `acquire` calls that time out (a binding acquires in short
    /// slices to stay interruptible).
    stalled_since: Option<(u64, Instant)>,
    /// Shared mode, while stalled: since when each consumer's page has said, without a break,
    /// that it holds the batch waited for. The lag policy blames a consumer for its own hold
    /// only: a batch left unclaimed (or whose claim word a peer keeps resetting) runs no
    /// consumer's clock, so the consumer that finally takes it is not detached at once.
    /// Keyed by the stall's start (reset lazily, off the hot path).
    held_since: std::cell::RefCell<(Option<Instant>, Vec<Option<Instant>>)>,
    /// One past the last batch whose slot was taken ahead ([`Producer::acquire_ahead`]):
    /// batches `head..reserved` have their slots waited for and are not yet published.
    reserved: u64,
    /// Bumped by [`Producer::cancel_ahead`]: loans from before are refused.
    loan_epoch: u64,
}

/// The producer thread's copy of the consumers' pages.
struct PageCache {
    epoch: u64,
    pages: Vec<Option<Arc<ConsumerPage>>>,
}

/// Where a slot the producer wants to write again stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotWait {
    /// Free: every holder let go of its batch.
    Free,
    /// These consumers still hold it.
    Held(u64),
    /// Shared mode: its batch waits for a consumer to claim it.
    Unclaimed,
    /// Shared mode: its claim word names nobody whose page backs it (this claim word).
    Unbacked(u64),
}

impl<B: ProducerBackend> Producer<B> {
    /// Creates the ring and its backend and listens on `socket_path` (mode 0600). A stale
    /// socket file left by a dead producer is replaced; a live producer's is not.
    ///
    /// It also makes the whole process not dumpable (no core dumps; no `/proc/<pid>/fd`,
    /// `/proc/<pid>/mem` or debugger access by other processes of its uid), unless
    /// [`ProducerConfig::keep_dumpable`] is set: see docs/security.md.
    pub fn bind(
        socket_path: impl AsRef<Path>,
        config: ProducerConfig,
        options: B::Options,
    ) -> Result<Self, Error> {
        crate::limits::check_shape(config.slots, config.batch_bytes, config.max_consumers)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let layout = config.layout();
        layout.validate()?;
        if config.max_lead == Some(0) {
            return Err(Error::InvalidArgument(
                "max_lead must be at least 1 batch (leave it out for the ring's own bound)".into(),
            ));
        }
        let socket_path = socket_path.as_ref().to_path_buf();
        // Before any fd of the ring exists: a process of our uid must not be able to open our
        // read-write fds through /proc/<pid>/fd (docs/security.md).
        if !config.keep_dumpable {
            sys::make_not_dumpable().map_err(Error::os("prctl(PR_SET_DUMPABLE, 0)"))?;
        }
        let seg = ControlSegment::create(layout, B::KIND.to_u32())?;
        let claims = ClaimSegment::create(&layout)?;
        // A ring too large for its memory is a wrong argument, not a failing backend.
        let backend = B::create(&layout, options).map_err(|e| {
            match e.downcast::<crate::limits::DoesNotFit>() {
                Ok(too_large) => Error::InvalidArgument(too_large.to_string()),
                Err(e) => Error::Backend(e),
            }
        })?;
        // Other users may attach: the socket must let them connect (the uid check on every
        // connection, not the file mode, then says who gets in).
        let open_to_others = !config.allowed_uids.is_empty() || !config.allowed_gids.is_empty();
        let (listener, socket_file) =
            socket_file::listen(&socket_path, if open_to_others { 0o666 } else { 0o600 })?;
        if open_to_others {
            socket_file::warn_if_unreachable(&socket_path);
        }
        let shared = Arc::new(Shared {
            seg,
            claims,
            pages: Mutex::new((0..layout.consumer_capacity).map(|_| None).collect()),
            pages_epoch: AtomicU64::new(0),
            consumed: (0..layout.slot_count).map(|_| AtomicU64::new(0)).collect(),
            backend,
            layout,
            config,
            members: Mutex::new(Members {
                conns: (0..layout.consumer_capacity).map(|_| None).collect(),
                handshaking: (0..layout.consumer_capacity).map(|_| None).collect(),
                reserved: 0,
                active: 0,
                head: 0,
            }),
            active: AtomicU64::new(0),
            joined_at: (0..layout.consumer_capacity)
                .map(|_| AtomicU64::new(0))
                .collect(),
            claim_tokens: (0..layout.consumer_capacity)
                .map(|_| AtomicU64::new(u64::MAX))
                .collect(),
            holders_gate: RwLock::new(()),
            closing: AtomicBool::new(false),
            stop_supervisor: AtomicBool::new(false),
            waker: sys::Waker::new().map_err(Error::os("pipe"))?,
            counters: Counters::default(),
        });
        let s2 = shared.clone();
        let supervisor = std::thread::Builder::new()
            .name("gpipe-supervisor".into())
            .spawn(move || s2.supervise(listener))
            .map_err(Error::os("spawn supervisor thread"))?;
        tracing::info!(
            socket = %socket_path.display(),
            slots = layout.slot_count,
            slot_bytes = layout.slot_bytes,
            mode = %layout.mode,
            backend = %B::KIND,
            "producer listening"
        );
        Ok(Self {
            shared,
            head: 0,
            holders: vec![0; layout.slot_count as usize],
            pages: std::cell::RefCell::new(PageCache {
                epoch: 0,
                pages: (0..layout.consumer_capacity).map(|_| None).collect(),
            }),
            pages_seen: std::cell::Cell::new(0),
            supervisor: Some(supervisor),
            socket_path,
            socket_file,
            closed: false,
            stalled_since: None,
            held_since: std::cell::RefCell::new((
                None,
                vec![None; layout.consumer_capacity as usize],
            )),
            reserved: 0,
            loan_epoch: 0,
        })
    }

    /// The ring's layout.
    pub fn layout(&self) -> RingLayout {
        self.shared.layout
    }

    /// The backend (e.g. for its stream or device).
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// The socket path consumers attach to.
    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// Number of consumers attached and active now.
    pub fn consumers(&self) -> u32 {
        self.shared.active.load(Ordering::Acquire).count_ones()
    }

    /// Sequence number of the next batch.
    pub fn next_seq(&self) -> u64 {
        self.head
    }

    /// Counters so far.
    pub fn stats(&self) -> ProducerStats {
        let c = &self.shared.counters;
        ProducerStats {
            published: self.head,
            attached: c.attached.load(Ordering::Relaxed),
            left: c.left.load(Ordering::Relaxed),
            died: c.died.load(Ordering::Relaxed),
            detached: c.detached.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            requeued: c.requeued.load(Ordering::Relaxed),
        }
    }

    /// Waits until at least `n` consumers are active, or `timeout` passes.
    pub fn wait_for_consumers(&self, n: u32, timeout: Duration) -> Result<(), Error> {
        self.wait_for_consumers_or_stop(n, timeout, &|| false)
            .map(|_| ())
    }

    /// As [`Producer::wait_for_consumers`], but also ends when `stop` returns true (a Ctrl-C
    /// flag, a shutdown request), which it asks every 2 ms. Returns whether the consumers
    /// came: `Ok(false)` when `stop` ended the wait. Refuses at once a wait that could never
    /// end: more consumers than the ring takes (`max_consumers`).
    pub fn wait_for_consumers_or_stop(
        &self,
        n: u32,
        timeout: Duration,
        stop: &dyn Fn() -> bool,
    ) -> Result<bool, Error> {
        let capacity = self.shared.layout.consumer_capacity;
        if n > capacity {
            return Err(Error::InvalidArgument(format!(
                "waiting for {n} consumers would never end: this ring takes at most {capacity} \
                 at once (max_consumers); raise max_consumers or wait for fewer"
            )));
        }
        let deadline = Instant::now() + timeout;
        while self.consumers() < n {
            if stop() {
                return Ok(false);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout("consumers to attach"));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(true)
    }

    /// While the producer waits for a slot (an [`Producer::acquire`] in progress, or the last
    /// one gave up with [`Error::Timeout`] and the slot is still taken): the batch it waits to
    /// write, since when, and the consumers that still hold the slot's previous batch. `None`
    /// when it is not waiting. In shared mode a slot whose batch no consumer has claimed yet
    /// is held by nobody in particular (`holders` is empty).
    pub fn held_back(&self) -> Option<HeldBack> {
        let (seq, since) = self.stalled_since?;
        if seq < self.head {
            return None;
        }
        let sh = &*self.shared;
        let n = sh.layout.slot_count;
        let waited_on = self
            .lead_bound(seq)
            .into_iter()
            .chain(ring::previous_in_slot(seq, n));
        for prev in waited_on {
            let slot = ring::slot_of(prev, n);
            let held = match self.slot_wait(slot, prev) {
                SlotWait::Free => continue,
                SlotWait::Held(m) => m,
                SlotWait::Unclaimed | SlotWait::Unbacked(_) => 0,
            };
            let members = sh.members.lock();
            let holders = (0..sh.layout.consumer_capacity)
                .filter(|&c| held & ring::bit(c) != 0)
                .map(|index| Holder {
                    index,
                    pid: members.conns[index as usize].as_ref().and_then(|m| m.pid),
                })
                .collect();
            return Some(HeldBack {
                seq,
                slot,
                since,
                holders,
            });
        }
        None
    }

    /// Takes the next slot, waiting until every consumer that had its previous batch has
    /// released it (and, through the backend, finished with it). Blocks while consumers lag,
    /// unless the lag policy detaches them.
    pub fn acquire(&mut self) -> Result<Slot<'_, B>, Error> {
        self.acquire_until(None)
    }

    /// As [`Producer::acquire`], but gives up with [`Error::Timeout`] after `timeout`.
    pub fn acquire_timeout(&mut self, timeout: Duration) -> Result<Slot<'_, B>, Error> {
        self.acquire_until(Some(Instant::now() + timeout))
    }

    fn acquire_until(&mut self, deadline: Option<Instant>) -> Result<Slot<'_, B>, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        let s = self.head;
        if s < self.reserved {
            // Taken ahead already (its waits are done): the same slot again.
            return Ok(Slot {
                seq: s,
                slot: ring::slot_of(s, self.shared.layout.slot_count),
                producer: self,
            });
        }
        self.wait_for_slot(s, deadline)?;
        Ok(Slot {
            seq: s,
            slot: ring::slot_of(s, self.shared.layout.slot_count),
            producer: self,
        })
    }

    /// Takes the slot of the next batch not yet taken, while earlier ones are still being
    /// written: a pipeline (a forwarder copying, a relay receiving) can have several batches
    /// in flight and publish each once it is whole. Returns a loan; write the slot through
    /// [`Producer::loan_memory`], and publish the batches in order: [`Producer::resume`] takes
    /// a loan back when it is the next batch (`loan.seq() == next_seq()`). At most as many
    /// batches as the ring has slots (and as `max_lead`) may be taken at once.
    /// [`Producer::acquire`] hands out the oldest taken one again.
    pub fn acquire_ahead(&mut self, timeout: Duration) -> Result<SlotLoan, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        let s = self.reserved.max(self.head);
        let n = u64::from(self.shared.layout.slot_count);
        let limit = self
            .shared
            .config
            .max_lead
            .map_or(n, |l| u64::from(l).min(n));
        if s - self.head >= limit {
            return Err(Error::InvalidArgument(format!(
                "{} batches are taken ahead and unpublished: at most {limit} may be (the ring's \
                 slots{})",
                s - self.head,
                if limit < n { " and max_lead" } else { "" }
            )));
        }
        self.wait_for_slot(s, Some(Instant::now() + timeout))?;
        self.reserved = s + 1;
        Ok(SlotLoan {
            seq: s,
            slot: ring::slot_of(s, self.shared.layout.slot_count),
            epoch: self.loan_epoch,
        })
    }

    /// The memory of a slot taken with [`Producer::acquire_ahead`] and not yet published.
    pub fn loan_memory(&mut self, loan: &SlotLoan) -> Result<B::SlotMut<'_>, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        if loan.epoch != self.loan_epoch
            || loan.seq < self.head
            || loan.seq >= self.reserved
            || loan.slot != ring::slot_of(loan.seq, self.shared.layout.slot_count)
        {
            return Err(Error::InvalidArgument(format!(
                "slot loan for batch {} is not an unpublished batch taken ahead ({}..{})",
                loan.seq, self.head, self.reserved
            )));
        }
        // The slot of an unpublished batch taken ahead: its previous holders released it and
        // the backend ordered after them (acquire_ahead); nothing else hands it out until it
        // is published (acquire returns it only as the head batch, through a Slot that
        // borrows the producer mutably, as this memory does).
        // SAFETY: the slot is ours alone until published, as argued above.
        Ok(unsafe { self.shared.backend.slot_mut(loan.slot) })
    }

    /// Gives back every slot taken ahead and not published (e.g. after the pipeline filling
    /// them failed): the next batch taken is the next to publish again, and the loans taken
    /// before are void (do not publish them). Asynchronous writes into those slots (a copy or
    /// a receive on a stream) must have finished or been ended first: the slots are handed out
    /// again.
    pub fn cancel_ahead(&mut self) {
        self.reserved = self.head;
        self.loan_epoch += 1;
    }

    /// The producer-lead bound it was configured with (None: the ring's own, its slots).
    pub fn max_lead(&self) -> Option<u32> {
        self.shared.config.max_lead
    }

    /// Batches taken ahead and not yet published.
    pub fn taken_ahead(&self) -> u64 {
        self.reserved.saturating_sub(self.head)
    }

    /// Waits until the slot of batch `s` may be written: its previous batch released by every
    /// holder (and, through the backend, their work done), and under `max_lead` the batch
    /// that far back done with too.
    fn wait_for_slot(&mut self, s: u64, deadline: Option<Instant>) -> Result<(), Error> {
        if s > MAX_SEQ {
            return Err(Error::InvalidArgument(
                "sequence numbers exhausted (2^48 batches)".into(),
            ));
        }
        let n = self.shared.layout.slot_count;
        let k = ring::slot_of(s, n);
        // Under a lead bound, the batch `max_lead` back must be done with too (it still sits
        // in its slot: the lead is below the ring's size).
        let early = self.lead_bound(s).map(|e| (ring::slot_of(e, n), e));
        let prev = ring::previous_in_slot(s, n);
        if early.is_none() && prev.is_none() {
            return Ok(());
        }
        let started = match self.stalled_since {
            Some((seq, t)) if seq == s => t,
            _ => self.stalled_since.insert((s, Instant::now())).1,
        };
        if let Some((k_early, e)) = early {
            self.wait_slot_free(k_early, e, started, deadline)?;
        }
        if let Some(p) = prev {
            self.wait_slot_free(k, p, started, deadline)?;
        }
        self.stalled_since = None;
        // Both released: the backend orders after both in one call (one stream operation).
        let _gate = self.shared.holders_gate.read();
        let mut waits = [(0, 0, 0); 2];
        let mut len = 0;
        for (slot, seq) in early.into_iter().chain(prev.map(|p| (k, p))) {
            waits[len] = (slot, seq, self.holders_of(slot, seq));
            len += 1;
        }
        self.shared
            .backend
            .wait_finished_all(&waits[..len])
            .map_err(Error::Backend)
    }

    /// Takes back a slot let go with [`Slot::into_loan`]. Refused once the producer has
    /// published past it or was closed: a loan is good for the next batch only.
    pub fn resume(&mut self, loan: SlotLoan) -> Result<Slot<'_, B>, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        if loan.epoch != self.loan_epoch {
            return Err(Error::InvalidArgument(format!(
                "slot loan for batch {} was cancelled (cancel_ahead)",
                loan.seq
            )));
        }
        if loan.seq != self.head
            || loan.slot != ring::slot_of(self.head, self.shared.layout.slot_count)
        {
            return Err(Error::InvalidArgument(format!(
                "slot loan for batch {} is stale: the next batch is {}",
                loan.seq, self.head
            )));
        }
        Ok(Slot {
            producer: self,
            seq: loan.seq,
            slot: loan.slot,
        })
    }

    /// While publishing batch `seq`: when the next batch will be acquired next and its
    /// slot's previous batch is already released by every holder, what `wait_for_slot` will
    /// hand [`ProducerBackend::wait_finished`] for it, `(slot, prev_seq, holders)`, for
    /// [`ProducerBackend::signal_ready_then_wait`]. Not under a lead bound below the ring
    /// (which waits for a second batch), nor with one slot (the next batch's previous one is
    /// `seq` itself), nor when a later batch was already taken ahead. The caller holds
    /// `holders_gate`.
    fn free_next(&self, seq: u64) -> Option<(u32, u64, u64)> {
        let sh = &*self.shared;
        let n = sh.layout.slot_count;
        let next = seq + 1;
        if n < 2 || next > MAX_SEQ || self.reserved > next || self.lead_bound(next).is_some() {
            return None;
        }
        let prev = ring::previous_in_slot(next, n)?;
        let k = ring::slot_of(next, n);
        (self.slot_wait(k, prev) == SlotWait::Free).then(|| (k, prev, self.holders_of(k, prev)))
    }

    /// The consumers' pages as of now, for the consumers in the active mask loaded first
    /// (the caller's `active` must be loaded before this call: a page is installed, and the
    /// epoch bumped, before its consumer's bit is set).
    fn pages(&self) -> std::cell::Ref<'_, PageCache> {
        let epoch = self.shared.pages_epoch.load(Ordering::Acquire);
        if self.pages_seen.get() != epoch {
            let mut cache = self.pages.borrow_mut();
            cache.pages.clone_from(&self.shared.pages.lock());
            cache.epoch = epoch;
            self.pages_seen.set(epoch);
        }
        self.pages.borrow()
    }

    /// Where slot `k`, holding batch `prev`, stands (see [`SlotWait`]). In shared mode a slot
    /// found free is marked as being written again (its descriptor's `seq` set to
    /// [`ring::NO_BATCH`]) and its holders looked for once more: a consumer that claims the
    /// batch anew (a peer may have reopened its claim word) either sees the mark and lets
    /// go, or is seen here and waited for.
    fn slot_wait(&self, k: u32, prev: u64) -> SlotWait {
        let sh = &*self.shared;
        let active = sh.active.load(Ordering::Acquire);
        let cache = self.pages();
        let word = |c: u32, order: Ordering| {
            cache.pages[c as usize]
                .as_ref()
                .map_or(0, |p| p.slot(k).load(order))
        };
        if !sh.shared_mode() {
            let addressed = self.addressed(k, prev, active);
            return match ring::broadcast_laggards(prev, addressed, |c| word(c, Ordering::Acquire)) {
                0 => SlotWait::Free,
                m => SlotWait::Held(m),
            };
        }
        let w = sh.claims.claim(k).load(Ordering::Acquire);
        let consumed = sh.consumed[k as usize].load(Ordering::Acquire) == prev + 1;
        match ring::shared_slot(w, prev, active, consumed, |c| word(c, Ordering::Acquire)) {
            ring::SharedSlot::Free => {
                let desc = sh.seg.slot(k);
                if desc.seq.load(Ordering::Relaxed) != ring::NO_BATCH {
                    desc.seq.store(ring::NO_BATCH, Ordering::SeqCst);
                }
                match ring::holders_after_mark(prev, active, |c| word(c, Ordering::SeqCst)) {
                    0 => SlotWait::Free,
                    m => SlotWait::Held(m),
                }
            }
            ring::SharedSlot::Held(m) => SlotWait::Held(m),
            ring::SharedSlot::Unclaimed => SlotWait::Unclaimed,
            ring::SharedSlot::Unbacked => SlotWait::Unbacked(w),
        }
    }

    /// Broadcast: the consumers batch `prev` (in slot `k`) was published to that are still
    /// attached — not a consumer that has since taken the same index (it joined after).
    fn addressed(&self, k: u32, prev: u64, active: u64) -> u64 {
        let sh = &*self.shared;
        let mut holders = 0;
        for c in ring::members(self.holders[k as usize] & active) {
            if sh
                .joined_at
                .get(c as usize)
                .is_some_and(|j| j.load(Ordering::Acquire) <= prev)
            {
                holders |= ring::bit(c);
            }
        }
        holders
    }

    /// Shared mode: puts back as unclaimed a batch whose claim word `w` no page backs (a
    /// scribble, a claim in another's name, a departed claimer's late claim), and tells the
    /// consumers to look again.
    fn put_back(&self, k: u32, prev: u64, w: u64) {
        let sh = &*self.shared;
        if sh
            .claims
            .claim(k)
            .compare_exchange(
                w,
                ring::claim_word(prev, None),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            tracing::debug!(
                slot = k,
                "slot {k}'s claim word held {w:#x}, which no consumer's page backs (a claim in \
                 another's name, or scribbled); put batch {prev} back as unclaimed"
            );
            self.rescan();
        }
    }

    /// Shared mode: tells consumers to scan the whole window again (a batch was put back).
    fn rescan(&self) {
        let sh = &*self.shared;
        sh.seg
            .header()
            .requeued
            .value
            .fetch_add(1, Ordering::AcqRel);
        sh.wake_consumers();
    }

    /// The batch that must be done with before batch `s` is written, under
    /// [`ProducerConfig::max_lead`]; None when the ring's own bound applies.
    fn lead_bound(&self, s: u64) -> Option<u64> {
        let lead = u64::from(self.shared.config.max_lead?);
        if lead >= u64::from(self.shared.layout.slot_count) {
            return None;
        }
        s.checked_sub(lead)
    }

    /// Waits until slot `k`, holding batch `prev`, is free; the lag policy counts from
    /// `started`.
    fn wait_slot_free(
        &self,
        k: u32,
        prev: u64,
        started: Instant,
        deadline: Option<Instant>,
    ) -> Result<(), Error> {
        let sh = &*self.shared;
        let h = sh.seg.header();
        // Sleep no longer than the deadline: a caller polling with short timeouts (a pipeline
        // that publishes between them) must get control back on time.
        let mut policy = sh.config.wait;
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            policy.tick = policy.tick.min(left.max(Duration::from_micros(50)));
        }
        wait::wait_for(
            policy,
            sh.claims.space_wake(),
            &h.space_sleepers.value,
            || match self.slot_wait(k, prev) {
                SlotWait::Free => Some(()),
                SlotWait::Unbacked(w) => {
                    self.put_back(k, prev, w);
                    None
                }
                _ => None,
            },
            || {
                let laggards = match self.slot_wait(k, prev) {
                    SlotWait::Free => return Ok(Some(())),
                    SlotWait::Held(m) => m,
                    SlotWait::Unbacked(w) => {
                        self.put_back(k, prev, w);
                        0
                    }
                    SlotWait::Unclaimed => {
                        // Consumers look for work from where they last found some: make
                        // them look at the whole window, whatever put this batch back.
                        self.rescan();
                        0
                    }
                };
                if let LagPolicy::DetachAfter(limit) = sh.config.lag {
                    // Broadcast: a laggard has held the batch since the wait began at least.
                    // Shared: since its page first said so (without a break) in this stall.
                    let now = Instant::now();
                    let mut overdue = 0;
                    let mut held_since = self.held_since.borrow_mut();
                    let (stall, since) = &mut *held_since;
                    if *stall != Some(started) {
                        since.fill(None);
                        *stall = Some(started);
                    }
                    for (c, t) in since.iter_mut().enumerate() {
                        let c = c as u32;
                        if laggards & ring::bit(c) == 0 {
                            *t = None;
                            continue;
                        }
                        let from = if sh.shared_mode() {
                            *t.get_or_insert(now)
                        } else {
                            started
                        };
                        if now.saturating_duration_since(from) >= limit {
                            overdue |= ring::bit(c);
                        }
                    }
                    drop(held_since);
                    for c in ring::members(overdue) {
                        sh.depart(
                            c,
                            Departure::Detached,
                            &format!(
                                "it held slot {k} for over {limit:?} (lag policy detach-after)"
                            ),
                        );
                    }
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(Error::Timeout("a free slot"));
                }
                Ok(None)
            },
        )
    }

    /// Waits until every published batch has been released by every consumer that holds it,
    /// and orders the backend after their work (as `acquire` does for each slot): afterwards
    /// the ring is idle. Gives up with [`Error::Timeout`] after `timeout`.
    pub fn flush(&mut self, timeout: Duration) -> Result<(), Error> {
        let deadline = Some(Instant::now() + timeout);
        let n = self.shared.layout.slot_count;
        for s in self.head.saturating_sub(n as u64)..self.head {
            let k = ring::slot_of(s, n);
            self.wait_slot_free(k, s, Instant::now(), deadline)?;
            let _gate = self.shared.holders_gate.read();
            let holders = self.holders_of(k, s);
            self.shared
                .backend
                .wait_finished(k, s, holders)
                .map_err(Error::Backend)?;
        }
        Ok(())
    }

    /// The consumers that got batch `seq` (in slot `k`) and are still attached — not a
    /// consumer that has since taken the same index (broadcast: it joined after `seq`;
    /// shared: the slot's claim token is an older attach's).
    fn holders_of(&self, k: u32, seq: u64) -> u64 {
        let sh = &*self.shared;
        let active = sh.active.load(Ordering::Acquire);
        if !sh.shared_mode() {
            return self.addressed(k, seq, active);
        }
        // Every active consumer whose page says it took the batch (held or released it): not
        // filtered by join point, since a consumer may claim a batch published before it
        // joined; a later consumer at an index has a fresh page that never took it.
        let cache = self.pages();
        let mut holders = 0;
        for c in ring::members(active) {
            let w = cache.pages[c as usize]
                .as_ref()
                .map_or(0, |p| p.slot(k).load(Ordering::Acquire));
            if w == ring::holding(seq) || w == ring::released(seq) {
                holders |= ring::bit(c);
            }
        }
        holders
    }

    /// Shuts the ring down cleanly: consumers get every batch already published, then end.
    /// Waits up to the configured drain timeout for them to release and detach (the CUDA
    /// backend frees memory only after importers are done).
    pub fn close(mut self) -> ProducerStats {
        self.close_inner();
        self.stats()
    }

    /// Closes the ring as [`Producer::close`] does, but keeps the slot memory until the
    /// producer is dropped: for bindings that handed out views of it.
    pub fn shutdown(&mut self) -> ProducerStats {
        self.close_inner();
        self.stats()
    }

    /// True once the ring is closed.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    fn close_inner(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let sh = &*self.shared;
        sh.closing.store(true, Ordering::Release);
        let h = sh.seg.header();
        h.constants
            .producer_state
            .store(producer_state::CLOSED, Ordering::Release);
        sh.wake_consumers();
        let deadline = Instant::now() + sh.config.drain_timeout;
        loop {
            let attached = {
                let m = sh.members.lock();
                // Reserved: an attach in progress, or a departure whose backend detach is
                // still running. Either ends soon.
                m.reserved != 0 || m.conns.iter().any(|c| c.is_some())
            };
            if !attached || Instant::now() >= deadline {
                if attached {
                    tracing::warn!(
                        "closing with consumers still attached after {:?}; detaching them",
                        sh.config.drain_timeout
                    );
                    // Detach them here, as the supervisor would: on the CUDA backend this
                    // releases their waits, which an attach in progress may be draining.
                    let idxs: Vec<u32> = {
                        let m = sh.members.lock();
                        (0..m.conns.len() as u32)
                            .filter(|&i| m.conns[i as usize].is_some())
                            .collect()
                    };
                    for i in idxs {
                        sh.depart(
                            i,
                            Departure::Detached,
                            "did not drain before the close timed out",
                        );
                    }
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        sh.stop_supervisor.store(true, Ordering::Release);
        sh.waker.wake();
        if let Some(t) = self.supervisor.take() {
            let _ = t.join();
        }
        socket_file::remove(&self.socket_path, self.socket_file);
    }

    /// Leaves the ring as a crashed producer would, for a producer whose own source failed
    /// (a forwarder whose upstream died, a relay whose sender vanished): consumers get
    /// [`Error::ProducerDied`] at once, not a clean end that would hide the batches that never
    /// came, while this process goes on. The connections are cut and the socket removed; the
    /// ring's memory (and on a GPU its streams, which may wait on work that never comes) is
    /// left to the process's exit rather than torn down here, where that could block.
    pub fn abandon(mut self) {
        self.closed = true;
        let sh = &*self.shared;
        {
            // Under the lock an attach checks `closing` with: no consumer joins after this.
            let mut m = sh.members.lock();
            sh.closing.store(true, Ordering::Release);
            for member in m.conns.iter_mut().filter_map(Option::take) {
                let _ = member.conn.shutdown(std::net::Shutdown::Both);
            }
        }
        // Consumers asleep waiting for a batch look at the producer now.
        sh.wake_consumers();
        socket_file::remove(&self.socket_path, self.socket_file);
        // The supervisor is told to stop but not joined: a handshake it waits for may be stuck
        // in the backend (a GPU stream that waits on work that never comes). It and the
        // backend stay alive to the end of the process (see above).
        sh.stop_supervisor.store(true, Ordering::Release);
        sh.waker.wake();
        drop(self.supervisor.take());
        std::mem::forget(Arc::clone(&self.shared));
    }
}

impl<B: ProducerBackend> Drop for Producer<B> {
    fn drop(&mut self) {
        self.close_inner();
    }
}

/// A slot acquired and let go with [`Slot::into_loan`]: [`Producer::resume`] turns it back
/// into the [`Slot`] while nothing else was acquired or published meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLoan {
    seq: u64,
    slot: u32,
    epoch: u64,
}

impl SlotLoan {
    /// Sequence number the batch will have.
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// Index of the slot in the ring.
    pub fn index(&self) -> u32 {
        self.slot
    }
}

/// A slot loaned to the producer: write the batch, then [`Slot::publish`]. Dropping it
/// unpublished returns it to the ring (the next `acquire` hands out the same slot).
pub struct Slot<'p, B: ProducerBackend> {
    producer: &'p mut Producer<B>,
    seq: u64,
    slot: u32,
}

impl<'p, B: ProducerBackend> Slot<'p, B> {
    /// Sequence number this batch will have.
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// Index of the slot in the ring.
    pub fn index(&self) -> u32 {
        self.slot
    }
    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.producer.shared.layout.slot_bytes
    }
    /// The backend (its stream, device, ...).
    pub fn backend(&self) -> &B {
        &self.producer.shared.backend
    }
    /// Lets go of the slot without publishing it, keeping a token to take it back with
    /// [`Producer::resume`] (the acquire's waits are not repeated). For bindings that cannot
    /// hold a borrow of the producer, such as the Python package.
    pub fn into_loan(self) -> SlotLoan {
        SlotLoan {
            seq: self.seq,
            slot: self.slot,
            epoch: self.producer.loan_epoch,
        }
    }

    /// The slot's memory.
    pub fn memory(&mut self) -> B::SlotMut<'_> {
        // SAFETY: between acquire (the slot's previous holders released it and the backend
        // ordered after their work) and publish, this Slot is the slot's only owner, and
        // `&mut self` keeps this the only live SlotMut.
        unsafe { self.producer.shared.backend.slot_mut(self.slot) }
    }

    /// Publishes `len` bytes with an all-zero user header.
    pub fn publish(self, len: u64) -> Result<u64, Error> {
        self.publish_with_header(len, &[0; USER_HEADER_WORDS])
    }

    /// Publishes `len` bytes with a user header. Signals the backend's "ready" first; only
    /// then the descriptor becomes visible. On error the slot returns to the ring.
    pub fn publish_with_header(
        self,
        len: u64,
        header: &[u64; USER_HEADER_WORDS],
    ) -> Result<u64, Error> {
        self.publish_with(len, header, &[])
    }

    /// Publishes named tensors (declared with a [`crate::TensorPlan`], so each lies within
    /// the slot) and a user header; the batch's length is the end of the last tensor.
    pub fn publish_tensors(
        self,
        tensors: &[TensorInfo],
        header: &[u64; USER_HEADER_WORDS],
    ) -> Result<u64, Error> {
        let len = tensors.iter().map(TensorInfo::end).max().unwrap_or(0);
        self.publish_with(len, header, tensors)
    }

    /// Publishes `len` bytes, a user header and a tensor table (empty: the batch reads as
    /// one `uint8` tensor of `len` bytes). Every tensor must lie within `len`.
    pub fn publish_with(
        self,
        len: u64,
        header: &[u64; USER_HEADER_WORDS],
        tensors: &[TensorInfo],
    ) -> Result<u64, Error> {
        let p = self.producer;
        let sh = &*p.shared;
        if len > sh.layout.slot_bytes {
            return Err(Error::InvalidArgument(format!(
                "batch of {len} bytes exceeds the slot capacity {}",
                sh.layout.slot_bytes
            )));
        }
        if tensors.len() > tensor::MAX_TENSORS {
            return Err(Error::InvalidArgument(format!(
                "{} tensors in one batch; at most {}",
                tensors.len(),
                tensor::MAX_TENSORS
            )));
        }
        for (i, t) in tensors.iter().enumerate() {
            // The same checks consumers make (TensorTable::read): refuse here what every
            // consumer would refuse.
            let end = t.extent_bytes().ok().and_then(|e| t.offset.checked_add(e));
            if end.is_none_or(|end| end > len) || t.offset % tensor::TENSOR_ALIGN != 0 {
                return Err(Error::InvalidArgument(format!(
                    "tensor {} (offset {}) is not aligned to {} bytes or ends beyond the batch's {len} bytes",
                    t.name,
                    t.offset,
                    tensor::TENSOR_ALIGN
                )));
            }
            if tensors[..i].iter().any(|o| o.name == t.name) {
                return Err(Error::InvalidArgument(format!(
                    "tensor name {} appears twice",
                    t.name
                )));
            }
        }
        // Not under `detach-after`: a backend's watch of its waits must see each one as the
        // acquire makes it.
        let ready =
            if sh.backend.looks_ahead() && !matches!(sh.config.lag, LagPolicy::DetachAfter(_)) {
                // Held across the look ahead's `holders_of` and its wait, as in `wait_for_slot`.
                let _gate = sh.holders_gate.read();
                let next = p.free_next(self.seq);
                sh.backend.signal_ready_then_wait(self.slot, self.seq, next)
            } else {
                sh.backend.signal_ready(self.slot, self.seq)
            };
        ready.map_err(Error::Backend)?;
        let desc = sh.seg.slot(self.slot);
        sh.seg.tensor_table(self.slot).write(tensors);
        desc.len.store(len, Ordering::Relaxed);
        for (w, v) in desc.header.iter().zip(header) {
            w.store(*v, Ordering::Relaxed);
        }
        desc.seq.store(self.seq, Ordering::Relaxed);
        if sh.shared_mode() {
            // Claimable from here on, for consumers that see the head below pass it.
            sh.claims
                .claim(self.slot)
                .store(ring::claim_word(self.seq, None), Ordering::Release);
        }
        crate::fault::point("producer.before_publish");
        let h = sh.seg.header();
        let mask = {
            let mut m = sh.members.lock();
            let mask = if sh.shared_mode() { 0 } else { m.active };
            desc.addressed.store(mask, Ordering::Relaxed);
            h.head.value.store(self.seq + 1, Ordering::Release);
            m.head = self.seq + 1;
            mask
        };
        crate::fault::point("producer.after_publish");
        p.holders[self.slot as usize] = mask;
        p.head = self.seq + 1;
        p.reserved = p.reserved.max(p.head);
        let active = sh.active.load(Ordering::Acquire);
        let cache = p.pages();
        wait::notify_if(&h.data_wake.value, true, || {
            ring::members(active).any(|c| {
                cache.pages[c as usize]
                    .as_ref()
                    .is_some_and(|pg| pg.header().sleeping.value.load(Ordering::SeqCst) != 0)
            })
        });
        Ok(self.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Consumer, HostConsumer, HostOptions, HostProducer};

    /// A table that does not fit its batch (only the producer can write one now: the control
    /// segment is read-only to consumers) is refused and the slot given back.
    #[test]
    fn a_table_that_does_not_fit_the_batch_is_refused_and_the_slot_given_back() {
        let sock = std::env::temp_dir().join(format!("gpipe-badtable-{}.sock", std::process::id()));
        let config = ProducerConfig {
            slots: 2,
            batch_bytes: 1 << 20,
            ..Default::default()
        };
        let mut producer: Producer<HostProducer> =
            Producer::bind(&sock, config, HostOptions::default()).unwrap();
        let mut consumer: Consumer<HostConsumer> =
            Consumer::attach(&sock, HostOptions::default()).unwrap();
        producer
            .wait_for_consumers(1, Duration::from_secs(5))
            .unwrap();
        producer.acquire().unwrap().publish(64).unwrap();
        // A table entry that reaches past the batch, as a buggy producer could write.
        producer
            .shared
            .seg
            .tensor_table(0)
            .write(&[crate::TensorInfo::bytes(4096)]);
        let e = consumer.recv().unwrap_err();
        assert!(e.to_string().contains("beyond the batch"), "{e}");
        // The slot went back: the producer can go round the ring.
        for _ in 0..2 {
            producer
                .acquire_timeout(Duration::from_secs(5))
                .unwrap()
                .publish(8)
                .unwrap();
        }
        drop(consumer);
        producer.close();
    }
}
