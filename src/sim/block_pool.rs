//! vLLM 0.32's V1 `BlockPool` (`v1/core/block_pool.py`) and its `FreeKVCacheBlockQueue`
//! (`v1/core/kv_cache_utils.py`), for one full-attention KV-cache group whose block size equals
//! the hash block size (every engine the twin models).
//!
//! What must match vLLM exactly, because the gate's probes and the hit rate depend on it:
//! - block 0 is the null block, popped from the queue at start and never freed;
//! - the free queue starts in block-id order; `get_new_blocks` pops from the front and only then
//!   drops a reused block's hash (`_maybe_evict_cached_block`);
//! - `free_blocks` takes blocks in eviction order (callers pass a request's blocks tail first):
//!   blocks reaching ref count 0 go to the FRONT if unhashed (`prepend_n`, order kept) and to the
//!   BACK if hashed (`append_n`);
//! - `touch` (a prefix hit) takes a free block out of the queue and raises its ref count;
//! - the cached map can hold several blocks under one hash (vLLM does not de-duplicate); a lookup
//!   returns the first one inserted that is still there, like `next(iter(dict))`.
//!
//! Every operation is O(1) per block: the queue is an intrusive doubly linked list over a `Vec`
//! (two sentinel slots past the real blocks), the cached map a `HashMap`.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::BlockHash;

/// A multiply-rotate hasher for the twin's u64 keys (block hashes, request ids): they are
/// already well spread or unique, and SipHash cost a third of a prefill-heavy run's time.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn finish(&self) -> u64 {
        // hashbrown takes the bucket from the low bits and a tag from the top 7: fold the
        // well-mixed high half down so both are good.
        self.0 ^ (self.0 >> 32)
    }
}

/// A `HashMap` keyed by ids, with [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Index of a block in the pool (`KVCacheBlock.block_id`).
pub type BlockId = u32;

/// No link (a block outside the free queue).
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    /// Bumped whenever the block gains or loses a hash, so a [`Witness`] taken while it held
    /// one proves, while the stamp is unchanged, that it still holds the same hash.
    stamp: u32,
    hash: Option<BlockHash>,
    prev: u32,
    next: u32,
}

/// Proof of a cache hit that can be re-checked without a cached-map lookup (an array read): the
/// block found, its stamp then, and the hash it was found under. While the block's stamp is
/// unchanged it still holds that hash, and it is still the block a lookup of the hash returns
/// (blocks under one hash are kept in insertion order and it was the first then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Witness {
    /// The block found.
    pub block: BlockId,
    stamp: u32,
    hash: BlockHash,
}

/// Blocks cached under one hash: almost always one, in insertion order otherwise (boxed so
/// the common entry stays small).
#[derive(Debug, Clone)]
enum Cached {
    One(BlockId),
    #[allow(clippy::box_collection)]
    Many(Box<Vec<BlockId>>),
}

impl Cached {
    fn first(&self) -> BlockId {
        match self {
            Cached::One(b) => *b,
            Cached::Many(v) => v[0],
        }
    }
}

