//! The committed fuzz seeds (pipeline-core/fuzz/corpus/<target>/, written by
//! pipeline-core/fuzz/gen_corpus.py from docs/protocol.md) still speak the protocol the code
//! speaks. A seed the code refuses at its first check (a version, a layout hash) exercises
//! nothing behind that check, so the corpus must not drift from the protocol unnoticed.
//!
//! Each seed goes through the public parsing its fuzz target runs, set up as the target sets
//! it up:
//! * handshake: `frame_*` through `wire::decode`, `body_*` (a u16 kind, then a body) through
//!   `wire::decode_body`, then the checks a peer makes on the decoded message (version, layout
//!   hash, mode, layout limits, backend, index, fd count, backend data); it must re-encode to
//!   the same bytes.
//! * segment_consumer: 4 set-up bytes, then the image, written into a memfd of
//!   `RingLayout::segment_bytes()` (or half that), sealed as the set-up says;
//!   `ControlSegment::open` must accept it and `inspect::Snapshot::read` read it, and every
//!   published slot must be in its place with a valid length and tensor table.
//! * segment_producer: a well-formed script (mode, hostile mask, u64, whole operations).
//!
//! A `bad_` seed must be refused, for the reason [`REFUSALS`] names.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use pipeline_core::inspect::Snapshot;
use pipeline_core::layout::{
    ControlSegment, LAYOUT_HASH, MAX_CONSUMERS, MAX_SEQ, Mode, PROTOCOL_VERSION, RingLayout,
    SLOT_ALIGN, consumer_state,
};
use pipeline_core::wire::{self, MAX_REASON, Message, OBSERVER, Role};
use pipeline_core::{BackendKind, ProtocolError, ring, sys};

/// Why each `bad_` seed must be refused: (target, seed name without `bad_` and, for
/// handshake seeds, without `frame_`/`body_`, a piece of the refusal's text).
const REFUSALS: &[(&str, &str, &str)] = &[
    ("handshake", "hello_v1", "protocol version mismatch"),
    ("handshake", "welcome_v1", "protocol version mismatch"),
    ("handshake", "joined_v1", "truncated"),
    ("handshake", "welcome_old_hash", "layout hash"),
    ("handshake", "welcome_few_fds", "needs at least 3"),
    ("handshake", "welcome_fds_over_limit", "announces 254 fds"),
    ("handshake", "welcome_index_over_capacity", "out of range"),
    ("handshake", "welcome_unknown_mode", "unknown mode"),
    (
        "handshake",
        "welcome_slot_bytes_unaligned",
        "not a whole number",
    ),
    (
        "handshake",
        "welcome_too_many_consumers",
        "more than a ring can hold",
    ),
    ("handshake", "hello_unknown_role", "unknown role"),
    ("handshake", "hello_unknown_backend", "unknown backend"),
    ("handshake", "ready_host_with_fds", "Ready carries 1 fds"),
    ("handshake", "reject_not_utf8", "not UTF-8"),
    ("handshake", "reject_too_long", "exceeds the limit"),
    ("handshake", "goodbye_trailing", "trailing"),
    ("handshake", "unknown_kind", "unknown message kind"),
    ("handshake", "magic", "bad frame magic"),
    ("handshake", "reserved", "reserved frame bits"),
    ("handshake", "length", "body bytes"),
    ("handshake", "oversized", "exceeds the limit"),
    ("segment_consumer", "zeroed", "bad magic"),
    (
        "segment_consumer",
        "not_write_sealed",
        "not sealed against writes",
    ),
    ("segment_consumer", "unsealed", "not sealed against writes"),
    ("segment_consumer", "short", "the layout needs"),
    ("segment_consumer", "version3", "protocol version mismatch"),
    ("segment_consumer", "layout_hash", "layout hash"),
    (
        "segment_consumer",
        "layout_differs",
        "differs from the handshake",
    ),
    ("segment_consumer", "unknown_mode", "unknown mode"),
];

