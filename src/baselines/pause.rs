//! ThunderAgent's program-aware scheduler (tool-boundary pausing), with the NVIDIA Dynamo port's
//! defaults, as a sans-IO controller for one replica.
//!
//! A *program* is a session. It is REASONING while a turn is pending or in flight and ACTING
//! between turns (in a tool call); ACTIVE or PAUSED. Memory is **counted tokens, not vLLM's
//! usage**: `used = Σ tokens(REASONING) + acting_token_weight · Σ tokens(ACTING) +
//! buffer_per_program · #programs`, over ACTIVE programs, against `capacity_tokens`
//! (`block_size × num_gpu_blocks`, read once).
//!
//! The driver calls:
//! - [`PauseController::before_request`] before each turn: an ACTIVE program is never gated; a
//!   PAUSED one holds until resumed; a new one queues behind any paused program, else is placed
//!   when `capacity - used >= tokens + buffer`, else is paused (`admission_full`);
//! - [`PauseController::after_request`] when a response ends (the program turns ACTING; a program
//!   marked for pause is paused now);
//! - [`PauseController::tick`] every `scheduler_interval_sec`: idle expiry, forced resumes of
//!   turns held `resume_timeout_sec`, then **resume first** (headroom = `capacity ×
//!   (pause_threshold − resume_hysteresis) − used`; waiting REASONING programs, then new ones,
//!   then paused ACTING ones, each smallest first, while cumulative tokens + buffer fit), then
//!   **pause** (above `pause_threshold`: pause ACTING programs smallest first until `used <=
//!   pause_target`; if still above, mark every REASONING program to pause when its response ends);
//! - [`PauseController::finish`] when a session ends.
//!
//! Pausing is logical: nothing is aborted, vLLM evicts on its own. Not modelled (one replica, FCFS
//! engine): placement across replicas, the port's soft demotion (a request priority), upstream's
//! `shared_tokens` correction from vLLM's metrics (the port drops it too).
use std::collections::HashMap;

use super::{ordered, positive};
use crate::error::{Error, Result};
use crate::gate::config::{fraction, seconds};

/// Every knob of the scheduler; `Default` is the Dynamo port's published defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct PauseConfig {
    /// Pause when `used > pause_threshold × capacity` (0.95; upstream pauses at 1.0).
    pub pause_threshold: f64,
    /// Pause down to `used <= pause_target × capacity` (0.80).
    pub pause_target: f64,
    /// Resume only below `pause_threshold − resume_hysteresis` (0.10).
    pub resume_hysteresis: f64,
    /// A turn held this long is resumed regardless of room (1,800 s).
    pub resume_timeout_sec: f64,
    /// Seconds between scheduler ticks (5).
    pub scheduler_interval_sec: f64,
    /// Weight of an ACTING program's tokens in `used` (1.0).
    pub acting_token_weight: f64,
    /// Tokens of decode headroom counted per program (100).
    pub buffer_per_program: u64,
    /// An ACTING program idle this long is released (600 s; 0 disables).
    pub idle_ttl_sec: f64,
}

impl Default for PauseConfig {
    fn default() -> Self {
        Self {
            pause_threshold: 0.95,
            pause_target: 0.80,
            resume_hysteresis: 0.10,
            resume_timeout_sec: 1800.0,
            scheduler_interval_sec: 5.0,
            acting_token_weight: 1.0,
            buffer_per_program: 100,
            idle_ttl_sec: 600.0,
        }
    }
}

