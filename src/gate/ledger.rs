//! The reservation ledger: committed blocks, reservations in age order, and idle-grace expiries.
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// A time in seconds with a total order, so it can key a `BTreeMap`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TimeKey(pub(crate) f64);

impl PartialEq for TimeKey {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for TimeKey {}
impl PartialOrd for TimeKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TimeKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Bookkeeping over all reservations. The session table owns each reservation's fields; the
/// ledger holds the indexes that need an order (age, expiry) and the running total.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// age → working set in blocks, oldest first.
    by_age: BTreeMap<u64, u64>,
    /// (idle_until, age) → session slot, for reservations in their grace window.
    expiries: BTreeMap<(TimeKey, u64), u32>,
    committed: u64,
    next_age: u64,
}

impl Ledger {
    pub(crate) fn committed(&self) -> u64 {
        self.committed
    }

    pub(crate) fn len(&self) -> usize {
        self.by_age.len()
    }

    pub(crate) fn idle_len(&self) -> usize {
        self.expiries.len()
    }

    /// Registers a new reservation and returns its age (younger = larger).
    pub(crate) fn open(&mut self, ws_blocks: u64) -> u64 {
        let age = self.next_age;
        self.next_age += 1;
        self.by_age.insert(age, ws_blocks);
        self.committed += ws_blocks;
        age
    }

    pub(crate) fn resize(&mut self, age: u64, old_blocks: u64, new_blocks: u64) {
        if let Some(ws) = self.by_age.get_mut(&age) {
            *ws = new_blocks;
            self.committed = self.committed - old_blocks + new_blocks;
        }
    }

    pub(crate) fn close(&mut self, age: u64, idle_until: Option<f64>) {
        if let Some(ws) = self.by_age.remove(&age) {
            self.committed -= ws;
        }
        if let Some(t) = idle_until {
            self.expiries.remove(&(TimeKey(t), age));
        }
    }

    /// Working sets of all reservations older than `age`.
    pub(crate) fn older_than(&self, age: u64) -> u64 {
        self.by_age.range(..age).map(|(_, ws)| ws).sum()
    }

    pub(crate) fn set_idle(&mut self, age: u64, until: f64, slot: u32) {
        self.expiries.insert((TimeKey(until), age), slot);
    }

    pub(crate) fn clear_idle(&mut self, age: u64, until: f64) {
        self.expiries.remove(&(TimeKey(until), age));
    }

    /// Reservations in their grace window, the one idle longest (earliest end) first:
    /// (end of the window, session slot, age, working set in blocks).
    pub(crate) fn idle(&self) -> impl Iterator<Item = (f64, u32, u64, u64)> + '_ {
        self.expiries.iter().map(|(&(t, age), &slot)| {
            let ws = self.by_age.get(&age).copied().unwrap_or(0);
            (t.0, slot, age, ws)
        })
    }

    /// Earliest end of an idle grace window.
    pub(crate) fn next_expiry(&self) -> Option<f64> {
        self.expiries.keys().next().map(|(t, _)| t.0)
    }

    /// Removes and returns one grace window that has ended by `now`: (session slot, age).
    pub(crate) fn pop_expired(&mut self, now: f64) -> Option<(u32, u64)> {
        let (&(t, age), &slot) = self.expiries.iter().next()?;
        if t.0 > now {
            return None;
        }
        self.expiries.remove(&(t, age));
        Some((slot, age))
    }

    /// Heap bytes, approximately (B-tree nodes hold 11 entries and run about 2/3 full).
    pub(crate) fn approx_bytes(&self) -> usize {
        let per_age = (size_of::<u64>() * 2) * 3 / 2 + 8;
        let per_expiry = (size_of::<(TimeKey, u64)>() + size_of::<u32>()) * 3 / 2 + 8;
        self.by_age.len() * per_age + self.expiries.len() * per_expiry
    }
}
