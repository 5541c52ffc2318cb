//! What stands between the clients and the replica: the [`Mode`] trait the event loop calls,
//! the [`Ctx`] a mode acts through, and [`ModeSpec`], which names the built-in modes.
//!
//! A mode is told what the clients do (a session arrived, a turn is ready, a turn's answer is
//! complete, a session ended) and answers through [`Ctx`]: start a session, admit a turn to the
//! replica. It may ask to be woken at a virtual time ([`Mode::next_wake`]). It reads the replica
//! only through its probes and counters, as a production controller reads vLLM. New modes (AIMD,
//! pausing, ...) are new implementations of this trait plus one arm in [`ModeSpec`]; the event
//! loop does not change.
use crate::baselines::{AimdConfig, AimdStats, PauseConfig};
use crate::error::{Error, Result};
use crate::gate::{GateConfig, GateStats, Pressure};
use crate::sim::{BlockHash, Probes, Replica, SimRequest};

use super::baselines::{AimdMode, PauseMode};
use super::cap::CapMode;
use super::client::Client;
use super::gate_modes::GateMode;
use super::sched_modes::{InferStats, SchedMode};

/// A session's index in the workload.
pub type SessionIx = usize;

/// What a mode asked the driver to do; applied in order once the mode's call returns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Command {
    /// The session may send its first turn.
    Start(SessionIx),
    /// The session's ready turn goes to the replica now; `reason` is recorded with it.
    Admit(SessionIx, &'static str),
    /// Cancel the session's episode (aimd): abort its request, drop its turns (lost work) and
    /// return it to not-started; the mode starts it again later.
    Cancel(SessionIx),
    /// The engine gate ended the session: its own blocks go to the front of its replica's free
    /// queue (the engine's `finished_blocks`; a no-op with `SESSION_GATE_FINISHED_BLOCKS=lru`).
    EvictFirst(SessionIx),
}

/// A session's current turn as a mode sees it.
#[derive(Debug, Clone, Copy)]
pub struct TurnView<'a> {
    /// The session's id.
    pub session_id: &'a str,
    /// Index of the turn in the session.
    pub turn: usize,
    /// Prompt (history) tokens of the turn.
    pub prompt_tokens: u32,
    /// The turn's `max_tokens`.
    pub max_tokens: u32,
    /// Hashes of the prompt's full blocks (what the prefix probe hashes).
    pub prompt_hashes: &'a [BlockHash],
}

/// The view of the simulation a mode gets in each call, and its way to act.
pub struct Ctx<'a> {
    pub(crate) now: f64,
    pub(crate) replica: &'a Replica,
    pub(crate) clients: &'a [Client],
    pub(crate) commands: &'a mut Vec<Command>,
    pub(crate) engine_busy: bool,
}

impl<'a> Ctx<'a> {
    /// Virtual seconds since the start of the run.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Whether the engine is stepping (a step in flight, or requests running or waiting). vLLM's
    /// engine core answers a utility call (the gate's probes) between steps, so while it is
    /// busy a probe waits for the next step boundary; an idle core answers at once.
    pub fn engine_busy(&self) -> bool {
        self.engine_busy
    }

    /// The replica, read-only: its probes (`usage`, `probe_prefix`) and counters.
    pub fn replica(&self) -> &'a Replica {
        self.replica
    }

    /// The session's current (or next) turn.
    pub fn turn(&self, s: SessionIx) -> TurnView<'a> {
        self.clients[s].view()
    }

    /// Lets session `s`, which has arrived, send its first turn.
    pub fn start(&mut self, s: SessionIx) {
        self.commands.push(Command::Start(s));
    }

    /// Sends session `s`'s ready turn to the replica; `reason` labels the admission in the
    /// records (`"none"` for modes without a gate, the gate's reason otherwise).
    pub fn admit(&mut self, s: SessionIx, reason: &'static str) {
        self.commands.push(Command::Admit(s, reason));
    }

    /// Cancels session `s`'s episode: its in-flight request is aborted, its finished turns are
    /// counted as lost work, and it goes back to not-started (start it again to re-run it).
    pub fn cancel(&mut self, s: SessionIx) {
        self.commands.push(Command::Cancel(s));
    }

    /// Tells session `s`'s replica that the session is over (a finish reached its engine
    /// gate): its blocks past its first prompt are evicted before any other session's.
    pub fn evict_first(&mut self, s: SessionIx) {
        self.commands.push(Command::EvictFirst(s));
    }
}