impl PauseConfig {
    /// Refuses out-of-domain knobs with an error naming the knob and the value.
    pub fn validate(&self) -> Result<()> {
        fraction("pause_threshold", self.pause_threshold)?;
        fraction("pause_target", self.pause_target)?;
        fraction("resume_hysteresis", self.resume_hysteresis)?;
        ordered(
            "pause_target",
            self.pause_target,
            self.pause_threshold,
            "must not exceed pause_threshold",
        )?;
        ordered(
            "resume_hysteresis",
            self.resume_hysteresis,
            self.pause_threshold,
            "must not exceed pause_threshold",
        )?;
        seconds("resume_timeout_sec", self.resume_timeout_sec, false)?;
        seconds("scheduler_interval_sec", self.scheduler_interval_sec, false)?;
        seconds("idle_ttl_sec", self.idle_ttl_sec, true)?;
        positive("acting_token_weight", self.acting_token_weight)?;
        Ok(())
    }

    /// The same scheduler with every time constant multiplied by `k` (tick, forced resume,
    /// idle expiry).
    pub fn scaled(&self, k: f64) -> Result<Self> {
        positive("time_scale", k)?;
        let mut c = self.clone();
        c.scheduler_interval_sec *= k;
        c.resume_timeout_sec *= k;
        c.idle_ttl_sec *= k;
        c.validate()?;
        Ok(c)
    }
}

/// The answer to [`PauseController::before_request`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseDecision {
    /// Send the turn now.
    Admit,
    /// Hold the turn until a tick resumes the program; the reason is the port's log reason
    /// (`paused`, `queued` behind paused programs, `admission_full`).
    Hold(&'static str),
}

/// What one tick did (program ids).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PauseTick {
    /// Programs resumed (a held turn may now be sent), forced ones included.
    pub resumed: Vec<String>,
    /// Of those, resumed by the timeout regardless of room.
    pub forced: Vec<String>,
    /// ACTING programs paused.
    pub paused: Vec<String>,
    /// REASONING programs marked to pause when their response ends.
    pub marked: Vec<String>,
    /// Idle programs released.
    pub expired: Vec<String>,
}

/// Counters of what the scheduler did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PauseStats {
    /// Ticks run.
    pub ticks: u64,
    /// Pauses (tick, marked-then-paused, admission_full and queued new programs).
    pub pauses: u64,
    /// Resumes, forced included.
    pub resumes: u64,
    /// Forced resumes.
    pub forced_resumes: u64,
    /// Marks put on REASONING programs.
    pub marked: u64,
    /// New programs paused at admission (`admission_full` or queued).
    pub admission_held: u64,
    /// Turns that were held at least once.
    pub held_turns: u64,
    /// Idle programs released.
    pub expired: u64,
}

#[derive(Debug, Clone)]
struct Program {
    tokens: u64,
    reasoning: bool,
    paused: bool,
    marked: bool,
    steps: u32,
    /// When the pending turn started waiting on a pause (forced-resume clock).
    held_since: Option<f64>,
    acting_since: f64,
    order: u64,
}

/// The scheduler (see the module docs).
#[derive(Debug)]
pub struct PauseController {
    config: PauseConfig,
    capacity: u64,
    programs: HashMap<String, Program>,
    order: u64,
    stats: PauseStats,
}

impl PauseController {
    /// A scheduler for one replica holding `capacity_tokens` of KV (`block_size × num_blocks`).
    pub fn new(config: PauseConfig, capacity_tokens: u64) -> Result<Self> {
        config.validate()?;
        if capacity_tokens == 0 {
            return Err(Error::InvalidKnob {
                knob: "capacity_tokens",
                value: "0".into(),
                why: "must be > 0",
            });
        }
        Ok(Self {
            config,
            capacity: capacity_tokens,
            programs: HashMap::new(),
            order: 0,
            stats: PauseStats::default(),
        })
    }

    /// The knobs in force.
    pub fn config(&self) -> &PauseConfig {
        &self.config
    }

    /// What the scheduler has done so far.
    pub fn stats(&self) -> &PauseStats {
        &self.stats
    }

    /// Counted tokens of ACTIVE programs, buffers included.
    pub fn used(&self) -> u64 {
        self.programs
            .values()
            .filter(|p| !p.paused)
            .map(|p| self.weighted(p) + self.config.buffer_per_program)
            .sum()
    }

