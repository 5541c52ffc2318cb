//! vLLM 0.32's V1 `Scheduler.schedule()` and `update_from_output()` (`v1/core/sched/scheduler.py`)
//! for the engines the twin models: FCFS policy, chunked prefill on, no speculative decoding, no
//! KV connector, `long_prefill_token_threshold` 0 and `watermark` 0 (the defaults), synchronous
//! steps.
//!
//! The rules, in vLLM's order:
//! 1. RUNNING requests first, in admission order, each getting `min(tokens it still needs,
//!    token budget)` tokens (a decode needs 1, an unfinished chunked prefill the rest of its
//!    prompt). When its blocks cannot be allocated, the LAST running request is preempted (its
//!    blocks freed tail first, `num_computed_tokens` reset to 0, pushed to the FRONT of the
//!    waiting queue), again and again until the allocation fits or the request preempted itself.
//!    A request that cannot be scheduled ends the running pass.
//! 2. WAITING requests only if nothing was preempted in this step, FCFS, while the token budget
//!    lasts and fewer than `max_num_seqs` run: a prefix-cache lookup, then `allocate_slots` with
//!    the whole current sequence required to fit (`scheduler_reserve_full_isl`); the first one
//!    that does not fit ends the pass.
//! 3. After the step, a request whose computed tokens reach its length samples one token; one that
//!    has `max_tokens` outputs finishes and frees its blocks (in scheduling order).
//!
//! A [`WaitingGate`] (the engine gate's scheduler mode, twin mode `sched`) may hold waiting
//! requests: the waiting pass asks it about each request it reaches, and a held request is
//! skipped, staying where it is in the queue, while the pass goes on with the requests behind it
//! (vLLM's `_handle_blocked_waiting_request`). Without a gate the pass is exactly rule 2.
//!
//! With a host KV tier ([`Offload`], vLLM's native offloading connector), the waiting pass
//! also looks up the tier after the GPU prefix hit and admits a request whose next blocks are
//! there with an asynchronous load (it waits in the queue, holding its blocks, until the load
//! completes), and each step offers the scheduled requests' new prompt blocks to the tier
//! (see [`super::offload`]). Without a tier none of this runs.
//!
//! `num_cached_tokens` (what the engine reports in the request's final output) is the prefix hit
//! found when the request is admitted for the first time; a request preempted and re-admitted
//! keeps that first value (`PrefillStats.set` runs only while `num_preemptions == 0`).
use std::collections::VecDeque;

use super::block_pool::{BlockId, IdMap};
use super::cost::StepWork;
use super::kv_manager::{HitMemo, KvManager, ReqKv};
use super::offload::{ExtHit, Offload};
use super::{FinishedRequest, SimRequest};

/// Scheduler limits (vLLM's `SchedulerConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// `max_num_seqs`.
    pub max_num_seqs: u32,
    /// `max_num_batched_tokens` (the per-step token budget).
    pub max_num_batched_tokens: u32,
}

#[derive(Debug)]
struct ReqState {
    req: SimRequest,
    num_output: u32,
    num_computed: u32,
    num_preemptions: u32,
    /// Set at the first admission.
    num_cached_tokens: Option<u32>,
    kv: ReqKv,
}

impl ReqState {
    fn num_tokens(&self) -> u32 {
        self.req.prompt_tokens + self.num_output
    }
}

/// Asked by the waiting pass about each waiting request it reaches, before the request's
/// prefix lookup: the twin's `Scheduler._handle_blocked_waiting_request`, which the engine gate's
/// scheduler mode wraps. It reads the KV state as the step has left it so far (read-only: the
/// gate's probes).
pub trait WaitingGate {
    /// Whether `req` may be scheduled in this step; `false` skips it for this step and leaves
    /// it where it is in the waiting queue. `queues` is `(running, waiting)` as the step has
    /// left them so far (`req` and the requests skipped before it are still waiting).
    fn may_schedule(&mut self, req: &SimRequest, kv: &KvManager, queues: (usize, usize)) -> bool;
}

/// What one step scheduled, for the cost model and the caller.
#[derive(Debug, Default, Clone)]
pub struct Scheduled {
    /// `(request id, tokens scheduled, tokens computed before)` in scheduling order.
    pub entries: Vec<(u64, u32, u32)>,
    /// Requests preempted in this step, in preemption order.
    pub preempted: Vec<u64>,
    /// The step's work, for the cost model.
    pub work: StepWork,
}

/// The scheduler: the waiting and running queues over a [`KvManager`].
#[derive(Debug)]
pub struct Scheduler {
    /// The KV-cache manager (public for probes).
    pub kv: KvManager,
    limits: SchedulerLimits,
    reqs: IdMap<u64, ReqState>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    hit_scratch: Vec<BlockId>,
    /// The waiting head's hit chain: vLLM looks the head up again on every step it cannot be
    /// admitted; the memo makes that lookup O(1) while the cached map lost nothing.
    head_memo: HitMemo,
    /// Cumulative preemptions.
    pub num_preemptions: u64,
    /// The host KV tier, if the engine has one.
    pub offload: Option<Offload>,
    /// The engine's clock at the start of the step being scheduled (the tier's transfers run
    /// on it).
    pub now: f64,
}

