//! Behaviour of the per-session chain cache and vLLM's longest-prefix walk.
use std::collections::HashSet;

use session_gate::hashing::{BlockHash, BlockHasher, HashAlgo};
use session_gate::prefix::{ChainCache, Lookup, Residency, WalkResult, max_hit_blocks};

const BS: usize = 16;

fn hasher() -> BlockHasher {
    BlockHasher::new(HashAlgo::Sha256, &[0x5a; 32]).unwrap()
}

/// Deterministic prompt tokens below a 151,936-token vocabulary.
fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 151_936)
        .collect()
}

/// vLLM's hashes for `tokens`, from a fresh hasher (the reference).
fn reference(tokens: &[u32]) -> Vec<BlockHash> {
    let mut out = Vec::new();
    hasher().hash_full_blocks(None, tokens, BS, &mut out);
    out
}

/// A deterministic `next(bound)` in `0..bound` (xorshift64), for the randomised tests.
fn xorshift(mut state: u64) -> impl FnMut(usize) -> usize {
    move |bound: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % bound as u64) as usize
    }
}

/// A stand-in for vLLM's `cached_block_hash_to_block`.
fn resident(hashes: &[BlockHash]) -> HashSet<BlockHash> {
    hashes.iter().copied().collect()
}

/// Walks and records every hash the walk looked up, in order.
fn walk(
    cache: &mut ChainCache,
    h: &mut BlockHasher,
    session: Option<&str>,
    tokens: &[u32],
    map: &HashSet<BlockHash>,
) -> (WalkResult, Vec<BlockHash>) {
    let mut seen = Vec::new();
    let r = cache.walk(session, tokens, BS, h, &mut |hash: &BlockHash| {
        seen.push(*hash);
        map.contains(hash)
    });
    (r, seen)
}

#[test]
fn a_cold_prompt_hashes_one_block() {
    let tokens = prompt(32_768, 1);
    for session in [None, Some("s")] {
        let mut cache = ChainCache::new(1 << 20);
        let (r, seen) = walk(&mut cache, &mut hasher(), session, &tokens, &HashSet::new());
        assert_eq!(r.hit_blocks, 0);
        assert_eq!(r.hit_tokens, 0);
        assert_eq!(r.prompt_tokens, 32_768);
        assert_eq!(r.blocks_hashed, 1);
        assert_eq!(r.blocks_reused, 0);
        assert_eq!(seen, reference(&tokens[..BS]));
    }
}

#[test]
fn lookups_stop_before_the_last_token() {
    let mut h = hasher();
    let mut cache = ChainCache::new(1 << 20);
    // Every full block is resident, but vLLM never reports the last token as cached.
    for (n, expect) in [(15, 0), (16, 0), (17, 1), (64, 3), (65, 4), (1000, 62)] {
        let tokens = prompt(n, 2);
        let map = resident(&reference(&tokens));
        let (r, seen) = walk(&mut cache, &mut h, None, &tokens, &map);
        assert_eq!(r.hit_blocks, expect, "n={n}");
        assert_eq!(r.hit_blocks, max_hit_blocks(n, BS));
        assert_eq!(r.hit_tokens, expect * BS);
        assert_eq!(seen.len(), expect, "n={n}: no lookup past the cap");
    }
    assert!(cache.is_empty(), "a session-less walk caches nothing");
}

#[test]
fn the_walk_stops_at_the_first_miss() {
    let tokens = prompt(1000, 3);
    let all = reference(&tokens);
    // Blocks 0..5 and 7..10 resident: the hole at 5 ends the walk even though 7.. would hit.
    let mut map = resident(&all[..5]);
    map.extend(&all[7..10]);
    let mut cache = ChainCache::new(1 << 20);
    let (r, seen) = walk(&mut cache, &mut hasher(), Some("s"), &tokens, &map);
    assert_eq!((r.hit_blocks, r.hit_tokens), (5, 80));
    assert_eq!(seen, all[..6]);
    assert_eq!(r.blocks_hashed, 6, "hashing is lazy: nothing past the miss");
}

