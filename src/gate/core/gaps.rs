//! Return gaps: how long sessions stay away between turns (a release that left a reservation
//! idle, to the session's next `begin`). Their recent 90th percentile tells when an idle
//! session is more likely gone than busy in a tool call — what a client that never calls
//! `finish_session` (a plain HTTP client behind the middleware) cannot say itself.
use std::collections::VecDeque;

/// Gaps remembered: the recent past, so a change of workload shows within a few hundred turns.
const KEEP: usize = 256;
/// Gaps needed before the percentile is trusted.
const MIN_GAPS: usize = 8;

/// The recent return gaps and their 90th percentile, recomputed on each record (once per
/// returning turn) so reads in the decision loop are O(1).
#[derive(Debug, Default)]
pub(crate) struct ReturnGaps {
    recent: VecDeque<f64>,
    p90: Option<f64>,
    /// Scratch for the percentile, kept to avoid an allocation per record.
    sorted: Vec<f64>,
}

impl ReturnGaps {
    pub(crate) fn record(&mut self, gap_sec: f64) {
        if !gap_sec.is_finite() || gap_sec < 0.0 {
            return;
        }
        if self.recent.len() == KEEP {
            self.recent.pop_front();
        }
        self.recent.push_back(gap_sec);
        if self.recent.len() < MIN_GAPS {
            return;
        }
        self.sorted.clear();
        self.sorted.extend(self.recent.iter().copied());
        self.sorted.sort_unstable_by(f64::total_cmp);
        // Nearest rank: the smallest gap that at least 90% of the recent gaps do not exceed.
        let rank = (self.sorted.len() * 9).div_ceil(10);
        self.p90 = Some(self.sorted[rank - 1]);
    }

    /// The 90th percentile of the recent gaps; `None` until [`MIN_GAPS`] were seen.
    pub(crate) fn p90(&self) -> Option<f64> {
        self.p90
    }

    /// Heap bytes, approximately.
    pub(crate) fn approx_bytes(&self) -> usize {
        (self.recent.capacity() + self.sorted.capacity()) * size_of::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p90_waits_for_enough_gaps_then_follows_the_recent_ones() {
        let mut g = ReturnGaps::default();
        for _ in 0..MIN_GAPS - 1 {
            g.record(1.0);
        }
        assert_eq!(g.p90(), None);
        g.record(1.0);
        assert_eq!(g.p90(), Some(1.0));
        // One long gap in ten is the 90th percentile's edge; two in ten move it.
        let mut g = ReturnGaps::default();
        for i in 0..20 {
            g.record(if i % 10 == 0 { 50.0 } else { 2.0 });
        }
        assert_eq!(g.p90(), Some(2.0));
        g.record(50.0);
        assert_eq!(g.p90(), Some(50.0));
        // Old gaps leave the window.
        for _ in 0..KEEP {
            g.record(3.0);
        }
        assert_eq!(g.p90(), Some(3.0));
    }

    #[test]
    fn bad_gaps_are_ignored() {
        let mut g = ReturnGaps::default();
        for x in [f64::NAN, -1.0, f64::INFINITY] {
            g.record(x);
        }
        assert!(g.recent.is_empty());
    }
}
