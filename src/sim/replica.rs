//! [`Replica`]: one modelled vLLM replica — scheduler, KV-cache manager and cost model behind
//! the calls a driver makes (add, abort, step, and the two probes the gate asks).
use super::cost::CostModel;
use super::host_tier::HostTier;
use super::kv_manager::{HitMemo, KvManager};
use super::offload::{Offload, OffloadConfig, OffloadStats};
use super::scheduler::{Scheduled, Scheduler, SchedulerLimits, WaitingGate};
use super::{BlockHash, ReplicaConfig, SimRequest, StepOutcome};
use crate::gate::{PrefixReport, UsageReport};
use crate::{Error, Result};

/// Cumulative counters of a replica.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplicaStats {
    /// Steps run.
    pub steps: u64,
    /// Modelled seconds the engine was busy (sum of step durations).
    pub busy_sec: f64,
    /// Preemptions (recompute).
    pub preemptions: u64,
    /// Tokens computed by prefills and decodes.
    pub scheduled_tokens: u64,
    /// Prefill tokens computed (recomputation included).
    pub prefill_tokens: u64,
    /// Requests finished.
    pub finished: u64,
    /// Cached blocks evicted (their hash dropped to reuse the block): 0 means every prefix
    /// computed stayed cached.
    pub evicted_blocks: u64,
}

/// One modelled vLLM replica.
#[derive(Debug)]
pub struct Replica {
    config: ReplicaConfig,
    sched: Scheduler,
    cost: CostModel,
    stats: ReplicaStats,
    step_scratch: Scheduled,
    /// The engine's clock: the driver's time at the last sync, plus the steps run since.
    now: f64,
}

impl Replica {
    /// A replica with an empty cache. Errors name the bad field of `config`.
    pub fn new(config: ReplicaConfig, cost: CostModel) -> Result<Self> {
        let knob = |knob: &'static str, value: u32, why: &'static str| Error::InvalidKnob {
            knob,
            value: value.to_string(),
            why,
        };
        if config.num_blocks < 2 {
            return Err(knob(
                "num_blocks",
                config.num_blocks,
                "at least 2 (the null block and one)",
            ));
        }
        if config.block_size == 0 {
            return Err(knob("block_size", 0, "at least 1"));
        }
        if config.max_num_seqs == 0 {
            return Err(knob("max_num_seqs", 0, "at least 1"));
        }
        if config.max_num_batched_tokens == 0 {
            return Err(knob("max_num_batched_tokens", 0, "at least 1"));
        }
        // One request can hold every non-null block: vLLM's largest usable max_model_len.
        let max_model_len = (config.num_blocks - 1).saturating_mul(config.block_size);
        let kv = KvManager::new(config.num_blocks, config.block_size, max_model_len);
        let limits = SchedulerLimits {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
        };
        Ok(Replica {
            config,
            sched: Scheduler::new(kv, limits),
            cost,
            stats: ReplicaStats::default(),
            step_scratch: Scheduled::default(),
            now: 0.0,
        })
    }

    /// The same replica with a host KV tier (vLLM's native offloading, see
    /// [`super::offload`]); it must be empty (no request added yet).
    pub fn with_offload(mut self, cfg: OffloadConfig) -> Self {
        debug_assert!(self.sched.num_running() + self.sched.num_waiting() == 0);
        self.sched.offload = Some(Offload::new(cfg));
        self
    }

    /// The host tier's transfer counters, if it has one.
    pub fn offload_stats(&self) -> Option<&OffloadStats> {
        self.sched.offload.as_ref().map(Offload::stats)
    }

    /// A session ended (the engine gate's finish): the free cached blocks of `hashes` (its
    /// history's full blocks) past its first `keep` go to the front of the free queue,
    /// deepest first, as `finished_blocks` does in the engine. Returns how many moved.
    pub fn evict_first(&mut self, hashes: &[BlockHash], keep: usize) -> u32 {
        let past = hashes.get(keep..).unwrap_or_default();
        self.sched.kv.pool.evict_first(past.iter().rev().copied())
    }

    /// Moves the engine's clock forward to `now` (the driver's time before a step; the
    /// clock never goes back). Only the host tier's transfers read it.
    pub fn sync_clock(&mut self, now: f64) {
        self.now = self.now.max(now);
    }

    /// The replica's shape.
    pub fn config(&self) -> &ReplicaConfig {
        &self.config
    }

    /// The cost model.
    pub fn cost(&self) -> &CostModel {
        &self.cost
    }

