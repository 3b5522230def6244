//! What `--repeat` adds to the bench's report: every repetition's figures and the spread.

use super::format::sorted_keys;

/// The repetitions of a `--repeat` run.
#[derive(Debug, serde::Serialize)]
pub struct Repetitions {
    /// Batches per second over the repetitions.
    pub batches_per_s: Spread,
    /// The ratio to the fair ceiling (CUDA), each repetition against its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to_fair_ceiling: Option<Spread>,
    /// Each repetition's figures, in the order they ran (keys in alphabetical order).
    #[serde(serialize_with = "sorted_keys")]
    pub runs: Vec<RunFigures>,
}

/// One repetition's figures.
#[derive(Debug, serde::Serialize)]
pub struct RunFigures {
    /// Its place in the order they ran, from 1.
    pub repetition: usize,
    /// Batches per second.
    pub batches_per_s: f64,
    /// GB/s handed over.
    pub gb_per_s: f64,
    /// Seconds timed.
    pub elapsed_s: f64,
    /// The ratio to its fair ceiling (CUDA; host: none).
    pub ratio_to_fair_ceiling: Option<f64>,
    /// Its fair ceiling (CUDA; host: none).
    pub fair_ceiling_batches_per_s: Option<f64>,
    /// Its median round trip, with `--round-trip`.
    pub round_trip_p50_us: Option<f64>,
    /// Its problems.
    pub problems: Vec<String>,
}

/// Median, minimum and maximum of a figure over repetitions.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Spread {
    /// The median (of an even count, the mean of the middle two).
    pub median: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Spread {
    /// The spread of `xs` (non-empty; NaNs sort last).
    pub fn of(xs: &[f64]) -> Spread {
        let mut v = xs.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }
}