#[test]
fn an_extension_hashes_only_the_new_blocks() {
    let mut h = hasher();
    let mut cache = ChainCache::new(1 << 22);
    let turn1 = prompt(1000, 4);
    let mut turn2 = turn1.clone();
    turn2.extend(prompt(200, 5));
    let map = resident(&reference(&turn2));

    let (r1, _) = walk(&mut cache, &mut h, Some("s"), &turn1, &map);
    assert_eq!((r1.blocks_hashed, r1.blocks_reused), (62, 0));
    let (r2, seen) = walk(&mut cache, &mut h, Some("s"), &turn2, &map);
    // 999 / 16 = 62 blocks known; 1199 / 16 = 74 looked up.
    assert_eq!(r2.hit_blocks, 74);
    assert_eq!((r2.blocks_hashed, r2.blocks_reused), (12, 62));
    assert_eq!(seen, reference(&turn2)[..74]);

    // The same prompt again, and a shorter prefix of it, hash nothing.
    let (r3, _) = walk(&mut cache, &mut h, Some("s"), &turn2, &map);
    assert_eq!((r3.blocks_hashed, r3.blocks_reused), (0, 74));
    let (r4, seen) = walk(&mut cache, &mut h, Some("s"), &turn1[..500], &map);
    assert_eq!(
        (r4.blocks_hashed, r4.blocks_reused, r4.hit_blocks),
        (0, 31, 31)
    );
    assert_eq!(seen, reference(&turn1)[..31]);
}

#[test]
fn a_changed_token_invalidates_the_chain_from_its_block() {
    let mut h = hasher();
    let base = prompt(2000, 6);
    let cap = max_hit_blocks(base.len(), BS);
    for k in [0, 1, 40, cap - 1] {
        let mut cache = ChainCache::new(1 << 22);
        walk(
            &mut cache,
            &mut h,
            Some("s"),
            &base,
            &resident(&reference(&base)),
        );

        let mut edited = base.clone();
        edited[k * BS + 7] ^= 1;
        let truth = reference(&edited);
        let (r, seen) = walk(&mut cache, &mut h, Some("s"), &edited, &resident(&truth));
        assert_eq!(seen, truth[..cap], "k={k}: same hashes as a fresh hasher");
        assert_eq!((r.blocks_reused, r.blocks_hashed), (k, cap - k), "k={k}");
        assert_eq!(r.hit_blocks, cap);
        // And the stored chain is now the edited prompt's.
        assert_eq!(cache.session_hashes("s").unwrap(), truth[..cap]);

        // vLLM still holds only the old blocks: the edit is a miss at block k.
        let (r, _) = walk(
            &mut cache,
            &mut h,
            Some("s"),
            &edited,
            &resident(&reference(&base)),
        );
        assert_eq!(r.hit_blocks, k);
        assert_eq!(r.blocks_hashed, 0);
    }
}

#[test]
fn a_change_in_the_partial_tail_changes_nothing() {
    let mut h = hasher();
    let mut cache = ChainCache::new(1 << 22);
    let base = prompt(1000, 7);
    let map = resident(&reference(&base));
    walk(&mut cache, &mut h, Some("s"), &base, &map);
    let mut edited = base.clone();
    edited[999] += 1; // block 62 is partial (992..1000) and never hashed
    let (r, _) = walk(&mut cache, &mut h, Some("s"), &edited, &map);
    assert_eq!(
        (r.hit_blocks, r.blocks_hashed, r.blocks_reused),
        (62, 0, 62)
    );
}

