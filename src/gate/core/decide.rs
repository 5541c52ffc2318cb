//! The decision tree (see the [`core`](super) module docs): pure reads of the core's state plus
//! the state changes a decision can make: revoking the asking session's reservation, and idle
//! reservations yielding their room to the head of the queue.
use super::{
    Attempt, GONE_AFTER_GAPS, GateCore, Hit, Step, YIELD_AFTER_TURNS, YIELD_FLOOR_OF_GRACE,
};
use crate::gate::config::Pressure;
use crate::gate::types::Reason;

impl GateCore {
    /// Steps 1–2 of the tree, once this cycle's usage answer is in.
    pub(super) fn decide_on_usage(&mut self, id: u64, now: f64) -> Step {
        let a = &self.attempts[&id];
        let (slot, order, usage, idle) = (a.slot, a.order, a.usage, a.engine_idle);
        let ws = self.blocks(a.ws_tokens);
        let fifo_ok = self.may_open(order);
        let hw = self.cfg.high_watermark;
        match self.cfg.pressure {
            Pressure::Engine => {
                // Unknown usage: assume pressure, the safe side.
                if usage.is_some_and(|u| u < hw) && fifo_ok {
                    return Step::Admit(Reason::Open);
                }
                if self.sessions.get(slot).reservation.is_some() {
                    return Step::Admit(Reason::ReservedSession);
                }
                Step::Prefix
            }
            Pressure::Committed => {
                if fifo_ok && self.tier_holds(slot, ws) {
                    return Step::Admit(Reason::Open);
                }
                let usage = usage.unwrap_or(0.0);
                let committed = self.ledger.committed();
                if let Some(res) = &self.sessions.get(slot).reservation {
                    let (age, old_ws, res_order) = (res.age, res.ws_blocks, res.order);
                    if let (Some(g), Some(ws)) = (self.geometry, ws) {
                        let line = hw * g.num_blocks as f64;
                        let updated = committed - old_ws + ws;
                        // Fast path: the whole committed set fits, so no prefix of it can overflow.
                        let keeps = |freed: u64, older: u64| {
                            (updated - freed) as f64 <= line
                                || older == 0
                                || (older + ws) as f64 <= line
                        };
                        let older = self.ledger.older_than(age);
                        // Idle rooms that may yield go before a live reservation is revoked:
                        // they are more likely gone than the session asking now.
                        let revoke = !keeps(0, older)
                            && !self.yield_idle_until(now, Some((slot, age)), idle, |freed, fo| {
                                keeps(freed, older - fo)
                            });
                        if !revoke {
                            let updated = self.ledger.committed() - old_ws + ws;
                            let calm = usage < hw && updated as f64 <= line;
                            return Step::Admit(if calm && fifo_ok {
                                Reason::Open
                            } else {
                                Reason::ReservedSession
                            });
                        }
                        self.drop_reservation(slot);
                        self.stats.revocations += 1;
                        self.epoch += 1;
                        let epoch = self.epoch;
                        self.keep_place(id, res_order);
                        let a = self.attempt_mut(id);
                        a.revoked = true;
                        // Our own revocation is not news that should restart our cycle.
                        a.usage_epoch = epoch;
                    } else {
                        return Step::Admit(Reason::ReservedSession);
                    }
                }
                let committed = self.ledger.committed();
                let fifo_ok = self.may_open(self.attempts[&id].order);
                if fifo_ok {
                    if committed == 0 {
                        return Step::Admit(Reason::Open);
                    }
                    if let (Some(g), Some(ws)) = (self.geometry, ws) {
                        let line = hw * g.num_blocks as f64;
                        if usage < hw && (committed + ws) as f64 <= line {
                            return Step::Admit(Reason::Open);
                        }
                        if usage < hw && self.yield_idle(ws, line, now, idle) {
                            return Step::Admit(Reason::Open);
                        }
                    }
                }
                Step::Prefix
            }
        }
    }

    /// Whether the engine's host KV tier holds every committed working set with this one's
    /// (`ws` blocks, replacing the session's own reservation): then an evicted prefix reloads
    /// from the tier instead of being recomputed, and holding the turn back costs more than
    /// it saves (module docs, "With a host KV tier").
    fn tier_holds(&self, slot: u32, ws: Option<u64>) -> bool {
        let (Some(g), Some(ws)) = (self.geometry, ws) else {
            return false;
        };
        let Some(tier) = g.tier_blocks else {
            return false;
        };
        let own = self
            .sessions
            .get(slot)
            .reservation
            .as_ref()
            .map_or(0, |r| r.ws_blocks);
        self.ledger.committed() - own + ws <= tier
    }

    /// Yielding idle room (module docs): lets a working set of `ws` blocks fit under `line`
    /// by dropping idle reservations that may yield. Returns whether it fits.
    fn yield_idle(&mut self, ws: u64, line: f64, now: f64, engine_idle: bool) -> bool {
        let committed = self.ledger.committed();
        self.yield_idle_until(now, None, engine_idle, |freed, _| {
            (committed - freed + ws) as f64 <= line
        })
    }

