//! Clients in virtual time: a discrete-event loop that replays a workload's sessions against
//! one [`Replica`] through a [`Mode`] (no gate, a session cap, or the real gate core).
//!
//! The loop owns the only clock. Each session arrives at its `arrival`, sends a turn (prompt =
//! its history, exactly `max_tokens` of output), waits for the whole answer, runs its tool for
//! `tool_latency` seconds, appends the tool result and sends the next turn; after its last turn
//! and tool call it ends. The replica runs one engine step at a time: a step is scheduled from
//! the replica's state when it starts, and its outcome (finished and preempted requests) lands
//! when it ends, `duration_sec` later; requests submitted meanwhile wait for the next step, as
//! in vLLM's busy loop. Between steps, everything that happens at one instant is settled before
//! time moves: client events, then the mode's reactions (which may admit turns), in a fixed
//! order, so a run is deterministic for its inputs.
//!
//! Each turn yields a [`TurnRecord`] with the fields of the real bench's `TurnRecord`
//! (`python/session_gate/bench/runner.py`) except the ideal hit, which Python derives from the
//! same records with the bench's own function.
mod baselines;
mod cap;
pub(crate) mod client;
pub(crate) mod events;
mod gate_modes;
pub mod limit;
pub mod mode;
mod parked;
mod sched_modes;
pub mod spec;
pub mod tokens;

use std::collections::{HashMap, HashSet, VecDeque};

use self::client::{Client, Phase, client_in};
use self::events::{Event, Events};
use self::mode::Command;
pub use self::mode::{Ctx, Mode, ModeSpec, SchedulerHook, SessionIx, TurnView};
pub use self::sched_modes::{InferStats, SCHED_MAX_WAIT_SEC};
pub use self::spec::{SessionSpec, TurnSpec};
use self::tokens::HashChain;
use crate::baselines::AimdStats;
use crate::error::{Error, Result};
use crate::gate::GateStats;
use crate::sim::scheduler::WaitingGate;
use crate::sim::{Probes, Replica, ReplicaStats, SimRequest, StepOutcome};

/// One turn as the client saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnRecord {
    /// The session's index in the workload.
    pub session: SessionIx,
    /// The turn's index in the session.
    pub turn: u32,
    /// Prompt (history) tokens.
    pub prompt_tokens: u32,
    /// vLLM's `num_cached_tokens` for the request, as the replica reports it.
    pub cached_tokens: u32,
    /// From the turn being ready to its whole answer: admission wait + generation.
    pub latency_sec: f64,
    /// From the turn being ready to its admission.
    pub wait_sec: f64,
    /// Why it was admitted (`"none"` without a gate).
    pub reason: &'static str,
    /// Virtual time the turn became ready.
    pub ready_at: f64,
    /// Virtual time its answer was complete.
    pub finished_at: f64,
    /// Times the engine preempted (recomputed) this request.
    pub engine_preemptions: u32,
}

/// Everything one simulated run produced.
#[derive(Debug, Clone)]
pub struct SimOutput {
    /// One record per turn, in the order the turns finished.
    pub records: Vec<TurnRecord>,
    /// Virtual seconds from the start to the end of the last session.
    pub makespan_sec: f64,
    /// The gate core's counters, for the gate modes.
    pub gate_stats: Option<GateStats>,
    /// The aimd controller's counters, for mode `aimd`.
    pub aimd_stats: Option<AimdStats>,
    /// Inferred sessions against the true ones, for mode `sched-infer`.
    pub infer_stats: Option<InferStats>,
    /// The replica's counters (steps, busy time, preemptions, ...).
    pub replica_stats: ReplicaStats,
    /// Work thrown away by cancelled episodes (aimd): the episodes cancelled, their finished
    /// turns, and the tokens those turns prefilled (prompt − cached) and generated.
    pub lost: LostWork,
}

/// Work thrown away by cancelled episodes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LostWork {
    /// Episodes cancelled (each re-ran from its first turn).
    pub cancellations: u64,
    /// Finished turns of cancelled attempts.
    pub turns: u64,
    /// Tokens those turns prefilled and generated.
    pub tokens: u64,
}

/// Notifications for the mode, delivered in order.
#[derive(Debug, Clone, Copy)]
enum Note {
    Arrived(SessionIx),
    TurnReady(SessionIx),
    TurnFinished(SessionIx),
    SessionFinished(SessionIx),
}

/// How many loop iterations may pass without virtual time moving before the run is declared
/// stuck (a mode that keeps waking itself at the same instant, say).
const STALL_LIMIT: u32 = 1_000_000;

