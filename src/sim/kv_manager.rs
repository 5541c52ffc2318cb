//! vLLM 0.32's `KVCacheManager` over one full-attention group (`v1/core/kv_cache_manager.py`,
//! `FullAttentionManager` in `v1/core/single_type_kv_cache_manager.py`, the unitary coordinator):
//! prefix lookup, `allocate_slots` (with the full-prompt admission check the scheduler asks for,
//! `scheduler_reserve_full_isl`, on by default), caching of full blocks as their tokens are
//! scheduled, and freeing a request's blocks tail first.
//!
//! A request's blocks live in its own [`ReqKv`] (vLLM's `req_to_blocks[request_id]` and
//! `num_cached_block[request_id]`), so no per-request map is needed.
use super::BlockHash;
use super::block_pool::{BlockId, BlockPool, Witness};

/// One request's KV blocks.
#[derive(Debug, Clone, Default)]
pub struct ReqKv {
    /// Blocks in token order (`req_to_blocks`).
    pub blocks: Vec<BlockId>,
    /// Leading blocks already in the cached map (`num_cached_block`).
    pub num_cached: u32,
}

/// A remembered chain of prefix hits for one hash chain, so the next lookup of the same prompt
/// re-checks witnesses (array reads) instead of looking every block up again, and skips even
/// that while nothing was removed from the cached map. The answer is always the one a fresh
/// lookup gives (the memo makes lookups cheaper, never different).
///
/// The scheduler keeps one for the head of the waiting queue (vLLM looks the head up again on
/// every step it cannot be admitted); the gate driver keeps one per session for its probes.
#[derive(Debug, Clone, Default)]
pub struct HitMemo {
    /// Whose chain this is (a request id, a session); another key starts over.
    key: Option<u64>,
    /// `pool.removals()` when the witnesses were last known to hold.
    removals: u64,
    witnesses: Vec<Witness>,
}

impl HitMemo {
    /// The memoised hit blocks, in order (valid right after a lookup through this memo).
    pub fn blocks(&self) -> impl ExactSizeIterator<Item = BlockId> + '_ {
        self.witnesses.iter().map(|w| w.block)
    }

    /// Number of memoised hit blocks.
    pub fn len(&self) -> usize {
        self.witnesses.len()
    }

    /// Whether no hit is memoised.
    pub fn is_empty(&self) -> bool {
        self.witnesses.is_empty()
    }
}

/// The KV-cache manager: the block pool plus vLLM's allocation rules.
#[derive(Debug, Clone)]
pub struct KvManager {
    /// The pool (public for probes and tests).
    pub pool: BlockPool,
    block_size: u32,
    max_model_len: u32,
    scratch: Vec<BlockId>,
}

/// `cdiv`.
fn blocks_for(tokens: u32, block_size: u32) -> u32 {
    tokens.div_ceil(block_size)
}

