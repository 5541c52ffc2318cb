//! Modes `seed` and `gate`: the real [`GateCore`] driven in virtual time, call for call as the
//! tokio driver (`crate::gate::driver`) drives it.
//!
//! A ready turn `begin`s an attempt and polls it: a usage probe is answered from the replica's
//! `usage()`, a prefix probe from its `probe_prefix()` (what the engine half would answer for
//! the same pool state). The real probes are utility calls into vLLM's engine core, which its
//! busy loop serves between steps: so while the engine is stepping, a probe is answered at the
//! next step boundary (with the next step already scheduled under vLLM's async scheduling, the
//! GPU default; before it is scheduled without it, as on the CPU engine), and one not answered
//! within `probe_timeout_sec` fails as a timeout, as in the
//! production drivers; an idle engine answers at once. `Wait { until }` parks the
//! attempt until `until` or until the core's epoch moves, whichever comes first; after every
//! call that moved the epoch every parked attempt polls again (the tokio driver's
//! `notify_waiters`), in attempt order. A finished turn releases its lease
//! (`retain_session = true`, as the bench's `SessionGate.admit`), and a finished session calls
//! `finish_session`. Grace windows expire inside the core's own calls, as in production.
//!
//! Each session's prefix probes go through its own [`HitMemo`] (the engine probe's identity
//! re-check, `crate::prefix::residency`, in the twin's terms): blocks a previous probe found are
//! re-checked by their witness instead of looked up again; the answers are the same.
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use super::events::Time;
use super::mode::{Ctx, Mode, SessionIx};
use super::parked::ParkedAttempts;
use crate::error::{Error, Result};
use crate::gate::{Action, AttemptId, GateConfig, GateCore, GateStats, LeaseId, ProbeKind};
use crate::sim::kv_manager::HitMemo;

/// The gate core and the driver state around it.
#[derive(Debug)]
pub(crate) struct GateMode {
    core: GateCore,
    /// Per session: its attempt not yet admitted.
    attempts: Vec<Option<AttemptId>>,
    /// Per session: its lease while its turn is in flight.
    leases: Vec<Option<LeaseId>>,
    /// Per session: the hit chain its last prefix probe found.
    probe_memos: Vec<HitMemo>,
    parked: ParkedAttempts,
    seen_epoch: u64,
    /// Probes waiting for the next step boundary, by attempt id: (session, kind, asked at).
    pending: BTreeMap<u64, (SessionIx, ProbeKind, f64)>,
    /// (timeout deadline, attempt id) of pending probes; stale once the probe was answered.
    deadlines: BinaryHeap<Reverse<(Time, u64)>>,
    probe_timeout: f64,
}

impl GateMode {
    pub(crate) fn new(config: GateConfig, sessions: usize) -> Result<Self> {
        let probe_timeout = config.probe_timeout_sec;
        let core = GateCore::new(config)?;
        let seen_epoch = core.epoch();
        Ok(Self {
            core,
            attempts: vec![None; sessions],
            leases: vec![None; sessions],
            probe_memos: vec![HitMemo::default(); sessions],
            parked: ParkedAttempts::default(),
            seen_epoch,
            pending: BTreeMap::new(),
            deadlines: BinaryHeap::new(),
            probe_timeout,
        })
    }

    /// Polls session `s`'s attempt and carries out its actions until it is admitted or parked.
    fn drive(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        let id = self.attempts[s].ok_or_else(|| internal(s, "no attempt to drive"))?;
        let now = ctx.now();
        loop {
            let kind = match self.core.poll(id, now)? {
                Action::ProbeUsage => Some(ProbeKind::Usage),
                Action::ProbePrefix => Some(ProbeKind::Prefix),
                Action::Wait { until } => {
                    self.parked.park(id.0, s, until);
                    return Ok(());
                }
                Action::Admit(admission) => {
                    self.parked.remove(id.0);
                    self.attempts[s] = None;
                    self.leases[s] = Some(admission.lease);
                    ctx.admit(s, admission.reason.as_str());
                    return Ok(());
                }
                // One attempt per session at a time: nothing can preempt it.
                _ => return Err(internal(s, "attempt preempted")),
            };
            let kind = kind.expect("a probe");
            if ctx.engine_busy() {
                self.parked.remove(id.0);
                self.pending.insert(id.0, (s, kind, now));
                let deadline = now + self.probe_timeout;
                self.deadlines.push(Reverse((Time(deadline), id.0)));
                return Ok(());
            }
            self.answer(ctx, id, s, kind, 0.0)?;
        }
    }

