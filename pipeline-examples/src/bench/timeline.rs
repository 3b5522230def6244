//! `--gpu-timeline`: what the GPU did over the stamped batches, from each kernel's start and
//! end on the GPU's own clock.

use std::path::Path;

/// What the GPU did over the stamped batches (`gpu_timeline` in the report).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TimelineSummary {
    /// Batches whose fill and every verify were stamped (the others are left out).
    pub batches: usize,
    /// The figures, when there is at least one such batch.
    #[serde(flatten)]
    pub figures: Option<TimelineFigures>,
}

/// The figures of a [`TimelineSummary`]; times in µs, rounded to 0.01.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TimelineFigures {
    /// From the first kernel's start to the last one's end.
    pub span_us: f64,
    /// The span over the batches.
    pub per_batch_us: f64,
    /// The share of the span some kernel ran.
    pub busy: f64,
    /// The share of the span two or more ran at once.
    pub overlap: f64,
    /// A fill's duration, median.
    pub fill_us_p50: f64,
    /// A verify's duration, median.
    pub verify_us_p50: f64,
    /// From a batch's fill's end to a verify's start, median.
    pub handover_us_p50: f64,
    /// The same, 99th percentile.
    pub handover_us_p99: f64,
    /// Stretches with no kernel running.
    pub idle_gaps: usize,
    /// Their total.
    pub idle_gap_us_total: f64,
    /// Their median.
    pub idle_gap_us_p50: f64,
    /// The longest.
    pub idle_gap_us_max: f64,
}

/// Every stamp of a run (`--gpu-timeline-out`): GPU (start, end) in ns of each batch's fill
/// and of each consumer's verify, by sequence number from `first_seq`.
#[derive(serde::Serialize)]
pub struct TimelineStamps {
    /// The sequence number of the first entry.
    pub first_seq: u64,
    /// The fills.
    pub fills: Vec<[u64; 2]>,
    /// Each consumer's verifies.
    pub verifies: Vec<Vec<[u64; 2]>>,
}

impl TimelineStamps {
    /// Writes the stamps as one line of JSON, keys in alphabetical order.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let json = serde_json::to_value(self).map_err(std::io::Error::other)?;
        std::fs::write(path, json.to_string())
    }
}

