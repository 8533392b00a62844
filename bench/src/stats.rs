//! Summaries of repeated measurements.
use serde::Serialize;

/// Median, extremes and every sample, in the order measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub samples: Vec<f64>,
}

impl Summary {
    /// `None` for no samples (a benchmark that measured nothing has nothing
    /// to report).
    pub fn of(samples: &[f64]) -> Option<Summary> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Summary {
            median: median_sorted(&sorted),
            min: sorted[0],
            max: sorted[sorted.len() - 1],
            samples: samples.to_vec(),
        })
    }

    /// (max - min) / median, in percent: how far apart the runs were.
    pub fn spread_percent(&self) -> f64 {
        percent(self.max - self.min, self.median)
    }
}

/// Median of the samples (the mean of the middle two for an even count);
/// `None` when empty.
pub fn median(samples: &[f64]) -> Option<f64> {
    Summary::of(samples).map(|s| s.median)
}

fn median_sorted(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// A distribution-free 95% confidence interval of the median (by order
/// statistics: the ranks n/2 − 1.96·√n/2 and 1 + n/2 + 1.96·√n/2, rounded), `None` below 6 samples, where
/// it would be no narrower than the samples' own range.
pub fn median_ci95(samples: &[f64]) -> Option<(f64, f64)> {
    let n = samples.len();
    if n < 6 {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let half = 1.96 * (n as f64).sqrt() / 2.0;
    // 1-based ranks, clamped to the samples.
    let lo = ((n as f64 / 2.0 - half).round() as usize).max(1);
    let hi = ((1.0 + n as f64 / 2.0 + half).round() as usize).min(n);
    Some((sorted[lo - 1], sorted[hi - 1]))
}

/// `part / whole` in percent (0 when `whole` is 0).
pub fn percent(part: f64, whole: f64) -> f64 {
    if whole == 0.0 {
        0.0
    } else {
        part / whole * 100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_and_even_medians() {
        let s = Summary::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(
            s.samples,
            vec![3.0, 1.0, 2.0],
            "samples keep the measured order"
        );
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn the_median_interval_narrows_with_more_samples() {
        assert_eq!(median_ci95(&[1.0, 2.0, 3.0, 4.0, 5.0]), None);
        // 10 samples: ranks 2 and 9.
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(median_ci95(&ten), Some((2.0, 9.0)));
        // 40 samples: ranks 14 and 27, whatever the order given.
        let forty: Vec<f64> = (1..=40).rev().map(f64::from).collect();
        assert_eq!(median_ci95(&forty), Some((14.0, 27.0)));
    }

    #[test]
    fn spread_is_relative_to_the_median() {
        let s = Summary::of(&[9.0, 10.0, 11.0]).unwrap();
        assert!((s.spread_percent() - 20.0).abs() < 1e-9);
        assert_eq!(percent(1.0, 0.0), 0.0);
    }
}
