//! Modes `aimd` and `pause` in virtual time: the production baselines' controllers
//! ([`crate::baselines`], the same code the real-engine bench drives) fed by the replica's own
//! signals, exactly as the bench feeds them from vLLM.
//!
//! - `aimd` scrapes the replica every poll interval (KV usage as vLLM computes it, requests
//!   running and waiting, the cumulative preemption counter, capacity `num_blocks × block_size`
//!   and a `max_model_len` of the workload's longest sequence + 64, like the real bench's
//!   engine), starts the sessions the controller admits, and cancels the ones it cancels: the
//!   driver aborts the session's request and the session re-runs from its first turn.
//! - `pause` counts tokens per session (prompt before a turn, prompt + output after it) and ticks
//!   every scheduler interval; a held turn is admitted when a tick resumes its session.
use std::collections::HashMap;

use super::mode::{Ctx, Mode, SessionIx};
use crate::baselines::{
    AimdConfig, AimdController, AimdSignals, AimdStats, PauseConfig, PauseController, PauseDecision,
};
use crate::error::{Error, Result};

fn id(s: SessionIx) -> String {
    s.to_string()
}

fn ix(id: &str) -> Result<SessionIx> {
    id.parse()
        .map_err(|_| Error::InvalidInput(format!("baseline returned a bad session id `{id}`")))
}

/// prime-rl's adaptive episode concurrency.
#[derive(Debug)]
pub(crate) struct AimdMode {
    ctl: AimdController,
    next_poll: f64,
    max_model_len: Option<u64>,
}

impl AimdMode {
    pub(crate) fn new(config: AimdConfig) -> Result<Self> {
        Ok(Self {
            ctl: AimdController::new(config)?,
            next_poll: 0.0,
            max_model_len: None,
        })
    }

    fn pump(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        for s in self.ctl.admit(ctx.now()) {
            ctx.start(ix(&s)?);
        }
        Ok(())
    }
}

impl Mode for AimdMode {
    fn session_arrived(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        self.ctl.submit(&id(s))?;
        self.pump(ctx)
    }

    fn turn_ready(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        ctx.admit(s, "aimd");
        Ok(())
    }

    fn session_finished(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        self.ctl.on_complete(ctx.now(), &id(s))?;
        self.pump(ctx)
    }

    fn next_wake(&mut self) -> Option<f64> {
        Some(self.next_poll)
    }

    fn aimd_stats(&self) -> Option<AimdStats> {
        Some(self.ctl.stats().clone())
    }

    fn wake(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        let replica = ctx.replica();
        let cfg = replica.config();
        let longest = *self.max_model_len.get_or_insert_with(|| {
            ctx.clients
                .iter()
                .map(|c| {
                    let s = &c.spec;
                    let turns: u64 = s
                        .turns
                        .iter()
                        .map(|t| u64::from(t.append) + u64::from(t.output))
                        .sum();
                    u64::from(s.system_tokens) + u64::from(s.task_tokens) + turns + 64
                })
                .max()
                .unwrap_or(1)
        });
        let signals = AimdSignals {
            kv_usage: replica.usage().kv_cache_usage,
            running: replica.num_running() as u64,
            waiting: replica.num_waiting() as u64,
            preemptions_total: replica.stats().preemptions,
            kv_capacity_tokens: Some(u64::from(cfg.num_blocks) * u64::from(cfg.block_size)),
            max_model_len: Some(longest),
        };
        let now = ctx.now();
        for victim in self.ctl.on_poll(now, &signals) {
            let s = ix(&victim)?;
            ctx.cancel(s);
            // The bench finishes the same work in every mode: the episode runs again.
            self.ctl.submit(&victim)?;
        }
        self.next_poll = now + self.ctl.config().poll_interval_sec;
        self.pump(ctx)
    }
}

/// ThunderAgent's tool-boundary pausing.
#[derive(Debug)]
pub(crate) struct PauseMode {
    config: PauseConfig,
    ctl: Option<PauseController>,
    held: HashMap<SessionIx, &'static str>,
    next_tick: f64,
}

impl PauseMode {
    pub(crate) fn new(config: PauseConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            next_tick: config.scheduler_interval_sec,
            config,
            ctl: None,
            held: HashMap::new(),
        })
    }

    /// The controller, built on first use from the replica's capacity (read once, as upstream).
    fn ctl(&mut self, ctx: &Ctx<'_>) -> Result<&mut PauseController> {
        if self.ctl.is_none() {
            let c = ctx.replica().config();
            let capacity = u64::from(c.num_blocks) * u64::from(c.block_size);
            self.ctl = Some(PauseController::new(self.config.clone(), capacity)?);
        }
        Ok(self.ctl.as_mut().expect("just built"))
    }
}

impl Mode for PauseMode {
    fn turn_ready(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        let (now, prompt) = (ctx.now(), u64::from(ctx.turn(s).prompt_tokens));
        match self.ctl(ctx)?.before_request(now, &id(s), prompt) {
            PauseDecision::Admit => ctx.admit(s, "active"),
            PauseDecision::Hold(reason) => {
                self.held.insert(s, reason);
            }
        }
        Ok(())
    }

    fn turn_finished(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        // The history already holds this turn's output: prompt + output tokens.
        let (now, total) = (ctx.now(), u64::from(ctx.turn(s).prompt_tokens));
        self.ctl(ctx)?.after_request(now, &id(s), total)?;
        Ok(())
    }

    fn session_finished(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        self.ctl(ctx)?.finish(&id(s));
        Ok(())
    }

    fn next_wake(&mut self) -> Option<f64> {
        Some(self.next_tick)
    }

    fn wake(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        let now = ctx.now();
        let tick = self.ctl(ctx)?.tick(now);
        for resumed in tick.resumed {
            let s = ix(&resumed)?;
            if let Some(reason) = self.held.remove(&s) {
                ctx.admit(s, reason);
            }
        }
        self.next_tick = now + self.config.scheduler_interval_sec;
        Ok(())
    }
}