/// Replays `sessions` (validated first) against `replica` through `mode`, with token identity
/// seeded by `seed` (see [`tokens`]). Fails if a spec is invalid, if the mode fails, or if the
/// run stalls with sessions unfinished (e.g. a prompt that can never fit the cache).
pub fn simulate(
    sessions: Vec<SessionSpec>,
    seed: u64,
    replica: Replica,
    mode: &mut dyn Mode,
) -> Result<SimOutput> {
    for s in &sessions {
        s.validate()?;
    }
    let block_size = replica.config().block_size;
    let async_scheduling = replica.cost().shape.async_scheduling;
    let mut events = Events::default();
    let clients = sessions
        .into_iter()
        .enumerate()
        .map(|(i, spec)| {
            events.push(spec.arrival, Event::Arrive(i));
            let chain = HashChain::new(seed, i as u64, spec.system_tokens, block_size);
            Client::new(spec, chain)
        })
        .collect();
    let mut sim = Sim {
        replica,
        clients,
        events,
        block_size,
        now: 0.0,
        commands: Vec::new(),
        notes: VecDeque::new(),
        requests: HashMap::new(),
        next_request: 1,
        records: Vec::new(),
        finished: 0,
        makespan: 0.0,
        aborted: HashSet::new(),
        lost: LostWork::default(),
        stepping: false,
        async_scheduling,
        finished_first: super::finished_blocks_first()?,
    };
    sim.run(mode)?;
    Ok(SimOutput {
        records: sim.records,
        makespan_sec: sim.makespan,
        gate_stats: mode.gate_stats(),
        aimd_stats: mode.aimd_stats(),
        infer_stats: mode.infer_stats(),
        replica_stats: sim.replica.stats().clone(),
        lost: sim.lost,
    })
}

/// Runs consecutive RL steps, `steps[k]` being step k's sessions, each on a fresh replica from
/// `replica` (vLLM's prefix cache is reset when new weights are loaded) and all through ONE
/// mode of kind `spec`: a mode that keeps state across steps (the gate core, see
/// [`Mode::next_step`]) is carried over, the others are built afresh for each step. One output
/// per step; the gate's counters are cumulative over the steps so far.
pub fn simulate_steps(
    steps: Vec<Vec<SessionSpec>>,
    seed: u64,
    mut replica: impl FnMut() -> Result<Replica>,
    spec: &ModeSpec,
) -> Result<Vec<SimOutput>> {
    let mut mode: Option<Box<dyn Mode>> = None;
    let mut out = Vec::with_capacity(steps.len());
    for sessions in steps {
        let n = sessions.len();
        let m = match mode.take() {
            Some(mut m) => {
                if m.next_step(n) {
                    m
                } else {
                    spec.build(n)?
                }
            }
            None => spec.build(n)?,
        };
        let m = mode.insert(m);
        let run = simulate(sessions, seed, replica()?, m.as_mut())?;
        if *spec == ModeSpec::Limit {
            limit::check_unlimited(&run)?;
        }
        out.push(run);
    }
    Ok(out)
}

struct Sim {
    replica: Replica,
    clients: Vec<Client>,
    events: Events,
    block_size: u32,
    now: f64,
    commands: Vec<Command>,
    notes: VecDeque<Note>,
    /// Request id → session, for requests in the replica.
    requests: HashMap<u64, SessionIx>,
    next_request: u64,
    records: Vec<TurnRecord>,
    finished: usize,
    makespan: f64,
    /// Requests aborted by a cancel: their outcome in a step already under way is dropped.
    aborted: HashSet<u64>,
    lost: LostWork,
    /// Whether an engine step is in flight.
    stepping: bool,
    /// The profile's `async_scheduling`: whether probes see the next step scheduled.
    async_scheduling: bool,
    /// Whether a finished session's blocks go first (`SESSION_GATE_FINISHED_BLOCKS`).
    finished_first: bool,
}