/// The fuzz folder: beside this crate's manifest where it was built, else (a staged test
/// executable run from the repository root of another copy, as on a GPU machine)
/// `pipeline-core/fuzz` below the working directory.
fn fuzz_dir() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("pipeline-core/fuzz")
    }
}

/// The files of `dir`, by name, sorted.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("directory entry").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .expect("a UTF-8 file name")
                .to_string();
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("read {name}: {e}"));
            (name, data)
        })
        .collect();
    out.sort();
    out
}

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let seeds = files(&fuzz_dir().join("corpus").join(target));
    assert!(
        seeds.iter().any(|(name, _)| !name.starts_with("bad_")),
        "{target}: no valid seed"
    );
    seeds
}

/// The text a `bad_` seed's refusal must contain.
fn refusal(target: &str, tag: &str) -> &'static str {
    REFUSALS
        .iter()
        .find(|(t, name, _)| *t == target && *name == tag)
        .map(|(_, _, why)| *why)
        .unwrap_or_else(|| {
            panic!("{target} seed bad_…{tag}: say in REFUSALS why it must be refused")
        })
}

/// Judges one seed: `Ok` when accepted (with what was checked), else the refusal.
fn judge(
    target: &str,
    name: &str,
    data: &[u8],
    verdict: impl Fn(&[u8]) -> Result<(), String>,
    tag: impl Fn(&str) -> String,
) {
    let got = verdict(data);
    match name.strip_prefix("bad_") {
        None => {
            if let Err(e) = got {
                panic!("{target}/{name} is meant to be accepted, and was refused: {e}");
            }
        }
        Some(rest) => {
            let why = refusal(target, &tag(rest));
            match got {
                Ok(()) => {
                    panic!("{target}/{name} is meant to be refused ({why}), and was accepted")
                }
                Err(e) => assert!(
                    e.contains(why),
                    "{target}/{name} was refused for another reason than {why:?}: {e}"
                ),
            }
        }
    }
}

// --- handshake ------------------------------------------------------------------------------