/// A mode inside the replica's scheduler (modes `sched`, `sched-infer`): asked about each
/// waiting request the scheduler's waiting pass reaches, in the step that starts at `now`.
pub trait SchedulerHook {
    /// Whether session `s`'s request `req` (its session id `session_id`) may be scheduled in
    /// this step; `false` holds it in place in the waiting queue. `probes` read the KV state as
    /// the step has left it so far.
    fn may_schedule(
        &mut self,
        now: f64,
        s: SessionIx,
        session_id: &str,
        req: &SimRequest,
        probes: Probes<'_>,
    ) -> Result<bool>;
}

/// An admission policy in virtual time. Every call happens at `ctx.now()`; a mode must not
/// assume anything about time except through it.
pub trait Mode {
    /// Session `s` arrived and wants to send its first turn. Default: start it at once.
    fn session_arrived(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        ctx.start(s);
        Ok(())
    }

    /// Session `s` has a turn ready (its prompt is `ctx.turn(s)`); admit it now or later.
    fn turn_ready(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()>;

    /// Session `s`'s admitted turn has its whole answer.
    fn turn_finished(&mut self, _ctx: &mut Ctx<'_>, _s: SessionIx) -> Result<()> {
        Ok(())
    }

    /// Session `s` has ended (its last tool call included).
    fn session_finished(&mut self, _ctx: &mut Ctx<'_>, _s: SessionIx) -> Result<()> {
        Ok(())
    }

    /// Session `s`'s ready turn, not admitted yet, goes elsewhere (a fleet moving a session
    /// that waits for its first admission): forget it as if it never came. Returns whether
    /// the mode let go of it; the default cannot (the turn may already be in the engine).
    fn withdraw(&mut self, _ctx: &mut Ctx<'_>, _s: SessionIx) -> Result<bool> {
        Ok(false)
    }

    /// An engine-step boundary: the step that just ended has been applied and, under the
    /// profile's `async_scheduling`, the next one (if any) is scheduled (without it, it is
    /// scheduled right after this call) — vLLM's busy loop answers queued utility calls
    /// (probes) here.
    fn step_boundary(&mut self, _ctx: &mut Ctx<'_>) -> Result<()> {
        Ok(())
    }

    /// The next virtual time at which the mode wants [`Mode::wake`], if any.
    fn next_wake(&mut self) -> Option<f64> {
        None
    }

    /// Called once virtual time reaches [`Mode::next_wake`].
    fn wake(&mut self, _ctx: &mut Ctx<'_>) -> Result<()> {
        Ok(())
    }

    /// The hook the replica's scheduler asks about waiting requests, for modes that gate
    /// inside the scheduler. Default: none (the scheduler is vLLM's, untouched).
    fn scheduler_hook(&mut self) -> Option<&mut dyn SchedulerHook> {
        None
    }

    /// How session `s`'s turn, whose answer is complete, was admitted (reason, virtual time),
    /// when the mode decided it after the turn reached the replica (inside the scheduler);
    /// asked before [`Mode::turn_finished`]. Default: none (what `Ctx::admit` said holds).
    fn admission(&self, _s: SessionIx) -> Option<(&'static str, f64)> {
        None
    }

    /// The gate's counters, for modes that run the gate core.
    fn gate_stats(&self) -> Option<GateStats> {
        None
    }

    /// How inferred sessions compare with the true ones, for mode `sched-infer`.
    fn infer_stats(&self) -> Option<InferStats> {
        None
    }

    /// The aimd controller's counters, for mode `aimd`.
    fn aimd_stats(&self) -> Option<AimdStats> {
        None
    }

    /// Gets ready for the next RL step, a new run over `sessions` sessions on a fresh replica,
    /// keeping what the mode learned (the gate core: its sessions' turn times, its counters). Returns false for a
    /// mode with nothing worth keeping: the driver then builds a fresh one. Default: false.
    fn next_step(&mut self, _sessions: usize) -> bool {
        false
    }
}

/// The built-in modes, as the bench names them.
#[derive(Debug, Clone, PartialEq)]
pub enum ModeSpec {
    /// Every turn goes straight to the replica.
    None,
    /// [`ModeSpec::None`] on a replica whose cache never runs out (`super::limit`): the
    /// workload's limit. The caller runs it on [`super::limit::limit_config`]'s shape;
    /// [`super::simulate_steps`] refuses the run if the replica evicted or preempted anyway.
    Limit,
    /// At most this many sessions live at once (a slot held for a session's whole life).
    Cap(u32),
    /// The seed's gate: the gate core with `pressure = "engine"` and the other knobs given.
    Seed(GateConfig),
    /// The default gate: the gate core with the knobs given.
    Gate(GateConfig),
    /// prime-rl's adaptive episode concurrency (`crate::baselines::aimd`).
    Aimd(AimdConfig),
    /// ThunderAgent's tool-boundary pausing (`crate::baselines::pause`).
    Pause(PauseConfig),
    /// The engine gate's scheduler mode: the gate core inside the replica's scheduler, keyed
    /// by the session id (`max_wait_sec` defaults to `SCHED_MAX_WAIT_SEC`); each client ends
    /// its session with a finish call (vllm-router's `POST /finish_session?session_id=`, which
    /// prime-rl and SkyRL send), as the bench's real `sched` clients do.
    Sched(GateConfig),
    /// [`ModeSpec::Sched`] keyed by the session the gate infers from the prompt's blocks (its
    /// clients name nothing, so they end nothing either).
    SchedInfer(GateConfig),
    /// [`ModeSpec::Sched`] whose clients never say that a session ended (a plain client with
    /// ids only): a session's last room is left to the core's idle rules.
    SchedNoFinish(GateConfig),
}

impl ModeSpec {
    /// The mode of kind `kind` (`none`, `limit`, `cap`, `seed`, `gate`, `aimd`, `pause`,
    /// `sched`, `sched-infer`, `sched-nofinish`), with `cap` sessions for `cap` and the gate
    /// knobs `config` for the gates
    /// (`seed` forces `pressure = "engine"`).
    pub fn from_kind(kind: &str, cap: u32, config: GateConfig) -> Result<Self> {
        Ok(match kind {
            "none" => Self::None,
            super::limit::LIMIT_MODE => Self::Limit,
            "cap" if cap > 0 => Self::Cap(cap),
            "cap" => return Err(Error::InvalidInput("mode cap needs a cap > 0".into())),
            "seed" => Self::Seed(GateConfig {
                pressure: Pressure::Engine,
                ..config
            }),
            "gate" => Self::Gate(config),
            "aimd" => Self::Aimd(AimdConfig::default()),
            "pause" => Self::Pause(PauseConfig::default()),
            "sched" => Self::Sched(config),
            "sched-infer" => Self::SchedInfer(config),
            "sched-nofinish" => Self::SchedNoFinish(config),
            other => {
                return Err(Error::InvalidInput(format!(
                    "unknown mode kind `{other}` (expected none, limit, cap, seed, gate, aimd, \
                     pause, sched, sched-infer or sched-nofinish)"
                )));
            }
        })
    }

    /// A fresh mode for a run over `sessions` sessions.
    pub fn build(&self, sessions: usize) -> Result<Box<dyn Mode>> {
        Ok(match self {
            Self::None | Self::Limit => Box::new(CapMode::new(None)),
            Self::Cap(n) => Box::new(CapMode::new(Some(*n as usize))),
            Self::Seed(c) | Self::Gate(c) => Box::new(GateMode::new(c.clone(), sessions)?),
            Self::Aimd(c) => Box::new(AimdMode::new(c.clone())?),
            Self::Pause(c) => Box::new(PauseMode::new(c.clone())?),
            Self::Sched(c) => Box::new(SchedMode::new(c.clone(), sessions, false, true)?),
            Self::SchedInfer(c) => Box::new(SchedMode::new(c.clone(), sessions, true, false)?),
            Self::SchedNoFinish(c) => Box::new(SchedMode::new(c.clone(), sessions, false, false)?),
        })
    }
}
