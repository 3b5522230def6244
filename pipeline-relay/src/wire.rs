//! The bytes of the rendezvous, protocol version 1, and the MACs over them.
//!
//! Every integer is little-endian. The exchange, on one TCP connection, is:
//!
//! | # | who | message | bytes |
//! | --- | --- | --- | --- |
//! | 1 | both, at once | hello | 48 |
//! | 2 | both, at once | proof | 32 |
//! | 3 | listener | payload message | 4 + 152 + 32 |
//! | 4 | connector | ack | 32 |
//!
//! **Hello** (48 bytes): `magic` `"GPRELAY\0"` (8), `version` u16 = 1, `role` u8 (1 listener,
//! 2 connector), `flags` u8 = 0, `reserved` u32 = 0, `nonce` (32 random bytes). A reader
//! checks the magic and the version (the first 10 bytes) before it reads further, so a later
//! version may change the rest; then the role must be the other side's, flags and reserved
//! zero, and the nonce must differ from its own.
//!
//! **Proof** (32 bytes): `HMAC-SHA256(secret, "gpipe-relay\0v1\0proof\0" || role name ||
//! own nonce || peer nonce)`, with the role name `"listener\0"` or `"connector\0"` of the
//! side that sends it. Fresh nonces from both sides make a recorded proof useless later
//! (replay); the role name makes a proof useless sent back to its maker (reflection).
//!
//! **Session key** `K = HMAC-SHA256(secret, "gpipe-relay\0v1\0session-key\0" ||
//! listener nonce || connector nonce)`.
//!
//! **Payload message**: `length` u32 = 152, the [`Payload`] (152 bytes), `mac` =
//! `HMAC-SHA256(K, "payload\0" || length || payload)`. The reader refuses any other length
//! before reading on, then checks the MAC, then the fields.
//!
//! **Ack** (32 bytes): `HMAC-SHA256(K, "ack\0" || payload)`, so the listener knows that the
//! connector got and accepted exactly what it sent.
//!
//! MACs are compared in constant time (`hmac`'s `verify_slice`).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// The first 8 bytes of every hello.
pub const MAGIC: [u8; 8] = *b"GPRELAY\0";
/// The protocol version this crate speaks.
pub const VERSION: u16 = 1;
/// Bytes in a hello.
pub const HELLO_LEN: usize = 48;
/// Bytes in the part of a hello every version keeps: magic and version.
pub const HELLO_HEAD_LEN: usize = 10;
/// Bytes in a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes in a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Bytes in an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_UNIQUE_ID_LEN: usize = 128;
/// Bytes in an encoded [`Payload`].
pub const PAYLOAD_LEN: usize = 152;

const TAG: &[u8] = b"gpipe-relay\0v1\0";

/// A nonce: 32 random bytes, fresh for each connection.
pub(crate) type Nonce = [u8; NONCE_LEN];
/// A MAC.
pub(crate) type Tag = [u8; MAC_LEN];

/// Which end of the rendezvous a side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that listens (`--listen`) and sends the payload.
    Listener,
    /// The side that connects (`--connect`) and receives the payload.
    Connector,
}

impl Role {
    fn code(self) -> u8 {
        match self {
            Role::Listener => 1,
            Role::Connector => 2,
        }
    }

    fn from_code(code: u8) -> Option<Role> {
        match code {
            1 => Some(Role::Listener),
            2 => Some(Role::Connector),
            _ => None,
        }
    }

    /// The role's name as MACed in a proof, NUL-terminated so the two cannot run together.
    pub(crate) fn mac_label(self) -> &'static [u8] {
        match self {
            Role::Listener => b"listener\0",
            Role::Connector => b"connector\0",
        }
    }

    /// The other role.
    pub fn peer(self) -> Role {
        match self {
            Role::Listener => Role::Connector,
            Role::Connector => Role::Listener,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Listener => "listener",
            Role::Connector => "connector",
        })
    }
}

/// What the listener gives the connector once both are authenticated: the NCCL unique id and
/// the shape of the ring the relay carries.
///
/// Encoded as 152 bytes: `nccl_unique_id` (128), `slot_bytes` u64, `slot_count` u32,
/// `world_size` u32, `rank` u32, `reserved` u32 = 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Payload {
    /// The `ncclUniqueId` from `ncclGetUniqueId` on the listener, as opaque bytes.
    pub nccl_unique_id: [u8; NCCL_UNIQUE_ID_LEN],
    /// Bytes per slot of the ring being relayed (at least 1).
    pub slot_bytes: u64,
    /// Slots in that ring (at least 1).
    pub slot_count: u32,
    /// Ranks in the NCCL communicator (at least 2).
    pub world_size: u32,
    /// The rank the connector takes (less than `world_size`).
    pub rank: u32,
}