    /// Adds a request at the back of the waiting queue (FCFS).
    pub fn add_request(&mut self, req: SimRequest) -> Result<()> {
        if req.prompt_tokens == 0 {
            return Err(Error::InvalidInput(format!(
                "request {}: empty prompt",
                req.id
            )));
        }
        if req.max_tokens == 0 {
            return Err(Error::InvalidInput(format!(
                "request {}: max_tokens is 0",
                req.id
            )));
        }
        let capacity = u64::from(self.config.num_blocks - 1) * u64::from(self.config.block_size);
        let len = u64::from(req.prompt_tokens) + u64::from(req.max_tokens);
        if len > capacity {
            return Err(Error::InvalidInput(format!(
                "request {}: {len} tokens can never fit in {capacity} KV slots",
                req.id
            )));
        }
        if self.sched.contains(req.id) {
            return Err(Error::InvalidInput(format!(
                "request {}: id already live",
                req.id
            )));
        }
        self.sched.add(req);
        Ok(())
    }

    /// Aborts a request (waiting or running), freeing its blocks as vLLM's abort does.
    pub fn abort_request(&mut self, id: u64) -> bool {
        self.sched.abort(id)
    }

    /// Schedules and runs one engine step; `None` when there is nothing to run.
    pub fn step(&mut self) -> Option<StepOutcome> {
        self.step_gated(None)
    }

    /// [`Self::step`] with `gate` asked about each waiting request the scheduler reaches (the
    /// engine gate's scheduler mode); `None` also when every waiting request is held and
    /// nothing runs.
    pub fn step_gated(&mut self, gate: Option<&mut dyn WaitingGate>) -> Option<StepOutcome> {
        if self.sched.num_running() == 0 && self.sched.num_waiting() == 0 {
            return None;
        }
        let mut step = std::mem::take(&mut self.step_scratch);
        self.sched.now = self.now;
        self.sched.schedule_gated(&mut step, gate);
        if step.entries.is_empty()
            && step.preempted.is_empty()
            && let Some(t) = self
                .sched
                .offload
                .as_ref()
                .and_then(Offload::next_completion)
        {
            // Nothing to compute, but transfers in flight: vLLM's engine keeps stepping
            // (empty steps) until they complete.
            let duration_sec = (t - self.now).max(self.cost.fixed_step_sec());
            self.end_step(duration_sec);
            self.stats.steps += 1;
            self.stats.busy_sec += duration_sec;
            self.step_scratch = step;
            return Some(StepOutcome {
                duration_sec,
                ..StepOutcome::default()
            });
        }
        if step.entries.is_empty() && step.preempted.is_empty() {
            // Nothing fits (only possible when waiting requests cannot be admitted and nothing
            // runs, which add_request's size check rules out), or a gate holds every waiting
            // request; report no progress.
            self.step_scratch = step;
            return None;
        }
        let duration_sec = self.cost.step_time(&step.work);
        let mut outcome = StepOutcome {
            duration_sec,
            finished: Vec::new(),
            preempted: step.preempted.clone(),
            num_scheduled_tokens: step.work.total_tokens,
        };
        self.sched.finish_step(&step, &mut outcome.finished);
        self.end_step(duration_sec);
        let s = &mut self.stats;
        s.steps += 1;
        s.busy_sec += duration_sec;
        s.preemptions += step.preempted.len() as u64;
        s.scheduled_tokens += step.work.total_tokens;
        s.prefill_tokens += step.work.prefill_tokens;
        s.finished += outcome.finished.len() as u64;
        s.evicted_blocks = self.sched.kv.pool.removals();
        self.step_scratch = step;
        Some(outcome)
    }

    /// Advances the clock past a step and lets the host tier see its transfers' progress.
    fn end_step(&mut self, duration_sec: f64) {
        self.now += duration_sec;
        if let Some(off) = &mut self.sched.offload {
            off.end_step(self.now);
        }
    }

    /// O(1): the same fields the real plugin's usage probe answers.
    pub fn usage(&self) -> UsageReport {
        self.probes().usage()
    }

    /// Read-only: what the real plugin's prefix probe would answer for this prompt now.
    pub fn probe_prefix(&self, block_hashes: &[BlockHash], prompt_tokens: u32) -> PrefixReport {
        self.probes().probe_prefix(block_hashes, prompt_tokens)
    }

    /// [`Self::probe_prefix`] through a caller's memo of the same hash chain (keyed by `key`;
    /// see [`HitMemo`]): the same answer, without looking up again the blocks that still hold.
    pub fn probe_prefix_memo(
        &self,
        key: u64,
        block_hashes: &[BlockHash],
        prompt_tokens: u32,
        memo: &mut HitMemo,
    ) -> PrefixReport {
        self.probes()
            .probe_prefix_memo(key, block_hashes, prompt_tokens, memo)
    }

