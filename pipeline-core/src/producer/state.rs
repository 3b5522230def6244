//! What the producer keeps: the state its handle, the supervisor and the handshakes share
//! (the ring's memories, the consumers, their pages and counters), and the handle itself.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Mutex, RwLock};

use crate::backend::ProducerBackend;
use crate::layout::{ControlSegment, RingLayout};
use crate::page::{ClaimSegment, ConsumerPage};
use crate::socket_file::SocketFile;
use crate::sys;

use super::config::ProducerConfig;

#[derive(Default)]
pub(super) struct Counters {
    pub(super) attached: AtomicU64,
    pub(super) left: AtomicU64,
    pub(super) died: AtomicU64,
    pub(super) detached: AtomicU64,
    pub(super) refused: AtomicU64,
    pub(super) requeued: AtomicU64,
}

pub(super) struct Member {
    pub(super) conn: Arc<UnixStream>,
    /// For logs only (`None`: in a pid namespace we cannot see).
    pub(super) pid: Option<u32>,
}

pub(super) struct Members {
    /// Attached consumers by index.
    pub(super) conns: Vec<Option<Member>>,
    /// Indices reserved by handshakes in progress (and by departures whose backend detach
    /// is still running).
    pub(super) reserved: u64,
    /// Per index: the handshake in progress that reserved it, and since when. One that has
    /// waited long for its Ready gives its index up to a newcomer when the ring is full
    /// ([`Shared::reserve_index`]): a pending handshake does not hold a consumer slot.
    pub(super) handshaking: Vec<Option<(Arc<Attaching>, Instant)>>,
    /// Active consumers (bit per index); mirrored in `Shared::active`.
    pub(super) active: u64,
    /// Sequence number the producer publishes next (only changed under this lock).
    pub(super) head: u64,
}

pub(super) struct Shared<B> {
    pub(super) seg: ControlSegment,
    /// The words every consumer may write (the producer's futex word, shared-mode claims).
    pub(super) claims: ClaimSegment,
    /// Per consumer index: the page of its current (or last) attach. Replaced, under the
    /// members lock, only when a new consumer at the index activates; `pages_epoch` is
    /// bumped then, before the consumer's bit enters `active`.
    pub(super) pages: Mutex<Vec<Option<Arc<ConsumerPage>>>>,
    pub(super) pages_epoch: AtomicU64,
    /// Per slot (shared mode): `seq + 1` of its batch if a claimer that has since departed
    /// had released it (its page is no longer looked at).
    pub(super) consumed: Vec<AtomicU64>,
    pub(super) backend: B,
    pub(super) layout: RingLayout,
    pub(super) config: ProducerConfig,
    pub(super) members: Mutex<Members>,
    pub(super) active: AtomicU64,
    /// Per consumer index: the first sequence number its current holder receives (set under
    /// the members lock at activation). A holder of an older batch in a slot was another
    /// consumer that used the same index.
    pub(super) joined_at: Vec<AtomicU64>,
    /// Per consumer index (shared mode): the claim token of its current holder, unique to
    /// that attach ([`ring::claim_token`]). A slot's `claimer` names a holder only if it
    /// equals this: the index's holder may have claimed a batch published before it joined,
    /// while an older token is a previous holder of the index.
    pub(super) claim_tokens: Vec<AtomicU64>,
    /// Held (shared) by the producer from choosing a slot's holders until the backend has
    /// enqueued its waits on them, and taken (exclusive, briefly) after an index is reserved,
    /// before the backend reuses the index's signals: holders chosen while the index's
    /// previous consumer was still active are never waited for on its successor's signals.
    pub(super) holders_gate: RwLock<()>,
    pub(super) closing: AtomicBool,
    pub(super) stop_supervisor: AtomicBool,
    pub(super) waker: sys::Waker,
    pub(super) counters: Counters,
}

/// A connection whose handshake runs on its own thread.
pub(super) struct Attaching {
    pub(super) conn: UnixStream,
    /// When it was accepted: the handshake's deadline counts from here.
    pub(super) accepted: Instant,
    /// Set (under the members lock) once the consumer is active.
    pub(super) joined: AtomicBool,
    /// Set once its Ready arrived (it is importing no more; it will not be taken over).
    pub(super) ready: AtomicBool,
    /// Set (under the members lock) when a newcomer took its index over; it then never
    /// activates.
    pub(super) taken_over: AtomicBool,
}

/// Handshakes in progress at once, at most: beyond, connections wait in the listen backlog
/// (each handshake holds a thread and a socket until its deadline).
pub(super) const MAX_HANDSHAKES: usize = 64;

/// How a consumer went away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Departure {
    Left,
    Died,
    Detached,
}

/// The producing side of a ring. Not `Sync`: one thread acquires and publishes.
pub struct Producer<B: ProducerBackend> {
    pub(super) shared: Arc<Shared<B>>,
    pub(super) head: u64,
    pub(super) holders: Vec<u64>,
    /// This thread's copy of the consumers' pages (`Shared::pages`), refreshed when the
    /// epoch moves: the hot path reads pages without a lock.
    pub(super) pages: std::cell::RefCell<PageCache>,
    /// The epoch `pages` was copied at (checked without borrowing it, on every publish and
    /// every slot check).
    pub(super) pages_seen: std::cell::Cell<u64>,
    pub(super) supervisor: Option<JoinHandle<()>>,
    pub(super) socket_path: PathBuf,
    /// The socket file we created: removed at the end only if the path still names it.
    pub(super) socket_file: SocketFile,
    pub(super) closed: bool,
    /// The batch the producer has been waiting to get a slot for, and since when: the lag
    /// policy's clock, kept across `acquire` calls that time out (a binding acquires in short
    /// slices to stay interruptible).
    pub(super) stalled_since: Option<(u64, Instant)>,
    /// Shared mode, while stalled: since when each consumer's page has said, without a break,
    /// that it holds the batch waited for. The lag policy blames a consumer for its own hold
    /// only: a batch left unclaimed (or whose claim word a peer keeps resetting) runs no
    /// consumer's clock, so the consumer that finally takes it is not detached at once.
    /// Keyed by the stall's start (reset lazily, off the hot path).
    pub(super) held_since: std::cell::RefCell<(Option<Instant>, Vec<Option<Instant>>)>,
    /// One past the last batch whose slot was taken ahead ([`Producer::acquire_ahead`]):
    /// batches `head..reserved` have their slots waited for and are not yet published.
    pub(super) reserved: u64,
    /// Bumped by [`Producer::cancel_ahead`]: loans from before are refused.
    pub(super) loan_epoch: u64,
}

/// The producer thread's copy of the consumers' pages.
pub(super) struct PageCache {
    pub(super) epoch: u64,
    pub(super) pages: Vec<Option<Arc<ConsumerPage>>>,
}

/// Where a slot the producer wants to write again stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotWait {
    /// Free: every holder let go of its batch.
    Free,
    /// These consumers still hold it.
    Held(u64),
    /// Shared mode: its batch waits for a consumer to claim it.
    Unclaimed,
    /// Shared mode: its claim word names nobody whose page backs it (this claim word).
    Unbacked(u64),
}
