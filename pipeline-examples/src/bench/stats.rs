//! `--repeat`: the repetition with the median rate stands for the run, with the spread over
//! the repetitions and each one's figures beside it.

use super::repetitions::{Repetitions, RunFigures, Spread};
use super::report::BenchReport;

/// Folds the reports of `--repeat` runs into one: the repetition with the median rate, every
/// problem of every repetition, and the spread.
pub fn fold_repetitions(mut reports: Vec<BenchReport>) -> BenchReport {
    if reports.len() == 1 {
        return reports.remove(0);
    }
    let rates: Vec<f64> = reports.iter().map(|r| r.batches_per_s).collect();
    let fair: Vec<f64> = reports
        .iter()
        .filter_map(|r| r.cuda.as_ref().map(|c| c.ratio_to_fair_ceiling))
        .filter(|x| x.is_finite())
        .collect();
    let runs = reports
        .iter()
        .enumerate()
        .map(|(i, r)| RunFigures {
            repetition: i + 1,
            batches_per_s: r.batches_per_s,
            gb_per_s: r.gb_per_s,
            elapsed_s: r.elapsed_s,
            ratio_to_fair_ceiling: r.cuda.as_ref().map(|c| c.ratio_to_fair_ceiling),
            fair_ceiling_batches_per_s: r.cuda.as_ref().map(|c| c.fair_ceiling_batches_per_s),
            round_trip_p50_us: r.round_trip_p50_us,
            problems: r.problems.clone(),
        })
        .collect();
    let mut order: Vec<usize> = (0..reports.len()).collect();
    order.sort_by(|&a, &b| rates[a].total_cmp(&rates[b]));
    let mid = order[(order.len() - 1) / 2];
    let problems: Vec<String> = reports
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.problems
                .iter()
                .map(move |p| format!("repetition {}: {p}", i + 1))
        })
        .collect();
    let mut report = reports.swap_remove(mid);
    report.problems = problems;
    report.repetitions = Some(Repetitions {
        batches_per_s: Spread::of(&rates),
        ratio_to_fair_ceiling: (fair.len() == rates.len()).then(|| Spread::of(&fair)),
        runs,
    });
    report
}

#[cfg(test)]
mod tests {
    use super::{Spread, fold_repetitions};
    use crate::bench::cuda_figures::CudaFigures;
    use crate::bench::report::tests::report;

    #[test]
    fn repetitions_fold_into_the_median_one_with_every_problem() {
        let mk = |rate: f64, fair: f64, problem: Option<&str>| {
            let mut r = report(Some(CudaFigures {
                ratio_to_fair_ceiling: fair,
                ..CudaFigures::default()
            }));
            r.batches_per_s = rate;
            r.problems = problem.map(|p| vec![p.to_string()]).unwrap_or_default();
            r
        };
        let folded = fold_repetitions(vec![
            mk(300.0, 0.9, None),
            mk(100.0, 0.3, Some("lost 1")),
            mk(200.0, 0.6, None),
        ]);
        assert_eq!(folded.batches_per_s, 200.0);
        assert_eq!(folded.problems, ["repetition 2: lost 1"]);
        let rep = folded.repetitions.as_ref().unwrap();
        assert_eq!(
            (
                rep.batches_per_s.median,
                rep.batches_per_s.min,
                rep.batches_per_s.max
            ),
            (200.0, 100.0, 300.0)
        );
        assert_eq!(rep.ratio_to_fair_ceiling.unwrap().median, 0.6);
        assert_eq!(rep.runs.len(), 3);
        assert_eq!(rep.runs[1].batches_per_s, 100.0);
        assert_eq!(rep.runs[1].ratio_to_fair_ceiling, Some(0.3));
        assert!(
            folded
                .to_string()
                .contains("3 repetitions: 200 batches/s median (100..300)")
        );
        // An even count takes the mean of the middle two as the median figure.
        assert_eq!(Spread::of(&[4.0, 1.0, 3.0, 2.0]).median, 2.5);
        // One repetition is the report itself.
        let one = fold_repetitions(vec![mk(5.0, 0.5, None)]);
        assert!(one.repetitions.is_none());
    }

    #[test]
    fn each_repetitions_figures_keep_their_keys_in_alphabetical_order() {
        let folded = fold_repetitions(vec![report(None), report(None)]);
        let json = serde_json::to_string(&folded.repetitions).unwrap();
        let keys = [
            "batches_per_s",
            "elapsed_s",
            "fair_ceiling_batches_per_s",
            "gb_per_s",
            "problems",
            "ratio_to_fair_ceiling",
            "repetition",
            "round_trip_p50_us",
        ];
        let runs = &json[json.find("\"runs\"").unwrap()..];
        let at: Vec<usize> = keys
            .iter()
            .map(|k| runs.find(&format!("\"{k}\":")).expect(k))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{json}");
        // The host backend has no fair ceiling: null, as it always was.
        assert!(
            runs.contains("\"fair_ceiling_batches_per_s\":null"),
            "{json}"
        );
    }
}
