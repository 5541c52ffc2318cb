//! Modes `seed` and `gate`: the real [`GateCore`] driven in virtual time, call for call as the
//! tokio driver (`crate::gate::driver`) drives it.
//!
//! A ready turn `begin`s an attempt and polls it: a usage probe is answered at once from the
//! replica's `usage()`, a prefix probe from its `probe_prefix()` (what the engine half would
//! answer for the same pool state; probes take no virtual time). `Wait { until }` parks the
//! attempt until `until` or until the core's epoch moves, whichever comes first; after every
//! call that moved the epoch every parked attempt polls again (the tokio driver's
//! `notify_waiters`), in attempt order. A finished turn releases its lease
//! (`retain_session = true`, as the bench's `SessionGate.admit`), and a finished session calls
//! `finish_session`. Grace windows expire inside the core's own calls, as in production.
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use super::events::Time;
use super::mode::{Ctx, Mode, SessionIx};
use crate::error::{Error, Result};
use crate::gate::{Action, AttemptId, GateConfig, GateCore, GateStats, LeaseId, ProbeKind};

/// The gate core and the driver state around it.
#[derive(Debug)]
pub(crate) struct GateMode {
    core: GateCore,
    /// Per session: its attempt not yet admitted.
    attempts: Vec<Option<AttemptId>>,
    /// Per session: its lease while its turn is in flight.
    leases: Vec<Option<LeaseId>>,
    /// Parked attempts by attempt id: (session, until).
    parked: BTreeMap<u64, (SessionIx, f64)>,
    /// (until, attempt id); an entry is stale once its attempt moved on or got a new `until`.
    timers: BinaryHeap<Reverse<(Time, u64)>>,
    seen_epoch: u64,
}

impl GateMode {
    pub(crate) fn new(config: GateConfig, sessions: usize) -> Result<Self> {
        let core = GateCore::new(config)?;
        let seen_epoch = core.epoch();
        Ok(Self {
            core,
            attempts: vec![None; sessions],
            leases: vec![None; sessions],
            parked: BTreeMap::new(),
            timers: BinaryHeap::new(),
            seen_epoch,
        })
    }

    /// Polls session `s`'s attempt and carries out its actions until it is admitted or parked.
    fn drive(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        let id = self.attempts[s].ok_or_else(|| internal(s, "no attempt to drive"))?;
        let now = ctx.now();
        loop {
            match self.core.poll(id, now)? {
                Action::ProbeUsage => {
                    let report = ctx.replica().usage();
                    self.core.record_probe(ProbeKind::Usage, 0.0, true);
                    self.core.on_usage(id, Ok(report), now)?;
                }
                Action::ProbePrefix => {
                    let turn = ctx.turn(s);
                    let report = ctx
                        .replica()
                        .probe_prefix(turn.prompt_hashes, turn.prompt_tokens);
                    self.core.record_probe(ProbeKind::Prefix, 0.0, true);
                    self.core.on_prefix(id, Ok(report), now)?;
                }
                Action::Wait { until } => {
                    let old = self.parked.insert(id.0, (s, until));
                    // A spurious wake-up answers the same deadline: keep the timer we have.
                    if old.is_none_or(|(_, t)| t != until) {
                        self.timers.push(Reverse((Time(until), id.0)));
                    }
                    return Ok(());
                }
                Action::Admit(admission) => {
                    self.parked.remove(&id.0);
                    self.attempts[s] = None;
                    self.leases[s] = Some(admission.lease);
                    ctx.admit(s, admission.reason.as_str());
                    return Ok(());
                }
                // One attempt per session at a time: nothing can preempt it.
                _ => return Err(internal(s, "attempt preempted")),
            }
        }
    }

    /// Wakes every parked attempt while the epoch keeps moving (`notify_waiters`).
    fn settle(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        while self.core.epoch() != self.seen_epoch {
            self.seen_epoch = self.core.epoch();
            let parked: Vec<(u64, SessionIx)> =
                self.parked.iter().map(|(&id, &(s, _))| (id, s)).collect();
            for (id, s) in parked {
                if self.parked.contains_key(&id) {
                    self.drive(ctx, s)?;
                }
            }
        }
        Ok(())
    }
}

fn internal(s: SessionIx, what: &str) -> Error {
    Error::InvalidInput(format!("sim gate driver: session #{s}: {what}"))
}

impl Mode for GateMode {
    fn turn_ready(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        let turn = ctx.turn(s);
        let id = self.core.begin(
            turn.session_id,
            turn.prompt_tokens as usize,
            turn.max_tokens as usize,
            true,
            ctx.now(),
        );
        self.attempts[s] = Some(id);
        self.drive(ctx, s)?;
        self.settle(ctx)
    }

    fn turn_finished(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        let lease = self.leases[s]
            .take()
            .ok_or_else(|| internal(s, "turn finished without a lease"))?;
        self.core.release(lease, ctx.now());
        self.settle(ctx)
    }

    fn session_finished(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        let turn = ctx.turn(s);
        self.core.finish_session(turn.session_id, ctx.now());
        self.settle(ctx)
    }

    fn next_wake(&mut self) -> Option<f64> {
        while let Some(&Reverse((Time(until), id))) = self.timers.peek() {
            if self.parked.get(&id).is_some_and(|&(_, t)| t == until) {
                return Some(until);
            }
            self.timers.pop();
        }
        None
    }

    fn wake(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        let now = ctx.now();
        while let Some(&Reverse((Time(until), id))) = self.timers.peek() {
            if until > now {
                break;
            }
            self.timers.pop();
            if let Some(&(s, t)) = self.parked.get(&id)
                && t == until
            {
                // Forget the fired deadline, so whatever `Wait` the poll answers gets a timer.
                self.parked.insert(id, (s, f64::NAN));
                self.drive(ctx, s)?;
            }
        }
        self.settle(ctx)
    }

    fn gate_stats(&self) -> Option<GateStats> {
        Some(self.core.stats())
    }
}