    /// Drops idle reservations that may yield by `now`, longest idle first, until
    /// `fits(freed blocks, freed blocks older than the asking reservation)`; if they cannot
    /// make it fit, nothing is dropped. `asking` (slot, age) is the asking session's own
    /// reservation, never dropped here. Returns whether it fits.
    fn yield_idle_until(
        &mut self,
        now: f64,
        asking: Option<(u32, u64)>,
        engine_idle: bool,
        fits: impl Fn(u64, u64) -> bool,
    ) -> bool {
        let (asking, asking_age) = asking.unwrap_or((u32::MAX, u64::MAX));
        let mut take = Vec::new();
        let (mut freed, mut freed_older) = (0, 0);
        for (until, slot, age, blocks) in self.ledger.idle() {
            if fits(freed, freed_older) {
                break;
            }
            if slot != asking
                && self
                    .may_yield_at(slot, until, engine_idle)
                    .is_some_and(|t| t <= now)
            {
                freed += blocks;
                if age < asking_age {
                    freed_older += blocks;
                }
                // Only the idle engine let it yield this early.
                let early = engine_idle
                    && self
                        .may_yield_at(slot, until, false)
                        .is_some_and(|t| t > now);
                take.push((slot, age, early));
            }
        }
        if take.is_empty() || !fits(freed, freed_older) {
            return false;
        }
        for (slot, age, early) in take {
            let res = self.sessions.get(slot).reservation.as_ref();
            if res.map(|r| r.age) == Some(age) {
                if let Some(until) = res.and_then(|r| r.idle_until) {
                    self.note_departed(slot, until);
                }
                self.drop_reservation(slot);
                self.sessions.gc(slot);
                self.stats.revocations += 1;
                if early {
                    self.stats.idle_engine_yields += 1;
                }
            }
        }
        self.epoch += 1;
        true
    }

    /// When the idle reservation of `slot`, whose grace window ends at `until`, may yield:
    /// once idle [`YIELD_AFTER_TURNS`] of its session's mean turn times and
    /// [`YIELD_FLOOR_OF_GRACE`] of `idle_grace_sec`, or sooner, [`GONE_AFTER_GAPS`] times the
    /// recent sessions' 90th-percentile return gap; and, while the engine has nothing to do
    /// (`engine_idle`), once idle `idle_engine_turns` of its session's mean turn times (0:
    /// never early). `None` if it has no turn time yet.
    pub(super) fn may_yield_at(&self, slot: u32, until: f64, engine_idle: bool) -> Option<f64> {
        let turn = self
            .sessions
            .get(slot)
            .reservation
            .as_ref()?
            .mean_turn_sec()?;
        let grace = self.cfg.idle_grace_sec;
        let mut after = (YIELD_AFTER_TURNS * turn).max(YIELD_FLOOR_OF_GRACE * grace);
        if let Some(gap) = self.gaps.p90() {
            after = after.min(GONE_AFTER_GAPS * gap);
        }
        let idle_turns = self.cfg.idle_engine_turns;
        if engine_idle && idle_turns > 0 {
            after = after.min(idle_turns as f64 * turn);
        }
        Some(until - grace + after)
    }

    /// The earliest time after `now` at which an idle reservation may yield, if any
    /// (`engine_idle` as in [`Self::may_yield_at`]).
    pub(super) fn next_yield(&self, now: f64, engine_idle: bool) -> Option<f64> {
        self.ledger
            .idle()
            .filter_map(|(until, slot, _, _)| self.may_yield_at(slot, until, engine_idle))
            .filter(|&t| t > now)
            .min_by(f64::total_cmp)
    }

    /// Steps 3–4, once the prefix answer is in.
    pub(super) fn decide_on_prefix(&mut self, id: u64, now: f64) -> Step {
        let a = &self.attempts[&id];
        let threshold = self.cfg.hit_threshold;
        match a.hit {
            // Committed mode counts blocks itself: no answer is a miss (module docs, "A probe
            // that does not answer").
            Hit::Unavailable if self.cfg.pressure == Pressure::Engine => {
                return Step::Admit(Reason::PrefixProbeUnavailable);
            }
            Hit::Ratio(h, _) if h >= threshold && self.fits_whole_cache(a) => {
                return Step::Admit(Reason::ResidentPrefix);
            }
            Hit::Ratio(_, Some(t)) if t >= threshold && self.fits_whole_cache(a) => {
                return Step::Admit(Reason::OffloadedPrefix);
            }
            _ => {}
        }
        if self.cfg.max_wait_sec.is_some_and(|m| now - a.started >= m) {
            return Step::Admit(Reason::MaxWait);
        }
        if a.usage_epoch != self.epoch && self.may_open(a.order) {
            // Something was released since the usage probe: look again before sleeping.
            return Step::Restart;
        }
        Step::Wait
    }

    /// Committed mode only: the working set still fits in the whole cache next to everything
    /// committed (`resident_prefix` may go past the watermark, never past the cache).
    pub(super) fn fits_whole_cache(&self, a: &Attempt) -> bool {
        match (self.cfg.pressure, self.geometry, self.blocks(a.ws_tokens)) {
            (Pressure::Committed, Some(g), Some(ws)) => {
                self.ledger.committed() + ws <= g.num_blocks
            }
            _ => true,
        }
    }

    /// A revoked session keeps its place in line: the attempt takes the FIFO key of the one
    /// that obtained the lost reservation (earlier, hence smaller) and waits ahead of sessions
    /// that arrived after it. Its prefix is still resident, so it should be first to use the
    /// room that frees up, before cold waiters whose prefixes are gone anyway.
    pub(super) fn keep_place(&mut self, id: u64, order: u64) {
        let a = self.attempts.get_mut(&id).expect("live attempt");
        if order >= a.order {
            return;
        }
        let old = a.order;
        a.order = order;
        if a.queued {
            self.queue.remove(&old);
            self.queue.insert(order, id);
        }
    }

    /// No queued attempt is ahead of this order key.
    pub(super) fn may_open(&self, order: u64) -> bool {
        self.queue.range(..order).next().is_none()
    }

    /// Working set in blocks, once a usage report has told the block size.
    pub(super) fn blocks(&self, tokens: u64) -> Option<u64> {
        self.geometry.map(|g| tokens.div_ceil(g.block_size))
    }
}