#[test]
fn the_cached_chain_equals_hash_full_blocks() {
    for algo in HashAlgo::ALL {
        let mut h = BlockHasher::new(algo, &vec![9; algo.digest_len()]).unwrap();
        let mut cache = ChainCache::new(1 << 22);
        let mut tokens = prompt(300, 8);
        for turn in 0..5 {
            tokens.extend(prompt(97, turn));
            cache.walk(Some("s"), &tokens, BS, &mut h, &mut |_: &BlockHash| true);
            let mut expected = Vec::new();
            h.hash_full_blocks(None, &tokens, BS, &mut expected);
            expected.truncate(max_hit_blocks(tokens.len(), BS));
            assert_eq!(
                cache.session_hashes("s").unwrap(),
                expected,
                "{algo:?} turn {turn}"
            );
        }
    }
}

#[test]
fn forget_drops_one_session() {
    let mut h = hasher();
    let mut cache = ChainCache::new(1 << 22);
    let tokens = prompt(500, 9);
    walk(&mut cache, &mut h, Some("a"), &tokens, &HashSet::new());
    walk(&mut cache, &mut h, Some("b"), &tokens, &HashSet::new());
    let both = cache.bytes();
    assert_eq!(cache.len(), 2);
    assert!(cache.forget("a"));
    assert!(!cache.forget("a"));
    assert!(!cache.contains("a") && cache.contains("b"));
    assert!(cache.bytes() < both);
    // A forgotten session starts from scratch.
    let map = resident(&reference(&tokens));
    let (r, _) = walk(&mut cache, &mut h, Some("a"), &tokens, &map);
    assert_eq!((r.blocks_reused, r.blocks_hashed), (0, 31));
}

#[test]
fn least_recently_used_sessions_are_evicted_first() {
    let mut h = hasher();
    let tokens = prompt(16 * 64 + 1, 10); // 64 blocks each
    let one = {
        let mut probe = ChainCache::new(usize::MAX);
        probe.walk(Some("a"), &tokens, BS, &mut h, &mut |_: &BlockHash| true);
        probe.bytes()
    };
    // Room for two sessions of this size, not three.
    let mut cache = ChainCache::new(one * 5 / 2);
    let map = resident(&reference(&tokens));
    let mut last = 0;
    for s in ["a", "b"] {
        walk(&mut cache, &mut h, Some(s), &tokens, &map);
        assert!(cache.bytes() > last, "bytes grow with every session");
        last = cache.bytes();
    }
    walk(&mut cache, &mut h, Some("a"), &tokens, &map); // a is now the most recent
    walk(&mut cache, &mut h, Some("c"), &tokens, &map);
    assert!(cache.bytes() <= cache.budget_bytes());
    assert_eq!(cache.len(), 2);
    assert!(cache.contains("a") && cache.contains("c") && !cache.contains("b"));
    let (r, _) = walk(&mut cache, &mut h, Some("a"), &tokens, &map);
    assert_eq!(r.blocks_reused, 64, "the survivor's chain is intact");
}

#[test]
fn bytes_stay_within_a_tiny_budget() {
    let mut h = hasher();
    // Room for one 64-block segment (hashes and the tokens they were computed from) and little
    // else.
    let budget = 8192;
    let mut cache = ChainCache::new(budget);
    assert_eq!(cache.budget_bytes(), budget);
    let mut tokens = Vec::new();
    for turn in 0..40u32 {
        tokens.extend(prompt(100, turn));
        let id = format!("session-{}", turn % 7);
        cache.walk(Some(&id), &tokens, BS, &mut h, &mut |_: &BlockHash| true);
        assert!(
            cache.bytes() <= budget,
            "turn {turn}: {} > {budget}",
            cache.bytes()
        );
    }
    assert!(!cache.is_empty());
    // Even the longest prompt still answers correctly with its chain cut short.
    let map = resident(&reference(&tokens));
    let (r, seen) = walk(&mut cache, &mut h, Some("x"), &tokens, &map);
    assert_eq!(r.hit_blocks, max_hit_blocks(tokens.len(), BS));
    assert_eq!(seen, reference(&tokens)[..r.hit_blocks]);
}