/// What the GPU did over the stamped batches, from the (start, end) GPU times (ns) of each
/// batch's fill and of each consumer's verify (zeros: not stamped; such batches are left
/// out): the span, how much of it some kernel ran (`busy`) and two ran at once (`overlap`),
/// the idle gaps between kernels, each kernel's duration, and the handover: how long after
/// its fill ended a batch's verify started.
pub fn summary(fills: &[[u64; 2]], verifies: &[Vec<[u64; 2]>]) -> TimelineSummary {
    let ok = |t: &[u64; 2]| t[0] > 0 && t[1] >= t[0];
    let complete: Vec<usize> = (0..fills.len())
        .filter(|&i| ok(&fills[i]) && verifies.iter().all(|v| v.get(i).is_some_and(ok)))
        .collect();
    if complete.is_empty() {
        return TimelineSummary::default();
    }
    let mut spans: Vec<[u64; 2]> = Vec::new();
    let (mut fill_us, mut verify_us, mut handover_us) = (Vec::new(), Vec::new(), Vec::new());
    for &i in &complete {
        let f = fills[i];
        spans.push(f);
        fill_us.push((f[1] - f[0]) as f64 / 1e3);
        for v in verifies {
            let v = v[i];
            spans.push(v);
            verify_us.push((v[1] - v[0]) as f64 / 1e3);
            handover_us.push((v[0] as f64 - f[1] as f64) / 1e3);
        }
    }
    // Sweep the starts and ends: time with at least one kernel running, with two or more,
    // and the gaps with none.
    let mut events: Vec<(u64, i32)> = spans.iter().flat_map(|s| [(s[0], 1), (s[1], -1)]).collect();
    events.sort_unstable();
    let (t0, t1) = (events[0].0, events[events.len() - 1].0);
    let (mut running, mut last) = (0i32, t0);
    let (mut busy, mut overlap) = (0u64, 0u64);
    let mut gaps_us: Vec<f64> = Vec::new();
    for (t, d) in events {
        let dt = t - last;
        match running {
            0 if dt > 0 => gaps_us.push(dt as f64 / 1e3),
            0 => {}
            1 => busy += dt,
            _ => {
                busy += dt;
                overlap += dt;
            }
        }
        running += d;
        last = t;
    }
    let span = (t1 - t0).max(1) as f64;
    let pct = |xs: &mut Vec<f64>, q: f64| -> f64 {
        if xs.is_empty() {
            return 0.0;
        }
        xs.sort_by(f64::total_cmp);
        xs[((xs.len() - 1) as f64 * q).round() as usize]
    };
    let gap_total: f64 = gaps_us.iter().sum();
    let round = |x: f64| (x * 100.0).round() / 100.0;
    TimelineSummary {
        batches: complete.len(),
        figures: Some(TimelineFigures {
            span_us: round(span / 1e3),
            per_batch_us: round(span / 1e3 / complete.len() as f64),
            busy: round(busy as f64 / span),
            overlap: round(overlap as f64 / span),
            fill_us_p50: round(pct(&mut fill_us, 0.5)),
            verify_us_p50: round(pct(&mut verify_us, 0.5)),
            handover_us_p50: round(pct(&mut handover_us, 0.5)),
            handover_us_p99: round(pct(&mut handover_us, 0.99)),
            idle_gaps: gaps_us.len(),
            idle_gap_us_total: round(gap_total),
            idle_gap_us_p50: round(pct(&mut gaps_us, 0.5)),
            idle_gap_us_max: round(pct(&mut gaps_us, 1.0)),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::{TimelineStamps, summary};

    #[test]
    fn the_gpu_timeline_gives_busy_overlap_gaps_and_handover() {
        let us = |a: u64, b: u64| [a * 1000, b * 1000];
        // Batch 0: fill 100-200, verify 250-350; batch 1: fill 300-400, verify 450-500;
        // batch 2 was not stamped on the consumer and is left out.
        let fills = [us(100, 200), us(300, 400), us(600, 700)];
        let verifies = vec![vec![us(250, 350), us(450, 500), [0, 0]]];
        let t = summary(&fills, &verifies);
        assert_eq!(t.batches, 2);
        let f = t.figures.clone().expect("figures");
        assert_eq!(f.span_us, 400.0);
        assert_eq!(f.per_batch_us, 200.0);
        assert_eq!(f.busy, 0.75, "{t:?}"); // 300 of 400 µs
        assert_eq!(f.overlap, 0.13, "{t:?}"); // 300-350: fill 1 and verify 0
        assert_eq!(f.idle_gaps, 2, "{t:?}");
        assert_eq!(f.idle_gap_us_total, 100.0, "{t:?}");
        assert_eq!(f.idle_gap_us_max, 50.0, "{t:?}");
        assert_eq!(f.handover_us_p50, 50.0, "{t:?}");
        assert_eq!(f.fill_us_p50, 100.0, "{t:?}");
        // In the JSON, the figures sit beside the batch count.
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(v["batches"], 2);
        assert_eq!(v["idle_gap_us_max"], 50.0);
        // Nothing stamped: nothing to say but that.
        let none = summary(&[[0, 0]], &[vec![[0, 0]]]);
        assert_eq!(
            serde_json::to_value(&none).unwrap(),
            serde_json::json!({ "batches": 0 })
        );
    }

    #[test]
    fn the_stamps_file_is_one_line_of_json_with_its_keys_sorted() {
        let path = std::env::temp_dir().join(format!("gpipe-stamps-{}.json", std::process::id()));
        let stamps = TimelineStamps {
            first_seq: 100,
            fills: vec![[1, 2]],
            verifies: vec![vec![[3, 4]]],
        };
        stamps.write(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            text,
            r#"{"fills":[[1,2]],"first_seq":100,"verifies":[[[3,4]]]}"#
        );
    }
}
