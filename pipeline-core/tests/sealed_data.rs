//! A consumer cannot change the batch data that other consumers read (docs/security.md,
//! "Batch data is read-only to consumers"), and a producer is not dumpable, so a process of
//! the same uid cannot take the producer's own read-write fds from `/proc/<pid>/fd`.
//!
//! The attacker here runs the real handshake up to the Welcome, which hands it every fd a
//! consumer gets, and then tries each way of writing through them: `write()`, a writable
//! shared mapping, `mprotect` of a read-only mapping, reopening `/proc/self/fd/N` read-write,
//! punching a hole and truncating; it also tries to make an honest consumer's own mapping
//! writable. An honest consumer holds the published batches meanwhile and checks them.

mod support;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use pipeline_core::layout::PROTOCOL_VERSION;
use pipeline_core::pattern;
use pipeline_core::wire::Message;
use pipeline_core::{
    Consumer, ConsumerBackend, HostConsumer, HostOptions, HostProducer, Producer, ProducerConfig,
    RingLayout,
};
use rustix::fs::{FallocateFlags, Mode, OFlags};
use rustix::mm::{MprotectFlags, ProtFlags};

const WAIT: Duration = Duration::from_secs(5);
const EVIL: &[u8; 8] = b"EVILEVIL";

/// Kills the whole test binary if a test hangs, instead of leaving CI waiting.
fn watchdog(limit: Duration) {
    support::watchdog("sealed_data", limit);
}

fn socket(name: &str) -> PathBuf {
    support::socket("sealed", name)
}

/// The first half of the attach handshake, done by hand: Hello, then the Welcome with every
/// fd a consumer gets (the control segment first, then the backend's).
fn welcome_fds(sock: &Path) -> (UnixStream, RingLayout, Vec<OwnedFd>) {
    let (conn, msg, fds) = support::hello(sock, PROTOCOL_VERSION);
    let Message::Welcome {
        mode,
        slot_count,
        slot_bytes,
        consumer_capacity,
        fd_count,
        ..
    } = msg
    else {
        panic!("expected a Welcome, got {}", msg.name());
    };
    assert_eq!(fds.len(), fd_count as usize, "fds announced and received");
    let layout = RingLayout {
        slot_count,
        slot_bytes,
        consumer_capacity,
        mode: pipeline_core::Mode::from_u32(mode).expect("a known mode"),
    };
    (conn, layout, fds)
}

/// Writes `EVIL` at `offsets` through a shared mapping of `len` bytes at `ptr`.
///
/// # Safety
/// `ptr` is a writable mapping of at least `len` bytes and every offset + 8 is within it.
unsafe fn scribble(ptr: *mut u8, offsets: &[u64]) {
    for &off in offsets {
        // SAFETY: the caller guarantees that the mapping is writable and covers the range.
        unsafe { std::ptr::copy_nonoverlapping(EVIL.as_ptr(), ptr.add(off as usize), 8) };
    }
}