#[test]
fn a_new_hash_configuration_invalidates_chains() {
    let tokens = prompt(800, 11);
    let mut cache = ChainCache::new(1 << 22);
    let mut a = hasher();
    cache.walk(Some("s"), &tokens, BS, &mut a, &mut |_: &BlockHash| true);
    let mut b = BlockHasher::new(HashAlgo::Sha256, &[0x5b; 32]).unwrap();
    let mut seen = Vec::new();
    let r = cache.walk(Some("s"), &tokens, BS, &mut b, &mut |hash: &BlockHash| {
        seen.push(*hash);
        true
    });
    assert_eq!(
        r.blocks_reused, 0,
        "hashes under another NONE_HASH are not reused"
    );
    let mut expected = Vec::new();
    b.hash_full_blocks(None, &tokens, BS, &mut expected);
    assert_eq!(seen, expected[..49]);
}

/// Random edits, truncations, extensions and residency, checked against a fresh hasher.
#[test]
fn randomised_walks_match_the_reference() {
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
    let mut h = hasher();
    let mut cache = ChainCache::new(1 << 16);
    let mut prompts: Vec<Vec<u32>> = vec![Vec::new(); 4];
    for step in 0..400 {
        let s = next(4);
        let p = &mut prompts[s];
        match next(5) {
            0 => p.truncate(next(p.len() + 1)),
            1 if !p.is_empty() => {
                let i = next(p.len());
                p[i] = next(1000) as u32;
            }
            _ => p.extend(prompt(next(200), step)),
        }
        let truth = reference(p);
        let lookups = max_hit_blocks(p.len(), BS);
        let resident_blocks = next(lookups + 2);
        let map = resident(&truth[..resident_blocks.min(truth.len())]);
        let (r, seen) = walk(&mut cache, &mut h, Some(&format!("s{s}")), p, &map);
        let expect_hits = resident_blocks.min(lookups);
        assert_eq!(r.hit_blocks, expect_hits, "step {step}");
        assert_eq!(seen, truth[..(expect_hits + 1).min(lookups)], "step {step}");
        assert_eq!(r.blocks_hashed + r.blocks_reused, seen.len());
        assert!(cache.bytes() <= cache.budget_bytes());
    }
}

/// A model of vLLM's block pool for witnesses: each cached block carries its hash and the
/// identity of the hash object (a fresh one each time a block is cached).
#[derive(Default)]
struct ModelPool {
    map: std::collections::HashMap<BlockHash, usize>,
    blocks: Vec<Option<(BlockHash, u64)>>,
    objects: u64,
    lookups: usize,
}

impl ModelPool {
    fn cache(&mut self, hash: BlockHash, block: usize) {
        self.evict(block);
        if self.map.contains_key(&hash) {
            return; // vLLM keeps the first block for a hash
        }
        self.objects += 1;
        self.blocks[block] = Some((hash, self.objects));
        self.map.insert(hash, block);
    }

    fn evict(&mut self, block: usize) {
        if let Some((hash, _)) = self.blocks[block].take() {
            self.map.remove(&hash);
        }
    }
}

impl Residency for ModelPool {
    type Witness = (usize, u64);

    fn lookup(&mut self, hash: &BlockHash) -> Lookup<(usize, u64)> {
        self.lookups += 1;
        match self.map.get(hash) {
            Some(&b) => Lookup::Hit(self.blocks[b].map(|(_, object)| (b, object))),
            None => Lookup::Miss,
        }
    }

    fn still_resident(&mut self, witnesses: &[Option<(usize, u64)>]) -> usize {
        witnesses
            .iter()
            .take_while(|w| matches!(w, Some((b, o)) if self.blocks[*b].map(|x| x.1) == Some(*o)))
            .count()
    }
}