    /// Answers a probe from the replica's state now (`latency` seconds after it was asked).
    fn answer(
        &mut self,
        ctx: &mut Ctx<'_>,
        id: AttemptId,
        s: SessionIx,
        kind: ProbeKind,
        latency: f64,
    ) -> Result<()> {
        let now = ctx.now();
        self.core.record_probe(kind, latency, true);
        match kind {
            ProbeKind::Usage => self.core.on_usage(id, Ok(ctx.replica().usage()), now),
            _ => {
                let turn = ctx.turn(s);
                let report = ctx.replica().probe_prefix_memo(
                    s as u64,
                    turn.prompt_hashes,
                    turn.prompt_tokens,
                    &mut self.probe_memos[s],
                );
                self.core.on_prefix(id, Ok(report), now)
            }
        }
    }

    /// Whether attempt `id` still waits for the probe whose timeout is `deadline`.
    fn is_pending(&self, id: u64, deadline: f64) -> bool {
        self.pending
            .get(&id)
            .is_some_and(|&(_, _, asked)| asked + self.probe_timeout == deadline)
    }

    /// Fails the pending probes whose timeout passed by `now`, as the production drivers do.
    fn time_out(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        let now = ctx.now();
        while let Some(&Reverse((Time(deadline), id))) = self.deadlines.peek() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            if !self.is_pending(id, deadline) {
                continue; // answered in time
            }
            let (s, kind, _) = self.pending.remove(&id).expect("pending");
            let attempt = AttemptId(id);
            self.core.record_probe(kind, self.probe_timeout, false);
            let err = "probe timed out".to_string();
            match kind {
                ProbeKind::Usage => self.core.on_usage(attempt, Err(err), now)?,
                _ => self.core.on_prefix(attempt, Err(err), now)?,
            }
            self.drive(ctx, s)?;
        }
        Ok(())
    }

    /// Wakes every parked attempt while the epoch keeps moving (`notify_waiters`).
    fn settle(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        while self.core.epoch() != self.seen_epoch {
            self.seen_epoch = self.core.epoch();
            for (id, s) in self.parked.snapshot() {
                if self.parked.contains(id) {
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

    fn withdraw(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<bool> {
        let Some(id) = self.attempts[s].take() else {
            return Ok(false);
        };
        // Its parked slot, probe in flight and queue place go with it (the core's cancel).
        self.parked.remove(id.0);
        self.pending.remove(&id.0);
        self.core.cancel(id, ctx.now());
        let turn = ctx.turn(s);
        self.core.finish_session(turn.session_id, ctx.now());
        self.settle(ctx)?;
        Ok(true)
    }

    fn session_finished(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        let turn = ctx.turn(s);
        self.core.finish_session(turn.session_id, ctx.now());
        ctx.evict_first(s);
        self.settle(ctx)
    }

    fn step_boundary(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let now = ctx.now();
        // Answered in the order they reached the engine (attempt order); what an answer leads
        // to (a prefix probe after a usage answer) waits for the next boundary.
        for (id, (s, kind, asked)) in std::mem::take(&mut self.pending) {
            self.answer(ctx, AttemptId(id), s, kind, now - asked)?;
            self.drive(ctx, s)?;
        }
        self.settle(ctx)
    }

    fn next_wake(&mut self) -> Option<f64> {
        while let Some(&Reverse((Time(deadline), id))) = self.deadlines.peek() {
            if self.is_pending(id, deadline) {
                break;
            }
            self.deadlines.pop();
        }
        let probe = self.deadlines.peek().map(|&Reverse((Time(t), _))| t);
        match self.parked.next_deadline() {
            Some(until) => Some(probe.map_or(until, |p| p.min(until))),
            None => probe,
        }
    }

    fn wake(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        self.time_out(ctx)?;
        let now = ctx.now();
        while let Some(s) = self.parked.pop_due(now) {
            self.drive(ctx, s)?;
        }
        self.settle(ctx)
    }

    fn gate_stats(&self) -> Option<GateStats> {
        Some(self.core.stats())
    }

    /// One gate object across RL steps: the core (and what it learned) stays, the per-run
    /// driver state starts over. The previous run ended with every session finished, so the
    /// core holds no attempt, lease or reservation.
    fn next_step(&mut self, sessions: usize) -> bool {
        self.attempts = vec![None; sessions];
        self.leases = vec![None; sessions];
        self.probe_memos = vec![HitMemo::default(); sessions];
        self.parked.clear();
        self.pending.clear();
        self.deadlines.clear();
        self.seen_epoch = self.core.epoch();
        true
    }
}