impl Sim {
    fn run(&mut self, mode: &mut dyn Mode) -> Result<()> {
        let mut step: Option<(f64, StepOutcome)> = None;
        let mut stalls = 0u32;
        while self.finished < self.clients.len() {
            self.settle(mode)?;
            while step.is_none() {
                // A step boundary: the mode's queued probes are answered now. vLLM's busy loop
                // serves utility calls between steps: under async scheduling (GPUs) the next
                // step is already scheduled then; without it (the CPU engine: `EngineCore.step`
                // schedules, runs and updates in one call) it is not scheduled yet. Either way,
                // what an answer admits reaches the engine after the next step was scheduled
                // (the client's round trip), so it waits in the queue for the step after; an
                // idle engine schedules it at once.
                if self.async_scheduling {
                    step = self.step_replica(mode)?;
                }
                let mut ctx = self.ctx();
                mode.step_boundary(&mut ctx)?;
                if !self.async_scheduling {
                    step = self.step_replica(mode)?;
                }
                let reacted = !self.commands.is_empty() || !self.notes.is_empty();
                self.settle(mode)?;
                if step.is_some() || !reacted {
                    break;
                }
            }
            let next = [
                step.as_ref().map(|(end, _)| *end),
                self.events.next_time(),
                mode.next_wake(),
            ]
            .into_iter()
            .flatten()
            .min_by(f64::total_cmp);
            let Some(next) = next else {
                return Err(self.stalled("nothing left to happen"));
            };
            if next > self.now {
                self.now = next;
                stalls = 0;
            } else {
                stalls += 1;
                if stalls > STALL_LIMIT {
                    return Err(self.stalled("virtual time stopped moving"));
                }
            }
            if step.as_ref().is_some_and(|(end, _)| *end <= self.now) {
                let (_, outcome) = step.take().expect("checked");
                self.stepping = false;
                self.step_done(mode, outcome)?;
            }
            while let Some(event) = self.events.pop_due(self.now) {
                self.event(event)?;
            }
            if mode.next_wake().is_some_and(|t| t <= self.now) {
                self.settle(mode)?;
                let mut ctx = self.ctx();
                mode.wake(&mut ctx)?;
            }
        }
        // The last session's end still goes to the mode (the gate's finish_session).
        self.settle(mode)
    }

    /// Starts the replica's next step (if it has anything to run), through the mode's
    /// scheduler hook if it has one; returns the step's end time and outcome.
    fn step_replica(&mut self, mode: &mut dyn Mode) -> Result<Option<(f64, StepOutcome)>> {
        self.replica.sync_clock(self.now);
        let outcome = match mode.scheduler_hook() {
            None => self.replica.step(),
            Some(hook) => {
                let mut gate = HookGate {
                    now: self.now,
                    requests: &self.requests,
                    clients: &self.clients,
                    hook,
                    error: None,
                };
                let outcome = self.replica.step_gated(Some(&mut gate));
                if let Some(e) = gate.error {
                    return Err(e);
                }
                outcome
            }
        };
        self.stepping = outcome.is_some();
        Ok(outcome.map(|o| (self.now + o.duration_sec, o)))
    }