#[test]
fn a_resident_chain_is_rechecked_without_lookups() {
    let mut h = hasher();
    let tokens = prompt(16 * 40 + 1, 21);
    let mut pool = ModelPool {
        blocks: vec![None; 64],
        ..ModelPool::default()
    };
    for (i, hash) in reference(&tokens).into_iter().enumerate() {
        pool.cache(hash, i);
    }
    let mut cache: ChainCache<(usize, u64)> = ChainCache::new(1 << 20);
    let first = cache.walk(Some("s"), &tokens, BS, &mut h, &mut pool);
    assert_eq!((first.hit_blocks, first.blocks_rechecked), (40, 0));
    pool.lookups = 0;
    let again = cache.walk(Some("s"), &tokens, BS, &mut h, &mut pool);
    assert_eq!((again.hit_blocks, again.blocks_rechecked), (40, 40));
    assert_eq!(pool.lookups, 0, "every block re-checked by its witness");

    // Block 17 is evicted, then cached again under the same hash (a new hash object): the
    // witness fails, a lookup finds it again.
    let hash17 = pool.blocks[17].unwrap().0;
    pool.evict(17);
    let evicted = cache.walk(Some("s"), &tokens, BS, &mut h, &mut pool);
    assert_eq!(evicted.hit_blocks, 17, "the eviction is reported");
    pool.cache(hash17, 63);
    let back = cache.walk(Some("s"), &tokens, BS, &mut h, &mut pool);
    assert_eq!((back.hit_blocks, back.blocks_rechecked), (40, 39));

    // Witnesses taken against another map are dropped, not trusted.
    cache.invalidate_witnesses();
    pool.lookups = 0;
    let fresh = cache.walk(Some("s"), &tokens, BS, &mut h, &mut pool);
    assert_eq!((fresh.hit_blocks, fresh.blocks_rechecked), (40, 0));
    assert_eq!(pool.lookups, 40);
}

/// Random growth, edits, evictions and re-caching: walks with witnesses answer exactly what
/// walks with lookups alone answer.
#[test]
fn witnesses_never_change_an_answer() {
    let mut next = xorshift(0x2545_f491_4f6c_dd1du64);
    let mut h = hasher();
    let mut plain_h = hasher();
    let mut pool = ModelPool {
        blocks: vec![None; 96],
        ..ModelPool::default()
    };
    let mut with: ChainCache<(usize, u64)> = ChainCache::new(1 << 16);
    let mut without: ChainCache = ChainCache::new(1 << 16);
    let mut prompts: Vec<Vec<u32>> = vec![Vec::new(); 4];
    let mut rechecked = 0;
    for step in 0..600 {
        let s = next(4);
        let p = &mut prompts[s];
        match next(6) {
            0 => p.truncate(next(p.len() + 1)),
            1 if !p.is_empty() => {
                let i = next(p.len());
                p[i] = next(1000) as u32;
            }
            _ if p.len() > 16 * 60 => p.truncate(16 * 3),
            _ => p.extend(prompt(next(100), step)),
        }
        // The engine ran this prompt: its blocks are cached, into random (reused) blocks.
        if next(2) == 0 {
            for hash in reference(p) {
                let block = next(pool.blocks.len());
                pool.cache(hash, block);
            }
        }
        for _ in 0..next(4) {
            let block = next(pool.blocks.len());
            pool.evict(block);
        }
        let id = format!("s{s}");
        let r = with.walk(Some(&id), p, BS, &mut h, &mut pool);
        let map = pool.map.clone();
        let expected = without.walk(Some(&id), p, BS, &mut plain_h, &mut |hash: &BlockHash| {
            map.contains_key(hash)
        });
        assert_eq!(r.hit_blocks, expected.hit_blocks, "step {step}");
        assert!(r.blocks_rechecked <= r.hit_blocks);
        rechecked += r.blocks_rechecked;
    }
    assert!(rechecked > 100, "witnesses were used ({rechecked})");
}

