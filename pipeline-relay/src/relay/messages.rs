//! The relay's messages after the rendezvous (each one session message, [`crate::session`]):
//! the ring message first, then one batch message per batch, then END; ABORT either way.
//! [`FromSender`] is the receiver's one dispatch of what the sender sends.

use pipeline_core::{BackendKind, DType, Mode, TensorInfo, USER_HEADER_WORDS};

/// Message kinds after the rendezvous.
pub(super) mod kind {
    /// Sender → receiver, first: the ring's backend and mode.
    pub const RING: u8 = 1;
    /// Sender → receiver: one batch's description (and, for a host ring, its bytes).
    pub const BATCH: u8 = 2;
    /// Sender → receiver: the sender's ring closed; nothing follows.
    pub const END: u8 = 3;
    /// Either way: the side is stopping because of this error (text).
    pub const ABORT: u8 = 4;
}

// ---------------------------------------------------------------------------------------
// Batch descriptions on the wire.

/// One batch's description: sequence number, length, user header, tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchMeta {
    /// The sender's sequence number.
    pub seq: u64,
    /// Bytes.
    pub len: u64,
    /// The user header.
    pub header: [u64; USER_HEADER_WORDS],
    /// The named tensors.
    pub tensors: Vec<TensorInfo>,
}

impl BatchMeta {
    /// Encodes the description, then `data` (host rings; empty for CUDA).
    pub fn encode(&self, data: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + USER_HEADER_WORDS * 8 + data.len());
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        for h in &self.header {
            b.extend_from_slice(&h.to_le_bytes());
        }
        b.extend_from_slice(&(self.tensors.len() as u32).to_le_bytes());
        for t in &self.tensors {
            let name = t.name.as_str().as_bytes();
            b.push(name.len() as u8);
            b.extend_from_slice(name);
            b.extend_from_slice(&t.dtype.to_code().to_le_bytes());
            b.push(t.shape().len() as u8);
            for x in t.shape().iter().chain(t.strides()) {
                b.extend_from_slice(&x.to_le_bytes());
            }
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        b.extend_from_slice(&(data.len() as u64).to_le_bytes());
        b.extend_from_slice(data);
        b
    }

    /// Decodes a description and the data after it; every field is checked (a peer's bytes).
    pub fn decode(body: &[u8]) -> Result<(BatchMeta, &[u8]), String> {
        let mut r = body;
        let mut take = |n: usize, what: &str| -> Result<&[u8], String> {
            if r.len() < n {
                return Err(format!("batch message ends inside {what}"));
            }
            let (a, rest) = r.split_at(n);
            r = rest;
            Ok(a)
        };
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        let seq = u64_at(take(8, "the sequence number")?);
        let len = u64_at(take(8, "the length")?);
        let mut header = [0u64; USER_HEADER_WORDS];
        for h in &mut header {
            *h = u64_at(take(8, "the header")?);
        }
        let n = u32::from_le_bytes(take(4, "the tensor count")?.try_into().unwrap_or([0; 4]));
        if n as usize > pipeline_core::tensor::MAX_TENSORS {
            return Err(format!(
                "batch {seq}: {n} tensors (at most {})",
                pipeline_core::tensor::MAX_TENSORS
            ));
        }
        let mut tensors = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let nl = take(1, "a tensor name")?[0] as usize;
            let name = std::str::from_utf8(take(nl, "a tensor name")?)
                .map_err(|_| format!("batch {seq}: a tensor name is not UTF-8"))?
                .to_string();
            let code = u32::from_le_bytes(take(4, "a dtype")?.try_into().unwrap_or([0; 4]));
            let dtype = DType::from_code(code)
                .ok_or_else(|| format!("batch {seq}: tensor {name}: unknown dtype code {code}"))?;
            let nd = take(1, "a tensor rank")?[0] as usize;
            if nd > pipeline_core::tensor::MAX_DIMS {
                return Err(format!("batch {seq}: tensor {name} has {nd} dimensions"));
            }
            let mut dims = Vec::with_capacity(2 * nd);
            for _ in 0..2 * nd {
                dims.push(u64_at(take(8, "a tensor shape")?));
            }
            let offset = u64_at(take(8, "a tensor offset")?);
            let t = TensorInfo::new(&name, dtype, &dims[..nd], Some(&dims[nd..]), offset)
                .map_err(|e| format!("batch {seq}: {e}"))?;
            if t.end() > len {
                return Err(format!(
                    "batch {seq}: tensor {name} ends past the batch ({len} bytes)"
                ));
            }
            tensors.push(t);
        }
        let dl = u64_at(take(8, "the data length")?);
        let data = take(
            usize::try_from(dl).map_err(|_| "data length overflows")?,
            "the data",
        )?;
        if !r.is_empty() {
            return Err(format!("batch {seq}: {} bytes after the message", r.len()));
        }
        Ok((
            BatchMeta {
                seq,
                len,
                header,
                tensors,
            },
            data,
        ))
    }
}

pub(super) fn ring_message(backend: BackendKind, mode: Mode) -> Vec<u8> {
    let mut b = backend.to_u32().to_le_bytes().to_vec();
    b.extend_from_slice(&(mode as u32).to_le_bytes());
    b
}

