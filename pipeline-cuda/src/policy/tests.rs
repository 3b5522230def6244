//! The resolver against saved facts (no GPU needed).

use super::*;
use crate::probe::fixtures::{h100, report};

fn facts(mps: bool, connections: Option<u32>) -> Result<Facts, String> {
    let mut r = report(vec![h100()]);
    if mps {
        r.devices[0].mps_enabled = Some(true);
    }
    Ok(Facts::of(r, connections))
}

fn cli() -> Inputs {
    Inputs::new(FrontEnd::CLI)
}

#[test]
fn the_host_backend_needs_no_probe() {
    let inputs = Inputs {
        backend: Some(BackendKind::Host),
        slots: None,
        max_lead: LeadRequest::Auto,
        ..cli()
    };
    let r = resolve(&inputs, &Err("never read".into())).unwrap();
    assert_eq!(r.backend.value, BackendKind::Host);
    assert_eq!(
        (r.slots.value, r.slots.reason.as_str()),
        (8, "the host backend")
    );
    assert_eq!(r.max_lead.value, None);
    assert!(r.cuda.is_none() && r.cuda_options().is_none());
    assert!(!r.side_signals.value);
}

#[test]
fn auto_backend_falls_back_to_host_and_says_why() {
    let r = resolve(&cli(), &Err("no CUDA driver".into())).unwrap();
    assert_eq!(r.backend.value, BackendKind::Host);
    assert!(
        r.backend.reason.contains("no CUDA driver"),
        "{:?}",
        r.backend
    );
    let asked = Inputs {
        backend: Some(BackendKind::Cuda),
        ..cli()
    };
    let e = resolve(&asked, &Err("no CUDA driver".into())).unwrap_err();
    assert_eq!(e.setting, Setting::Backend);
    // The device the ring uses, not device 0.
    let on_1 = Inputs {
        backend: Some(BackendKind::Cuda),
        device: 1,
        ..cli()
    };
    let e = resolve(&on_1, &facts(false, None)).unwrap_err();
    assert!(e.problem.contains("no CUDA device 1"), "{e}");
}

#[test]
fn the_cli_and_python_differ_only_where_their_front_end_says() {
    let f = facts(false, None);
    let cli = resolve(&cli(), &f).unwrap();
    let python = resolve(&Inputs::new(FrontEnd::PYTHON), &f).unwrap();
    let (c, p) = (cli.cuda.clone().unwrap(), python.cuda.clone().unwrap());
    // Device words on an H100 without a queue limit: semaphores either way.
    assert_eq!(c.timeline_memory.value, TimelineMemory::Device);
    assert_eq!(c.sync.value, SyncMode::Semaphore);
    assert_eq!(p.sync.value, SyncMode::Semaphore);
    // A broadcast ring: Python takes VMM (read-only consumers), the CLI the pool.
    assert_eq!(c.memory.value, MemoryPath::Pool);
    assert_eq!(p.memory.value, MemoryPath::Vmm);
    // Host words: the CLI takes events (measured), Python semaphores (a dead producer).
    let host_words = |fe| Inputs {
        timeline_memory: Some(TimelineMemory::Host),
        ..Inputs::new(fe)
    };
    let c = resolve(&host_words(FrontEnd::CLI), &f)
        .unwrap()
        .cuda
        .unwrap();
    let p = resolve(&host_words(FrontEnd::PYTHON), &f)
        .unwrap()
        .cuda
        .unwrap();
    assert_eq!(c.sync.value, SyncMode::Events);
    assert_eq!(p.sync.value, SyncMode::Semaphore);
    assert!(p.sync.reason.contains("producer dies"), "{:?}", p.sync);
    // Everything else agrees.
    assert_eq!(
        (cli.backend, cli.slots, cli.max_lead, cli.side_signals),
        (
            python.backend,
            python.slots,
            python.max_lead,
            python.side_signals
        )
    );
}

#[test]
fn depth_and_lead_follow_mps_and_the_l2() {
    let asked = Inputs {
        slots: None,
        max_lead: LeadRequest::Auto,
        batch_bytes: 8 << 20,
        ..cli()
    };
    let no_mps = resolve(&asked, &facts(false, None)).unwrap();
    let expect = depth::rule_depth(false, 8 << 20, depth::DEFAULT_DEPTH_BUDGET);
    assert_eq!(no_mps.slots.value, expect);
    assert!(no_mps.slots.reason.starts_with("MPS is not running"));
    let l2 = h100().l2_cache_bytes.unwrap();
    assert_eq!(
        no_mps.max_lead.value,
        lead::l2_max_lead(l2, 8 << 20, expect)
    );
    let mps = resolve(&asked, &facts(true, None)).unwrap();
    assert_eq!(
        (mps.slots.value, mps.slots.reason.as_str()),
        (8, "MPS is running")
    );
    // No L2 size reported: auto cannot be resolved, and says so.
    let mut r = report(vec![h100()]);
    r.devices[0].l2_cache_bytes = None;
    let e = resolve(&asked, &Ok(Facts::of(r, None))).unwrap_err();
    assert_eq!(e.setting, Setting::MaxLead);
}

#[test]
fn few_queues_keep_the_words_on_the_host_and_flag_side_signals() {
    let big = Inputs {
        batch_bytes: 64 << 20,
        ..cli()
    };
    let r = resolve(&big, &facts(false, Some(4))).unwrap();
    let c = r.cuda.unwrap();
    assert_eq!(c.timeline_memory.value, TimelineMemory::Host);
    assert!(
        c.timeline_memory
            .reason
            .contains("CUDA_DEVICE_MAX_CONNECTIONS=4")
    );
    assert_eq!(c.sync.value, SyncMode::Events);
    assert!(r.side_signals.value);
    assert!(r.side_signals_queues.unwrap().contains("=4"));
    let ok = resolve(&big, &facts(false, Some(8))).unwrap();
    assert!(ok.side_signals_queues.is_none());
}

#[test]
fn a_memory_path_the_device_lacks_is_named() {
    let mut r = report(vec![h100()]);
    r.devices[0].virtual_memory_management = false;
    let asked = Inputs {
        memory: Some(MemoryPath::Vmm),
        ..cli()
    };
    let e = resolve(&asked, &Ok(Facts::of(r.clone(), None))).unwrap_err();
    assert_eq!(e.setting, Setting::Memory);
    assert!(e.problem.contains("VIRTUAL_MEMORY_MANAGEMENT"), "{e}");
    // Without VMM, Python's broadcast ring takes the pool, and the words stay on the host.
    let p = resolve(&Inputs::new(FrontEnd::PYTHON), &Ok(Facts::of(r, None)))
        .unwrap()
        .cuda
        .unwrap();
    assert_eq!(p.memory.value, MemoryPath::Pool);
    assert_eq!(p.timeline_memory.value, TimelineMemory::Host);
}

#[test]
fn a_saved_report_round_trips_through_json() {
    let f = facts(false, Some(8)).unwrap();
    let text = serde_json::to_string(&f.report).unwrap();
    let back: ProbeReport = serde_json::from_str(&text).unwrap();
    let back = Facts::of(back, Some(8));
    assert_eq!(back, f);
    assert_eq!(
        resolve(&cli(), &Ok(back)).unwrap(),
        resolve(&cli(), &Ok(f)).unwrap()
    );
}

#[test]
fn sizes_are_written_in_whole_units() {
    assert_eq!(bytes_text(2 << 30), "2 GiB");
    assert_eq!(bytes_text(3 << 20), "3 MiB");
    assert_eq!(bytes_text(1536 << 10), "1536 KiB");
    assert_eq!(bytes_text(100), "100 B");
}
