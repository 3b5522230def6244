//! A slot being filled: the memory the producer writes, the tensor table and header it
//! publishes with, and a slot taken ahead (a loan) for a batch written out of order.

use std::sync::atomic::Ordering;

use crate::backend::ProducerBackend;
use crate::error::Error;
use crate::layout::USER_HEADER_WORDS;
use crate::ring;
use crate::tensor::{self, TensorInfo};
use crate::wait;

use super::config::LagPolicy;
use super::state::Producer;

/// A slot acquired and let go with [`Slot::into_loan`]: [`Producer::resume`] turns it back
/// into the [`Slot`] while nothing else was acquired or published meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLoan {
    pub(super) seq: u64,
    pub(super) slot: u32,
    pub(super) epoch: u64,
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
    pub(super) producer: &'p mut Producer<B>,
    pub(super) seq: u64,
    pub(super) slot: u32,
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
    use super::super::config::ProducerConfig;
    use super::*;
    use crate::{Consumer, HostConsumer, HostOptions, HostProducer};
    use std::time::Duration;

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
