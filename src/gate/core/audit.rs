//! Self-checks and size accounting of [`GateCore`]: they walk every table, so they live apart
//! from the hot path.
use std::collections::HashMap;

use super::{Attempt, GateCore, LeaseRec};

impl GateCore {
    /// Approximate heap bytes held by the core's tables (sessions, reservations, attempts,
    /// leases, queue). The benchmark also measures it with a counting allocator.
    pub fn approx_bytes(&self) -> usize {
        let map = |cap: usize, entry: usize| cap * (entry + 1);
        size_of::<Self>()
            + self.sessions.approx_bytes()
            + self.ledger.approx_bytes()
            + self.gaps.approx_bytes()
            + map(self.attempts.capacity(), size_of::<(u64, Attempt)>())
            + map(self.leases.capacity(), size_of::<(u64, LeaseRec)>())
            + self.queue.len() * (size_of::<(u64, u64)>() * 3 / 2 + 8)
    }

    /// Checks the core's internal bookkeeping against itself; `Err` describes the first
    /// inconsistency. For tests and debugging: it walks every table.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut committed = 0;
        let mut reservations = 0;
        let mut idle = 0;
        let mut attempts_per_slot: HashMap<u32, u32> = HashMap::new();
        let mut leases_per_slot: HashMap<u32, u32> = HashMap::new();
        for a in self.attempts.values() {
            *attempts_per_slot.entry(a.slot).or_default() += 1;
        }
        for l in self.leases.values() {
            *leases_per_slot.entry(l.slot).or_default() += 1;
        }
        for (slot, s) in self.sessions.iter() {
            if let Some(r) = &s.reservation {
                committed += r.ws_blocks;
                reservations += 1;
                idle += usize::from(r.idle_until.is_some());
                if (r.holders == 0) != r.idle_until.is_some() {
                    return Err(format!("session {}: holders/idle mismatch", s.id));
                }
            }
            if s.attempts != attempts_per_slot.get(&slot).copied().unwrap_or(0) {
                return Err(format!("session {}: attempt count", s.id));
            }
            if s.leases != leases_per_slot.get(&slot).copied().unwrap_or(0) {
                return Err(format!("session {}: lease count", s.id));
            }
            if s.reservation.is_none() && s.attempts == 0 && s.leases == 0 {
                return Err(format!("session {}: idle but kept", s.id));
            }
        }
        if committed != self.ledger.committed() || reservations != self.ledger.len() {
            return Err("ledger totals differ from the session table".into());
        }
        if idle != self.ledger.idle_len() {
            return Err("idle reservations differ from the expiry index".into());
        }
        for (order, id) in &self.queue {
            match self.attempts.get(id) {
                Some(a) if a.queued && a.order == *order && !a.preempted => {}
                _ => return Err(format!("queue entry {order} → {id} is stale")),
            }
        }
        let live = self.attempts.values().filter(|a| !a.preempted).count() as u64;
        if live != self.pending {
            return Err("pending count".into());
        }
        let s = self.stats();
        if s.attempts != s.admissions_total() + s.preemptions + s.cancellations + s.pending {
            return Err("attempts != admitted + preempted + cancelled + pending".into());
        }
        if s.admissions_total() != s.leases_released + s.leases_dropped_unreleased + s.leases_active
        {
            return Err("leases issued != released + dropped + active".into());
        }
        Ok(())
    }
}
