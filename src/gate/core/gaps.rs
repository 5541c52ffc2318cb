//! Return gaps: how long sessions stay away between turns (a release that left a reservation
//! idle, to the session's next `begin`). Their recent 90th percentile tells when an idle
//! session is more likely gone than busy in a tool call — what a client that never calls
//! `finish_session` (a plain HTTP client behind the middleware) cannot say itself.
//!
//! Sessions whose idle room was taken from them (it yielded, or its grace window ended) are
//! remembered too, by id, so their gap still counts when they come back: otherwise only gaps
//! short enough to keep a room would be seen, and the percentile could only drift down.
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

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
    /// Sessions that lost their idle room: id → when they went idle; at most [`KEEP`], the
    /// oldest forgotten first (`departed_order`, which may hold ids already returned).
    departed: HashMap<Arc<str>, f64>,
    departed_order: VecDeque<Arc<str>>,
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

    /// `id` lost its idle room; it has been away since `idle_since`.
    pub(crate) fn departed(&mut self, id: &Arc<str>, idle_since: f64) {
        self.departed.insert(id.clone(), idle_since);
        self.departed_order.push_back(id.clone());
        while self.departed.len() > KEEP || self.departed_order.len() > 2 * KEEP {
            let Some(old) = self.departed_order.pop_front() else {
                break;
            };
            // An id that returned (or departed again since) is no longer this entry's.
            if !self.departed_order.contains(&old) {
                self.departed.remove(&old);
            }
        }
    }

    /// `id` is back without a room: records its gap if it was remembered as departed.
    pub(crate) fn returned(&mut self, id: &str, now: f64) {
        // Every new session's `begin` asks: with nobody departed, skip hashing its id.
        if self.departed.is_empty() {
            return;
        }
        if let Some(since) = self.departed.remove(id) {
            self.record(now - since);
        }
    }

    /// The 90th percentile of the recent gaps; `None` until [`MIN_GAPS`] were seen.
    pub(crate) fn p90(&self) -> Option<f64> {
        self.p90
    }

    /// Heap bytes, approximately.
    pub(crate) fn approx_bytes(&self) -> usize {
        let ids: usize = self
            .departed
            .keys()
            .map(|k| (k.len() + 16).div_ceil(16) * 16)
            .sum();
        (self.recent.capacity() + self.sorted.capacity()) * size_of::<f64>()
            + self.departed.capacity() * (size_of::<(Arc<str>, f64)>() + 1)
            + self.departed_order.capacity() * size_of::<Arc<str>>()
            + ids
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
    fn a_departed_session_counts_its_gap_when_it_returns() {
        let mut g = ReturnGaps::default();
        let id: Arc<str> = "s".into();
        g.departed(&id, 10.0);
        g.returned("other", 20.0);
        assert!(g.recent.is_empty());
        g.returned("s", 25.0);
        assert_eq!(g.recent.back(), Some(&15.0));
        // Once only.
        g.returned("s", 30.0);
        assert_eq!(g.recent.len(), 1);
    }

    #[test]
    fn departed_sessions_are_bounded() {
        let mut g = ReturnGaps::default();
        for i in 0..3 * KEEP {
            g.departed(&Arc::from(format!("s{i}")), i as f64);
        }
        assert!(g.departed.len() <= KEEP);
        assert!(g.departed_order.len() <= 2 * KEEP);
        // The newest are kept, the oldest forgotten.
        g.returned(&format!("s{}", 3 * KEEP - 1), 1e6);
        g.returned("s0", 1e6);
        assert_eq!(g.recent.len(), 1);
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
