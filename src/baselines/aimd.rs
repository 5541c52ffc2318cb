//! prime-rl's adaptive concurrency (the orchestrator's `ConcurrencyController`, PR #3285 as
//! changed by #3307), as a sans-IO controller.
//!
//! One unit of concurrency is one episode (a session). The controller keeps a floating cap on
//! episodes in flight and a FIFO of episodes waiting to start. The driver:
//! - [`AimdController::submit`]s every episode that should run, and starts the ones
//!   [`AimdController::admit`] returns (admission is metered: at most
//!   `max(meter_min, cap * meter_fraction)` net starts per `meter_window_sec`, each completion
//!   refunds one);
//! - every `poll_interval_sec` scrapes the engine (KV usage, requests running and waiting, the
//!   preemption counter; KV capacity and `max_model_len` once) and calls
//!   [`AimdController::on_poll`], which answers the episodes to cancel — whole episodes, youngest
//!   first. Lowering the cap below what is in flight cancels nothing by itself: admission blocks;
//! - reports each natural completion with [`AimdController::on_complete`]; a completion while the
//!   engine was clear at the last poll (valid `grow_valid_sec`) and the cap binds (`n >=
//!   binding_fraction * cap`, n = episodes in flight counting this one) grows the cap by
//!   `growth^(1/n)` — about `growth` per cap's worth of completions.
//!
//! On each poll: a preemption-counter increase, or `queue_polls` consecutive polls with
//! `waiting > queue_ratio * running`, is a *hard* signal: cut to `inflight * f` (f =
//! `preempt_factor`, `queue_factor`, or `escalated_factor` after an earlier hard cut), cancel the
//! excess and latch *draining* (no further decisions until `inflight <= cap` on a poll without a
//! hard signal). Otherwise usage above `cut_usage` resizes to `inflight * cut_target / usage`
//! (cancelling only above `cancel_usage`), then `cooldown_polls` polls of cooldown.
//!
//! Interpretations (of the orchestrator's controller as PRs #3285/#3307 describe it; where it was
//! silent):
//! the escalated factor stays armed for `grace_polls` polls after the draining latch clears and is
//! disarmed by a grace without a hard signal; when preemption and queue overload coincide the
//! harsher `preempt_factor` applies; the bench has no GRPO groups, so a group is one episode.
use std::collections::{HashMap, VecDeque};

use super::{factor, positive};
use crate::error::{Error, Result};
use crate::gate::config::{fraction, seconds};

/// Every knob of the controller; `Default` is prime-rl's published behaviour.
#[derive(Debug, Clone, PartialEq)]
pub struct AimdConfig {
    /// Seconds between engine scrapes (prime-rl: 5).
    pub poll_interval_sec: f64,
    /// Cap before the first capacity poll; `None` starts at `min_inflight` and jumps to
    /// `kv_capacity_tokens / max_model_len` on the first poll that reports capacity.
    pub initial_inflight: Option<f64>,
    /// Lower clamp of the cap (prime-rl `min_inflight`: 1).
    pub min_inflight: f64,
    /// Upper clamp of the cap (prime-rl `max_inflight`: 1,024).
    pub max_inflight: f64,
    /// Usage above which the engine is not "clear" (no growth): 0.6.
    pub soft_usage: f64,
    /// Usage above which the cap is resized down (the soft cap): 0.8.
    pub cut_usage: f64,
    /// Usage above which that resize also cancels episodes (the hard cap): 0.9.
    pub cancel_usage: f64,
    /// The usage a soft resize aims for: `inflight * cut_target / usage` (0.7).
    pub cut_target: f64,
    /// Multiplicative decrease on a preemption: 0.8.
    pub preempt_factor: f64,
    /// Multiplicative decrease on a persistent queue: 0.9.
    pub queue_factor: f64,
    /// Multiplicative decrease when overload survives a drain: 0.5.
    pub escalated_factor: f64,
    /// A poll "queues" when `waiting > queue_ratio * running` (0.5).
    pub queue_ratio: f64,
    /// Consecutive queueing polls that make a hard signal: 6.
    pub queue_polls: u32,
    /// Polls without a soft resize after one: 6.
    pub cooldown_polls: u32,
    /// Polls the escalated factor stays armed after the draining latch clears: 6.
    pub grace_polls: u32,
    /// Geometric growth per cap's worth of completions: 1.25.
    pub growth: f64,
    /// The cap binds when `n >= binding_fraction * cap`: 0.9.
    pub binding_fraction: f64,
    /// Seconds a clear poll licenses growth for: 15.
    pub grow_valid_sec: f64,
    /// The admission meter's window: 5 s.
    pub meter_window_sec: f64,
    /// Net starts allowed per window at least (prime-rl: the group size, or 8).
    pub meter_min: u32,
    /// ... or this fraction of the cap when larger (`cap // 10`).
    pub meter_fraction: f64,
}

