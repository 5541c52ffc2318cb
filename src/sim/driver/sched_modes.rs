//! Modes `sched` and `sched-infer`: the engine gate's scheduler mode
//! (`python/session_gate/engine/gate_scheduler.py`) in virtual time. Clients send every turn
//! straight to the replica; the replica's scheduler asks this mode about each waiting request
//! when its waiting pass reaches it ([`SchedulerHook`], the twin's
//! `_handle_blocked_waiting_request`), and the real [`GateCore`] decides, with the same knobs and
//! reasons as mode `gate`.
//!
//! - First look at a request: `begin` an attempt (`retain_session = true`, as the production
//!   scheduler's admit) and poll it. The engine gate lives in the engine core, so its probes
//!   are answered in-process at once, from the KV state as the step has left it so far. Admitted:
//!   scheduled in this very step. Otherwise the request is *held*: skipped, left in place in the
//!   waiting queue; the requests behind it may still be scheduled.
//! - A held attempt is polled again when the core's epoch moves (a release, another admission:
//!   the engine book's `settle`) and at its `Wait { until }` (the engine driver's timer tick);
//!   once admitted, the scheduler takes it in the next step it starts. The tick runs after an
//!   engine step (vLLM keeps stepping while requests are held), so a `Wait` whose deadline is
//!   already due (`until <= now`: the core's head waiting on a grace end or a yield that is due
//!   but did not let it in) is polled again one fixed step cost later, not at the same instant.
//! - The lease is released when the replica finishes the request. The scheduler sees requests,
//!   not sessions: in `sched` each client ends its session with a finish call after its last
//!   turn (vllm-router's `POST /finish_session?session_id=`, which prime-rl and SkyRL already
//!   send, served by the plugin as the engine gate's `finish`). In `sched-nofinish` (ids only)
//!   and `sched-infer` nobody does, and a session's last room is left to the core's own idle
//!   rules (it yields once idle twice the usual return gap), as in production.
//! - `max_wait_sec` bounds every hold: [`SCHED_MAX_WAIT_SEC`] unless the config sets one.
//!
//! `sched-infer` keys the gate by the session [`SessionInference`] infers from the request's
//! prompt hashes (arrive at the first look, finish when the request finishes, with the request's
//! whole chain of prompt + answer blocks), not by the true session id, and counts how the
//! inferred sessions compare with the true ones ([`InferStats`]).
use std::sync::Arc;

use super::mode::{Ctx, Mode, SchedulerHook, SessionIx};
use super::parked::ParkedAttempts;
use crate::error::{Error, Result};
use crate::gate::infer::{InferCounts, Inferred, SessionInference};
use crate::gate::{Action, AttemptId, GateConfig, GateCore, GateStats, LeaseId, ProbeKind};
use crate::sim::kv_manager::HitMemo;
use crate::sim::replica::Probes;
use crate::sim::{BlockHash, SimRequest};

/// `max_wait_sec` in the scheduler modes when the config sets none: production's
/// ([`crate::gate::knobs::SCHEDULER_MAX_WAIT_SEC`]), so a held request never starves.
pub const SCHED_MAX_WAIT_SEC: f64 = crate::gate::knobs::SCHEDULER_MAX_WAIT_SEC;

/// How the inferred sessions of `sched-infer` compare with the true ones, per request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct InferStats {
    /// What the inference decided (continued / ambiguous / new, and its own counters).
    pub counts: InferCounts,
    /// Requests inferred.
    pub turns: u64,
    /// First turns of their true session inferred as a new session (right).
    pub first_new: u64,
    /// First turns inferred to continue some session (two true sessions merged).
    pub first_merged: u64,
    /// Later turns inferred to continue their true session's previous turn (right; an
    /// ambiguous pick of the right session included).
    pub continued_true: u64,
    /// Later turns inferred to continue another session.
    pub continued_other: u64,
    /// Later turns inferred as a new session (the session split).
    pub missed: u64,
}