/// A field of a [`Payload`] out of range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PayloadError {
    /// `slot_bytes` is 0.
    ZeroSlotBytes,
    /// `slot_count` is 0.
    ZeroSlotCount,
    /// `world_size` is below 2.
    WorldTooSmall(u32),
    /// `rank` is not below `world_size`.
    RankOutOfRange {
        /// The rank.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// The reserved word is not 0.
    ReservedNotZero(u32),
}

impl fmt::Display for PayloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PayloadError::ZeroSlotBytes => write!(f, "slot_bytes is 0"),
            PayloadError::ZeroSlotCount => write!(f, "slot_count is 0"),
            PayloadError::WorldTooSmall(n) => write!(f, "world_size is {n}, at least 2 needed"),
            PayloadError::RankOutOfRange { rank, world_size } => {
                write!(f, "rank {rank} is not below world_size {world_size}")
            }
            PayloadError::ReservedNotZero(v) => write!(f, "the reserved word is {v:#x}, not 0"),
        }
    }
}

impl std::error::Error for PayloadError {}

impl Payload {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), PayloadError> {
        if self.slot_bytes == 0 {
            return Err(PayloadError::ZeroSlotBytes);
        }
        if self.slot_count == 0 {
            return Err(PayloadError::ZeroSlotCount);
        }
        if self.world_size < 2 {
            return Err(PayloadError::WorldTooSmall(self.world_size));
        }
        if self.rank >= self.world_size {
            return Err(PayloadError::RankOutOfRange {
                rank: self.rank,
                world_size: self.world_size,
            });
        }
        Ok(())
    }

    /// The 152-byte encoding.
    pub fn encode(&self) -> [u8; PAYLOAD_LEN] {
        let mut out = [0u8; PAYLOAD_LEN];
        out[..128].copy_from_slice(&self.nccl_unique_id);
        out[128..136].copy_from_slice(&self.slot_bytes.to_le_bytes());
        out[136..140].copy_from_slice(&self.slot_count.to_le_bytes());
        out[140..144].copy_from_slice(&self.world_size.to_le_bytes());
        out[144..148].copy_from_slice(&self.rank.to_le_bytes());
        // 148..152: reserved, zero.
        out
    }

    /// Decodes and validates 152 bytes.
    pub fn decode(bytes: &[u8; PAYLOAD_LEN]) -> Result<Payload, PayloadError> {
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let mut nccl_unique_id = [0u8; NCCL_UNIQUE_ID_LEN];
        nccl_unique_id.copy_from_slice(&bytes[..128]);
        let mut slot_bytes = [0u8; 8];
        slot_bytes.copy_from_slice(&bytes[128..136]);
        let reserved = u32_at(148);
        if reserved != 0 {
            return Err(PayloadError::ReservedNotZero(reserved));
        }
        let payload = Payload {
            nccl_unique_id,
            slot_bytes: u64::from_le_bytes(slot_bytes),
            slot_count: u32_at(136),
            world_size: u32_at(140),
            rank: u32_at(144),
        };
        payload.validate()?;
        Ok(payload)
    }
}

/// A hello: magic, version, role, zeroes, nonce.
pub(crate) fn hello(role: Role, nonce: &Nonce) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..8].copy_from_slice(&MAGIC);
    out[8..10].copy_from_slice(&VERSION.to_le_bytes());
    out[10] = role.code();
    // 11: flags, 12..16: reserved, both zero.
    out[16..].copy_from_slice(nonce);
    out
}

/// What is wrong with a peer's hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum HelloError {
    BadMagic([u8; 8]),
    Version(u16),
    UnknownRole(u8),
    SameRole(Role),
    NonZero,
    Reflected,
}

/// Checks the first [`HELLO_HEAD_LEN`] bytes: the magic, then the version.
pub(crate) fn check_hello_head(head: &[u8; HELLO_HEAD_LEN]) -> Result<(), HelloError> {
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&head[..8]);
    if magic != MAGIC {
        return Err(HelloError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([head[8], head[9]]);
    if version != VERSION {
        return Err(HelloError::Version(version));
    }
    Ok(())
}

/// Checks the rest of a version-1 hello sent to `us`, and returns the peer's nonce.
pub(crate) fn parse_hello_rest(
    rest: &[u8; HELLO_LEN - HELLO_HEAD_LEN],
    us: Role,
    our_nonce: &Nonce,
) -> Result<Nonce, HelloError> {
    let role = Role::from_code(rest[0]).ok_or(HelloError::UnknownRole(rest[0]))?;
    if role == us {
        return Err(HelloError::SameRole(role));
    }
    if rest[1..6].iter().any(|&b| b != 0) {
        return Err(HelloError::NonZero);
    }
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&rest[6..]);
    if &nonce == our_nonce {
        return Err(HelloError::Reflected);
    }
    Ok(nonce)
}