impl Default for AimdConfig {
    fn default() -> Self {
        Self {
            poll_interval_sec: 5.0,
            initial_inflight: None,
            min_inflight: 1.0,
            max_inflight: 1024.0,
            soft_usage: 0.6,
            cut_usage: 0.8,
            cancel_usage: 0.9,
            cut_target: 0.7,
            preempt_factor: 0.8,
            queue_factor: 0.9,
            escalated_factor: 0.5,
            queue_ratio: 0.5,
            queue_polls: 6,
            cooldown_polls: 6,
            grace_polls: 6,
            growth: 1.25,
            binding_fraction: 0.9,
            grow_valid_sec: 15.0,
            meter_window_sec: 5.0,
            meter_min: 8,
            meter_fraction: 0.1,
        }
    }
}

impl AimdConfig {
    /// Refuses out-of-domain knobs with an error naming the knob and the value.
    pub fn validate(&self) -> Result<()> {
        seconds("poll_interval_sec", self.poll_interval_sec, false)?;
        seconds("grow_valid_sec", self.grow_valid_sec, true)?;
        seconds("meter_window_sec", self.meter_window_sec, false)?;
        if !(self.min_inflight.is_finite() && self.min_inflight >= 1.0) {
            return Err(crate::gate::config::invalid(
                "min_inflight",
                self.min_inflight,
                "must be a finite number >= 1",
            ));
        }
        positive("max_inflight", self.max_inflight)?;
        super::ordered(
            "min_inflight",
            self.min_inflight,
            self.max_inflight,
            "must not exceed max_inflight",
        )?;
        if let Some(v) = self.initial_inflight {
            positive("initial_inflight", v)?;
        }
        for (knob, v) in [
            ("soft_usage", self.soft_usage),
            ("cut_usage", self.cut_usage),
            ("cancel_usage", self.cancel_usage),
            ("binding_fraction", self.binding_fraction),
            ("meter_fraction", self.meter_fraction),
        ] {
            fraction(knob, v)?;
        }
        for (knob, v) in [
            ("cut_target", self.cut_target),
            ("preempt_factor", self.preempt_factor),
            ("queue_factor", self.queue_factor),
            ("escalated_factor", self.escalated_factor),
        ] {
            factor(knob, v)?;
        }
        positive("queue_ratio", self.queue_ratio)?;
        if !(self.growth.is_finite() && self.growth >= 1.0) {
            return Err(crate::gate::config::invalid(
                "growth",
                self.growth,
                "must be a finite factor >= 1",
            ));
        }
        Ok(())
    }

    /// The same controller with every time constant multiplied by `k` (poll interval, growth
    /// licence, meter window); poll counts keep their meaning in polls.
    pub fn scaled(&self, k: f64) -> Result<Self> {
        positive("time_scale", k)?;
        let mut c = self.clone();
        c.poll_interval_sec *= k;
        c.grow_valid_sec *= k;
        c.meter_window_sec *= k;
        c.validate()?;
        Ok(c)
    }
}

/// What one scrape of the engine said.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AimdSignals {
    /// vLLM's `kv_cache_usage_perc` (max over engines), 0..=1.
    pub kv_usage: f64,
    /// `num_requests_running`.
    pub running: u64,
    /// `num_requests_waiting`.
    pub waiting: u64,
    /// The cumulative `num_preemptions` counter.
    pub preemptions_total: u64,
    /// KV capacity in tokens (`num_gpu_blocks * block_size`), when the scrape knows it.
    pub kv_capacity_tokens: Option<u64>,
    /// The engine's `max_model_len`, when the scrape knows it.
    pub max_model_len: Option<u64>,
}

