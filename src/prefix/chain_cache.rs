//! `ChainCache`: per-session hash chains under a byte budget, least recently used out first.
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;

use super::chain::{Chain, walk_uncached};
use super::{NoWitness, Residency, WalkResult, max_hit_blocks};
use crate::hashing::{BlockHash, BlockHasher, HashAlgo};

/// Bookkeeping bytes per session besides its chain and id: the hash-map slot (at hashbrown's
/// 7/8 load factor, plus its control byte) and the LRU index entry (B-tree nodes run about
/// half full, so twice the entry size).
const fn per_session_overhead<W>() -> usize {
    size_of::<(Box<str>, Entry<W>)>() * 8 / 7 + 1 + 2 * size_of::<(u64, Box<str>)>()
}

/// One cached session.
#[derive(Debug)]
struct Entry<W> {
    chain: Chain<W>,
    /// Key of this session in the LRU index.
    last_used: u64,
    /// The witness generation the chain's witnesses were taken in.
    generation: u64,
}

/// What the cached chains were hashed with; a different configuration invalidates them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ChainConfig {
    algo: HashAlgo,
    none_hash: BlockHash,
    block_size: usize,
}

/// Remembers each session's vLLM block-hash chain so repeated probes of a growing prompt only
/// hash the new blocks, and runs vLLM's longest-prefix walk over it.
///
/// One `ChainCache` serves one engine: it records the hash algorithm, `NONE_HASH` and block
/// size of the chains it holds and drops them all if a walk comes with different ones.
/// Memory is bounded by `budget_bytes`; the least recently walked sessions are evicted first.
///
/// `W` is the witness type of the [`Residency`] the walks use: what each hit left behind so the
/// next walk can re-check the block without a lookup ([`NoWitness`] when every block is looked
/// up). Witnesses are only valid against the map they were taken from:
/// [`ChainCache::invalidate_witnesses`] forgets them all when that changes.
#[derive(Debug)]
pub struct ChainCache<W = NoWitness> {
    budget_bytes: usize,
    bytes: usize,
    config: Option<ChainConfig>,
    sessions: HashMap<Box<str>, Entry<W>>,
    /// `last_used` tick → session id, oldest first.
    lru: BTreeMap<u64, Box<str>>,
    tick: u64,
    /// Bumped by `invalidate_witnesses`; a chain from an older generation drops its witnesses
    /// before its next walk (lazily, so invalidating is O(1)).
    generation: u64,
}