impl InferStats {
    /// Later turns (those that should continue a session).
    pub fn later_turns(&self) -> u64 {
        self.continued_true + self.continued_other + self.missed
    }

    /// Fraction of later turns that continued their true session (1 with no later turn).
    pub fn continued_fraction(&self) -> f64 {
        match self.later_turns() {
            0 => 1.0,
            n => self.continued_true as f64 / n as f64,
        }
    }
}

/// The inference of `sched-infer` and its comparison with the truth.
#[derive(Debug, Default)]
struct Inference {
    inner: SessionInference,
    /// Per true session: the inferred session of its previous turn.
    previous: Vec<Option<u64>>,
    stats: InferStats,
}

impl Inference {
    /// Infers true session `s`'s request from its prompt hashes; returns the gate's key.
    fn arrive(&mut self, s: SessionIx, prompt: &[BlockHash]) -> (u64, String) {
        let inferred = self.inner.arrive(prompt);
        let n = inferred.session();
        let st = &mut self.stats;
        st.turns += 1;
        match (self.previous[s], inferred) {
            (None, Inferred::New(_)) => st.first_new += 1,
            (None, _) => st.first_merged += 1,
            (Some(_), Inferred::New(_)) => st.missed += 1,
            (Some(p), _) if p == n => st.continued_true += 1,
            (Some(_), _) => st.continued_other += 1,
        }
        self.previous[s] = Some(n);
        (n, format!("inferred-{n}"))
    }

    fn stats(&self) -> InferStats {
        InferStats {
            counts: self.inner.counts(),
            ..self.stats
        }
    }
}

/// Where a session's request in the replica stands with the gate.
#[derive(Debug, Clone)]
enum Look {
    /// Held: its attempt waits.
    Held(AttemptId),
    /// Admitted at `at` with `reason`; `lease` is released when the request finishes.
    Admitted {
        lease: LeaseId,
        reason: &'static str,
        at: f64,
    },
}

/// Session `s`'s request as the gate saw it at its first look.
#[derive(Debug, Clone)]
struct Seen {
    look: Look,
    /// The request's whole chain (prompt + answer blocks) and prompt length.
    hashes: Arc<[BlockHash]>,
    prompt_tokens: u32,
    /// The inferred session (`sched-infer`).
    inferred: Option<u64>,
}

impl Seen {
    fn prompt_hashes(&self, block_size: u32) -> &[BlockHash] {
        let blocks = (self.prompt_tokens / block_size) as usize;
        &self.hashes[..blocks.min(self.hashes.len())]
    }
}

/// The gate core inside the modelled scheduler.
#[derive(Debug)]
pub(crate) struct SchedMode {
    core: GateCore,
    /// `Some` for `sched-infer`.
    infer: Option<Inference>,
    /// Whether a session's end reaches the gate (`finish_session`).
    finish_sessions: bool,
    /// Per session: its request in the replica, once the scheduler looked at it.
    seen: Vec<Option<Seen>>,
    /// Per session: the hit chain its last prefix probe found.
    probe_memos: Vec<HitMemo>,
    parked: ParkedAttempts,
    seen_epoch: u64,
    /// Requests the gate holds (their look is [`Look::Held`]): all in the replica's waiting
    /// queue, and taken off its count in the usage the gate reads (as the engine's book does).
    held: u64,
    /// Seconds from a due `Wait` to its next poll: the profile's fixed step cost (set at the
    /// first turn, from the replica).
    tick_gap: f64,
}

/// [`SchedMode::tick_gap`] until the replica's profile is known, and its floor (a profile
/// whose fixed step cost is 0 must still let virtual time move).
const MIN_TICK_GAP_SEC: f64 = 1e-3;