    /// The probes over the replica's KV state and queues now.
    pub fn probes(&self) -> Probes<'_> {
        let probes =
            Probes::new(&self.sched.kv).with_queues(self.num_running(), self.num_waiting());
        match &self.sched.offload {
            Some(off) => probes.with_tier(&off.tier),
            None => probes,
        }
    }

    /// Running requests.
    pub fn num_running(&self) -> usize {
        self.sched.num_running()
    }

    /// Waiting requests (new and preempted).
    pub fn num_waiting(&self) -> usize {
        self.sched.num_waiting()
    }

    /// Cumulative counters.
    pub fn stats(&self) -> &ReplicaStats {
        &self.stats
    }

    /// What the last step scheduled: `(request id, tokens, computed before)` in scheduling
    /// order (empty before the first step).
    pub fn last_scheduled(&self) -> &[(u64, u32, u32)] {
        &self.step_scratch.entries
    }

    /// The scheduler (tests and diagnostics).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }
}

/// The gate's two probes over a KV-cache manager: what the replica answers between steps, and
/// what a [`WaitingGate`] reads in the middle of a step (the engine gate's scheduler mode probes
/// vLLM's block pool in-process, from inside `schedule()`).
#[derive(Debug, Clone, Copy)]
pub struct Probes<'a> {
    kv: &'a KvManager,
    tier: Option<&'a HostTier>,
    /// The scheduler's running and waiting request counts, when known.
    queues: Option<(u64, u64)>,
}

impl<'a> Probes<'a> {
    /// The probes over `kv`, with no host tier.
    pub fn new(kv: &'a KvManager) -> Self {
        Self {
            kv,
            tier: None,
            queues: None,
        }
    }

    /// The same probes also answering the scheduler's request counts: `running` requests
    /// and `waiting` ones (all of them: a scheduler-mode gate takes off those it holds).
    pub fn with_queues(self, running: usize, waiting: usize) -> Self {
        Self {
            queues: Some((running as u64, waiting as u64)),
            ..self
        }
    }

    /// The same probes also reading the host tier `tier` (read-only: lookups do not touch
    /// its recency, as vLLM's `lookup` does not).
    pub fn with_tier(self, tier: &'a HostTier) -> Self {
        Self {
            tier: Some(tier),
            ..self
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.kv.block_size()
    }

    /// O(1): the same fields the real plugin's usage probe answers.
    pub fn usage(&self) -> UsageReport {
        let pool = &self.kv.pool;
        UsageReport {
            kv_cache_usage: pool.usage(),
            num_blocks: u64::from(pool.num_blocks() - 1),
            num_free_blocks: u64::from(pool.num_free_blocks()),
            // The twin keeps this count in O(1), so it always answers it (the real plugin only
            // counts when asked: `count_cached_free`).
            num_cached_free_blocks: Some(u64::from(pool.num_cached_free_blocks())),
            block_size: u64::from(self.kv.block_size()),
            offload_num_blocks: self.tier.map(HostTier::capacity),
            offload_used_blocks: self.tier.map(HostTier::used),
            num_running_reqs: self.queues.map(|q| q.0),
            num_waiting_reqs: self.queues.map(|q| q.1),
        }
    }

    /// What the real plugin's prefix probe would answer for this prompt now.
    pub fn probe_prefix(&self, block_hashes: &[BlockHash], prompt_tokens: u32) -> PrefixReport {
        let hit_blocks = self.kv.count_hit_blocks(block_hashes, prompt_tokens);
        self.prefix_report(hit_blocks, block_hashes, prompt_tokens)
    }

    /// [`Self::probe_prefix`] through a caller's memo of the same hash chain (keyed by `key`).
    pub fn probe_prefix_memo(
        &self,
        key: u64,
        block_hashes: &[BlockHash],
        prompt_tokens: u32,
        memo: &mut HitMemo,
    ) -> PrefixReport {
        let hit_blocks = self
            .kv
            .cache_hit_memo(key, block_hashes, prompt_tokens, memo);
        self.prefix_report(hit_blocks, block_hashes, prompt_tokens)
    }

    fn prefix_report(
        &self,
        hit_blocks: u32,
        block_hashes: &[BlockHash],
        prompt_tokens: u32,
    ) -> PrefixReport {
        let bs = self.kv.block_size();
        let hit_tokens = (u64::from(hit_blocks) * u64::from(bs)).min(u64::from(prompt_tokens));
        // The blocks after the GPU hit the tier holds (ready or being stored: either would be
        // loaded, the latter a step later), up to the prompt's full blocks.
        let offloaded_tokens = self.tier.map(|tier| {
            let end = ((prompt_tokens / bs) as usize).min(block_hashes.len());
            let start = (hit_blocks as usize).min(end);
            let (n, _) = tier.leading_hits(&block_hashes[start..end]);
            (u64::from(n) * u64::from(bs)).min(u64::from(prompt_tokens) - hit_tokens)
        });
        PrefixReport {
            hit_ratio: if prompt_tokens == 0 {
                0.0
            } else {
                hit_tokens as f64 / f64::from(prompt_tokens)
            },
            hit_blocks: u64::from(hit_blocks),
            hit_tokens,
            prompt_tokens: u64::from(prompt_tokens),
            offloaded_tokens,
        }
    }
}