/// A [`ModelPool`] that records which witnesses the walk asked to prefetch, and when.
struct PrefetchSpy {
    pool: ModelPool,
    prefetched: std::cell::RefCell<HashSet<(usize, u64)>>,
    /// Re-checked witnesses that had not been requested before their check.
    unrequested: usize,
    checked: usize,
}

impl Residency for PrefetchSpy {
    type Witness = (usize, u64);

    fn lookup(&mut self, hash: &BlockHash) -> Lookup<(usize, u64)> {
        self.pool.lookup(hash)
    }

    fn still_resident(&mut self, witnesses: &[Option<(usize, u64)>]) -> usize {
        let proven = self.pool.still_resident(witnesses);
        for w in witnesses[..proven].iter().flatten() {
            self.checked += 1;
            self.unrequested += usize::from(!self.prefetched.borrow().contains(w));
        }
        proven
    }

    fn prefetch(&self, witnesses: &[Option<(usize, u64)>]) {
        self.prefetched
            .borrow_mut()
            .extend(witnesses.iter().flatten());
    }
}

/// Every block a walk re-checks through its witness was requested ahead (the loads overlap the
/// checks), at chain lengths on and off the 64-block segment boundaries, and the hint changes
/// no answer.
#[test]
fn rechecked_witnesses_are_prefetched_first() {
    for blocks in [1, 63, 64, 65, 128, 130, 200] {
        let mut h = hasher();
        let tokens = prompt(BS * blocks + 1, 7);
        let mut spy = PrefetchSpy {
            pool: ModelPool {
                blocks: vec![None; blocks],
                ..ModelPool::default()
            },
            prefetched: Default::default(),
            unrequested: 0,
            checked: 0,
        };
        for (i, hash) in reference(&tokens).into_iter().enumerate() {
            spy.pool.cache(hash, i);
        }
        let mut cache: ChainCache<(usize, u64)> = ChainCache::new(1 << 20);
        cache.walk(Some("s"), &tokens, BS, &mut h, &mut spy);
        let again = cache.walk(Some("s"), &tokens, BS, &mut h, &mut spy);
        assert_eq!((again.hit_blocks, again.blocks_rechecked), (blocks, blocks));
        assert_eq!(
            (spy.checked, spy.unrequested),
            (blocks, 0),
            "{blocks} blocks"
        );
    }
}

/// `copy_hashes` hands out a session's cached hashes only where the stored tokens are the
/// prompt's: after a miss inside the shared prefix the chain keeps an older prompt's tail.
#[test]
fn copy_hashes_stops_where_the_chain_holds_another_prompts_tail() {
    let mut cache: ChainCache = ChainCache::new(1 << 20);
    let mut h = hasher();
    let older = prompt(20 * BS + 1, 1);
    let all = reference(&older);
    cache.walk(Some("s"), &older, BS, &mut h, &mut |_: &BlockHash| true);
    let mut out = Vec::new();
    assert_eq!(cache.copy_hashes("s", &older, 3, 20, &mut out), 17);
    assert_eq!(out, all[3..20]);
    // A newer prompt sharing 5 blocks, walked while nothing is resident: the walk misses at
    // block 0, inside the shared prefix, and leaves the chain (the older prompt's) alone.
    let mut newer = older[..5 * BS].to_vec();
    newer.extend(prompt(12 * BS + 1, 2));
    cache.walk(Some("s"), &newer, BS, &mut h, &mut |_: &BlockHash| false);
    out.clear();
    assert_eq!(cache.copy_hashes("s", &newer, 0, 17, &mut out), 5);
    assert_eq!(out, reference(&newer)[..5]);
    // Unknown sessions and ranges past the chain copy nothing.
    assert_eq!(cache.copy_hashes("nobody", &newer, 0, 17, &mut out), 0);
    assert_eq!(cache.copy_hashes("s", &older, 25, 30, &mut out), 0);
}