/// Counters of what the controller did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AimdStats {
    /// Polls seen.
    pub polls: u64,
    /// Episodes started.
    pub admitted: u64,
    /// Episodes that completed naturally.
    pub completed: u64,
    /// Episodes cancelled.
    pub cancelled: u64,
    /// Hard-signal cuts (preemption, queue overload).
    pub hard_cuts: u64,
    /// Usage-driven resizes.
    pub soft_cuts: u64,
    /// Completions that grew the cap.
    pub grown: u64,
    /// The highest KV usage a poll saw. vLLM's usage counts the blocks of running requests
    /// only: the cached prefixes of sessions between turns count as free, so prefix thrash
    /// (those prefixes evicted and re-prefilled) can run while this stays low.
    pub peak_usage: f64,
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    started: f64,
    seq: u64,
}

/// The controller (see the module docs).
#[derive(Debug)]
pub struct AimdController {
    config: AimdConfig,
    cap: f64,
    capacity_seen: bool,
    queue: VecDeque<String>,
    inflight: HashMap<String, InFlight>,
    seq: u64,
    last_preemptions: Option<u64>,
    prev_waiting: u64,
    queue_polls: u32,
    draining: bool,
    escalated: bool,
    grace: u32,
    cooldown: u32,
    grow_until: f64,
    window_start: Option<f64>,
    window_net: i64,
    stats: AimdStats,
}

impl AimdController {
    /// A controller with `config` (validated).
    pub fn new(config: AimdConfig) -> Result<Self> {
        config.validate()?;
        let cap = clamp(
            &config,
            config.initial_inflight.unwrap_or(config.min_inflight),
        );
        Ok(Self {
            capacity_seen: config.initial_inflight.is_some(),
            cap,
            config,
            queue: VecDeque::new(),
            inflight: HashMap::new(),
            seq: 0,
            last_preemptions: None,
            prev_waiting: 0,
            queue_polls: 0,
            draining: false,
            escalated: false,
            grace: 0,
            cooldown: 0,
            grow_until: f64::NEG_INFINITY,
            window_start: None,
            window_net: 0,
            stats: AimdStats::default(),
        })
    }

    /// The knobs in force.
    pub fn config(&self) -> &AimdConfig {
        &self.config
    }

    /// The current (floating) cap on episodes in flight.
    pub fn cap(&self) -> f64 {
        self.cap
    }

    /// Episodes in flight.
    pub fn inflight(&self) -> usize {
        self.inflight.len()
    }

    /// Episodes waiting to start.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Whether the draining latch is set.
    pub fn draining(&self) -> bool {
        self.draining
    }

    /// What the controller has done so far.
    pub fn stats(&self) -> &AimdStats {
        &self.stats
    }

    /// Queue an episode to start (FIFO). An episode already queued or in flight is refused.
    pub fn submit(&mut self, session: &str) -> Result<()> {
        if self.inflight.contains_key(session) || self.queue.iter().any(|s| s == session) {
            return Err(Error::InvalidInput(format!(
                "episode `{session}` is already queued or in flight"
            )));
        }
        self.queue.push_back(session.to_owned());
        Ok(())
    }

    /// The queued episodes to start now, in FIFO order: while fewer than `floor(cap)` are in
    /// flight and the meter's window has budget.
    pub fn admit(&mut self, now: f64) -> Vec<String> {
        self.roll_window(now);
        let limit = self.cap.floor().max(self.config.min_inflight) as usize;
        let budget = (self.config.meter_min as f64)
            .max((self.cap * self.config.meter_fraction).floor()) as i64;
        let mut started = Vec::new();
        while self.inflight.len() < limit && self.window_net < budget {
            let Some(session) = self.queue.pop_front() else {
                break;
            };
            self.seq += 1;
            self.inflight.insert(
                session.clone(),
                InFlight {
                    started: now,
                    seq: self.seq,
                },
            );
            self.window_net += 1;
            self.stats.admitted += 1;
            started.push(session);
        }
        started
    }