pub(super) fn parse_ring(body: &[u8]) -> Result<(BackendKind, Mode), String> {
    if body.len() != 8 {
        return Err(format!("ring message of {} bytes (8 expected)", body.len()));
    }
    let code = u32::from_le_bytes(body[..4].try_into().unwrap_or([0; 4]));
    let backend = BackendKind::from_u32(code).ok_or_else(|| format!("unknown backend {code}"))?;
    let mode = match u32::from_le_bytes(body[4..].try_into().unwrap_or([0; 4])) {
        m if m == Mode::Broadcast as u32 => Mode::Broadcast,
        m if m == Mode::Shared as u32 => Mode::Shared,
        m => return Err(format!("unknown mode {m}")),
    };
    Ok((backend, mode))
}

/// A message from the sender after the ring message, dispatched by its kind.
#[derive(Debug)]
pub(super) enum FromSender {
    /// One batch: its description, and the bytes that came with it (a host ring's; none for
    /// a CUDA ring).
    Batch(BatchMeta, Inline),
    /// The sender's ring closed; nothing follows.
    End,
}

/// The bytes a batch message carried: the tail of the message's body, kept without a copy.
pub(super) struct Inline {
    body: Vec<u8>,
    at: usize,
}

impl Inline {
    /// The batch's bytes.
    pub(super) fn bytes(&self) -> &[u8] {
        &self.body[self.at..]
    }
}

impl std::fmt::Debug for Inline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Inline({} bytes)", self.bytes().len())
    }
}

impl FromSender {
    /// Dispatches the message of kind `kind`: END, or a batch (its description decoded and
    /// checked). The sender's ABORT is an error carrying its reason, and so is any other kind.
    pub(super) fn parse(kind: u8, body: Vec<u8>) -> Result<FromSender, String> {
        match kind {
            kind::END => Ok(FromSender::End),
            kind::ABORT => Err(format!(
                "the sender stopped: {}",
                String::from_utf8_lossy(&body)
            )),
            kind::BATCH => {
                let (meta, data) = BatchMeta::decode(&body)?;
                // The data is the body's tail (decode refuses bytes after it).
                let at = body.len() - data.len();
                Ok(FromSender::Batch(meta, Inline { body, at }))
            }
            other => Err(format!("unexpected message kind {other}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_descriptions_round_trip_and_garbage_is_refused() {
        let t = TensorInfo::new("x", DType::F32, &[2, 3], None, 0).unwrap();
        let u = TensorInfo::new("label", DType::I64, &[2], None, 256).unwrap();
        let mut header = [0u64; USER_HEADER_WORDS];
        header[0] = 42;
        let meta = BatchMeta {
            seq: 7,
            len: 512,
            header,
            tensors: vec![t, u],
        };
        let body = meta.encode(b"abc");
        let (back, data) = BatchMeta::decode(&body).unwrap();
        assert_eq!(back, meta);
        assert_eq!(data, b"abc");
        // Every truncation is an error, never a panic.
        for n in 0..body.len() {
            assert!(BatchMeta::decode(&body[..n]).is_err(), "prefix {n}");
        }
        // A tensor past the batch's end.
        let bad = BatchMeta {
            len: 16,
            ..meta.clone()
        };
        let e = BatchMeta::decode(&bad.encode(&[])).unwrap_err();
        assert!(e.contains("ends past the batch"), "{e}");
        // Trailing bytes.
        let mut long = meta.encode(&[]);
        long.push(0);
        assert!(
            BatchMeta::decode(&long)
                .unwrap_err()
                .contains("after the message")
        );
    }

    #[test]
    fn ring_messages_round_trip() {
        for b in [BackendKind::Host, BackendKind::Cuda] {
            for m in [Mode::Broadcast, Mode::Shared] {
                assert_eq!(parse_ring(&ring_message(b, m)).unwrap(), (b, m));
            }
        }
        assert!(parse_ring(&[9; 8]).is_err());
        assert!(parse_ring(&[1; 3]).is_err());
    }

    #[test]
    fn messages_from_the_sender_are_dispatched_by_kind() {
        let meta = BatchMeta {
            seq: 3,
            len: 3,
            header: [0; USER_HEADER_WORDS],
            tensors: vec![],
        };
        match FromSender::parse(kind::BATCH, meta.encode(b"xyz")).unwrap() {
            FromSender::Batch(got, data) => {
                assert_eq!(got, meta);
                assert_eq!(data.bytes(), b"xyz");
            }
            FromSender::End => panic!("a batch message read as END"),
        }
        assert!(matches!(
            FromSender::parse(kind::END, vec![]).unwrap(),
            FromSender::End
        ));
        let e = FromSender::parse(kind::ABORT, b"out of memory".to_vec()).unwrap_err();
        assert_eq!(e, "the sender stopped: out of memory");
        // The ring message comes once, before the batches; anything else is refused.
        for k in [kind::RING, 0, 99] {
            let e = FromSender::parse(k, vec![]).unwrap_err();
            assert_eq!(e, format!("unexpected message kind {k}"));
        }
        // A batch message that does not decode.
        assert!(FromSender::parse(kind::BATCH, vec![1, 2, 3]).is_err());
    }
}