impl Scheduler {
    /// A scheduler over `kv` with these limits.
    pub fn new(kv: KvManager, limits: SchedulerLimits) -> Self {
        Scheduler {
            kv,
            limits,
            reqs: IdMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            hit_scratch: Vec::new(),
            head_memo: HitMemo::default(),
            num_preemptions: 0,
            offload: None,
            now: 0.0,
        }
    }

    /// Whether a request with this id is waiting or running.
    pub fn contains(&self, id: u64) -> bool {
        self.reqs.contains_key(&id)
    }

    /// Running requests.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Waiting requests (new and preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Ids of the running requests in admission order (tests).
    pub fn running_ids(&self) -> &[u64] {
        &self.running
    }

    /// Ids of the waiting requests, front first (tests).
    pub fn waiting_ids(&self) -> Vec<u64> {
        self.waiting.iter().copied().collect()
    }

    /// Tokens a request has computed so far, if it is known (tests).
    pub fn num_computed(&self, id: u64) -> Option<u32> {
        self.reqs.get(&id).map(|r| r.num_computed)
    }

    /// Outputs a request has generated so far, if it is known (tests).
    pub fn num_output(&self, id: u64) -> Option<u32> {
        self.reqs.get(&id).map(|r| r.num_output)
    }

    /// Adds a request at the back of the waiting queue (the caller checked the id is new).
    pub fn add(&mut self, req: SimRequest) {
        let id = req.id;
        self.reqs.insert(
            id,
            ReqState {
                req,
                num_output: 0,
                num_computed: 0,
                num_preemptions: 0,
                num_cached_tokens: None,
                kv: ReqKv::default(),
            },
        );
        self.waiting.push_back(id);
    }