/// The checks a peer makes of a message beyond its encoding (the consumer's attach for
/// Welcome, the producer's for Hello and Ready; docs/protocol.md sections 1 and 7).
fn peer_check(msg: &Message) -> Result<(), String> {
    let version = |v: u32| {
        if v == PROTOCOL_VERSION {
            Ok(())
        } else {
            Err(ProtocolError::Version {
                ours: PROTOCOL_VERSION,
                theirs: v,
            }
            .to_string())
        }
    };
    match msg {
        Message::Hello {
            version: v,
            role: _,
            backend,
        } => {
            version(*v)?;
            if *backend != 0 && BackendKind::from_u32(*backend).is_none() {
                return Err(format!("Hello: unknown backend {backend}"));
            }
        }
        Message::Welcome {
            version: v,
            layout_hash,
            consumer_index,
            mode,
            slot_count,
            slot_bytes,
            consumer_capacity,
            backend,
            fd_count,
            blob,
        } => {
            version(*v)?;
            if *layout_hash != LAYOUT_HASH {
                return Err(format!(
                    "Welcome: layout hash {layout_hash:#x} differs from ours {LAYOUT_HASH:#x}"
                ));
            }
            let layout = RingLayout {
                slot_count: *slot_count,
                slot_bytes: *slot_bytes,
                consumer_capacity: *consumer_capacity,
                mode: Mode::from_u32(*mode)
                    .ok_or_else(|| format!("Welcome: unknown mode {mode}"))?,
            };
            layout.validate().map_err(|e| e.to_string())?;
            let backend = BackendKind::from_u32(*backend)
                .ok_or_else(|| format!("Welcome: unknown backend {backend}"))?;
            if *consumer_index == OBSERVER {
                // The control segment only, no blob.
                if *fd_count != 1 || !blob.is_empty() {
                    return Err(format!(
                        "an observer's Welcome carries {fd_count} fds and {} blob bytes, not 1 \
                         and none",
                        blob.len()
                    ));
                }
                return Ok(());
            }
            if *consumer_index >= *consumer_capacity {
                return Err(format!(
                    "Welcome: consumer index {consumer_index} out of range (capacity \
                     {consumer_capacity})"
                ));
            }
            // Control segment, claim segment, its own page, then the backend's.
            if *fd_count < 3 {
                return Err(format!(
                    "a consumer's Welcome carries {fd_count} fds; it needs at least 3"
                ));
            }
            match backend {
                // The slot memfd, no blob.
                BackendKind::Host if *fd_count != 4 || !blob.is_empty() => {
                    return Err(format!(
                        "a host Welcome carries {fd_count} fds and {} blob bytes, not 4 and none",
                        blob.len()
                    ));
                }
                BackendKind::Host => {}
                // The export header names the ring's slots; the finished words come last.
                BackendKind::Cuda => {
                    let word = |at: usize, n: usize| {
                        blob.get(at..at + n)
                            .map(|b| b.iter().rev().fold(0u64, |v, &x| (v << 8) | u64::from(x)))
                    };
                    if blob.get(..4) != Some(b"GCU1")
                        || word(36, 4) != Some(u64::from(*slot_count))
                        || word(40, 8) != Some(*slot_bytes)
                        || *fd_count < 4
                    {
                        return Err(format!(
                            "a CUDA Welcome's export does not describe its {slot_count} slots \
                             ({fd_count} fds)"
                        ));
                    }
                }
            }
        }
        Message::Ready { fd_count, blob } => {
            // Host: nothing; CUDA: "GCF1" and the slot count. Neither producer takes fds.
            if *fd_count != 0 {
                return Err(format!("Ready carries {fd_count} fds; producers take none"));
            }
            if !blob.is_empty() && (blob.len() != 8 || &blob[..4] != b"GCF1") {
                return Err(format!("Ready carries a {}-byte blob", blob.len()));
            }
        }
        Message::Joined {
            start_seq,
            claim_token,
        } => {
            if *start_seq > MAX_SEQ || ring::token_index(*claim_token) >= MAX_CONSUMERS {
                return Err(format!("Joined at {start_seq} with token {claim_token:#x}"));
            }
        }
        Message::Reject { reason } => {
            if reason.len() > MAX_REASON {
                return Err(format!("a Reject of {} bytes", reason.len()));
            }
        }
        Message::Goodbye => {}
    }
    Ok(())
}

/// A handshake seed as the target reads it: a whole frame (`frame_`) or a kind and a body
/// (`body_`). Accepted messages must re-encode to the same bytes.
fn handshake_verdict(frame: bool, data: &[u8]) -> Result<(), String> {
    let (msg, kind, body) = if frame {
        let msg = wire::decode(data).map_err(|e| e.to_string())?;
        (msg, u16::from_le_bytes([data[4], data[5]]), &data[12..])
    } else {
        let [k0, k1, body @ ..] = data else {
            return Err("shorter than a kind".into());
        };
        let kind = u16::from_le_bytes([*k0, *k1]);
        let msg = wire::decode_body(kind, body).map_err(|e| e.to_string())?;
        (msg, kind, body)
    };
    peer_check(&msg)?;
    let again = wire::encode(&msg);
    assert_eq!(u16::from_le_bytes([again[4], again[5]]), kind, "{msg:?}");
    assert_eq!(&again[12..], body, "{msg:?} re-encodes to other bytes");
    Ok(())
}

fn handshake_reading(name: &str) -> (bool, &str) {
    let rest = name.strip_prefix("bad_").unwrap_or(name);
    if let Some(tag) = rest.strip_prefix("frame_") {
        (true, tag)
    } else if let Some(tag) = rest.strip_prefix("body_") {
        (false, tag)
    } else {
        panic!("handshake/{name}: name it frame_*, body_*, bad_frame_* or bad_body_*")
    }
}