/// The block pool: ref counts, hashes, the free queue and the cached-block map.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Sentinel indices of the free queue (`fake_free_list_head` / `_tail`).
    head: u32,
    tail: u32,
    num_free: u32,
    /// Free blocks that still hold a hash (what the usage probe calls cached-free).
    num_cached_free: u32,
    cached: IdMap<BlockHash, Cached>,
    /// Hashes dropped from the cached map so far: while it is unchanged, every witness that held
    /// still holds (a chain of hits can only grow).
    removals: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (vLLM's `num_gpu_blocks`, the null block included).
    /// Panics if `num_blocks < 2` (callers validate the configuration first).
    pub fn new(num_blocks: u32) -> Self {
        assert!(
            num_blocks >= 2,
            "a block pool needs the null block and one more"
        );
        let n = num_blocks as usize;
        let head = num_blocks;
        let tail = num_blocks + 1;
        let mut blocks: Vec<Block> = (0..n + 2)
            .map(|_| Block {
                ref_cnt: 0,
                stamp: 0,
                hash: None,
                prev: NIL,
                next: NIL,
            })
            .collect();
        for (i, b) in blocks.iter_mut().take(n).enumerate() {
            b.prev = if i == 0 { head } else { i as u32 - 1 };
            b.next = if i + 1 == n { tail } else { i as u32 + 1 };
        }
        blocks[head as usize].next = 0;
        blocks[tail as usize].prev = num_blocks - 1;
        let mut pool = BlockPool {
            blocks,
            head,
            tail,
            num_free: num_blocks,
            num_cached_free: 0,
            cached: IdMap::default(),
            removals: 0,
        };
        // The null block: popped once, never freed, its ref count not maintained.
        let null = pool.pop_front();
        debug_assert_eq!(null, 0);
        pool
    }

    /// Total blocks, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.head
    }

    /// Blocks in the free queue (cached or not): `get_num_free_blocks()`.
    pub fn num_free_blocks(&self) -> u32 {
        self.num_free
    }

    /// Free blocks that still hold a cached prefix.
    pub fn num_cached_free_blocks(&self) -> u32 {
        self.num_cached_free
    }

    /// `get_usage()`: the used fraction of the non-null blocks.
    pub fn usage(&self) -> f64 {
        let total = self.num_blocks() - 1;
        1.0 - f64::from(self.num_free) / f64::from(total)
    }

    /// A block's ref count.
    pub fn ref_cnt(&self, block: BlockId) -> u32 {
        self.blocks[block as usize].ref_cnt
    }

    /// A block's hash, if it is cached.
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks[block as usize].hash
    }

    /// `get_cached_block`: the first block cached under `hash`, if any.
    pub fn cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).map(Cached::first)
    }

    /// A lookup of `hash` with a witness for later re-checks ([`Self::still_cached`]).
    pub fn cached_witness(&self, hash: BlockHash) -> Option<Witness> {
        self.cached_block(hash).map(|block| Witness {
            block,
            stamp: self.blocks[block as usize].stamp,
            hash,
        })
    }

    /// Whether `w` still proves its hit: its block still holds `hash`, and a lookup of `hash`
    /// would still return it. O(1), no map lookup.
    pub fn still_cached(&self, w: &Witness, hash: BlockHash) -> bool {
        w.hash == hash && self.blocks[w.block as usize].stamp == w.stamp
    }

    /// Hashes removed from the cached map so far (evictions of reused blocks).
    pub fn removals(&self) -> u64 {
        self.removals
    }

    /// Number of distinct hashes in the cached map (`len(cached_block_hash_to_block)`).
    pub fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// The blocks cached under `hash`, in insertion order (for the differential test).
    pub fn cached_blocks(&self, hash: BlockHash) -> Vec<BlockId> {
        match self.cached.get(&hash) {
            None => Vec::new(),
            Some(Cached::One(b)) => vec![*b],
            Some(Cached::Many(v)) => v.to_vec(),
        }
    }

    /// Every (hash, block) pair of the cached map, sorted (for the differential test).
    pub fn cached_map(&self) -> Vec<(BlockHash, BlockId)> {
        let mut out: Vec<(BlockHash, BlockId)> = Vec::with_capacity(self.cached.len());
        for (h, c) in &self.cached {
            match c {
                Cached::One(b) => out.push((*h, *b)),
                Cached::Many(v) => out.extend(v.iter().map(|b| (*h, *b))),
            }
        }
        out.sort_unstable();
        out
    }

    /// The free queue, front (next to allocate) to back. O(free blocks): tests only.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free as usize);
        let mut cur = self.blocks[self.head as usize].next;
        while cur != self.tail {
            out.push(cur);
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    /// `get_new_blocks(n)`: pops `n` blocks from the front, dropping each one's old hash.
    /// Returns `None` (and changes nothing) when fewer than `n` blocks are free.
    pub fn get_new_blocks(&mut self, n: u32, out: &mut Vec<BlockId>) -> Option<()> {
        if n > self.num_free {
            return None;
        }
        for _ in 0..n {
            let b = self.pop_front();
            self.evict_hash(b);
            let blk = &mut self.blocks[b as usize];
            debug_assert_eq!(blk.ref_cnt, 0);
            blk.ref_cnt = 1;
            out.push(b);
        }
        Some(())
    }

    /// `touch`: a prefix hit on these blocks; free ones leave the queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.blocks[b as usize].ref_cnt == 0 && b != 0 {
                self.unlink(b);
            }
            self.blocks[b as usize].ref_cnt += 1;
        }
    }

    /// `free_blocks`: `ordered` in eviction order (first evicted first). Blocks reaching ref count
    /// 0 go to the front if unhashed, to the back if hashed, each group keeping its order.
    pub fn free_blocks(&mut self, ordered: impl IntoIterator<Item = BlockId>) {
        // Unhashed blocks are prepended as one run: remember the run's last block so the next
        // one links after it, which keeps `prepend_n`'s order without a temporary list.
        let mut front_cursor = self.head;
        for b in ordered {
            if b == 0 {
                // The null block's ref count is not maintained (vLLM decrements it but never
                // frees it); requests here never hold it.
                continue;
            }
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.ref_cnt > 0, "freeing a free block {b}");
            blk.ref_cnt -= 1;
            if blk.ref_cnt == 0 {
                if blk.hash.is_none() {
                    self.link_after(front_cursor, b);
                    front_cursor = b;
                } else {
                    let last = self.blocks[self.tail as usize].prev;
                    self.link_after(last, b);
                    self.num_cached_free += 1;
                }
            }
        }
    }

    /// A finished session's blocks go first (`finished_blocks` in the engine): the free cached
    /// block of each hash in `deepest_first` leaves its place in the queue and joins the front
    /// run, in that order (`FreeKVCacheBlockQueue.remove`, then `prepend_n`). Blocks in use
    /// and hashes no longer cached are skipped; returns how many moved.
    pub fn evict_first(&mut self, deepest_first: impl IntoIterator<Item = BlockHash>) -> u32 {
        let mut cursor = self.head;
        let mut moved = 0;
        for hash in deepest_first {
            let Some(b) = self.cached_block(hash) else {
                continue;
            };
            if b == 0 || self.blocks[b as usize].ref_cnt != 0 {
                continue;
            }
            self.unlink(b);
            self.link_after(cursor, b);
            self.num_cached_free += 1;
            cursor = b;
            moved += 1;
        }
        moved
    }

    /// Caches `block` (full, owned by a request) under `hash`: `_insert_block_hash` for a block
    /// with no hash yet. A block that already carries this hash is left alone.
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash) {
        let blk = &mut self.blocks[block as usize];
        if blk.hash == Some(hash) {
            return;
        }
        debug_assert!(blk.hash.is_none(), "re-hashing block {block}");
        blk.hash = Some(hash);
        blk.stamp = blk.stamp.wrapping_add(1);
        match self.cached.get_mut(&hash) {
            None => {
                self.cached.insert(hash, Cached::One(block));
            }
            Some(c) => match c {
                Cached::One(first) => *c = Cached::Many(Box::new(vec![*first, block])),
                Cached::Many(v) => v.push(block),
            },
        }
    }

    /// `_maybe_evict_cached_block` for a block just popped from the queue.
    fn evict_hash(&mut self, b: BlockId) {
        let blk = &mut self.blocks[b as usize];
        let Some(hash) = blk.hash.take() else {
            return;
        };
        blk.stamp = blk.stamp.wrapping_add(1);
        self.removals += 1;
        if let Some(c) = self.cached.get_mut(&hash) {
            match c {
                Cached::One(only) => {
                    if *only == b {
                        self.cached.remove(&hash);
                    }
                }
                Cached::Many(v) => {
                    if let Some(pos) = v.iter().position(|&x| x == b) {
                        v.remove(pos);
                    }
                    // vLLM keeps a dict even when one block is left; it behaves the same.
                    if v.is_empty() {
                        self.cached.remove(&hash);
                    }
                }
            }
        }
    }

    fn pop_front(&mut self) -> BlockId {
        let b = self.blocks[self.head as usize].next;
        debug_assert_ne!(b, self.tail, "pop from an empty free queue");
        self.unlink(b);
        b
    }

    fn unlink(&mut self, b: BlockId) {
        let Block {
            prev, next, hash, ..
        } = self.blocks[b as usize];
        debug_assert!(
            prev != NIL && next != NIL,
            "block {b} is not in the free queue"
        );
        self.blocks[prev as usize].next = next;
        self.blocks[next as usize].prev = prev;
        let blk = &mut self.blocks[b as usize];
        blk.prev = NIL;
        blk.next = NIL;
        self.num_free -= 1;
        if hash.is_some() {
            self.num_cached_free -= 1;
        }
    }

    /// Links `b` (not in the queue) right after `at` (a queued block or the head sentinel).
    fn link_after(&mut self, at: u32, b: BlockId) {
        let next = self.blocks[at as usize].next;
        self.blocks[at as usize].next = b;
        self.blocks[next as usize].prev = b;
        let blk = &mut self.blocks[b as usize];
        blk.prev = at;
        blk.next = next;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_in_id_order_without_the_null_block() {
        let pool = BlockPool::new(5);
        assert_eq!(pool.free_queue(), vec![1, 2, 3, 4]);
        assert_eq!(pool.num_free_blocks(), 4);
        assert_eq!(pool.usage(), 0.0);
    }

    #[test]
    fn evict_first_moves_free_cached_blocks_to_the_front_deepest_first() {
        let mut pool = BlockPool::new(8);
        let mut got = Vec::new();
        pool.get_new_blocks(5, &mut got).unwrap();
        assert_eq!(got, vec![1, 2, 3, 4, 5]);
        for (b, h) in [(1, 10), (2, 11), (3, 12), (4, 20)] {
            pool.cache_block(b, h);
        }
        // Block 4 (hash 20) is freed first, then 3, 2, 1 (tail first), block 5 stays in use.
        pool.free_blocks([4]);
        pool.free_blocks([3, 2, 1]);
        assert_eq!(pool.free_queue(), vec![6, 7, 4, 3, 2, 1]);
        // Hashes 12 and 11 (deepest first), 99 (not cached) and block 5 (in use) are skipped.
        pool.cache_block(5, 30);
        assert_eq!(pool.evict_first([12, 11, 99, 30]), 2);
        assert_eq!(pool.free_queue(), vec![3, 2, 6, 7, 4, 1]);
        assert_eq!(pool.num_free_blocks(), 6);
        assert_eq!(pool.num_cached_free_blocks(), 4);
        // Still cached: a hit before vLLM needs the blocks finds them.
        assert_eq!(pool.cached_block(12), Some(3));
        let mut next = Vec::new();
        pool.get_new_blocks(2, &mut next).unwrap();
        assert_eq!(next, vec![3, 2]);
        assert_eq!(pool.cached_block(12), None);
        assert_eq!(pool.num_cached_free_blocks(), 2);
    }

    #[test]
    fn freed_unhashed_go_front_in_order_and_hashed_go_back() {
        let mut pool = BlockPool::new(8);
        let mut got = Vec::new();
        pool.get_new_blocks(4, &mut got).unwrap();
        assert_eq!(got, vec![1, 2, 3, 4]);
        pool.cache_block(1, 11);
        pool.cache_block(2, 12);
        // A request frees tail first.
        pool.free_blocks([4, 3, 2, 1]);
        assert_eq!(pool.free_queue(), vec![4, 3, 5, 6, 7, 2, 1]);
        assert_eq!(pool.num_cached_free_blocks(), 2);
    }

    #[test]
    fn reuse_evicts_the_hash_only_when_allocated() {
        let mut pool = BlockPool::new(3);
        let mut got = Vec::new();
        pool.get_new_blocks(2, &mut got).unwrap();
        pool.cache_block(1, 7);
        pool.free_blocks([2, 1]);
        assert_eq!(pool.cached_block(7), Some(1));
        got.clear();
        pool.get_new_blocks(1, &mut got).unwrap();
        assert_eq!(got, vec![2]);
        assert_eq!(pool.cached_block(7), Some(1));
        got.clear();
        pool.get_new_blocks(1, &mut got).unwrap();
        assert_eq!(got, vec![1]);
        assert_eq!(pool.cached_block(7), None);
        assert!(pool.get_new_blocks(1, &mut got).is_none());
    }

    #[test]
    fn touch_takes_a_free_block_out_of_the_queue() {
        let mut pool = BlockPool::new(4);
        let mut got = Vec::new();
        pool.get_new_blocks(1, &mut got).unwrap();
        pool.cache_block(1, 9);
        pool.free_blocks([1]);
        assert_eq!(pool.free_queue(), vec![2, 3, 1]);
        pool.touch(&[1]);
        assert_eq!(pool.free_queue(), vec![2, 3]);
        assert_eq!(pool.ref_cnt(1), 1);
        assert_eq!(pool.num_cached_free_blocks(), 0);
    }

    #[test]
    fn duplicate_hashes_answer_the_first_inserted() {
        let mut pool = BlockPool::new(4);
        let mut got = Vec::new();
        pool.get_new_blocks(2, &mut got).unwrap();
        pool.cache_block(1, 5);
        pool.cache_block(2, 5);
        assert_eq!(pool.cached_blocks(5), vec![1, 2]);
        pool.free_blocks([1, 2]);
        // Block 3 is first, then 1 and 2 (hashed, appended in order).
        got.clear();
        pool.get_new_blocks(2, &mut got).unwrap();
        assert_eq!(got, vec![3, 1]);
        assert_eq!(pool.cached_block(5), Some(2));
    }
}
