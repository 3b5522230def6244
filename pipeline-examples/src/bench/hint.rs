//! The hint a CUDA run gives when MPS is not running: what this run's own figures say, and
//! what MPS did for the same bench on an H100.

use super::format::compact_rate;

/// What MPS did for the same bench elsewhere, with where it comes from: never this run's.
const MPS_ON_AN_H100: &str = "docs/benchmarks.md, on an H100 with 2 MiB batches and 1 \
     consumer: MPS took gpipe bench from 20.2k to 110k batches/s, 0.14x to 0.77x of the \
     ceiling, and a batch's round trip from 288 to 17 µs";

/// The hint a CUDA bench gives when MPS is not running (`None` when it is), from this run's
/// figures where they are usable: its rate against its own one-process ceiling, and with
/// `--round-trip` its median round trip. Much of the share of the ceiling a run misses is
/// the GPU time-slicing between the processes, which MPS avoids.
pub(super) fn mps_hint(
    mps_active: bool,
    batches_per_s: f64,
    ceiling: f64,
    round_trip_p50_us: Option<f64>,
) -> Option<String> {
    if mps_active {
        return None;
    }
    let usable = |x: &f64| x.is_finite() && *x > 0.0;
    let ratio = (usable(&batches_per_s) && usable(&ceiling)).then(|| batches_per_s / ceiling);
    let mut measured = Vec::new();
    if let Some(r) = ratio {
        measured.push(format!(
            "this run reached {r:.2}x of the one-process ceiling measured here ({} vs {} batches/s)",
            compact_rate(batches_per_s),
            compact_rate(ceiling)
        ));
    }
    if let Some(rt) = round_trip_p50_us.filter(usable) {
        measured.push(format!("a batch's round trip took {rt:.0} µs (p50)"));
    }
    let mut hint = String::from("MPS is not running");
    if !measured.is_empty() {
        hint += ": ";
        hint += &measured.join(" and ");
    }
    hint += match ratio {
        Some(r) if r >= 0.9 => {
            "; time-slicing between the processes cost little throughput in this run, but MPS \
             still shortens each hand-off"
        }
        Some(_) => {
            "; the GPU time-slicing between the producer's and the consumers' processes costs \
             much of the rest, and MPS avoids it by running their work side by side"
        }
        None if measured.is_empty() => {
            ", so the GPU time-slices between the producer's and the consumers' processes; MPS \
             avoids that by running their work side by side"
        }
        None => {
            "; the GPU time-slices between the producer's and the consumers' processes, and MPS \
             avoids that by running their work side by side"
        }
    };
    Some(format!(
        "{hint} ({MPS_ON_AN_H100}). Start it with: nvidia-cuda-mps-control -d"
    ))
}

#[cfg(test)]
mod tests {
    use super::mps_hint;

    #[test]
    fn no_hint_when_mps_is_running() {
        assert_eq!(mps_hint(true, 20_138.0, 128_000.0, None), None);
        assert_eq!(mps_hint(true, f64::NAN, 0.0, Some(288.0)), None);
    }

    #[test]
    fn a_run_far_below_its_ceiling_is_told_what_mps_recovers() {
        let hint = mps_hint(false, 20_138.0, 128_000.0, None).unwrap();
        assert!(
            hint.starts_with(
                "MPS is not running: this run reached 0.16x of the one-process ceiling measured \
                 here (20.1k vs 128k batches/s); the GPU time-slicing between the producer's and \
                 the consumers' processes costs much of the rest, and MPS avoids it"
            ),
            "{hint}"
        );
        // The H100 figures are cited as such, and the fix is named.
        assert!(
            hint.contains(" side by side (docs/benchmarks.md, on an H100 with 2 MiB batches"),
            "{hint}"
        );
        assert!(
            hint.ends_with(". Start it with: nvidia-cuda-mps-control -d"),
            "{hint}"
        );
        assert!(!hint.contains("round trip took"), "{hint}");
    }

    #[test]
    fn the_round_trip_is_quoted_when_measured() {
        let hint = mps_hint(false, 3_412.0, 143_196.0, Some(287.6)).unwrap();
        assert!(
            hint.contains(
                "0.02x of the one-process ceiling measured here (3.41k vs 143k batches/s) and a \
                 batch's round trip took 288 µs (p50); the GPU time-slicing"
            ),
            "{hint}"
        );
    }

    #[test]
    fn a_run_near_its_ceiling_is_not_promised_throughput() {
        let hint = mps_hint(false, 14_100.0, 14_966.0, None).unwrap();
        assert!(
            hint.contains(
                "0.94x of the one-process ceiling measured here (14.1k vs 15.0k batches/s); \
                 time-slicing between the processes cost little throughput in this run, but \
                 MPS still shortens each hand-off"
            ),
            "{hint}"
        );
        assert!(!hint.contains("much of the rest"), "{hint}");
    }

    #[test]
    fn unusable_figures_give_the_hint_without_them() {
        for (rate, ceiling) in [
            (f64::INFINITY, 1e5),
            (0.0, 1e5),
            (1e4, f64::NAN),
            (1e4, 0.0),
        ] {
            let hint = mps_hint(false, rate, ceiling, None).unwrap();
            assert!(
                hint.starts_with(
                    "MPS is not running, so the GPU time-slices between the producer's and the \
                     consumers' processes; MPS avoids that"
                ),
                "{hint}"
            );
            assert!(!hint.contains("this run"), "{hint}");
            assert!(!hint.contains("inf") && !hint.contains("NaN"), "{hint}");
        }
        let hint = mps_hint(false, f64::NAN, 1e5, Some(290.0)).unwrap();
        assert!(
            hint.starts_with(
                "MPS is not running: a batch's round trip took 290 µs (p50); the GPU time-slices"
            ),
            "{hint}"
        );
    }
}
