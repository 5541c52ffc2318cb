//! Token identity in the twin: the chained block hashes of each session's history, kept
//! incrementally (each turn hashes only its new full blocks).
//!
//! The real bench draws token ids from a seed: one system prompt shared by every session (a
//! session uses its first `system_tokens`), then tokens unique to the session (task, tool
//! results, the model's outputs). Only block identity matters to vLLM's prefix cache, so the
//! twin names each block's contents instead of drawing tokens: a block lying wholly inside the
//! session's system prefix has contents `("system", block index)` — the same in every session —
//! and any other block has contents unique to `(session, block index)`. Chaining each block's
//! hash to its parent's, as vLLM does, makes two sessions share exactly their common leading
//! system blocks, and a session share every earlier turn's blocks with its next prompt.
use std::sync::Arc;

use crate::sim::BlockHash;

/// SplitMix64's finaliser: a cheap bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of a block given its parent's hash and a name for its contents.
fn chain(parent: BlockHash, contents: u64) -> BlockHash {
    mix64(parent ^ mix64(contents).rotate_left(17))
}

/// Tags that keep the content names of the three kinds of input apart.
const SYSTEM: u64 = 0x5359_5354_454d_0000;
const SESSION: u64 = 0x5345_5353_494f_4e00;
/// The parent hash of a sequence's first block (vLLM's `NONE_HASH` plays this part).
const ROOT: u64 = 0x6e6f_6e65_6861_7368;

/// One session's history, as full-block hashes grown turn by turn.
#[derive(Debug, Clone)]
pub struct HashChain {
    seed: u64,
    session: u64,
    system_tokens: u64,
    block_size: u64,
    hashes: Vec<BlockHash>,
}

impl HashChain {
    /// An empty history for session number `session` (its index in the workload) of a run
    /// seeded with `seed`. `block_size` must be > 0.
    pub fn new(seed: u64, session: u64, system_tokens: u32, block_size: u32) -> Self {
        assert!(block_size > 0, "block_size must be > 0");
        Self {
            seed,
            session,
            system_tokens: u64::from(system_tokens),
            block_size: u64::from(block_size),
            hashes: Vec::new(),
        }
    }

    /// Hashes the new full blocks of a history now `tokens` long; O(new blocks).
    pub fn extend_to(&mut self, tokens: u64) {
        let full = (tokens / self.block_size) as usize;
        self.hashes.reserve(full.saturating_sub(self.hashes.len()));
        while self.hashes.len() < full {
            let i = self.hashes.len() as u64;
            let parent = self.hashes.last().copied().unwrap_or(ROOT ^ self.seed);
            let contents = if (i + 1) * self.block_size <= self.system_tokens {
                mix64(SYSTEM ^ self.seed) ^ i
            } else {
                mix64(SESSION ^ self.seed ^ mix64(self.session)) ^ i
            };
            self.hashes.push(chain(parent, contents));
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size as u32
    }

    /// Every full block's hash so far.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// The first `blocks` hashes as the shared slice a request carries.
    pub fn snapshot(&self, blocks: usize) -> Arc<[BlockHash]> {
        Arc::from(&self.hashes[..blocks.min(self.hashes.len())])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_share_exactly_their_common_system_blocks() {
        let mut a = HashChain::new(7, 0, 100, 16);
        let mut b = HashChain::new(7, 1, 70, 16);
        a.extend_to(200);
        b.extend_to(200);
        // b's system prefix fills 4 whole blocks (64 tokens); block 4 straddles 70.
        assert_eq!(a.hashes()[..4], b.hashes()[..4]);
        assert!(
            a.hashes()[4..]
                .iter()
                .zip(&b.hashes()[4..])
                .all(|(x, y)| x != y)
        );
    }

    #[test]
    fn growing_a_history_keeps_its_earlier_blocks() {
        let mut once = HashChain::new(1, 3, 32, 16);
        once.extend_to(1000);
        let mut grown = HashChain::new(1, 3, 32, 16);
        for t in [10, 33, 500, 999, 1000] {
            grown.extend_to(t);
            assert_eq!(grown.hashes(), &once.hashes()[..(t / 16) as usize]);
        }
    }

    #[test]
    fn the_seed_changes_every_block() {
        let mut a = HashChain::new(1, 0, 64, 16);
        let mut b = HashChain::new(2, 0, 64, 16);
        a.extend_to(64);
        b.extend_to(64);
        assert!(a.hashes().iter().zip(b.hashes()).all(|(x, y)| x != y));
    }
}