    /// Programs currently paused.
    pub fn paused_count(&self) -> usize {
        self.programs.values().filter(|p| p.paused).count()
    }

    /// Whether `session` is paused.
    pub fn is_paused(&self, session: &str) -> bool {
        self.programs.get(session).is_some_and(|p| p.paused)
    }

    /// The earliest time a held turn is due a forced resume, if any is held.
    pub fn next_forced_resume(&self) -> Option<f64> {
        self.programs
            .values()
            .filter(|p| p.paused)
            .filter_map(|p| p.held_since)
            .map(|t| t + self.config.resume_timeout_sec)
            .min_by(f64::total_cmp)
    }

    /// A turn of `session` whose prompt is `prompt_tokens` long is about to be sent.
    pub fn before_request(&mut self, now: f64, session: &str, prompt_tokens: u64) -> PauseDecision {
        let is_new = !self.programs.contains_key(session);
        let any_paused = self.programs.values().any(|p| p.paused);
        let free = self.capacity as i64 - self.used() as i64;
        let order = self.order;
        let p = self
            .programs
            .entry(session.to_owned())
            .or_insert_with(|| Program {
                tokens: 0,
                reasoning: true,
                paused: false,
                marked: false,
                steps: 0,
                held_since: None,
                acting_since: now,
                order,
            });
        self.order += 1;
        p.steps += 1;
        p.tokens = p.tokens.max(prompt_tokens);
        p.reasoning = true;
        if p.paused {
            p.held_since.get_or_insert(now);
            self.stats.held_turns += 1;
            return PauseDecision::Hold("paused");
        }
        if !is_new {
            return PauseDecision::Admit;
        }
        let reason = if any_paused {
            "queued"
        } else if free >= (p.tokens + self.config.buffer_per_program) as i64 {
            return PauseDecision::Admit;
        } else {
            "admission_full"
        };
        p.paused = true;
        p.held_since = Some(now);
        self.stats.pauses += 1;
        self.stats.admission_held += 1;
        self.stats.held_turns += 1;
        PauseDecision::Hold(reason)
    }