#[test]
fn handshake_seeds_speak_the_current_protocol() {
    let seeds = corpus("handshake");
    let mut kinds = std::collections::BTreeSet::new();
    for (name, data) in &seeds {
        let (frame, _) = handshake_reading(name);
        judge(
            "handshake",
            name,
            data,
            |d| handshake_verdict(frame, d),
            |rest| handshake_reading(rest).1.to_string(),
        );
        if !name.starts_with("bad_") && frame {
            let msg = wire::decode(data).expect("judged above");
            kinds.insert(msg.name());
            if let Message::Hello { role, .. } = msg {
                kinds.insert(if role == Role::Observer {
                    "Hello (observer)"
                } else {
                    "Hello (consumer)"
                });
            }
        }
    }
    for kind in [
        "Hello (consumer)",
        "Hello (observer)",
        "Welcome",
        "Ready",
        "Joined",
        "Reject",
        "Goodbye",
    ] {
        assert!(
            kinds.contains(kind),
            "no valid {kind} frame among the seeds"
        );
    }
}

// --- segment_consumer -----------------------------------------------------------------------

/// The set-up the target reads from the first 4 bytes.
struct Setup {
    layout: RingLayout,
    write_sealed: bool,
    sealed: bool,
    short: bool,
}

fn setup(b: [u8; 4]) -> Setup {
    Setup {
        layout: RingLayout {
            slot_count: 1 + u32::from(b[0] % 16),
            consumer_capacity: 1 + u32::from(b[1] % 8),
            mode: if b[2] & 1 == 0 {
                Mode::Broadcast
            } else {
                Mode::Shared
            },
            slot_bytes: SLOT_ALIGN,
        },
        write_sealed: b[2] & 2 == 0,
        sealed: b[2] & 4 == 0,
        short: b[2] & 8 != 0,
    }
}