    /// A natural completion: refunds the meter and may grow the cap. Unknown episodes are
    /// refused (a cancelled episode never completes).
    pub fn on_complete(&mut self, now: f64, session: &str) -> Result<()> {
        if self.inflight.remove(session).is_none() {
            return Err(Error::InvalidInput(format!(
                "episode `{session}` is not in flight"
            )));
        }
        self.stats.completed += 1;
        self.roll_window(now);
        self.window_net -= 1;
        let n = (self.inflight.len() + 1) as f64;
        if now <= self.grow_until && n >= self.config.binding_fraction * self.cap {
            self.cap = clamp(&self.config, self.cap * self.config.growth.powf(1.0 / n));
            self.stats.grown += 1;
        }
        Ok(())
    }

    /// One scrape of the engine. Returns the episodes to cancel (already removed from the
    /// in-flight set; the driver aborts them), youngest first.
    pub fn on_poll(&mut self, now: f64, s: &AimdSignals) -> Vec<String> {
        let c = self.config.clone();
        self.stats.polls += 1;
        self.stats.peak_usage = self.stats.peak_usage.max(s.kv_usage);
        if !self.capacity_seen
            && let (Some(kv), Some(len)) = (s.kv_capacity_tokens, s.max_model_len)
            && len > 0
        {
            self.cap = clamp(&c, kv as f64 / len as f64);
            self.capacity_seen = true;
        }
        let preempted = self
            .last_preemptions
            .is_some_and(|last| s.preemptions_total > last);
        self.last_preemptions = Some(s.preemptions_total);
        let queueing = s.running > 0 && s.waiting as f64 > c.queue_ratio * s.running as f64;
        self.queue_polls = if queueing { self.queue_polls + 1 } else { 0 };
        let queue_over = self.queue_polls >= c.queue_polls;
        let hard = preempted || queue_over;
        let soft = (s.waiting > 0 && self.prev_waiting > 0) || s.kv_usage > c.soft_usage;
        self.prev_waiting = s.waiting;
        let inflight = self.inflight.len() as f64;

        if self.draining && inflight <= self.cap && !hard {
            self.draining = false;
            self.grace = c.grace_polls;
        } else if !self.draining && self.grace > 0 && !hard {
            self.grace -= 1;
            if self.grace == 0 {
                self.escalated = false;
            }
        }
        self.cooldown = self.cooldown.saturating_sub(1);
        if !soft && !hard && s.waiting == 0 && !self.draining {
            self.grow_until = now + c.grow_valid_sec;
        } else {
            self.grow_until = f64::NEG_INFINITY;
        }
        if self.draining {
            return Vec::new();
        }
        if hard {
            let f = if self.escalated {
                c.escalated_factor
            } else if preempted {
                c.preempt_factor
            } else {
                c.queue_factor
            };
            self.stats.hard_cuts += 1;
            self.draining = true;
            self.escalated = true;
            self.grace = 0;
            let target = clamp(&c, inflight * f).floor();
            return self.resize_down(target, true);
        }
        if s.kv_usage > c.cut_usage && inflight > 0.0 && self.cooldown == 0 {
            self.stats.soft_cuts += 1;
            self.cooldown = c.cooldown_polls;
            let target = clamp(&c, inflight * c.cut_target / s.kv_usage).floor();
            return self.resize_down(target, s.kv_usage > c.cancel_usage);
        }
        Vec::new()
    }

    fn resize_down(&mut self, target: f64, cancel: bool) -> Vec<String> {
        self.cap = self.cap.min(target);
        let excess = self.inflight.len().saturating_sub(target as usize);
        if !cancel || excess == 0 {
            return Vec::new();
        }
        let mut by_age: Vec<(String, InFlight)> =
            self.inflight.iter().map(|(k, v)| (k.clone(), *v)).collect();
        // Youngest first: latest start, and among equal starts the later admission.
        by_age.sort_by(|a, b| {
            b.1.started
                .total_cmp(&a.1.started)
                .then(b.1.seq.cmp(&a.1.seq))
        });
        let victims: Vec<String> = by_age.into_iter().take(excess).map(|(k, _)| k).collect();
        for v in &victims {
            self.inflight.remove(v);
        }
        self.stats.cancelled += victims.len() as u64;
        victims
    }

    fn roll_window(&mut self, now: f64) {
        match self.window_start {
            Some(start) if now - start < self.config.meter_window_sec => {}
            _ => {
                self.window_start = Some(now);
                self.window_net = 0;
            }
        }
    }
}

fn clamp(c: &AimdConfig, v: f64) -> f64 {
    v.max(c.min_inflight).min(c.max_inflight)
}