    /// The response of `session`'s turn ended; its sequence is now `total_tokens` long. Returns
    /// whether the program was paused now (it had been marked).
    pub fn after_request(&mut self, now: f64, session: &str, total_tokens: u64) -> Result<bool> {
        let p = self.programs.get_mut(session).ok_or_else(|| {
            Error::InvalidInput(format!("program `{session}` has no turn in flight"))
        })?;
        p.tokens = total_tokens;
        p.reasoning = false;
        p.acting_since = now;
        if p.marked && !p.paused {
            p.marked = false;
            p.paused = true;
            self.stats.pauses += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// The session ended: its tokens stop counting. Returns whether it was known.
    pub fn finish(&mut self, session: &str) -> bool {
        self.programs.remove(session).is_some()
    }

    /// One scheduler tick (see the module docs for the order of its steps).
    pub fn tick(&mut self, now: f64) -> PauseTick {
        self.stats.ticks += 1;
        let mut out = PauseTick::default();
        self.expire(now, &mut out);
        self.force_resumes(now, &mut out);
        self.resume(&mut out);
        self.pause(&mut out);
        out
    }

    fn weighted(&self, p: &Program) -> u64 {
        if p.reasoning {
            p.tokens
        } else {
            (p.tokens as f64 * self.config.acting_token_weight) as u64
        }
    }

    fn expire(&mut self, now: f64, out: &mut PauseTick) {
        let ttl = self.config.idle_ttl_sec;
        if ttl <= 0.0 {
            return;
        }
        let mut idle: Vec<String> = self
            .programs
            .iter()
            .filter(|(_, p)| !p.reasoning && !p.paused && now - p.acting_since >= ttl)
            .map(|(k, _)| k.clone())
            .collect();
        idle.sort();
        for k in idle {
            self.programs.remove(&k);
            self.stats.expired += 1;
            out.expired.push(k);
        }
    }

    fn force_resumes(&mut self, now: f64, out: &mut PauseTick) {
        let timeout = self.config.resume_timeout_sec;
        let mut due: Vec<(u64, String)> = self
            .programs
            .iter()
            .filter(|(_, p)| p.paused && p.held_since.is_some_and(|t| now - t >= timeout))
            .map(|(k, p)| (p.order, k.clone()))
            .collect();
        due.sort();
        for (_, k) in due {
            self.resume_one(&k);
            self.stats.forced_resumes += 1;
            out.forced.push(k.clone());
            out.resumed.push(k);
        }
    }

    fn resume(&mut self, out: &mut PauseTick) {
        let buffer = self.config.buffer_per_program as i64;
        let ceiling = (self.config.pause_threshold - self.config.resume_hysteresis).max(0.0);
        let headroom = (self.capacity as f64 * ceiling).floor() as i64 - self.used() as i64;
        if headroom <= buffer {
            return;
        }
        // Waiting REASONING programs first, then new ones, then paused ACTING ones; each group
        // smallest first (ties: arrival order, for determinism).
        let mut paused: Vec<(u8, u64, u64, String)> = self
            .programs
            .iter()
            .filter(|(_, p)| p.paused)
            .map(|(k, p)| {
                let group = if p.steps <= 1 {
                    1
                } else if p.reasoning {
                    0
                } else {
                    2
                };
                (group, p.tokens, p.order, k.clone())
            })
            .collect();
        paused.sort();
        let mut cumulative = 0i64;
        let mut chosen: Vec<(u64, u64, String)> = Vec::new();
        for (_, tokens, order, k) in paused {
            let required = tokens as i64 + buffer;
            if cumulative + required <= headroom {
                cumulative += required;
                chosen.push((tokens, order, k));
            }
        }
        // Placement: largest first while the replica keeps more than a buffer of room.
        chosen.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut remaining = headroom;
        for (tokens, _, k) in chosen {
            let required = tokens as i64 + buffer;
            if remaining <= buffer {
                break;
            }
            if required > remaining {
                continue;
            }
            remaining -= required;
            self.resume_one(&k);
            out.resumed.push(k);
        }
    }

    fn pause(&mut self, out: &mut PauseTick) {
        let cap = self.capacity as f64;
        let mut used = self.used() as f64;
        if used <= cap * self.config.pause_threshold {
            return;
        }
        let target = cap * self.config.pause_target.min(self.config.pause_threshold);
        let buffer = self.config.buffer_per_program;
        let mut acting: Vec<(u64, u64, String)> = self
            .programs
            .iter()
            .filter(|(_, p)| !p.paused && !p.reasoning && !p.marked)
            .map(|(k, p)| (p.tokens, p.order, k.clone()))
            .collect();
        acting.sort();
        for (_, _, k) in acting {
            if used <= target {
                break;
            }
            let p = self.programs.get_mut(&k).expect("listed above");
            let freed = (p.tokens as f64 * self.config.acting_token_weight) as u64 + buffer;
            p.paused = true;
            self.stats.pauses += 1;
            used -= freed as f64;
            out.paused.push(k);
        }
        if used <= target {
            return;
        }
        let mut reasoning: Vec<(u64, u64, String)> = self
            .programs
            .iter()
            .filter(|(_, p)| !p.paused && p.reasoning && !p.marked)
            .map(|(k, p)| (p.tokens, p.order, k.clone()))
            .collect();
        reasoning.sort();
        for (_, _, k) in reasoning {
            self.programs.get_mut(&k).expect("listed above").marked = true;
            self.stats.marked += 1;
            out.marked.push(k);
        }
    }

    fn resume_one(&mut self, k: &str) {
        if let Some(p) = self.programs.get_mut(k) {
            p.paused = false;
            p.held_since = None;
            self.stats.resumes += 1;
        }
    }
}