impl<W> ChainCache<W> {
    /// An empty cache that holds at most about `budget_bytes` of chains and bookkeeping.
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget_bytes,
            bytes: 0,
            config: None,
            sessions: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            generation: 0,
        }
    }

    /// Walks `tokens` the way vLLM looks up a prompt's cached prefix: block hashes from block 0,
    /// at most `(tokens.len() - 1) / block_size` of them, stopping at the first one for which
    /// `is_resident` says false. Hashes are computed lazily with `hasher`, only for blocks the
    /// walk reaches.
    ///
    /// With `session = Some(id)` the session's cached chain is reused for the blocks this prompt
    /// shares with it and updated with any blocks hashed now; `None` caches nothing. What is
    /// cached depends only on the tokens, never on `is_resident`'s answers, so a lookup that
    /// fails (and answers false) cannot leave a wrong chain behind.
    /// A `block_size` of 0 looks nothing up. Hits re-checked through a witness of an earlier
    /// walk count in `blocks_rechecked`; a witness that no longer holds costs a lookup, so the
    /// answer is always what lookups alone would give.
    pub fn walk<R: Residency<Witness = W>>(
        &mut self,
        session: Option<&str>,
        tokens: &[u32],
        block_size: usize,
        hasher: &mut BlockHasher,
        res: &mut R,
    ) -> WalkResult {
        let unchecked = |_: &[u32], _: usize| Ok::<(), Infallible>(());
        match self.walk_checked(session, tokens, block_size, hasher, res, unchecked) {
            Ok(result) => result,
            Err(never) => match never {},
        }
    }

    /// [`ChainCache::walk`] for a prompt that must pass `check` first. `check(tail, offset)`
    /// gets `tokens[offset..]`: the tokens before `offset` equal tokens the session's chain
    /// already holds, which passed `check` when they were stored, so a prompt grown by one turn
    /// is checked over its new tokens only. That holds only if every walk of this cache uses
    /// the same check (a plain [`ChainCache::walk`] stores tokens unchecked). On `Err`, nothing
    /// was looked up, hashed or cached.
    pub fn walk_checked<R: Residency<Witness = W>, E>(
        &mut self,
        session: Option<&str>,
        tokens: &[u32],
        block_size: usize,
        hasher: &mut BlockHasher,
        res: &mut R,
        check: impl FnOnce(&[u32], usize) -> Result<(), E>,
    ) -> Result<WalkResult, E> {
        let lookups = max_hit_blocks(tokens.len(), block_size);
        // A prompt with no full block before its last token has nothing to cache.
        let Some(id) = session.filter(|_| lookups > 0) else {
            check(tokens, 0)?;
            return Ok(walk_uncached(tokens, block_size, hasher, res));
        };
        self.configure(ChainConfig {
            algo: hasher.algo(),
            none_hash: *hasher.none_hash(),
            block_size,
        });

        self.tick += 1;
        let tick = self.tick;
        if !self.sessions.contains_key(id) {
            self.sessions.insert(
                id.into(),
                Entry {
                    chain: Chain::default(),
                    last_used: tick,
                    generation: self.generation,
                },
            );
            self.lru.insert(tick, id.into());
            self.bytes += Self::session_bytes(id, &Chain::default());
        }
        let entry = self.sessions.get_mut(id).expect("inserted above");
        if entry.last_used != tick {
            // Move to the young end; the id's allocation moves with it.
            let name = self
                .lru
                .remove(&entry.last_used)
                .expect("LRU indexes every session");
            self.lru.insert(tick, name);
            entry.last_used = tick;
        }

        if entry.generation != self.generation {
            entry.chain.clear_witnesses();
            entry.generation = self.generation;
        }

        let before = entry.chain.heap_bytes();
        let result = match entry
            .chain
            .walk_checked(tokens, block_size, hasher, res, check)
        {
            Ok(result) => result,
            Err(err) => {
                if entry.chain.len() == 0 {
                    // A session first seen with a prompt that failed the check: keep nothing.
                    self.forget(id);
                }
                return Err(err);
            }
        };
        self.bytes = self.bytes - before + entry.chain.heap_bytes();
        if self.bytes > self.budget_bytes {
            self.enforce_budget(id, result.blocks_hashed > 0);
        }
        Ok(result)
    }

    /// Drops `session`'s chain; returns whether it was cached.
    pub fn forget(&mut self, session: &str) -> bool {
        let Some((id, entry)) = self.sessions.remove_entry(session) else {
            return false;
        };
        self.lru.remove(&entry.last_used);
        self.bytes -= Self::session_bytes(&id, &entry.chain);
        true
    }

    /// Forgets every witness (the map they were taken from was replaced); the hashes stay.
    /// O(1): each chain drops its witnesses before its next walk.
    pub fn invalidate_witnesses(&mut self) {
        self.generation += 1;
    }

    /// Drops every chain.
    pub fn clear(&mut self) {
        self.sessions.clear();
        self.lru.clear();
        self.bytes = 0;
    }

    /// Memory held for the cached sessions: hashes, block tokens, witnesses, session ids (stored twice:
    /// map key and LRU index) and per-session map and index entries. Always `<= budget_bytes`.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Number of cached sessions.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no session is cached.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// The byte budget given to [`ChainCache::new`].
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Whether `session` has a cached chain.
    pub fn contains(&self, session: &str) -> bool {
        self.sessions.contains_key(session)
    }

    /// A copy of `session`'s cached block hashes, in block order (for diagnostics and tests).
    pub fn session_hashes(&self, session: &str) -> Option<Vec<BlockHash>> {
        let stride = self.config?.algo.digest_len();
        Some(self.sessions.get(session)?.chain.hashes(stride))
    }

    /// Appends to `out` the hashes of blocks `from..to` of `tokens` that `session`'s cached
    /// chain holds, and returns how many: consecutive blocks from `from` whose stored tokens
    /// are `tokens`' own (a chain keeps an older prompt's tail after a miss inside the shared
    /// prefix, and that tail is not this prompt's). The caller vouches that the chain's blocks
    /// before `from` are `tokens`' (right after a walk of `tokens`, every block up to its hit
    /// is). Does not count as a use of the session (the LRU order is unchanged).
    pub fn copy_hashes(
        &self,
        session: &str,
        tokens: &[u32],
        from: usize,
        to: usize,
        out: &mut Vec<BlockHash>,
    ) -> usize {
        let (Some(config), Some(entry)) = (self.config, self.sessions.get(session)) else {
            return 0;
        };
        let stride = config.algo.digest_len();
        let n = entry
            .chain
            .matching_blocks(tokens, config.block_size, from, to);
        out.extend((from..from + n).map(|i| entry.chain.hash(i, stride)));
        n
    }

    /// Forgets everything if the chains were hashed under another configuration.
    fn configure(&mut self, config: ChainConfig) {
        if self.config != Some(config) {
            self.clear();
            self.config = Some(config);
        }
    }

    fn session_bytes(id: &str, chain: &Chain<W>) -> usize {
        per_session_overhead::<W>() + 2 * id.len() + chain.heap_bytes()
    }

    /// Evicts other sessions, oldest first; if `current` alone is still too big, keeps only as
    /// many of its leading blocks as fit (when it just `grew`).
    fn enforce_budget(&mut self, current: &str, grew: bool) {
        while self.bytes > self.budget_bytes {
            let oldest = self.lru.first_key_value().map(|(_, id)| id.clone());
            match oldest {
                Some(id) if *id != *current => {
                    self.forget(&id);
                }
                _ => break,
            }
        }
        if self.bytes <= self.budget_bytes {
            return;
        }
        let config = self
            .config
            .expect("configured before any session is cached");
        let stride = config.algo.digest_len();
        let entry = self
            .sessions
            .get_mut(current)
            .expect("current session is cached");
        let others = self.bytes - Self::session_bytes(current, &entry.chain);
        let room = self
            .budget_bytes
            .saturating_sub(others + Self::session_bytes(current, &Chain::default()));
        let blocks = Chain::<W>::blocks_within(room, stride, config.block_size);
        if grew && blocks > 0 && blocks < entry.chain.len() {
            let before = entry.chain.heap_bytes();
            entry.chain.shrink_to(blocks, stride, config.block_size);
            self.bytes = self.bytes - before + entry.chain.heap_bytes();
        }
        if self.bytes > self.budget_bytes {
            self.forget(current);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher() -> BlockHasher {
        BlockHasher::new(HashAlgo::Sha256, &[1; 32]).unwrap()
    }

    #[test]
    fn accounting_returns_to_zero() {
        let mut cache: ChainCache = ChainCache::new(1 << 20);
        let mut h = hasher();
        let tokens: Vec<u32> = (0..1000).collect();
        cache.walk(Some("a"), &tokens, 16, &mut h, &mut |_: &BlockHash| true);
        cache.walk(Some("bb"), &tokens, 16, &mut h, &mut |_: &BlockHash| true);
        assert!(cache.bytes() > 0);
        assert!(cache.forget("a"));
        assert!(!cache.forget("a"));
        assert!(cache.forget("bb"));
        assert_eq!(cache.bytes(), 0);
        assert_eq!(cache.lru.len(), 0);
    }

    #[test]
    fn new_configuration_drops_old_chains() {
        let mut cache: ChainCache = ChainCache::new(1 << 20);
        let tokens: Vec<u32> = (0..100).collect();
        cache.walk(
            Some("a"),
            &tokens,
            16,
            &mut hasher(),
            &mut |_: &BlockHash| true,
        );
        assert!(cache.contains("a"));
        let mut other = BlockHasher::new(HashAlgo::Sha256, &[2; 32]).unwrap();
        cache.walk(Some("b"), &tokens, 16, &mut other, &mut |_: &BlockHash| {
            true
        });
        assert!(!cache.contains("a") && cache.contains("b"));
        cache.walk(Some("b"), &tokens, 32, &mut other, &mut |_: &BlockHash| {
            true
        });
        assert_eq!(cache.session_hashes("b").unwrap().len(), 3);
    }

    #[test]
    fn the_check_sees_only_what_the_chain_does_not_hold() {
        let mut cache: ChainCache = ChainCache::new(1 << 20);
        let mut h = hasher();
        let all = &mut |_: &BlockHash| true;
        let mut tokens: Vec<u32> = (0..100).collect();
        let mut seen = Vec::new();
        let mut record = |tail: &[u32], at: usize| {
            seen.push((at, tail.len()));
            Ok::<(), ()>(())
        };
        cache
            .walk_checked(Some("s"), &tokens, 16, &mut h, all, &mut record)
            .unwrap();
        tokens.extend(100..140);
        cache
            .walk_checked(Some("s"), &tokens, 16, &mut h, all, &mut record)
            .unwrap();
        // One-off probes check everything.
        cache
            .walk_checked(None, &tokens, 16, &mut h, all, &mut record)
            .unwrap();
        assert_eq!(seen, [(0, 100), (96, 44), (0, 140)]);

        // A refused prompt changes nothing; a new session refused is not kept.
        let before = cache.session_hashes("s");
        tokens[20] = 7;
        let refuse = |_: &[u32], at: usize| Err(at);
        assert_eq!(
            cache.walk_checked(Some("s"), &tokens, 16, &mut h, all, refuse),
            Err(16)
        );
        assert_eq!(cache.session_hashes("s"), before);
        assert_eq!(
            cache.walk_checked(Some("t"), &tokens, 16, &mut h, all, refuse),
            Err(0)
        );
        assert!(!cache.contains("t") && cache.len() == 1);
    }

    #[test]
    fn a_session_bigger_than_the_budget_keeps_a_prefix() {
        let tokens: Vec<u32> = (0..16 * 100 + 1).collect();
        let one_session = ChainCache::<NoWitness>::session_bytes("s", &Chain::default());
        let budget = one_session + Chain::<NoWitness>::heap_bytes_for(64, 32, 16) + 100;
        let mut cache: ChainCache = ChainCache::new(budget);
        let mut h = hasher();
        let r = cache.walk(Some("s"), &tokens, 16, &mut h, &mut |_: &BlockHash| true);
        assert_eq!(r.hit_blocks, 100);
        assert!(cache.bytes() <= budget);
        assert_eq!(cache.session_hashes("s").unwrap().len(), 64);
        // The kept prefix is still reused next time.
        let r = cache.walk(Some("s"), &tokens, 16, &mut h, &mut |_: &BlockHash| true);
        assert_eq!((r.blocks_reused, r.blocks_hashed), (64, 36));
    }
}