/// Every way this test knows to write through `fd` at `offsets` (each inside the first `len`
/// bytes) or to zero the `slots` (offset, bytes: page-aligned); returns a description of each
/// that the kernel allowed.
fn try_to_write(
    fd: BorrowedFd<'_>,
    len: usize,
    offsets: &[u64],
    slots: &[(u64, u64)],
) -> Vec<String> {
    let mut allowed = Vec::new();
    let fdn = fd.as_raw_fd();

    // write()
    for &off in offsets {
        if rustix::io::pwrite(fd, EVIL, off).is_ok() {
            allowed.push(format!("pwrite through fd {fdn} at offset {off}"));
        }
    }

    // A new writable shared mapping.
    let rw = support::map_shared(fd, len, ProtFlags::READ | ProtFlags::WRITE);
    if let Ok(p) = rw {
        allowed.push(format!("mmap(PROT_WRITE, MAP_SHARED) of fd {fdn}"));
        // SAFETY: `p` is our writable mapping of `len` bytes; the offsets lie inside it.
        unsafe {
            scribble(p.cast(), offsets);
            rustix::mm::munmap(p, len).unwrap();
        }
    }

    // A read-only shared mapping made writable afterwards.
    let ro = support::map_shared(fd, len, ProtFlags::READ);
    match ro {
        Ok(p) => {
            let writable = MprotectFlags::READ | MprotectFlags::WRITE;
            // SAFETY: `p` is our own mapping of `len` bytes; nothing else refers to it.
            let flipped = unsafe { rustix::mm::mprotect(p, len, writable) };
            if flipped.is_ok() {
                allowed.push(format!(
                    "mprotect(PROT_WRITE) of a read-only mapping of fd {fdn}"
                ));
                // SAFETY: the mapping is now writable and `len` bytes long.
                unsafe { scribble(p.cast(), offsets) };
            }
            // SAFETY: `p` is our mapping of `len` bytes, no longer used.
            unsafe { rustix::mm::munmap(p, len).unwrap() };
        }
        Err(e) => panic!("a consumer must still be able to map fd {fdn} read-only: {e}"),
    }

    // A new read-write file description through /proc/self/fd.
    let path = format!("/proc/self/fd/{fdn}");
    if let Ok(again) = rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
        for &off in offsets {
            if rustix::io::pwrite(&again, EVIL, off).is_ok() {
                allowed.push(format!("pwrite through {path} reopened read-write"));
            }
        }
        let rw = support::map_shared(again.as_fd(), len, ProtFlags::READ | ProtFlags::WRITE);
        if let Ok(p) = rw {
            allowed.push(format!("mmap(PROT_WRITE) of {path} reopened read-write"));
            // SAFETY: `p` is our writable mapping of `len` bytes; the offsets lie inside it.
            unsafe {
                scribble(p.cast(), offsets);
                rustix::mm::munmap(p, len).unwrap();
            }
        }
    }

    // Zeroing the slots by punching holes, or the whole file by truncating it.
    for &(start, bytes) in slots {
        let punch = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        if rustix::fs::fallocate(fd, punch, start, bytes).is_ok() {
            allowed.push(format!(
                "fallocate(PUNCH_HOLE) of fd {fdn} at offset {start}"
            ));
        }
    }
    if rustix::fs::ftruncate(fd, 0).is_ok() {
        allowed.push(format!("ftruncate of fd {fdn}"));
    }
    allowed
}

#[test]
fn no_fd_a_consumer_receives_lets_it_write_the_batch_data() {
    watchdog(Duration::from_secs(60));
    let sock = socket("attack");
    let config = ProducerConfig {
        slots: 3,
        batch_bytes: 1 << 20,
        keep_dumpable: true,
        ..Default::default()
    };
    let mut producer: Producer<HostProducer> =
        Producer::bind(&sock, config, HostOptions::default()).expect("bind the producer");
    let mut honest: Consumer<HostConsumer> =
        Consumer::attach(&sock, HostOptions::default()).expect("attach the honest consumer");
    producer.wait_for_consumers(1, WAIT).unwrap();

    // Fill every slot and let the honest consumer hold every batch while the attack runs.
    let len = 1u64 << 20;
    let mut held = Vec::new();
    for seq in 0..3u64 {
        let mut slot = producer.acquire_timeout(WAIT).expect("a free slot");
        pattern::fill(&mut slot.memory()[..len as usize], seq);
        slot.publish(len).unwrap();
        let batch = honest.recv_timeout(WAIT).unwrap().expect("a batch");
        assert_eq!(batch.seq(), seq);
        assert_eq!(
            pattern::checksum(batch.data()),
            pattern::expected_checksum(seq, len)
        );
        held.push(batch);
    }

    let (conn, layout, fds) = welcome_fds(&sock);
    assert!(
        fds.len() >= 4,
        "a host Welcome carries the control segment, the claim segment, the consumer's page \
         and the slot memfd"
    );
    let total = (layout.slot_bytes * u64::from(layout.slot_count)) as usize;
    // In each slot, a word inside the batch (past the first page) and the batch's first word.
    let offsets: Vec<u64> = (0..u64::from(layout.slot_count))
        .flat_map(|k| [k * layout.slot_bytes + 4096, k * layout.slot_bytes])
        .collect();

    // fds[0..3] are the control segment, the claim segment and this consumer's own page
    // (tests/hostile_consumer.rs attacks those). Every later fd is the backend's and must be
    // read-only to a consumer.
    let slots: Vec<(u64, u64)> = (0..u64::from(layout.slot_count))
        .map(|k| (k * layout.slot_bytes, layout.slot_bytes))
        .collect();
    let mut allowed = Vec::new();
    for fd in &fds[3..] {
        allowed.extend(try_to_write(fd.as_fd(), total, &offsets, &slots));
    }

    // The honest consumer's own read-only mapping must not be made writable either. A slot
    // starts on a page (slots are multiples of 2 MiB in a page-aligned mapping).
    let start = held[0].data().as_ptr() as *mut std::ffi::c_void;
    let slot_bytes = layout.slot_bytes as usize;
    // SAFETY: mprotect only changes the protection of the honest consumer's read-only mapping
    // of this slot, which stays mapped; nothing here writes through it, and it is made
    // read-only again at once if the call succeeded.
    let flipped = unsafe {
        rustix::mm::mprotect(
            start,
            slot_bytes,
            MprotectFlags::READ | MprotectFlags::WRITE,
        )
    };
    if flipped.is_ok() {
        allowed.push("mprotect(PROT_WRITE) of the honest consumer's own mapping".into());
        // SAFETY: as above; read-only again.
        unsafe { rustix::mm::mprotect(start, slot_bytes, MprotectFlags::READ).unwrap() };
    }

    let changed: Vec<u64> = held
        .iter()
        .filter(|b| pattern::checksum(b.data()) != pattern::expected_checksum(b.seq(), len))
        .map(|b| b.seq())
        .collect();
    assert!(
        allowed.is_empty() && changed.is_empty(),
        "a consumer could write the batch data: the kernel allowed {allowed:#?}, and batches \
         {changed:?} changed under the honest consumer"
    );
    drop(conn);
    drop(fds);

    // Sealed memory changes nothing for honest peers: the ring goes on.
    held.clear();
    let mut slot = producer
        .acquire_timeout(WAIT)
        .expect("a free slot after the attack");
    pattern::fill(&mut slot.memory()[..len as usize], 3);
    slot.publish(len).unwrap();
    let batch = honest
        .recv_timeout(WAIT)
        .unwrap()
        .expect("a batch after the attack");
    assert_eq!(batch.seq(), 3);
    assert_eq!(
        pattern::checksum(batch.data()),
        pattern::expected_checksum(3, len)
    );
    drop(batch);
    drop(honest);
    producer.close();
}

