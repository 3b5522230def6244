//! The bench's report: a typed struct, printed as JSON with `--json` and as text otherwise.

use pipeline_core::Mode;
use pipeline_relay::{Fanout, RelayReport};

use super::args::Backend;
use super::cuda_figures::CudaFigures;
use super::format::sorted_keys;
use super::repetitions::Repetitions;
use crate::duration;
use crate::work::ConsumerReport;

/// The bench result.
#[derive(Debug, serde::Serialize)]
pub struct BenchReport {
    /// Backend used.
    pub backend: Backend,
    /// Delivery mode.
    pub mode: Mode,
    /// Consumers.
    pub consumers: u32,
    /// Slots.
    pub slots: u32,
    /// The producer-lead bound, when one was set (`--max-lead`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_lead: Option<u32>,
    /// Reads of every batch by each consumer (`--passes`), one entry per consumer.
    pub passes: Vec<u32>,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// Batches published.
    pub published: u64,
    /// Seconds from the first timed batch (after the warm-up) to the last release.
    pub elapsed_s: f64,
    /// Batches published before timing started (verified, not timed).
    pub warmup: u64,
    /// Batches per second published and fully consumed.
    pub batches_per_s: f64,
    /// GB/s of batches handed over (published bytes / s).
    pub gb_per_s: f64,
    /// GB/s delivered summed over consumers (broadcast: x consumers).
    pub delivered_gb_per_s: f64,
    /// Each consumer's report.
    pub per_consumer: Vec<ConsumerReport>,
    /// Batches that failed verification.
    pub mismatches: u64,
    /// Batches lost (never delivered where they should have been).
    pub lost: u64,
    /// Batches delivered more than once (shared) or twice to one consumer.
    pub duplicated: u64,
    /// Seconds the producer spent in `acquire` waiting for consumers to release (whole run).
    pub producer_acquire_wait_s: f64,
    /// Seconds the producer spent in its fill (enqueueing the fill kernel), timed batches.
    pub producer_fill_s: f64,
    /// Seconds the producer spent in `publish` (signalling `ready`), timed batches.
    pub producer_publish_s: f64,
    /// Batches the producer's fill and publish times cover (the timed ones).
    pub producer_host_timed: u64,
    /// Round trip publish -> consumer done -> slot free, median (µs), with `--round-trip`.
    pub round_trip_p50_us: Option<f64>,
    /// Round trip, 99th percentile (µs).
    pub round_trip_p99_us: Option<f64>,
    /// Problems found, in words.
    pub problems: Vec<String>,
    /// A chain or tree fan-out: its rings and forwarders.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fanout: Option<FanoutReport>,
    /// What a CUDA run adds: its paths, the single-process ceilings and its ratios to them
    /// (`extra` in the JSON, as always; null on the host backend).
    #[serde(rename = "extra", serialize_with = "sorted_keys")]
    pub cuda: Option<CudaFigures>,
    /// With `--repeat N` (N > 1): every repetition and the spread; the rest of the report is
    /// the repetition with the median rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetitions: Option<Repetitions>,
}

/// The rings of a chain or tree fan-out, in the bench report.
#[derive(Debug, serde::Serialize)]
pub struct FanoutReport {
    /// The shape run (`auto` resolved).
    pub shape: Fanout,
    /// The most forwarders between the producer and a consumer.
    pub depth: usize,
    /// The forwarders' chunk size (None: whole batches).
    pub chunk_bytes: Option<u64>,
    /// Where the forwarders ran: "in-consumer" (each in its GPU's first consumer's process)
    /// or "process" (a process each).
    pub forwarders: &'static str,
    /// Ring 0 is the producer's; each other is fed by a forwarder from its parent.
    pub rings: Vec<RingReport>,
    /// Why `--fanout auto` chose this shape (None: the shape was asked for).
    pub why: Option<&'static str>,
}

/// One ring of a fan-out.
#[derive(Debug, serde::Serialize)]
pub struct RingReport {
    /// Its GPU (on the host backend: the group named in --consumer-devices).
    pub device: usize,
    /// The ring it is forwarded from.
    pub parent: Option<usize>,
    /// Bench consumers reading it.
    pub consumers: usize,
    /// Its forwarder's report.
    pub forwarder: Option<RelayReport>,
}

