//! The checks of `gpipe bench`'s arguments, in the order a run meets them, and the warning
//! about a combination that measured slow.

use pipeline_core::{Delivery, Mode};
use pipeline_relay::Fanout;

use super::args::{BenchArgs, BenchCmd};
use crate::args::{BackendArg, SideSignalsArg, SlotsArg};
use crate::duration;

/// What can be checked before the backend is resolved: the lists against the consumer count,
/// what `--gpu-timeline` and `--round-trip` need, the ring's shape and the batch size.
pub(super) fn arguments(cmd: &BenchCmd, args: &BenchArgs) -> Result<(), String> {
    if cmd.round_trip && cmd.ring.slots != SlotsArg::Count(1) {
        return Err("--round-trip measures a single-slot round trip: add --slots 1".into());
    }
    if cmd.consumers == 0 {
        return Err(
            "--consumers 0: a benchmark measures what consumers receive; give 1 consumer or more"
                .into(),
        );
    }
    let consumers = || duration::plural(u64::from(cmd.consumers), "consumer", "consumers");
    if cmd.delivery.len() != 1 && cmd.delivery.len() != cmd.consumers as usize {
        return Err(format!(
            "--delivery names {} choices for {}: give one for all, or one per consumer",
            cmd.delivery.len(),
            consumers()
        ));
    }
    if cmd.passes.len() > 1 && args.mode == Mode::Shared {
        return Err(
            "--passes takes one value in shared mode (each batch goes to one consumer, so the \
             fair ceiling needs one figure for all)"
                .into(),
        );
    }
    if cmd.passes.len() != 1 && cmd.passes.len() != cmd.consumers as usize {
        return Err(format!(
            "--passes names {} values for {}: give one for all, or one per consumer",
            cmd.passes.len(),
            consumers()
        ));
    }
    if !cmd.consumer_devices.is_empty() && cmd.consumer_devices.len() != cmd.consumers as usize {
        return Err(format!(
            "--consumer-devices names {} device(s) for {}: give one per consumer",
            cmd.consumer_devices.len(),
            consumers()
        ));
    }
    if cmd.gpu_timeline > 0 {
        if cmd.consumer_devices.iter().any(|&d| d != 0) || cmd.fanout != Fanout::Direct {
            return Err(
                "--gpu-timeline needs every consumer on the producer's GPU, reading its ring \
                 (each GPU has a timer of its own)"
                    .into(),
            );
        }
        // Each batch's fill and one verify per consumer are stamped: work besides them
        // would show as idle time, and a batch must reach every consumer once.
        if args.mode == Mode::Shared
            || cmd.passes.iter().any(|&p| p > 1)
            || cmd.delivery.contains(&Delivery::Mirror)
        {
            return Err(
                "--gpu-timeline stamps one fill and one verify per consumer of each batch: it \
                 needs --mode broadcast, --passes 1 and in-place delivery"
                    .into(),
            );
        }
    }
    // The producer's ring holds every consumer that reads it (each of its forwarders, too).
    let attached = args.plan().attachments(0).max(1);
    crate::args::check_shape(
        cmd.ring.slots,
        cmd.ring.batch_bytes,
        attached,
        "--consumers",
    )?;
    crate::args::check_pattern_bytes(cmd.ring.batch_bytes)
}

/// `--gpu-timeline` stamps GPU kernels: the resolved backend must be CUDA.
pub(super) fn gpu_timeline_backend(cmd: &BenchCmd, backend: BackendArg) -> Result<(), String> {
    if cmd.gpu_timeline > 0 && backend != BackendArg::Cuda {
        return Err("--gpu-timeline stamps GPU kernels: it needs --backend cuda".into());
    }
    Ok(())
}

/// A chain or tree fan-out needs broadcast; on the host backend, `--consumer-devices` names
/// the groups of such a fan-out and means nothing without one.
pub(super) fn fanout(cmd: &BenchCmd, args: &BenchArgs, backend: BackendArg) -> Result<(), String> {
    let shape = args.plan().shape;
    if shape != Fanout::Direct && args.mode != Mode::Broadcast {
        return Err(format!(
            "--fanout {shape} forwards every batch to every GPU: it needs --mode broadcast"
        ));
    }
    if backend == BackendArg::Host && !cmd.consumer_devices.is_empty() && shape == Fanout::Direct {
        return Err(
            "--consumer-devices applies to the CUDA backend (or, on the host backend, to a \
             chain or tree --fanout, where it names groups of consumers)"
                .into(),
        );
    }
    Ok(())
}

/// A warning when the consumers take side signals and the producer's lead is bounded below
/// the ring: on an H100 the two together ran slower than either alone (8 and 16 MiB,
/// docs/benchmarks.md).
pub(super) fn side_signals_with_lead(
    backend: BackendArg,
    side: SideSignalsArg,
    batch_bytes: u64,
    slots: u32,
    max_lead: Option<u32>,
) -> Option<String> {
    let lead = max_lead.filter(|&l| l < slots)?;
    (backend != BackendArg::Host && side.resolve(batch_bytes)).then(|| {
        format!(
            "side signals with a lead bound of {lead} batches: measured slower together than \
             either alone (docs/benchmarks.md); keep one, e.g. add --side-signals off"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::side_signals_with_lead;
    use crate::args::{BackendArg, SideSignalsArg};

    #[test]
    fn side_signals_with_a_bounded_lead_are_flagged() {
        use BackendArg::{Cuda, Host};
        use SideSignalsArg::{Auto, Off, On};
        let w = |b, s, bytes: u64, lead| side_signals_with_lead(b, s, bytes, 8, lead).is_some();
        // 16 MiB: auto takes side signals; with a lead below the ring's 8 slots, flagged.
        assert!(w(Cuda, Auto, 16 << 20, Some(2)));
        assert!(!w(Cuda, Off, 16 << 20, Some(2)));
        assert!(!w(Host, On, 16 << 20, Some(2)));
        assert!(!w(Cuda, Auto, 16 << 20, Some(8))); // the ring's own bound
        assert!(!w(Cuda, Auto, 16 << 20, None));
        // 8 MiB: auto leaves them off; asked for, flagged.
        assert!(!w(Cuda, Auto, 8 << 20, Some(2)));
        assert!(w(Cuda, On, 8 << 20, Some(2)));
    }
}