#[test]
fn a_consumer_refuses_slot_memory_that_is_not_sealed_against_writes() {
    let layout = RingLayout {
        slot_count: 2,
        slot_bytes: pipeline_core::round_slot_bytes(1),
        consumer_capacity: 1,
        mode: pipeline_core::Mode::Broadcast,
    };
    let total = layout.slot_bytes * u64::from(layout.slot_count);
    let import = |fd: OwnedFd| {
        <HostConsumer as ConsumerBackend>::import(&layout, 0, HostOptions::default(), &[], vec![fd])
            .map(|_| ())
    };
    // Sealed against resizing only, as the slot memory was before: anyone holding it could
    // write it.
    let open = pipeline_core::sys::sealed_memfd("gpipe-test-unsealed", total).unwrap();
    let err = import(open).expect_err("slot memory others can write must be refused");
    assert!(
        err.to_string().contains("not sealed against writes"),
        "{err}"
    );
    // Sealed as a producer seals it: accepted, and read as it was written.
    let unshared = pipeline_core::sys::UnsharedMemfd::create("gpipe-test-sealed", total).unwrap();
    rustix::io::pwrite(unshared.fd(), EVIL, 0).expect("the creator writes before the seal");
    let sealed = unshared.seal_writes().expect("seal");
    assert!(
        rustix::io::pwrite(&sealed, EVIL, 8).is_err(),
        "no write after the seal"
    );
    import(sealed).expect("sealed slot memory is accepted");
}

/// Roles this test binary plays when it runs itself as a child process (see
/// `child_role`): a producer that reports whether it is dumpable, and an attacker that tries to
/// open a producer's fd through `/proc`.
const ROLE: &str = "GPIPE_SEALED_DATA_ROLE";

fn dumpable() -> bool {
    rustix::process::dumpable_behavior().expect("prctl(PR_GET_DUMPABLE)")
        != rustix::process::DumpableBehavior::NotDumpable
}

/// Runs in a child process only (the tests below start it with `--ignored --exact`).
#[test]
#[ignore = "a child role of producer_bind_makes_the_process_not_dumpable and \
            a_same_uid_process_cannot_open_the_producer_fds"]