/// Writes a JSON value as labelled lines ("ceiling batches per s: 142907"), nested objects
/// indented, for the text report (`--json` keeps the raw object).
fn write_labelled(
    f: &mut std::fmt::Formatter<'_>,
    v: &serde_json::Value,
    depth: usize,
) -> std::fmt::Result {
    fn scalar(v: &serde_json::Value) -> String {
        match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => u.to_string(),
                (_, Some(i), _) => i.to_string(),
                (_, _, Some(x)) if x.abs() >= 100.0 => format!("{x:.0}"),
                (_, _, Some(x)) => format!("{x:.3}"),
                _ => n.to_string(),
            },
            serde_json::Value::Array(a) => a.iter().map(scalar).collect::<Vec<_>>().join(", "),
            serde_json::Value::Null => "-".into(),
            other => other.to_string(),
        }
    }
    let pad = "  ".repeat(depth);
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let label = k.replace('_', " ");
                if v.is_object() {
                    writeln!(f, "{pad}{label}:")?;
                    write_labelled(f, v, depth + 1)?;
                } else {
                    writeln!(f, "{pad}{label}: {}", scalar(v))?;
                }
            }
            Ok(())
        }
        other => writeln!(f, "{pad}{}", scalar(other)),
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let passes = if self.passes.iter().all(|&p| p == 1) {
            String::new()
        } else {
            let list: Vec<String> = self.passes.iter().map(u32::to_string).collect();
            format!(" | reads per batch {}", list.join(","))
        };
        writeln!(
            f,
            "gpipe bench: backend {} | mode {} | {} | {} slots | {} per batch{passes}",
            self.backend,
            self.mode,
            duration::plural(self.consumers, "consumer", "consumers"),
            self.slots,
            crate::size::format(self.batch_bytes)
        )?;
        writeln!(
            f,
            "  {} timed batches (after {} warm-up) in {:.3} s: {:.0} batches/s, {:.2} GB/s handed over ({:.2} GB/s delivered to all consumers)",
            self.published - self.warmup,
            self.warmup,
            self.elapsed_s,
            self.batches_per_s,
            self.gb_per_s,
            self.delivered_gb_per_s
        )?;
        if let Some(rep) = &self.repetitions {
            let b = rep.batches_per_s;
            write!(
                f,
                "  {} repetitions: {:.0} batches/s median ({:.0}..{:.0}); figures below are the median one's",
                rep.runs.len(),
                b.median,
                b.min,
                b.max
            )?;
            if let Some(r) = rep.ratio_to_fair_ceiling {
                write!(
                    f,
                    "; ratio to fair ceiling {:.3} median ({:.3}..{:.3})",
                    r.median, r.min, r.max
                )?;
            }
            writeln!(f)?;
        }
        if let Some(fan) = &self.fanout {
            let unit = if self.backend == Backend::Cuda {
                "GPU"
            } else {
                "group"
            };
            writeln!(
                f,
                "  fan-out {} (depth {}; forwarders {}, {}): {}",
                fan.shape,
                fan.depth,
                fan.forwarders,
                fan.chunk_bytes
                    .map(|c| format!("chunks of {}", crate::size::format(c)))
                    .unwrap_or_else(|| "whole batches".into()),
                fan.rings
                    .iter()
                    .enumerate()
                    .map(|(i, r)| match (r.parent, &r.forwarder) {
                        (None, _) => {
                            format!(
                                "ring 0 on {unit} {} ({})",
                                r.device,
                                duration::plural(r.consumers as u64, "consumer", "consumers")
                            )
                        }
                        (Some(p), fw) => format!(
                            "ring {i} on {unit} {} from ring {p} ({}, {} forwarded{})",
                            r.device,
                            duration::plural(r.consumers as u64, "consumer", "consumers"),
                            duration::plural(
                                fw.as_ref().map(|f| f.batches).unwrap_or(0),
                                "batch",
                                "batches"
                            ),
                            match fw.as_ref().map(|f| f.copied_ahead).unwrap_or(0) {
                                0 => String::new(),
                                n => format!(", {n} copied ahead"),
                            }
                        ),
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            )?;
            if let Some(why) = fan.why {
                writeln!(f, "    ({why})")?;
            }
        }
        // By index, whatever order they attached in (the lists below follow the same order).
        let mut consumers: Vec<&ConsumerReport> = self.per_consumer.iter().collect();
        consumers.sort_by_key(|r| r.index);
        for r in &consumers {
            let place = match (&r.delivery, r.device) {
                (Some(d), Some(g)) => format!(", {d} on GPU {g}"),
                (Some(d), None) if d == "mirror" => format!(", {d}"),
                _ => String::new(),
            };
            let checked = match (r.verified, r.mismatches) {
                (false, _) => "not verified".to_string(),
                (true, 0) => "no checksum mismatches".to_string(),
                (true, n) => duration::plural(n, "checksum mismatch", "checksum mismatches"),
            };
            let taken_back = match r.taken_back {
                0 => String::new(),
                n => format!(
                    ", {} taken back by the producer when it detached this consumer",
                    duration::plural(n, "batch", "batches")
                ),
            };
            writeln!(
                f,
                "  consumer #{:<2} pid {:>7}: {:>8} {}, {checked}{taken_back}{place}",
                r.index,
                r.pid,
                r.received,
                if r.received == 1 { "batch" } else { "batches" },
            )?;
        }
        writeln!(
            f,
            "  where the time went: producer waited {:.3} s for free slots; consumers waited {} s for batches",
            self.producer_acquire_wait_s,
            consumers
                .iter()
                .map(|r| format!("{:.3}", r.recv_wait_s))
                .collect::<Vec<_>>()
                .join("/")
        )?;
        // Host time per batch of each side's own steps: where a side that never waits spends
        // its time (a host-bound side shows here, not in the waits above).
        let per = |s: f64, n: u64| if n == 0 { 0.0 } else { s * 1e6 / n as f64 };
        writeln!(
            f,
            "  host µs per batch: producer fill {:.2}, publish {:.2}; consumers check {}, release {}",
            per(self.producer_fill_s, self.producer_host_timed),
            per(self.producer_publish_s, self.producer_host_timed),
            consumers
                .iter()
                .map(|r| format!("{:.2}", per(r.check_s, r.host_timed)))
                .collect::<Vec<_>>()
                .join("/"),
            consumers
                .iter()
                .map(|r| format!("{:.2}", per(r.release_s, r.host_timed)))
                .collect::<Vec<_>>()
                .join("/")
        )?;
        if let (Some(p50), Some(p99)) = (self.round_trip_p50_us, self.round_trip_p99_us) {
            writeln!(
                f,
                "  round trip (publish -> consumer done -> slot free): p50 {p50:.1} µs, p99 {p99:.1} µs"
            )?;
        }
        if let Some(cuda) = &self.cuda {
            // Every figure but the hint as a labelled line, in the JSON's order; the hint last.
            let figures = CudaFigures {
                mps_hint: None,
                ..cuda.clone()
            };
            let figures = serde_json::to_value(&figures).map_err(|_| std::fmt::Error)?;
            write_labelled(f, &figures, 1)?;
            if let Some(hint) = &cuda.mps_hint {
                writeln!(f, "  hint: {hint}")?;
            }
        }
        if self.problems.is_empty() {
            writeln!(f, "  OK: every batch verified; none lost, none duplicated")
        } else {
            for p in &self.problems {
                writeln!(f, "  PROBLEM: {p}")?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::{BenchReport, write_labelled};
    use crate::bench::args::Backend;
    use crate::bench::cuda_figures::CudaFigures;

    struct Show(serde_json::Value);
    impl std::fmt::Display for Show {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write_labelled(f, &self.0, 1)
        }
    }

    #[test]
    fn extra_figures_become_labelled_lines() {
        let v = serde_json::json!({
            "ceiling_batches_per_s": 142907.4,
            "ratio_to_ceiling": 0.7712,
            "memory": "pool",
            "attach": {"total_us": 812, "slots": [31, 40]},
        });
        let text = Show(v).to_string();
        assert!(text.contains("  ceiling batches per s: 142907\n"), "{text}");
        assert!(text.contains("  ratio to ceiling: 0.771\n"), "{text}");
        assert!(text.contains("  memory: pool\n"), "{text}");
        assert!(
            text.contains("  attach:\n    slots: 31, 40\n    total us: 812\n"),
            "{text}"
        );
        assert!(!text.contains('{'), "{text}");
    }

    /// A CUDA report of 2000 batches with `cuda` as its figures, no consumers and no problems.
    pub(crate) fn report(cuda: Option<CudaFigures>) -> BenchReport {
        BenchReport {
            backend: Backend::Cuda,
            mode: pipeline_core::Mode::Broadcast,
            consumers: 1,
            slots: 8,
            max_lead: None,
            passes: vec![1],
            batch_bytes: 2 << 20,
            published: 2000,
            elapsed_s: 0.1,
            warmup: 100,
            batches_per_s: 20_138.0,
            gb_per_s: 42.0,
            delivered_gb_per_s: 42.0,
            per_consumer: Vec::new(),
            mismatches: 0,
            lost: 0,
            duplicated: 0,
            producer_acquire_wait_s: 0.0,
            producer_fill_s: 0.0,
            producer_publish_s: 0.0,
            producer_host_timed: 0,
            round_trip_p50_us: None,
            round_trip_p99_us: None,
            problems: Vec::new(),
            fanout: None,
            cuda,
            repetitions: None,
        }
    }

    #[test]
    fn the_text_report_lists_consumers_by_index_with_their_figures_in_the_same_order() {
        let mut r = report(None);
        let consumer =
            |index: u32, received: u64, mismatches: u64, wait: f64| crate::work::ConsumerReport {
                index,
                received,
                verified: true,
                mismatches,
                recv_wait_s: wait,
                ..Default::default()
            };
        // Consumer #1 attached (and reported) first.
        r.per_consumer = vec![consumer(1, 1, 1, 0.25), consumer(0, 2000, 0, 0.5)];
        let text = r.to_string();
        let first = text.find("consumer #0 ").expect(&text);
        let second = text.find("consumer #1 ").expect(&text);
        assert!(first < second, "{text}");
        assert!(
            text.contains("2000 batches, no checksum mismatches"),
            "{text}"
        );
        assert!(text.contains("1 batch, 1 checksum mismatch\n"), "{text}");
        assert!(text.contains("consumers waited 0.500/0.250 s"), "{text}");
    }

    #[test]
    fn the_text_report_gives_each_sides_host_time_per_batch() {
        let mut r = report(None);
        r.producer_fill_s = 0.008; // 2000 timed batches: 4 µs each
        r.producer_publish_s = 0.003;
        r.producer_host_timed = 2000;
        r.per_consumer = vec![crate::work::ConsumerReport {
            received: 1100,
            host_timed: 1000,
            check_s: 0.007,
            release_s: 0.0015,
            ..Default::default()
        }];
        let text = r.to_string();
        assert!(
            text.contains(
                "  host µs per batch: producer fill 4.00, publish 1.50; consumers check 7.00, \
                 release 1.50\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn the_text_report_prints_the_hint_last_not_as_a_figure() {
        let hint = crate::bench::hint::mps_hint(false, 20_138.0, 128_000.0, None).unwrap();
        let figures = CudaFigures {
            ceiling_batches_per_s: 128000.0,
            mps_active: false,
            mps_hint: Some(hint.clone()),
            ..CudaFigures::default()
        };
        let text = report(Some(figures.clone())).to_string();
        assert!(text.contains("  ceiling batches per s: 128000\n"), "{text}");
        assert!(!text.contains("mps hint"), "{text}");
        assert!(
            text.ends_with(&format!(
                "  hint: {hint}\n  OK: every batch verified; none lost, none duplicated\n"
            )),
            "{text}"
        );
        // In the JSON the hint is one of the figures.
        let json = serde_json::to_value(report(Some(figures))).unwrap();
        assert_eq!(json["extra"]["mps_hint"], hint.as_str());
        // Without the hint (MPS running, host backend) the report has no hint line.
        let running = CudaFigures {
            mps_active: true,
            ..CudaFigures::default()
        };
        let text = report(Some(running)).to_string();
        assert!(!text.contains("hint"), "{text}");
        let text = report(None).to_string();
        assert!(!text.contains("hint"), "{text}");
    }

    #[test]
    fn the_cuda_figures_keep_their_json_keys_in_alphabetical_order() {
        use crate::bench::cuda_figures::PeerCeilings;
        let figures = CudaFigures {
            attach_us: Some(serde_json::json!({"total_us": 812})),
            gpu_timeline: Some(crate::bench::timeline::summary(&[[1, 2]], &[vec![[3, 4]]])),
            peer_ceilings: vec![PeerCeilings {
                device: 1,
                peer_copy_ceiling_batches_per_s: 1.0,
                peer_copy_ceiling_gb_per_s: 1.0,
                remote_read_ceiling_batches_per_s: 1.0,
                remote_read_ceiling_gb_per_s: 1.0,
            }],
            mps_hint: Some("MPS is not running".into()),
            max_lead_auto: Some(crate::args::LeadChoice {
                max_lead: Some(2),
                auto: true,
                l2_bytes: Some(50 << 20),
            }),
            slots_auto: Some(crate::args::DepthChoice {
                slots: 32,
                auto: true,
                why: Some("measured".into()),
                trials: vec![(8, 1.0), (32, 2.0)],
            }),
            cuda_env: Some([("CUDA_DEVICE_MAX_CONNECTIONS".into(), "8".into())].into()),
            ..CudaFigures::default()
        };
        let json = serde_json::to_string_pretty(&report(Some(figures))).unwrap();
        // The keys scripts read (scripts/gpu, the GPU tests), one level under `extra`.
        let keys = [
            "attach_us",
            "ceiling_batches_per_s",
            "consumer_devices",
            "cuda_env",
            "delivery",
            "fair_ceiling_batches_per_s",
            "fair_ceiling_one_stream_batches_per_s",
            "fair_ceiling_spread_batches_per_s",
            "fair_ceiling_verifies_per_batch",
            "gpu_timeline",
            "handle",
            "lag",
            "lagged_ceiling_batches_per_s",
            "max_lead_auto",
            "memory",
            "mps_active",
            "mps_hint",
            "peer_ceilings",
            "pool_ceiling_batches_per_s",
            "producer_device",
            "ratio_to_ceiling",
            "ratio_to_fair_ceiling",
            "slots_auto",
            "sync",
            "timeline_memory",
            "two_stream_ceiling_batches_per_s",
        ];
        let extra = &json[json.find("\n  \"extra\": {").expect(&json)..];
        let at: Vec<usize> = keys
            .iter()
            .map(|k| extra.find(&format!("\n    \"{k}\": ")).expect(k))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{json}");
        assert_eq!(extra.matches("\n    \"").count(), keys.len(), "{json}");
        // Nested figures are sorted too, as they were as a map.
        let lead = &extra[extra.find("\"max_lead_auto\"").unwrap()..];
        let (a, l, m) = (
            lead.find("\"auto\"").unwrap(),
            lead.find("\"l2_bytes\"").unwrap(),
            lead.find("\"max_lead\"").unwrap(),
        );
        assert!(a < l && l < m, "{json}");
        // The paths are their names.
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["extra"]["memory"], "pool", "{json}");
        assert_eq!(v["extra"]["handle"], "posix_fd", "{json}");
        // The host backend has no CUDA figures: `extra` is null.
        let mut host = report(None);
        host.backend = Backend::Host;
        let v = serde_json::to_value(&host).unwrap();
        assert_eq!(
            (&v["backend"], &v["extra"]),
            (&"host".into(), &serde_json::Value::Null)
        );
    }

    #[test]
    fn the_text_report_names_the_reads_per_batch_only_when_not_one() {
        let plain = report(None).to_string();
        assert!(!plain.contains("reads per batch"), "{plain}");
        let mut r = report(None);
        r.passes = vec![16, 1];
        let text = r.to_string();
        assert!(
            text.lines()
                .next()
                .unwrap()
                .ends_with("per batch | reads per batch 16,1"),
            "{text}"
        );
    }
}