pub(crate) fn mac(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length (longer ones are hashed), so this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
    for part in parts {
        mac.update(part);
    }
    mac
}

fn proof_mac(secret: &[u8], role: Role, own: &Nonce, peer: &Nonce) -> HmacSha256 {
    mac(secret, &[TAG, b"proof\0", role.mac_label(), own, peer])
}

/// The proof that `role`, which sent `own` and received `peer`, holds the secret.
pub(crate) fn proof(secret: &[u8], role: Role, own: &Nonce, peer: &Nonce) -> Tag {
    proof_mac(secret, role, own, peer)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `tag` is the proof `role` should have sent, compared in constant time.
pub(crate) fn proof_ok(secret: &[u8], role: Role, own: &Nonce, peer: &Nonce, tag: &Tag) -> bool {
    proof_mac(secret, role, own, peer).verify_slice(tag).is_ok()
}

/// The session key for the payload and the ack.
pub(crate) fn session_key(secret: &[u8], listener: &Nonce, connector: &Nonce) -> [u8; MAC_LEN] {
    mac(secret, &[TAG, b"session-key\0", listener, connector])
        .finalize()
        .into_bytes()
        .into()
}

fn payload_mac(key: &[u8; MAC_LEN], length: &[u8; 4], payload: &[u8; PAYLOAD_LEN]) -> HmacSha256 {
    mac(key, &[b"payload\0", length, payload])
}

/// The payload message: length, payload, MAC.
pub(crate) fn payload_message(key: &[u8; MAC_LEN], payload: &[u8; PAYLOAD_LEN]) -> Vec<u8> {
    let length = (PAYLOAD_LEN as u32).to_le_bytes();
    let tag: Tag = payload_mac(key, &length, payload)
        .finalize()
        .into_bytes()
        .into();
    let mut out = Vec::with_capacity(4 + PAYLOAD_LEN + MAC_LEN);
    out.extend_from_slice(&length);
    out.extend_from_slice(payload);
    out.extend_from_slice(&tag);
    out
}

/// Whether `tag` is the payload's MAC, compared in constant time.
pub(crate) fn payload_ok(key: &[u8; MAC_LEN], payload: &[u8; PAYLOAD_LEN], tag: &Tag) -> bool {
    let length = (PAYLOAD_LEN as u32).to_le_bytes();
    payload_mac(key, &length, payload).verify_slice(tag).is_ok()
}

fn ack_mac(key: &[u8; MAC_LEN], payload: &[u8; PAYLOAD_LEN]) -> HmacSha256 {
    mac(key, &[b"ack\0", payload])
}

/// The connector's ack of a payload.
pub(crate) fn ack(key: &[u8; MAC_LEN], payload: &[u8; PAYLOAD_LEN]) -> Tag {
    ack_mac(key, payload).finalize().into_bytes().into()
}

/// Whether `tag` acks the payload, compared in constant time.
pub(crate) fn ack_ok(key: &[u8; MAC_LEN], payload: &[u8; PAYLOAD_LEN], tag: &Tag) -> bool {
    ack_mac(key, payload).verify_slice(tag).is_ok()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A valid payload with a recognisable id.
    pub(crate) fn sample_payload() -> Payload {
        let mut id = [0u8; NCCL_UNIQUE_ID_LEN];
        for (i, b) in id.iter_mut().enumerate() {
            *b = i as u8;
        }
        Payload {
            nccl_unique_id: id,
            slot_bytes: 64 << 20,
            slot_count: 8,
            world_size: 2,
            rank: 1,
        }
    }

    #[test]
    fn payload_round_trips_and_its_layout_is_fixed() {
        let p = sample_payload();
        let bytes = p.encode();
        assert_eq!(&bytes[..128], &p.nccl_unique_id);
        assert_eq!(&bytes[128..136], &(64u64 << 20).to_le_bytes());
        assert_eq!(&bytes[136..140], &8u32.to_le_bytes());
        assert_eq!(&bytes[140..144], &2u32.to_le_bytes());
        assert_eq!(&bytes[144..148], &1u32.to_le_bytes());
        assert_eq!(&bytes[148..], &[0; 4]);
        assert_eq!(Payload::decode(&bytes).unwrap(), p);
    }

    #[test]
    fn payload_fields_are_range_checked() {
        let mut p = sample_payload();
        p.slot_bytes = 0;
        assert_eq!(
            Payload::decode(&p.encode()),
            Err(PayloadError::ZeroSlotBytes)
        );
        let mut p = sample_payload();
        p.slot_count = 0;
        assert_eq!(p.validate(), Err(PayloadError::ZeroSlotCount));
        let mut p = sample_payload();
        p.world_size = 1;
        p.rank = 0;
        assert_eq!(p.validate(), Err(PayloadError::WorldTooSmall(1)));
        let mut p = sample_payload();
        p.rank = 2;
        assert!(matches!(
            p.validate(),
            Err(PayloadError::RankOutOfRange { .. })
        ));
        let mut bytes = sample_payload().encode();
        bytes[151] = 1;
        assert_eq!(
            Payload::decode(&bytes),
            Err(PayloadError::ReservedNotZero(0x0100_0000))
        );
    }

    #[test]
    fn hello_layout_and_checks() {
        let nonce = [7u8; NONCE_LEN];
        let h = hello(Role::Connector, &nonce);
        assert_eq!(&h[..8], b"GPRELAY\0");
        assert_eq!(&h[8..10], &[1, 0]);
        assert_eq!(h[10], 2);
        assert_eq!(&h[11..16], &[0; 5]);
        assert_eq!(&h[16..], &nonce);
        let head: [u8; HELLO_HEAD_LEN] = h[..HELLO_HEAD_LEN].try_into().unwrap();
        let rest: [u8; HELLO_LEN - HELLO_HEAD_LEN] = h[HELLO_HEAD_LEN..].try_into().unwrap();
        assert_eq!(check_hello_head(&head), Ok(()));
        let ours = [9u8; NONCE_LEN];
        assert_eq!(parse_hello_rest(&rest, Role::Listener, &ours), Ok(nonce));
        assert_eq!(
            parse_hello_rest(&rest, Role::Connector, &ours),
            Err(HelloError::SameRole(Role::Connector))
        );
        assert_eq!(
            parse_hello_rest(&rest, Role::Listener, &nonce),
            Err(HelloError::Reflected)
        );
        let mut bad = rest;
        bad[3] = 1;
        assert_eq!(
            parse_hello_rest(&bad, Role::Listener, &ours),
            Err(HelloError::NonZero)
        );
        bad = rest;
        bad[0] = 9;
        assert_eq!(
            parse_hello_rest(&bad, Role::Listener, &ours),
            Err(HelloError::UnknownRole(9))
        );
        let mut v2 = head;
        v2[8] = 2;
        assert_eq!(check_hello_head(&v2), Err(HelloError::Version(2)));
        assert!(matches!(
            check_hello_head(b"GET / HTTP"),
            Err(HelloError::BadMagic(_))
        ));
    }

    #[test]
    fn proofs_bind_secret_role_and_both_nonces() {
        let s = b"0123456789abcdef";
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let p = proof(s, Role::Listener, &a, &b);
        assert!(proof_ok(s, Role::Listener, &a, &b, &p));
        // Reflection: the listener's proof is no connector's proof, for any nonce order.
        assert!(!proof_ok(s, Role::Connector, &a, &b, &p));
        assert!(!proof_ok(s, Role::Connector, &b, &a, &p));
        // Replay against a fresh nonce, or another secret.
        assert!(!proof_ok(s, Role::Listener, &a, &[3u8; 32], &p));
        assert!(!proof_ok(b"0123456789abcdeF", Role::Listener, &a, &b, &p));
        // Known-answer check that the construction is HMAC-SHA256 (RFC 4231, case 2).
        let kat: Tag = mac(b"Jefe", &[b"what do ya want ", b"for nothing?"])
            .finalize()
            .into_bytes()
            .into();
        assert_eq!(kat[..8], [0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e]);
    }

    #[test]
    fn payload_and_ack_macs_depend_on_the_session() {
        let s = b"0123456789abcdef";
        let k1 = session_key(s, &[1; 32], &[2; 32]);
        let k2 = session_key(s, &[1; 32], &[3; 32]);
        assert_ne!(k1, k2);
        let p = sample_payload().encode();
        let msg = payload_message(&k1, &p);
        assert_eq!(msg.len(), 4 + PAYLOAD_LEN + MAC_LEN);
        assert_eq!(&msg[..4], &152u32.to_le_bytes());
        let tag: Tag = msg[4 + PAYLOAD_LEN..].try_into().unwrap();
        assert!(payload_ok(&k1, &p, &tag));
        assert!(!payload_ok(&k2, &p, &tag));
        let a = ack(&k1, &p);
        assert!(ack_ok(&k1, &p, &a));
        assert!(!ack_ok(&k2, &p, &a));
        // The ack is not the payload MAC, so echoing one cannot pass for the other.
        assert!(!ack_ok(&k1, &p, &tag));
    }
}