fn child_role() {
    // Run alone (`--include-ignored`, as the GPU test runner does), it has nothing to do.
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        "producer" | "producer-keep-dumpable" => {
            let before = dumpable();
            let config = ProducerConfig {
                slots: 2,
                batch_bytes: 4096,
                keep_dumpable: role == "producer-keep-dumpable",
                ..Default::default()
            };
            let sock = socket(&format!("child-{role}"));
            let producer: Producer<HostProducer> =
                Producer::bind(&sock, config, HostOptions::default()).expect("bind");
            let after = dumpable();
            // The producer's own fds, for the attacker role: every memfd it holds.
            let memfds: Vec<String> = std::fs::read_dir("/proc/self/fd")
                .unwrap()
                .filter_map(|e| {
                    let e = e.ok()?;
                    let target = std::fs::read_link(e.path()).ok()?;
                    target
                        .to_string_lossy()
                        .starts_with("/memfd:gpipe")
                        .then(|| e.file_name().to_string_lossy().into_owned())
                })
                .collect();
            println!(
                "dumpable-before={before} dumpable-after={after} pid={} memfds={}",
                std::process::id(),
                memfds.join(",")
            );
            // Stay up until the parent closes our stdin.
            let mut buf = String::new();
            let _ = std::io::stdin().read_line(&mut buf);
            producer.close();
        }
        "open-proc-fd" => {
            let path = std::env::var("GPIPE_SEALED_DATA_PATH").expect("a path to open");
            match rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
                Ok(_) => println!("opened {path}"),
                Err(e) => println!("refused {path}: {e}"),
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// Starts this binary as a child playing `role`, optionally as another uid.
fn spawn_role(role: &str, uid: Option<u32>, path: Option<&str>) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "child_role",
        "--nocapture",
        "--quiet",
    ])
    .env(ROLE, role)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped());
    if let Some(p) = path {
        cmd.env("GPIPE_SEALED_DATA_PATH", p);
    }
    if let Some(u) = uid {
        cmd.uid(u).gid(u);
    }
    cmd
}

/// Starts a producer child and returns it with its report line's fields.
fn producer_child(role: &str, uid: Option<u32>) -> (std::process::Child, Vec<(String, String)>) {
    use std::io::BufRead;
    let mut child = spawn_role(role, uid, None)
        .spawn()
        .expect("start the child producer");
    let mut line = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    while !line.starts_with("dumpable-before=") {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            panic!(
                "the child producer ({role}) exited without reporting: {:?}",
                child.wait()
            );
        }
    }
    // Keep reading what the child prints later (its test harness's summary), so it never
    // writes to a closed pipe.
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let fields = line
        .split_whitespace()
        .filter_map(|f| f.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    (child, fields)
}

fn field<'a>(fields: &'a [(String, String)], key: &str) -> &'a str {
    &fields.iter().find(|(k, _)| k == key).expect(key).1
}

fn finish(mut child: std::process::Child) {
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success(), "the child producer failed");
}

#[test]
fn producer_bind_makes_the_process_not_dumpable() {
    watchdog(Duration::from_secs(60));
    let (child, fields) = producer_child("producer", None);
    finish(child);
    assert_eq!(
        field(&fields, "dumpable-before"),
        "true",
        "a fresh process is dumpable"
    );
    assert_eq!(
        field(&fields, "dumpable-after"),
        "false",
        "Producer::bind must make the process not dumpable"
    );
    let (child, fields) = producer_child("producer-keep-dumpable", None);
    finish(child);
    assert_eq!(
        field(&fields, "dumpable-after"),
        "true",
        "keep_dumpable: true leaves the process dumpable"
    );
}

/// A process of the producer's own uid (not root: root may trace anyone) cannot reopen the
/// producer's fds through `/proc/<pid>/fd`. Needs root to run both as an unprivileged uid.
#[test]
fn a_same_uid_process_cannot_open_the_producer_fds() {
    watchdog(Duration::from_secs(60));
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to run the producer and the attacker as uid 65534");
        return;
    }
    let nobody = 65534;
    for (role, refused) in [("producer", true), ("producer-keep-dumpable", false)] {
        let (child, fields) = producer_child(role, Some(nobody));
        let pid = field(&fields, "pid").to_string();
        let memfds: Vec<String> = field(&fields, "memfds")
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        assert!(!memfds.is_empty(), "the producer holds memfds");
        for n in &memfds {
            let path = format!("/proc/{pid}/fd/{n}");
            let out = spawn_role("open-proc-fd", Some(nobody), Some(&path))
                .output()
                .expect("run the attacker");
            let said = String::from_utf8_lossy(&out.stdout);
            let opened = said.contains(&format!("opened {path}"));
            assert!(
                said.contains(&path),
                "the attacker did not report on {path}: {said}"
            );
            assert_eq!(
                opened,
                !refused,
                "{role}: a process of the same uid {} {path}: {said}",
                if opened { "opened" } else { "could not open" }
            );
        }
        finish(child);
    }
}
