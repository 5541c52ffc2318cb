//! Residency probes: which leading blocks of a prompt vLLM would report as cached.
//!
//! vLLM's rule (`KVCacheManager.get_computed_blocks` → `FullAttentionManager
//! .find_longest_cache_hit`): only full blocks have hashes; at most
//! `(num_prompt_tokens - 1) / block_size` blocks are looked up, because the last prompt token is
//! always recomputed to get logits; the walk starts at block 0 and stops at the first hash that
//! is not in `BlockPool.cached_block_hash_to_block`. Hashes chain, so nothing after a miss can
//! hit.
//!
//! [`ChainCache`] runs that walk with lazy hashing and remembers each session's hash chain, so a
//! session whose prompt grows by one turn only pays for the new blocks. With a [`Residency`]
//! that hands out witnesses, it also remembers what each lookup found, so re-checking a resident
//! prefix costs one pointer comparison per block instead of a map lookup.

mod chain;
mod chain_cache;
mod residency;

pub use chain_cache::ChainCache;
pub use residency::{Lookup, NoWitness, Residency};

/// What one longest-prefix walk found, and what it cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalkResult {
    /// Leading blocks whose hashes are resident (vLLM's cache hit, in blocks).
    pub hit_blocks: usize,
    /// `hit_blocks * block_size`: the tokens vLLM would report as cached.
    pub hit_tokens: usize,
    /// Length of the probed prompt.
    pub prompt_tokens: usize,
    /// Blocks whose vLLM hash had to be computed by this walk.
    pub blocks_hashed: usize,
    /// Blocks whose hash came from the session's cached chain.
    pub blocks_reused: usize,
    /// Hits proven by a witness from an earlier walk, without a lookup in the engine's map.
    pub blocks_rechecked: usize,
}

impl WalkResult {
    /// `hit_tokens / prompt_tokens` (0 for an empty prompt).
    pub fn hit_ratio(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// The most blocks vLLM looks up for a prompt: `(prompt_tokens - 1) / block_size`
/// (0 for an empty prompt or a zero block size).
pub fn max_hit_blocks(prompt_tokens: usize, block_size: usize) -> usize {
    if block_size == 0 {
        return 0;
    }
    prompt_tokens.saturating_sub(1) / block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_token_is_always_recomputed() {
        assert_eq!(max_hit_blocks(0, 16), 0);
        assert_eq!(max_hit_blocks(1, 16), 0);
        assert_eq!(max_hit_blocks(16, 16), 0);
        assert_eq!(max_hit_blocks(17, 16), 1);
        assert_eq!(max_hit_blocks(32, 16), 1);
        assert_eq!(max_hit_blocks(33, 16), 2);
        assert_eq!(max_hit_blocks(100, 0), 0);
    }

    #[test]
    fn hit_ratio_handles_empty_prompts() {
        assert_eq!(WalkResult::default().hit_ratio(), 0.0);
        let r = WalkResult {
            hit_tokens: 16,
            prompt_tokens: 64,
            ..WalkResult::default()
        };
        assert_eq!(r.hit_ratio(), 0.25);
    }
}