impl SchedMode {
    /// `config` as given, except that a config without `max_wait_sec` gets
    /// [`SCHED_MAX_WAIT_SEC`]; `infer` keys the gate by inferred sessions; `finish_sessions`
    /// tells the gate when a session ends.
    pub(crate) fn new(
        mut config: GateConfig,
        sessions: usize,
        infer: bool,
        finish_sessions: bool,
    ) -> Result<Self> {
        config.max_wait_sec.get_or_insert(SCHED_MAX_WAIT_SEC);
        let core = GateCore::new(config)?;
        let seen_epoch = core.epoch();
        let mut mode = Self {
            core,
            infer: infer.then(Inference::default),
            finish_sessions,
            seen: Vec::new(),
            probe_memos: Vec::new(),
            parked: ParkedAttempts::default(),
            seen_epoch,
            held: 0,
            tick_gap: MIN_TICK_GAP_SEC,
        };
        mode.reset(sessions);
        Ok(mode)
    }

    /// Per-run state for a run over `sessions` sessions.
    fn reset(&mut self, sessions: usize) {
        self.seen = vec![None; sessions];
        self.probe_memos = vec![HitMemo::default(); sessions];
        if let Some(inf) = &mut self.infer {
            inf.previous = vec![None; sessions];
        }
        self.parked.clear();
        self.held = 0;
        self.seen_epoch = self.core.epoch();
    }

    /// Polls session `s`'s held attempt, answering probes from `probes`, until it is admitted
    /// or parked.
    fn drive(&mut self, s: SessionIx, now: f64, probes: Probes<'_>) -> Result<()> {
        let seen = self.seen[s]
            .as_mut()
            .ok_or_else(|| internal(s, "no request"))?;
        let Look::Held(id) = seen.look else {
            return Err(internal(s, "driven while not held"));
        };
        loop {
            match self.core.poll(id, now)? {
                Action::ProbeUsage => {
                    // In-process, on the engine thread: no wait, no timeout.
                    self.core.record_probe(ProbeKind::Usage, 0.0, true);
                    let mut usage = probes.usage();
                    usage.num_waiting_reqs =
                        usage.num_waiting_reqs.map(|w| w.saturating_sub(self.held));
                    self.core.on_usage(id, Ok(usage), now)?;
                }
                Action::ProbePrefix => {
                    self.core.record_probe(ProbeKind::Prefix, 0.0, true);
                    let hashes = seen.prompt_hashes(probes.block_size());
                    let report = probes.probe_prefix_memo(
                        s as u64,
                        hashes,
                        seen.prompt_tokens,
                        &mut self.probe_memos[s],
                    );
                    self.core.on_prefix(id, Ok(report), now)?;
                }
                Action::Wait { until } => {
                    let due = if until > now {
                        until
                    } else {
                        now + self.tick_gap
                    };
                    self.parked.park(id.0, s, due);
                    return Ok(());
                }
                Action::Admit(admission) => {
                    self.parked.remove(id.0);
                    self.held -= 1;
                    seen.look = Look::Admitted {
                        lease: admission.lease,
                        reason: admission.reason.as_str(),
                        at: now,
                    };
                    return Ok(());
                }
                // One attempt per session at a time: nothing can preempt it.
                _ => return Err(internal(s, "attempt preempted")),
            }
        }
    }

    /// Wakes every parked attempt while the epoch keeps moving (the book's `settle`).
    fn settle(&mut self, now: f64, probes: Probes<'_>) -> Result<()> {
        while self.core.epoch() != self.seen_epoch {
            self.seen_epoch = self.core.epoch();
            for (id, s) in self.parked.snapshot() {
                if self.parked.contains(id) {
                    self.drive(s, now, probes)?;
                }
            }
        }
        Ok(())
    }

