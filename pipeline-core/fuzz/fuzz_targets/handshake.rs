//! The attach socket's frames, as a producer or consumer receives them from its peer.
//!
//! The whole input is one frame for `wire::decode`; independently, its first two bytes are a
//! kind and the rest a body for `wire::decode_body` (the path `wire::recv` takes after the
//! prefix). Whatever decodes must re-encode to the very same bytes: every message has exactly
//! one accepted encoding (a `Reject` whose reason is not UTF-8 is refused, not decoded lossily).

#![no_main]

use libfuzzer_sys::fuzz_target;
use pipeline_core::sys::MAX_FDS_PER_MESSAGE;
use pipeline_core::wire::{self, MAX_REASON, Message};

/// Checks what a successful decode promises; `body` is the body the message came from.
fn check(msg: &Message, kind: u16, body: &[u8]) {
    match msg {
        Message::Welcome { fd_count, .. } | Message::Ready { fd_count, .. } => {
            assert!(*fd_count as usize <= MAX_FDS_PER_MESSAGE, "{msg:?}");
        }
        Message::Reject { reason } => {
            // A reason longer than MAX_REASON cannot be sent on as is (`encode` truncates it).
            assert!(
                reason.len() <= MAX_REASON,
                "decoded a Reject reason of {} bytes (> MAX_REASON = {MAX_REASON}) from a \
                 {}-byte body",
                reason.len(),
                body.len()
            );
            assert!(
                std::str::from_utf8(&body[4..]).is_ok(),
                "accepted a Reject reason that is not UTF-8"
            );
        }
        _ => {}
    }
    let frame = wire::encode(msg);
    assert_eq!(u16::from_le_bytes([frame[4], frame[5]]), kind, "{msg:?}");
    let again = wire::decode(&frame).unwrap_or_else(|e| panic!("{msg:?} re-encoded: {e}"));
    assert_eq!(&again, msg, "round trip changed the message");
    assert_eq!(&frame[12..], body, "{msg:?} has a second accepted encoding");
}

fuzz_target!(|data: &[u8]| {
    match wire::decode(data) {
        Ok(msg) => {
            let kind = u16::from_le_bytes([data[4], data[5]]);
            check(&msg, kind, &data[12..]);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    if let [k0, k1, body @ ..] = data {
        let kind = u16::from_le_bytes([*k0, *k1]);
        match wire::decode_body(kind, body) {
            Ok(msg) => check(&msg, kind, body),
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
});
