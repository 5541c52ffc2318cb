//! The replica twin's engine model: a sans-IO, deterministic model of one vLLM 0.32 V1 replica
//! (block pool, KV-cache manager, scheduler) with a step-time cost model per hardware/model
//! profile. No I/O, no wall clock: the driver (`driver`) owns virtual time and calls
//! [`Replica::step`], advancing its clock by each step's `duration_sec`.
//!
//! Parts, one job each:
//! - [`block_pool`]: vLLM's `BlockPool` and free-queue order, exactly (a differential test drives
//!   it against the installed vLLM after every operation: `tests/python/test_sim_block_pool.py`);
//! - [`kv_manager`]: prefix lookup, `allocate_slots`, caching of full blocks, freeing tail first;
//! - [`scheduler`]: `Scheduler.schedule()` / `update_from_output()` (FCFS, chunked prefill,
//!   preemption by recompute of the last admitted request, `num_cached_tokens`);
//! - [`cost`]: the step-time model and the embedded profiles (`profiles/*.toml`);
//! - [`host_tier`] and [`offload`]: the host (CPU) KV tier of vLLM's native offloading, off
//!   unless asked for (`--offload-gb`): its block accounting and LRU exactly (a differential
//!   test drives it against vLLM's own manager: `tests/python/test_sim_host_tier.py`), stores
//!   of computed prompt blocks, asynchronous loads at admission, and the transfers' timing;
//! - [`replica`]: the facade the driver uses ([`Replica`]), and the gate's probes over the KV
//!   state ([`Probes`]).
//!
//! A [`scheduler::WaitingGate`] passed to [`Replica::step_gated`] is asked about each waiting
//! request the scheduler reaches and may hold it in place (the engine gate's scheduler mode);
//! [`Replica::step`] has none.
//!
//! # Interface notes for the driver
//! - [`Replica::add_request`] returns `crate::Result<()>`: a request with no prompt, no output
//!   tokens, a duplicate id, or one that can never fit in the pool is refused with
//!   `Error::InvalidInput` (vLLM refuses such requests too, at input processing).
//! - [`SimRequest::block_hashes`] must cover every full block of prompt + `max_tokens` outputs
//!   (`(prompt_tokens + max_tokens) / block_size` hashes); extra hashes are ignored, missing
//!   ones mean those blocks are never cached.
//! - [`FinishedRequest`] also carries `num_preemptions` (how often that request was recomputed).
//! - [`ReplicaConfig::from_profile`] gives the profile's replica shape.
//! - The model is synchronous scheduling (schedule, run, update). vLLM 0.32 turns on async
//!   scheduling by default on GPUs (its CPU platform turns it off), which overlaps the next
//!   step's scheduling with the model run; it changes the timing of outputs by at most one step
//!   and is folded into the fitted costs. What the profile's `async_scheduling` does change is
//!   when a probe is answered (see `driver`): after the next step is scheduled, or before.
use std::sync::Arc;

pub mod block_pool;
pub mod cost;
pub mod driver;
pub mod fleet;
pub mod host_tier;
pub mod kv_manager;
pub mod offload;
pub mod replica;
pub mod scheduler;

pub use cost::{CostModel, EngineRecord, MachineRecord, StepWork};

/// Whether a finished session's blocks are evicted first (`SESSION_GATE_FINISHED_BLOCKS`, the
/// engine's knob: the twin models the engine the process would start); an invalid value is an
/// error naming the knob.
pub fn finished_blocks_first() -> crate::Result<bool> {
    let value = crate::gate::knobs::row("finished_blocks").from_env()?;
    Ok(value == crate::gate::knobs::Value::Name("first"))
}
pub use replica::{Probes, Replica, ReplicaStats};

/// A block's chained hash: any value that is equal iff the whole prefix up to and including the
/// block is equal (a token-block id sequence is enough; real hash bytes are not needed).
pub type BlockHash = u64;

/// One request as a client submits it to the replica.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// The caller's id (unique among live requests).
    pub id: u64,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Exactly this many output tokens are generated (the bench uses ignore_eos).
    pub max_tokens: u32,
    /// Chained hashes of every FULL block of the whole sequence (prompt followed by its outputs),
    /// in order, like vLLM's `request.block_hashes` once all tokens exist. Blocks whose tokens
    /// are not computed yet are only hashed/cached by the replica once they are computed, as vLLM
    /// does. Two requests share a block iff they share the hash at that index.
    pub block_hashes: Arc<[BlockHash]>,
}

/// The replica's shape: vLLM's KV geometry and scheduler limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// KV blocks including vLLM's null block, like `num_gpu_blocks`.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// `max_num_seqs`.
    pub max_num_seqs: u32,
    /// `max_num_batched_tokens`.
    pub max_num_batched_tokens: u32,
}

impl ReplicaConfig {
    /// The shape a cost profile implies.
    pub fn from_profile(cost: &CostModel) -> Self {
        ReplicaConfig {
            num_blocks: cost.shape.num_blocks,
            block_size: cost.shape.block_size,
            max_num_seqs: cost.shape.max_num_seqs,
            max_num_batched_tokens: cost.shape.max_num_batched_tokens,
        }
    }
}

/// What one engine step did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutcome {
    /// Modelled time of the step, in seconds.
    pub duration_sec: f64,
    /// Requests that produced their last token in this step (in scheduling order).
    pub finished: Vec<FinishedRequest>,
    /// Requests preempted (recompute) in this step, in preemption order.
    pub preempted: Vec<u64>,
    /// Tokens the step computed (prefill and decode).
    pub num_scheduled_tokens: u64,
}

/// A request that finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishedRequest {
    /// The request's id.
    pub id: u64,
    /// vLLM's `num_cached_tokens` for this request (as the real engine reports it: the prefix
    /// hit at its first admission, kept across preemptions).
    pub num_cached_tokens: u32,
    /// How often this request was preempted and recomputed.
    pub num_preemptions: u32,
}
