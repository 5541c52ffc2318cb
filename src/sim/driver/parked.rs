//! The twin's parked gate attempts, shared by the drivers that run a gate core (`gate_modes`,
//! `sched_modes`): each parked attempt waits for its `Wait { until }` deadline or for the
//! core's epoch to move, as the tokio driver's and the engine book's waiters do.
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use super::events::Time;
use super::mode::SessionIx;

/// Parked attempts by attempt id, and a heap of their deadlines.
#[derive(Debug, Default)]
pub(crate) struct ParkedAttempts {
    /// Attempt id → (session, until); `until` is NaN once its deadline fired.
    parked: BTreeMap<u64, (SessionIx, f64)>,
    /// (until, attempt id); an entry is stale once its attempt moved on or got a new `until`.
    timers: BinaryHeap<Reverse<(Time, u64)>>,
}

impl ParkedAttempts {
    /// Parks attempt `id` of session `s` until `until`.
    pub(crate) fn park(&mut self, id: u64, s: SessionIx, until: f64) {
        let old = self.parked.insert(id, (s, until));
        // A spurious wake-up answers the same deadline: keep the timer we have.
        if old.is_none_or(|(_, t)| t != until) {
            self.timers.push(Reverse((Time(until), id)));
        }
    }

    /// Attempt `id` is no longer parked (admitted, or off to a probe); its timer goes stale.
    pub(crate) fn remove(&mut self, id: u64) {
        self.parked.remove(&id);
    }

    pub(crate) fn contains(&self, id: u64) -> bool {
        self.parked.contains_key(&id)
    }

    /// Every parked (attempt, session), in attempt order: what an epoch move wakes (a copy, as
    /// driving an attempt parks or removes it).
    pub(crate) fn snapshot(&self) -> Vec<(u64, SessionIx)> {
        self.parked.iter().map(|(&id, &(s, _))| (id, s)).collect()
    }

    /// The earliest live deadline (stale timers are dropped on the way).
    pub(crate) fn next_deadline(&mut self) -> Option<f64> {
        while let Some(&Reverse((Time(until), id))) = self.timers.peek() {
            if self.parked.get(&id).is_some_and(|&(_, t)| t == until) {
                return Some(until);
            }
            self.timers.pop();
        }
        None
    }

    /// The session of the next attempt whose deadline is due at `now`, its deadline forgotten
    /// (so whatever `Wait` its poll answers gets a timer); `None` when none is due.
    pub(crate) fn pop_due(&mut self, now: f64) -> Option<SessionIx> {
        while let Some(&Reverse((Time(until), id))) = self.timers.peek() {
            if until > now {
                return None;
            }
            self.timers.pop();
            if let Some(&(s, t)) = self.parked.get(&id)
                && t == until
            {
                self.parked.insert(id, (s, f64::NAN));
                return Some(s);
            }
        }
        None
    }

    pub(crate) fn clear(&mut self) {
        self.parked.clear();
        self.timers.clear();
    }
}