impl KvManager {
    /// A manager over a fresh pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: u32, block_size: u32, max_model_len: u32) -> Self {
        KvManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            max_model_len,
            scratch: Vec::new(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// `get_computed_blocks`: the longest run of cached leading blocks of a request with
    /// `num_tokens` tokens, capped at `(num_tokens - 1) // block_size` blocks so at least one
    /// token is computed. Writes the blocks to `out` (cleared first).
    pub fn find_longest_cache_hit(
        &self,
        block_hashes: &[BlockHash],
        num_tokens: u32,
        out: &mut Vec<BlockId>,
    ) {
        out.clear();
        let cap = (num_tokens.saturating_sub(1) / self.block_size) as usize;
        for &h in block_hashes.iter().take(cap) {
            match self.pool.cached_block(h) {
                Some(b) => out.push(b),
                None => break,
            }
        }
    }

    /// [`Self::find_longest_cache_hit`] through `memo` (keyed by `key`, whose hash chain
    /// `block_hashes` must be for the memo's whole life): leading witnesses that still hold are
    /// kept — all of them, unchecked, while the cached map lost no hash — and the chain is
    /// extended by lookups from the first that does not. Returns the hit blocks' count; the
    /// blocks are `memo.blocks()`.
    pub fn cache_hit_memo(
        &self,
        key: u64,
        block_hashes: &[BlockHash],
        num_tokens: u32,
        memo: &mut HitMemo,
    ) -> u32 {
        let pool = &self.pool;
        if memo.key != Some(key) {
            memo.key = Some(key);
            memo.witnesses.clear();
        } else if memo.removals != pool.removals() {
            let held = memo
                .witnesses
                .iter()
                .zip(block_hashes)
                .take_while(|(w, h)| pool.still_cached(w, **h))
                .count();
            memo.witnesses.truncate(held);
        }
        memo.removals = pool.removals();
        let cap = (num_tokens.saturating_sub(1) / self.block_size) as usize;
        let cap = cap.min(block_hashes.len());
        memo.witnesses.truncate(cap);
        while memo.witnesses.len() < cap {
            match pool.cached_witness(block_hashes[memo.witnesses.len()]) {
                Some(w) => memo.witnesses.push(w),
                None => break,
            }
        }
        memo.witnesses.len() as u32
    }

    /// Read-only hit count (blocks) for a prompt, the same rule as [`Self::find_longest_cache_hit`].
    pub fn count_hit_blocks(&self, block_hashes: &[BlockHash], num_tokens: u32) -> u32 {
        let cap = (num_tokens.saturating_sub(1) / self.block_size) as usize;
        block_hashes
            .iter()
            .take(cap)
            .take_while(|h| self.pool.cached_block(**h).is_some())
            .count() as u32
    }

    /// Hit blocks that sit in the free queue (a hit on them uses up free capacity).
    fn num_evictable(&self, blocks: &[BlockId]) -> u32 {
        blocks
            .iter()
            .filter(|&&b| self.pool.ref_cnt(b) == 0)
            .count() as u32
    }

    /// `allocate_slots` for a request with `num_computed` tokens already computed (0 for a
    /// waiting request) that now hits `new_computed` cached blocks and schedules
    /// `num_new_tokens` more. `num_tokens` is the request's current length (prompt plus the
    /// outputs it has), `block_hashes` its chained hashes. `full_sequence_must_fit` is the
    /// admission check for a waiting request: the whole current sequence must fit.
    /// Returns false, changing nothing, when the blocks are not there.
    #[allow(clippy::too_many_arguments)]
    pub fn allocate_slots(
        &mut self,
        kv: &mut ReqKv,
        num_computed: u32,
        num_new_tokens: u32,
        new_computed: &[BlockId],
        num_tokens: u32,
        block_hashes: &[BlockHash],
        full_sequence_must_fit: bool,
    ) -> bool {
        let bs = self.block_size;
        let num_new_computed = new_computed.len() as u32 * bs;
        let total_computed = (num_computed + num_new_computed).min(self.max_model_len);
        let held = kv.blocks.len() as u32 + new_computed.len() as u32;
        let evictable = self.num_evictable(new_computed);
        let free = self.pool.num_free_blocks();
        if full_sequence_must_fit {
            let full = num_tokens.min(self.max_model_len);
            let need = blocks_for(full, bs).saturating_sub(held) + evictable;
            if need > free {
                return false;
            }
        }
        let need_slot = (total_computed + num_new_tokens).min(self.max_model_len);
        let need = blocks_for(need_slot, bs).saturating_sub(held) + evictable;
        if need > free {
            return false;
        }
        if !new_computed.is_empty() {
            debug_assert!(kv.blocks.is_empty());
            self.pool.touch(new_computed);
            kv.blocks.extend_from_slice(new_computed);
            kv.num_cached = kv.blocks.len() as u32;
        }
        let want = blocks_for(need_slot, bs);
        let have = kv.blocks.len() as u32;
        if want > have {
            let ok = self.pool.get_new_blocks(want - have, &mut kv.blocks);
            debug_assert!(ok.is_some());
        }
        let to_cache = (total_computed + num_new_tokens).min(num_tokens);
        self.cache_blocks(kv, to_cache, block_hashes);
        true
    }

    /// `allocate_slots` for a waiting request admitted with an asynchronous load from the host
    /// tier (`delay_cache_blocks`): takes the `new_computed` GPU hit and allocates blocks for
    /// `ext_tokens` more, caching nothing new (the loaded blocks are cached once their load
    /// completes and the request is scheduled). The whole `num_tokens` sequence must fit.
    /// Returns false, changing nothing, when the blocks are not there.
    pub fn allocate_for_load(
        &mut self,
        kv: &mut ReqKv,
        new_computed: &[BlockId],
        ext_tokens: u32,
        num_tokens: u32,
    ) -> bool {
        debug_assert!(kv.blocks.is_empty());
        let bs = self.block_size;
        let held = new_computed.len() as u32;
        let evictable = self.num_evictable(new_computed);
        let free = self.pool.num_free_blocks();
        let full = num_tokens.min(self.max_model_len);
        if blocks_for(full, bs).saturating_sub(held) + evictable > free {
            return false;
        }
        let total = (held * bs + ext_tokens).min(self.max_model_len);
        let want = blocks_for(total, bs);
        if want.saturating_sub(held) + evictable > free {
            return false;
        }
        self.pool.touch(new_computed);
        kv.blocks.extend_from_slice(new_computed);
        kv.num_cached = held;
        if want > held {
            let ok = self.pool.get_new_blocks(want - held, &mut kv.blocks);
            debug_assert!(ok.is_some());
        }
        true
    }

    /// `cache_blocks`: caches the request's full blocks up to `num_tokens` tokens.
    fn cache_blocks(&mut self, kv: &mut ReqKv, num_tokens: u32, block_hashes: &[BlockHash]) {
        let full = (num_tokens / self.block_size).min(block_hashes.len() as u32);
        if kv.num_cached >= full {
            return;
        }
        for i in kv.num_cached..full {
            self.pool
                .cache_block(kv.blocks[i as usize], block_hashes[i as usize]);
        }
        kv.num_cached = full;
    }

    /// `free`: returns a request's blocks to the pool, tail first.
    pub fn free(&mut self, kv: &mut ReqKv) {
        self.scratch.clear();
        self.scratch.extend(kv.blocks.drain(..).rev());
        let blocks = std::mem::take(&mut self.scratch);
        self.pool.free_blocks(blocks.iter().copied());
        self.scratch = blocks;
        kv.num_cached = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny xorshift, so the test needs no crate and is the same on every run.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Requests over a few shared hash chains fill, evict and re-cache a small pool; after
    /// every operation each memo (one per chain, reused across operations, as the scheduler's
    /// and the gate driver's are) answers exactly what a fresh lookup answers.
    #[test]
    fn memoised_hits_always_equal_a_fresh_lookup() {
        let bs = 4;
        let mut kv = KvManager::new(40, bs, 39 * bs);
        let chains: Vec<Vec<BlockHash>> = (0..6u64)
            .map(|c| {
                // Chains c and c + 3 share their first 10 blocks (hashes are chained).
                let fork = |i: u64| if i < 10 { 0 } else { (c / 3 + 1) << 16 };
                (0..30u64).map(|i| (c % 3) << 32 | fork(i) | i).collect()
            })
            .collect();
        let mut memos = vec![HitMemo::default(); chains.len()];
        let mut live: Vec<ReqKv> = Vec::new();
        let mut rng = Rng(0x9E37_79B9);
        let mut fresh = Vec::new();
        let mut hits_seen = 0;
        for step in 0..20_000 {
            if live.len() < 6 && rng.below(2) == 0 {
                let c = rng.below(chains.len() as u64) as usize;
                let tokens = 1 + rng.below(u64::from(bs) * 12) as u32;
                kv.find_longest_cache_hit(&chains[c], tokens, &mut fresh);
                let computed = fresh.clone();
                let new = tokens - computed.len() as u32 * bs;
                let mut req = ReqKv::default();
                if kv.allocate_slots(&mut req, 0, new, &computed, tokens, &chains[c], true) {
                    live.push(req);
                }
            } else if !live.is_empty() {
                let i = rng.below(live.len() as u64) as usize;
                let mut req = live.swap_remove(i);
                kv.free(&mut req);
            }
            for (c, memo) in memos.iter_mut().enumerate() {
                let tokens = 1 + ((step as u32 * 7 + c as u32 * 13) % (bs * 14));
                let n = kv.cache_hit_memo(c as u64, &chains[c], tokens, memo);
                kv.find_longest_cache_hit(&chains[c], tokens, &mut fresh);
                assert_eq!(n as usize, fresh.len(), "step {step}, chain {c}");
                assert!(
                    memo.blocks().eq(fresh.iter().copied()),
                    "step {step}, chain {c}"
                );
                assert_eq!(n, kv.count_hit_blocks(&chains[c], tokens));
                hits_seen += n;
            }
        }
        assert!(kv.pool.removals() > 1000, "the pool evicted cached blocks");
        assert!(hits_seen > 10_000, "the memos had hits to remember");
    }
}