    /// The scheduler's first look at session `s`'s request: begin its attempt and drive it.
    fn first_look(
        &mut self,
        now: f64,
        s: SessionIx,
        session_id: &str,
        req: &SimRequest,
        probes: Probes<'_>,
    ) -> Result<()> {
        let blocks = (req.prompt_tokens / probes.block_size()) as usize;
        let prompt = &req.block_hashes[..blocks.min(req.block_hashes.len())];
        let (inferred, key) = match &mut self.infer {
            Some(inf) => {
                let (n, key) = inf.arrive(s, prompt);
                (Some(n), key)
            }
            None => (None, session_id.to_string()),
        };
        let id = self.core.begin(
            &key,
            req.prompt_tokens as usize,
            req.max_tokens as usize,
            true,
            now,
        );
        self.held += 1;
        self.seen[s] = Some(Seen {
            look: Look::Held(id),
            hashes: req.block_hashes.clone(),
            prompt_tokens: req.prompt_tokens,
            inferred,
        });
        self.drive(s, now, probes)?;
        self.settle(now, probes)
    }
}

fn internal(s: SessionIx, what: &str) -> Error {
    Error::InvalidInput(format!("sim scheduler gate: session #{s}: {what}"))
}

impl SchedulerHook for SchedMode {
    fn may_schedule(
        &mut self,
        now: f64,
        s: SessionIx,
        session_id: &str,
        req: &SimRequest,
        probes: Probes<'_>,
    ) -> Result<bool> {
        if self.seen[s].is_none() {
            self.first_look(now, s, session_id, req, probes)?;
        }
        // Held: skipped for this step, answered by a later settle or timer (the `done()` read).
        Ok(matches!(
            self.seen[s].as_ref().map(|x| &x.look),
            Some(Look::Admitted { .. })
        ))
    }
}

impl Mode for SchedMode {
    fn turn_ready(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        self.tick_gap = ctx.replica().cost().fixed_step_sec().max(MIN_TICK_GAP_SEC);
        // Straight to the replica: the scheduler asks the gate. The label is replaced by the
        // gate's reason once the turn finishes (`admission`).
        ctx.admit(s, "sched");
        Ok(())
    }

    fn turn_finished(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        let seen = self.seen[s]
            .take()
            .ok_or_else(|| internal(s, "turn finished unseen"))?;
        let Look::Admitted { lease, .. } = seen.look else {
            return Err(internal(s, "turn finished while held"));
        };
        let now = ctx.now();
        self.core.release(lease, now);
        if let (Some(inf), Some(n)) = (&mut self.infer, seen.inferred) {
            let block_size = ctx.replica().config().block_size;
            let prompt_blocks = (seen.prompt_tokens / block_size) as usize;
            inf.inner.finish(n, &seen.hashes, prompt_blocks);
        }
        self.settle(now, ctx.replica().probes())
    }

    fn session_finished(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        if !self.finish_sessions {
            return Ok(());
        }
        let turn = ctx.turn(s);
        self.core.finish_session(turn.session_id, ctx.now());
        ctx.evict_first(s);
        self.settle(ctx.now(), ctx.replica().probes())
    }

    fn scheduler_hook(&mut self) -> Option<&mut dyn SchedulerHook> {
        Some(self)
    }

    fn admission(&self, s: SessionIx) -> Option<(&'static str, f64)> {
        match self.seen.get(s)?.as_ref()?.look {
            Look::Admitted { reason, at, .. } => Some((reason, at)),
            Look::Held(_) => None,
        }
    }

    fn next_wake(&mut self) -> Option<f64> {
        self.parked.next_deadline()
    }

    /// The engine driver's timer tick: held attempts whose `Wait` ran out poll again.
    fn wake(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        let now = ctx.now();
        let probes = ctx.replica().probes();
        while let Some(s) = self.parked.pop_due(now) {
            self.drive(s, now, probes)?;
        }
        self.settle(now, probes)
    }

    fn gate_stats(&self) -> Option<GateStats> {
        Some(self.core.stats())
    }

    fn infer_stats(&self) -> Option<InferStats> {
        self.infer.as_ref().map(Inference::stats)
    }

    /// One gate (and inference) across RL steps, as one engine process keeps its gate; the
    /// per-run state starts over. The previous run finished every request, so the core holds
    /// no attempt or lease.
    fn next_step(&mut self, sessions: usize) -> bool {
        self.reset(sessions);
        true
    }
}