/// The memfd the target makes: `bytes` long, holding `image`, unsealed, sealed against
/// resizing only, or sealed against writes too (what a producer hands out).
fn memfd(bytes: u64, image: &[u8], s: &Setup) -> OwnedFd {
    let write = |fd: &OwnedFd| {
        let file = File::from(fd.try_clone().expect("dup"));
        file.write_all_at(image, 0).expect("write the image");
    };
    if !s.sealed {
        let fd = rustix::fs::memfd_create("gpipe-seed-control", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd");
        rustix::fs::ftruncate(&fd, bytes).expect("ftruncate");
        write(&fd);
        return fd;
    }
    if !s.write_sealed {
        let fd = sys::sealed_memfd("gpipe-seed-control", bytes).expect("memfd");
        write(&fd);
        return fd;
    }
    let unshared = sys::UnsharedMemfd::create("gpipe-seed-control", bytes).expect("memfd");
    let fd = unshared.fd().try_clone_to_owned().expect("dup");
    write(&fd);
    drop(fd);
    unshared.seal_writes().expect("seal")
}

/// Opens a seed's segment as the target does, and reads what `gpipe inspect` and a consumer
/// read from it.
fn segment_verdict(data: &[u8]) -> Result<(), String> {
    let (b, image) = data
        .split_first_chunk::<4>()
        .ok_or("shorter than the 4 set-up bytes")?;
    let s = setup(*b);
    let l = s.layout;
    let want = l.segment_bytes();
    let bytes = if s.short { want / 2 } else { want };
    let image = &image[..image.len().min(bytes as usize)];
    let seg = ControlSegment::open(memfd(bytes, image, &s), l).map_err(|e| e.to_string())?;
    assert_eq!(seg.layout(), l);

    let snap = Snapshot::read(&seg, "host");
    let text = snap.to_string();
    assert_eq!(
        text.lines().count(),
        3 + snap.slots.len() + snap.consumers.len().max(1),
        "{text}"
    );
    if snap.producer_state == "invalid" {
        return Err(format!("producer state is invalid\n{text}"));
    }
    if let Some(c) = snap.consumers.iter().find(|c| c.state == "invalid") {
        return Err(format!("consumer {} has an invalid state\n{text}", c.index));
    }
    let head = snap.head;
    if head > MAX_SEQ + 1 {
        return Err(format!("head {head} is past the last sequence number"));
    }
    let attached = (0..l.consumer_capacity)
        .filter(|&c| {
            let st = seg
                .consumer(c)
                .state
                .load(std::sync::atomic::Ordering::Relaxed);
            st == consumer_state::ACTIVE || st == consumer_state::ATTACHING
        })
        .fold(0u64, |m, c| m | ring::bit(c));
    let mut tensors = Vec::new();
    for v in &snap.slots {
        let k = v.index;
        let Some(seq) = v.seq else { continue };
        if ring::slot_of(seq, l.slot_count) != k
            || !ring::live_window(head, l.slot_count).contains(&seq)
        {
            return Err(format!(
                "slot {k} holds batch {seq}, not one of its live batches (head {head})"
            ));
        }
        ring::check_len(seq, k, v.len, l.slot_bytes).map_err(|e| e.to_string())?;
        seg.tensor_table(k)
            .read(v.len, &mut tensors)
            .map_err(|e| format!("slot {k}'s tensor table: {e}"))?;
        let addressed = v.held_by.iter().fold(0u64, |m, &c| m | ring::bit(c));
        if (l.mode == Mode::Shared && addressed != 0) || addressed & !attached != 0 {
            return Err(format!("slot {k} is addressed to {:?}", v.held_by));
        }
    }
    Ok(())
}

#[test]
fn segment_consumer_seeds_speak_the_current_protocol() {
    for (name, data) in &corpus("segment_consumer") {
        judge(
            "segment_consumer",
            name,
            data,
            segment_verdict,
            str::to_string,
        );
    }
}

// --- segment_producer -----------------------------------------------------------------------

/// A script the target runs: mode, hostile mask, the codec's u64, then operations; a hostile
/// consumer's write carries a selector byte, and a selector of kind 7 a u64.
fn script_verdict(data: &[u8]) -> Result<(), String> {
    let [mode, hostile, rest @ ..] = data else {
        return Err("no mode and hostile bytes".into());
    };
    if *mode > 1 || *hostile > 0b1111 {
        return Err(format!(
            "mode {mode} or hostile mask {hostile:#b} out of range"
        ));
    }
    let mut ops = rest.get(8..).ok_or("no codec word")?.iter();
    let mut count = 0;
    while let Some(&op) = ops.next() {
        count += 1;
        let c = (op >> 4) % 4;
        if matches!(op & 7, 5 | 6) {
            // Only a hostile consumer writes; for another one the op is a look, and a
            // selector after it would be read as an operation.
            if hostile & (1 << c) == 0 {
                return Err(format!("operation {count}: a write by honest consumer {c}"));
            }
            let sel = ops.next().ok_or("a write without its selector")?;
            if sel & 7 == 7 && ops.by_ref().take(8).count() != 8 {
                return Err("a raw selector without its u64".into());
            }
        }
    }
    if count < 4 {
        return Err(format!("only {count} operations"));
    }
    Ok(())
}

#[test]
fn segment_producer_seeds_are_whole_scripts() {
    for (name, data) in &corpus("segment_producer") {
        judge(
            "segment_producer",
            name,
            data,
            script_verdict,
            str::to_string,
        );
    }
}

// --- regressions ----------------------------------------------------------------------------

#[test]
fn regressions_still_reach_what_they_guard() {
    let dir = fuzz_dir().join("regressions");
    for (name, data) in files(&dir.join("handshake")) {
        // Any verdict, but no panic.
        let _ = handshake_verdict(true, &data);
        let _ = handshake_verdict(false, &data);
        if name == "reject_lossy_over_max" {
            let e = handshake_verdict(true, &data).expect_err("a reason that is not UTF-8");
            assert!(e.contains("not UTF-8"), "{e}");
        }
    }
    for (name, data) in files(&dir.join("segment_consumer")) {
        let verdict = segment_verdict(&data);
        if name == "pid_not_i32" {
            // It guards Snapshot::read on a pid that is no i32: `open` must accept it.
            verdict.unwrap_or_else(|e| panic!("regressions/segment_consumer/{name}: {e}"));
        }
    }
}
