//! A received batch: an owned value that may be held with others, sent to another thread and
//! released in any order; dropping it releases it.

use std::sync::Arc;

use crate::backend::ConsumerBackend;
use crate::error::Error;
use crate::layout::USER_HEADER_WORDS;
use crate::tensor::{TensorInfo, Tensors};

use super::link::Link;

/// A batch received in place: an owned value (`Send`), so several may be held at once and
/// released in any order, from any thread. Dropping it releases it (recording the backend's
/// finished signal first); [`Batch::release`] does the same and reports errors. The consumer
/// stays attached while any of its batches lives.
pub struct Batch<B: ConsumerBackend> {
    pub(super) link: Arc<Link<B>>,
    pub(super) seq: u64,
    pub(super) slot: u32,
    pub(super) len: u64,
    pub(super) header: [u64; USER_HEADER_WORDS],
    pub(super) tensors: Tensors,
    /// Shared mode: claimed but the token not recorded (see `next_shared`).
    pub(super) claim_unrecorded: bool,
    /// Delivered as a copy in the consumer's own memory; the slot is already released.
    pub(super) mirrored: bool,
    pub(super) done: bool,
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
