//! The limit: a workload run with no gate on the same engine (profile, block size,
//! `max_num_seqs`, token budget) whose GPU cache never runs out, so no cached block is ever
//! evicted and nothing is preempted. Its makespan is a floor no admission policy on a finite
//! cache can reach; a mode's makespan over it (`over_limit`) is how much the finite cache costs
//! that mode.
//!
//! "Never runs out" is made exact, not a big number: [`unlimited_blocks`] sizes the pool so that
//! every block the run can ever allocate is a never-used one (vLLM's free queue hands out blocks
//! front first and only reuses a freed block after every never-used one is gone), and
//! [`check_unlimited`] refuses a run whose replica evicted a cached block or preempted a request
//! anyway.
use crate::error::{Error, Result};
use crate::sim::ReplicaConfig;

use super::SimOutput;
use super::spec::SessionSpec;

/// The limit mode's name (twin only: the real engine's cache is what it is).
pub const LIMIT_MODE: &str = "limit";

/// Blocks (the null block included) that one run of `sessions` can allocate, at most, when no
/// cached block is ever evicted.
///
/// Why this bound holds: a session's turn `k` finds every full block of its previous turn's
/// sequence cached (nothing was evicted), so it allocates blocks from there up to the end of
/// its own prompt + output: at most its new tokens' blocks plus two partial ones (the one the
/// previous turn left partial, and its own last one). Over a session that is at most
/// `ceil(final_tokens / block_size) + 2 * turns` blocks. Sessions are counted apart (two
/// sessions may both prefill the shared system prompt before either caches it), and no
/// request is preempted (allocation never fails), so nothing is recomputed.
pub fn unlimited_blocks(sessions: &[SessionSpec], block_size: u32) -> Result<u32> {
    if block_size == 0 {
        return Err(Error::InvalidInput(
            "limit: block_size is 0 (at least 1)".into(),
        ));
    }
    let per_session = |s: &SessionSpec| {
        s.final_tokens().div_ceil(u64::from(block_size)) + 2 * s.turns.len() as u64
    };
    let blocks: u64 = 1 + sessions.iter().map(per_session).sum::<u64>();
    // A pool needs the null block and one more.
    u32::try_from(blocks.max(2)).map_err(|_| {
        Error::InvalidInput(format!(
            "limit: the workload needs {blocks} KV blocks of {block_size} tokens to never evict, \
             more than a pool can index (2^32)"
        ))
    })
}

/// `shape` with a pool no step of `steps` (each run on a fresh replica) can exhaust; every
/// other field (block size, `max_num_seqs`, `max_num_batched_tokens`) is kept, so the limit
/// runs the same engine.
pub fn limit_config(shape: ReplicaConfig, steps: &[Vec<SessionSpec>]) -> Result<ReplicaConfig> {
    let mut num_blocks = 2;
    for sessions in steps {
        num_blocks = num_blocks.max(unlimited_blocks(sessions, shape.block_size)?);
    }
    Ok(ReplicaConfig {
        num_blocks,
        ..shape
    })
}

/// Refuses a limit run that was not unlimited after all: its replica evicted a cached block
/// or preempted a request (a pool smaller than [`limit_config`]'s).
pub fn check_unlimited(out: &SimOutput) -> Result<()> {
    let s = &out.replica_stats;
    if s.evicted_blocks > 0 || s.preemptions > 0 {
        return Err(Error::InvalidInput(format!(
            "mode {LIMIT_MODE}: the replica evicted {} cached blocks and preempted {} requests, \
             so its cache was not unlimited (run it on limit_config's shape)",
            s.evicted_blocks, s.preemptions
        )));
    }
    Ok(())
}
