//! The producer's side of the attach handshake: who may connect, reserving a consumer index
//! (and taking over one whose handshake stalls when the ring is full), the Hello/Welcome/
//! Ready/Joined exchange under one deadline, and activating the consumer.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::ProducerBackend;
use crate::error::{Error, ProtocolError};
use crate::layout::{self, PROTOCOL_VERSION, consumer_state};
use crate::page::ConsumerPage;
use crate::ring;
use crate::sys::{self, IoDeadline};
use crate::wire::{self, Message, Role};

use super::state::{Attaching, Member, Shared};

impl<B: ProducerBackend> Shared<B> {
    pub(super) fn uid_allowed(&self, cred: &sys::PeerCred) -> bool {
        cred.uid == sys::effective_uid()
            || self.config.allowed_uids.contains(&cred.uid)
            || self.config.allowed_gids.contains(&cred.gid)
    }

    /// Runs the attach handshake with one connection (on its own thread). The whole
    /// handshake, however the peer slices its messages, ends by the handshake timeout after
    /// the accept.
    pub(super) fn handshake(self: &Arc<Self>, attaching: &Arc<Attaching>) {
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
    pub(super) fn takeover_after(&self) -> Duration {
        self.config.handshake_timeout / 4
    }

    /// Reserves a consumer index for a handshake. The ring's capacity counts attached
    /// consumers: while every index is taken but some only by handshakes in progress, waits
    /// (until `deadline`) for one to finish, and takes over the index of one that has waited
    /// for its Ready longer than [`Shared::takeover_after`] (a peer that trickles its Ready,
    /// or never sends it, holds no slot for long).
    pub(super) fn reserve_index(
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
    pub(super) fn handshake_inner(
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

    pub(super) fn attach_reserved(
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
    pub(super) fn cut_handshakes(&self, attaching: &[(JoinHandle<()>, Arc<Attaching>)]) {
        let _m = self.members.lock();
        for (_, a) in attaching {
            if !a.joined.load(Ordering::Acquire) {
                let _ = a.conn.shutdown(std::net::Shutdown::Read);
            }
        }
    }
}