    /// Aborts a request wherever it is, freeing its blocks like `finish_requests`.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(mut st) = self.reqs.remove(&id) else {
            return false;
        };
        if let Some(pos) = self.running.iter().position(|&r| r == id) {
            self.running.remove(pos);
        } else if let Some(pos) = self.waiting.iter().position(|&r| r == id) {
            self.waiting.remove(pos);
        }
        self.kv.free(&mut st.kv);
        if let Some(off) = &mut self.offload {
            off.finish(id);
        }
        true
    }

    /// `schedule()`: picks this step's tokens and advances `num_computed_tokens`.
    pub fn schedule(&mut self, out: &mut Scheduled) {
        self.schedule_gated(out, None);
    }

    /// [`Self::schedule`] with `gate` asked about each waiting request the pass reaches; the
    /// requests it holds are skipped in place.
    pub fn schedule_gated(&mut self, out: &mut Scheduled, mut gate: Option<&mut dyn WaitingGate>) {
        out.entries.clear();
        out.preempted.clear();
        out.work = StepWork::default();
        let mut budget = self.limits.max_num_batched_tokens;

        // 1. Running requests.
        let mut idx = 0;
        while idx < self.running.len() && budget > 0 {
            let id = self.running[idx];
            let st = self.reqs.get_mut(&id).expect("running request is known");
            let need = st.num_tokens() - st.num_computed;
            let n = need.min(budget);
            if n == 0 {
                idx += 1;
                continue;
            }
            let mut scheduled = false;
            loop {
                let st = self.reqs.get_mut(&id).expect("running request is known");
                let (computed, num_tokens) = (st.num_computed, st.num_tokens());
                let ok = self.kv.allocate_slots(
                    &mut st.kv,
                    computed,
                    n,
                    &[],
                    num_tokens,
                    &st.req.block_hashes,
                    false,
                );
                if ok {
                    scheduled = true;
                    break;
                }
                let victim = self.running.pop().expect("the request itself is running");
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == id {
                    break;
                }
            }
            if !scheduled {
                break;
            }
            self.record(id, n, out);
            budget -= n;
            idx += 1;
        }

        // 2. Waiting requests, only when nothing was preempted. `pos` passes over the requests
        // a gate holds (always 0 without a gate: the queue's front).
        if out.preempted.is_empty() {
            let mut pos = 0;
            while budget > 0
                && (self.running.len() as u32) < self.limits.max_num_seqs
                && let Some(&id) = self.waiting.get(pos)
            {
                if let Some(off) = &mut self.offload
                    && off.is_loading(id)
                {
                    // WAITING_FOR_REMOTE_KVS: skipped until its load completes, then
                    // scheduled with the loaded tokens computed.
                    if !off.load_done(id) {
                        pos += 1;
                        continue;
                    }
                    let st = self.reqs.get_mut(&id).expect("waiting request is known");
                    let num_tokens = st.num_tokens();
                    let computed = st.num_computed.min(num_tokens - 1);
                    let n = (num_tokens - computed).min(budget);
                    let ok = self.kv.allocate_slots(
                        &mut st.kv,
                        computed,
                        n,
                        &[],
                        num_tokens,
                        &st.req.block_hashes,
                        true,
                    );
                    if !ok {
                        break;
                    }
                    off.consume_load(id);
                    st.num_computed = computed;
                    self.waiting.remove(pos);
                    self.running.push(id);
                    self.record(id, n, out);
                    budget -= n;
                    continue;
                }
                if let Some(gate) = gate.as_deref_mut() {
                    let st = self.reqs.get(&id).expect("waiting request is known");
                    let queues = (self.running.len(), self.waiting.len());
                    if !gate.may_schedule(&st.req, &self.kv, queues) {
                        pos += 1;
                        continue;
                    }
                }
                let st = self.reqs.get_mut(&id).expect("waiting request is known");
                let num_tokens = st.num_tokens();
                // Waiting requests always have num_computed 0 here (new or preempted).
                self.kv
                    .cache_hit_memo(id, &st.req.block_hashes, num_tokens, &mut self.head_memo);
                self.hit_scratch.clear();
                self.hit_scratch.extend(self.head_memo.blocks());
                let hit_tokens = self.hit_scratch.len() as u32 * self.kv.block_size();
                if let Some(off) = &mut self.offload {
                    let bs = self.kv.block_size();
                    let gpu_blocks = self.hit_scratch.len() as u32;
                    match off.lookup(&st.req.block_hashes, gpu_blocks, num_tokens / bs) {
                        ExtHit::Defer => {
                            pos += 1;
                            continue;
                        }
                        ExtHit::Blocks(0) => {}
                        ExtHit::Blocks(ext) => {
                            let ext_tokens = ext * bs;
                            if !self.kv.allocate_for_load(
                                &mut st.kv,
                                &self.hit_scratch,
                                ext_tokens,
                                num_tokens,
                            ) {
                                break;
                            }
                            if st.num_preemptions == 0 {
                                st.num_cached_tokens = Some(hit_tokens + ext_tokens);
                            }
                            st.num_computed = hit_tokens + ext_tokens;
                            off.start_load(id, &st.req.block_hashes, gpu_blocks, ext, self.now);
                            pos += 1;
                            continue;
                        }
                    }
                }
                if st.num_preemptions == 0 {
                    st.num_cached_tokens = Some(hit_tokens);
                }
                let n = (num_tokens - hit_tokens).min(budget);
                let ok = self.kv.allocate_slots(
                    &mut st.kv,
                    0,
                    n,
                    &self.hit_scratch,
                    num_tokens,
                    &st.req.block_hashes,
                    true,
                );
                if !ok {
                    break;
                }
                st.num_computed = hit_tokens;
                self.waiting.remove(pos);
                self.running.push(id);
                self.record(id, n, out);
                budget -= n;
            }
        }
        if let Some(off) = &mut self.offload {
            let bs = self.kv.block_size();
            for &(id, n, before) in &out.entries {
                let st = &self.reqs[&id];
                off.offer(
                    id,
                    &st.req.block_hashes,
                    before + n,
                    st.req.prompt_tokens,
                    bs,
                );
            }
            off.after_stores();
        }
    }

    /// Adds a scheduled request to the step and advances its computed tokens.
    fn record(&mut self, id: u64, n: u32, out: &mut Scheduled) {
        let st = self.reqs.get_mut(&id).expect("scheduled request is known");
        let before = st.num_computed;
        let num_tokens = st.num_tokens();
        out.entries.push((id, n, before));
        out.work.add(n, before, num_tokens, st.num_output);
        st.num_computed += n;
    }

    /// `_preempt_request`: frees the blocks and puts the request at the front of the queue.
    fn preempt(&mut self, id: u64) {
        let st = self.reqs.get_mut(&id).expect("preempted request is known");
        self.kv.free(&mut st.kv);
        st.num_computed = 0;
        st.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(id);
    }

    /// `update_from_output()` after the step ran: samples tokens, finishes and frees requests.
    pub fn finish_step(&mut self, step: &Scheduled, finished: &mut Vec<FinishedRequest>) {
        let mut any_finished = false;
        for &(id, _, _) in &step.entries {
            let st = self.reqs.get_mut(&id).expect("scheduled request is known");
            if st.num_computed < st.num_tokens() {
                continue; // a chunk of a longer prefill: no token sampled
            }
            st.num_output += 1;
            if st.num_output >= st.req.max_tokens {
                let mut st = self.reqs.remove(&id).expect("known");
                self.kv.free(&mut st.kv);
                if let Some(off) = &mut self.offload {
                    off.finish(id);
                }
                finished.push(FinishedRequest {
                    id,
                    num_cached_tokens: st.num_cached_tokens.unwrap_or(0),
                    num_preemptions: st.num_preemptions,
                });
                any_finished = true;
            }
        }
        if any_finished {
            let reqs = &self.reqs;
            self.running.retain(|id| reqs.contains_key(id));
        }
    }
}