    fn ctx(&mut self) -> Ctx<'_> {
        let engine_busy =
            self.stepping || self.replica.num_running() > 0 || self.replica.num_waiting() > 0;
        Ctx {
            now: self.now,
            replica: &self.replica,
            clients: &self.clients,
            commands: &mut self.commands,
            engine_busy,
        }
    }

    fn stalled(&self, why: &str) -> Error {
        Error::InvalidInput(format!(
            "simulation stalled at t={:.3} s ({why}): {} of {} sessions unfinished, {} requests \
             running and {} waiting in the replica (a prompt larger than the cache?)",
            self.now,
            self.clients.len() - self.finished,
            self.clients.len(),
            self.replica.num_running(),
            self.replica.num_waiting(),
        ))
    }

    /// Applies the mode's commands and delivers notifications until both run dry.
    fn settle(&mut self, mode: &mut dyn Mode) -> Result<()> {
        loop {
            let commands = std::mem::take(&mut self.commands);
            for command in &commands {
                self.apply(*command)?;
            }
            let Some(note) = self.notes.pop_front() else {
                if self.commands.is_empty() {
                    return Ok(());
                }
                continue;
            };
            let mut ctx = self.ctx();
            match note {
                Note::Arrived(s) => mode.session_arrived(&mut ctx, s)?,
                Note::TurnReady(s) => mode.turn_ready(&mut ctx, s)?,
                Note::TurnFinished(s) => mode.turn_finished(&mut ctx, s)?,
                Note::SessionFinished(s) => mode.session_finished(&mut ctx, s)?,
            }
        }
    }

    fn apply(&mut self, command: Command) -> Result<()> {
        match command {
            Command::Start(s) => {
                let now = self.now;
                let client = self.client(s, Phase::Idle, "start")?;
                client.prepare_turn(now);
                self.notes.push_back(Note::TurnReady(s));
            }
            Command::Admit(s, reason) => {
                let (id, bs, now) = (self.next_request, self.block_size, self.now);
                let client = self.client(s, Phase::Ready, "admit")?;
                client.phase = Phase::InFlight;
                client.admitted_at = now;
                client.reason = reason;
                let request = client.request(id, bs);
                self.next_request += 1;
                self.requests.insert(id, s);
                self.replica.add_request(request)?;
            }
            Command::Cancel(s) => self.cancel(s)?,
            Command::EvictFirst(s) => {
                if self.finished_first {
                    let (hashes, keep) = self.clients[s].history_blocks();
                    self.replica.evict_first(hashes, keep);
                }
            }
        }
        Ok(())
    }

    /// Cancels session `s`'s episode (see [`Ctx::cancel`]).
    fn cancel(&mut self, s: SessionIx) -> Result<()> {
        let phase = self.clients.get(s).map(|c| c.phase);
        match phase {
            None | Some(Phase::Finished) => {
                return Err(Error::InvalidInput(format!(
                    "mode asked to cancel session #{s}, which is finished or does not exist"
                )));
            }
            Some(Phase::InFlight) => {
                let ids: Vec<u64> = self
                    .requests
                    .iter()
                    .filter(|(_, v)| **v == s)
                    .map(|(k, _)| *k)
                    .collect();
                for id in ids {
                    self.requests.remove(&id);
                    self.replica.abort_request(id);
                    self.aborted.insert(id);
                }
            }
            Some(Phase::Tool | Phase::Idle | Phase::Ready) => {}
        }
        let c = &mut self.clients[s];
        let mut lost = LostWork {
            cancellations: 1,
            ..Default::default()
        };
        self.records.retain(|r| {
            if r.session != s {
                return true;
            }
            lost.turns += 1;
            let output = c.spec.turns[r.turn as usize].output;
            lost.tokens += u64::from(r.prompt_tokens - r.cached_tokens) + u64::from(output);
            false
        });
        self.lost.cancellations += lost.cancellations;
        self.lost.turns += lost.turns;
        self.lost.tokens += lost.tokens;
        c.restart_episode();
        Ok(())
    }

    /// Session `s`, which must be in `phase` for `what` to make sense.
    fn client(&mut self, s: SessionIx, phase: Phase, what: &str) -> Result<&mut Client> {
        client_in(&mut self.clients, s, phase, what)
    }

    fn step_done(&mut self, mode: &dyn Mode, outcome: StepOutcome) -> Result<()> {
        for done in &outcome.finished {
            if self.aborted.remove(&done.id) {
                continue;
            }
            let s = self.requests.remove(&done.id).ok_or_else(|| {
                Error::InvalidInput(format!("replica finished unknown request {}", done.id))
            })?;
            let now = self.now;
            let c = &mut self.clients[s];
            // A gate inside the scheduler admitted the turn after it reached the replica.
            let (reason, admitted_at) = mode.admission(s).unwrap_or((c.reason, c.admitted_at));
            self.records.push(TurnRecord {
                session: s,
                turn: c.turn as u32,
                prompt_tokens: c.history as u32,
                cached_tokens: done.num_cached_tokens,
                latency_sec: now - c.ready_at,
                wait_sec: admitted_at - c.ready_at,
                reason,
                ready_at: c.ready_at,
                finished_at: now,
                engine_preemptions: done.num_preemptions,
            });
            c.history += u64::from(c.max_tokens());
            c.phase = Phase::Tool;
            let tool = c.spec.turns[c.turn].tool_latency;
            self.events.push(now + tool, Event::ToolDone(s, c.attempt));
            self.notes.push_back(Note::TurnFinished(s));
        }
        Ok(())
    }

    fn event(&mut self, event: Event) -> Result<()> {
        match event {
            Event::Arrive(s) => self.notes.push_back(Note::Arrived(s)),
            Event::ToolDone(s, attempt) => {
                let now = self.now;
                let c = &mut self.clients[s];
                if attempt != c.attempt {
                    return Ok(());
                }
                if c.turn + 1 < c.spec.turns.len() {
                    c.turn += 1;
                    c.prepare_turn(now);
                    self.notes.push_back(Note::TurnReady(s));
                } else {
                    c.phase = Phase::Finished;
                    self.finished += 1;
                    self.makespan = now;
                    self.notes.push_back(Note::SessionFinished(s));
                }
            }
        }
        Ok(())
    }
}

/// The replica scheduler's [`WaitingGate`] for a mode's [`SchedulerHook`]: names the request's
/// session and the step's time. The hook's first error is kept for the driver (the request is
/// then let through, so the step stays well-formed).
struct HookGate<'a> {
    now: f64,
    requests: &'a HashMap<u64, SessionIx>,
    clients: &'a [Client],
    hook: &'a mut dyn SchedulerHook,
    error: Option<Error>,
}

impl WaitingGate for HookGate<'_> {
    fn may_schedule(
        &mut self,
        req: &SimRequest,
        kv: &crate::sim::kv_manager::KvManager,
        (running, waiting): (usize, usize),
    ) -> bool {
        if self.error.is_some() {
            return true;
        }
        let Some(&s) = self.requests.get(&req.id) else {
            self.error = Some(Error::InvalidInput(format!(
                "replica holds unknown request {}",
                req.id
            )));
            return true;
        };
        let session_id = &self.clients[s].spec.session_id;
        match self.hook.may_schedule(
            self.now,
            s,
            session_id,
            req,
            Probes::new(kv).with_queues(running, waiting),
        ) {
            Ok(ready) => ready,
            Err(e) => {
                self.error = Some(e);
                true
            }
        }
    }
}
