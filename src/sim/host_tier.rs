//! The host (CPU) KV tier's block accounting: vLLM 0.32's `CPUOffloadingManager`
//! (`v1/kv_offload/cpu/manager.py`) with its default `LRUCachePolicy`
//! (`v1/kv_offload/cpu/policies/lru.py`), the manager the native offloading backend
//! (`--kv-offloading-size`, `OffloadingConnector`) runs in the scheduler.
//!
//! One chunk is one GPU block (vLLM's default `blocks_per_chunk = 1`), keyed by the block's
//! chained hash. The rules, as vLLM's source has them:
//! - a chunk is *pending* from `prepare_store` until `complete_store` (a lookup answers
//!   `HitPending`), then *ready*; a ready chunk with no load in flight is *evictable*;
//! - recency is a rank: a chunk gets a new rank when it is inserted and when a request that
//!   stored or loaded it finishes (`on_request_finished`: every key the request observed, in
//!   prefix order, re-ranked tail first so the head is the most recent); lookups and loads do
//!   not touch it;
//! - `prepare_store` stores the offered keys the tier does not hold; when the free chunks do
//!   not suffice it evicts the evictable chunks of lowest rank, never one of the offered keys,
//!   and refuses the whole offer (changing nothing but the request's observed keys) when it
//!   cannot evict enough;
//! - chunk ids: fresh ids first, then ids freed by evictions, last freed first.
//!
//! `store_threshold` is 0 (vLLM's default: every offered chunk is stored). The differential
//! test `tests/python/test_sim_host_tier.py` drives this and vLLM's own manager with the same
//! operations and compares every answer and the eviction order.
use std::collections::{BTreeSet, HashSet};

use super::BlockHash;
use super::block_pool::IdMap;

/// What a lookup of one key finds (`LookupResult`, without `RETRY`, which only the
/// asynchronous tiers answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Not in the tier.
    Miss,
    /// Stored and readable.
    Hit,
    /// Being stored; not readable yet.
    HitPending,
}

#[derive(Debug, Clone, Copy)]
struct Chunk {
    /// -1 while being stored, else the loads in flight from it.
    ref_cnt: i32,
    chunk_id: u64,
    rank: u64,
}

/// The keys one request observed (`_RequestCacheAccess`): `(block index, hash)` in the order
/// first seen, sorted by block index when the request finishes.
#[derive(Debug, Default)]
struct Access {
    keys: Vec<(u32, BlockHash)>,
    seen: HashSet<BlockHash>,
}

/// What `prepare_store` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// Keys now being stored, in offer order.
    pub keys: Vec<BlockHash>,
    /// Their chunk ids.
    pub chunk_ids: Vec<u64>,
    /// Keys evicted to make room, in eviction order.
    pub evicted: Vec<BlockHash>,
}

/// The tier's block accounting (see the module docs).
#[derive(Debug)]
pub struct HostTier {
    num_chunks: u64,
    num_allocated: u64,
    free_list: Vec<u64>,
    chunks: IdMap<BlockHash, Chunk>,
    /// Evictable chunks by (rank, key): the LRU order, least recent first.
    evictable: BTreeSet<(u64, BlockHash)>,
    next_rank: u64,
    num_pending: u64,
    access: IdMap<u64, Access>,
}

impl HostTier {
    /// A tier of `num_chunks` chunks (one GPU block each).
    pub fn new(num_chunks: u64) -> Self {
        HostTier {
            num_chunks,
            num_allocated: 0,
            free_list: Vec::new(),
            chunks: IdMap::default(),
            evictable: BTreeSet::new(),
            next_rank: 0,
            num_pending: 0,
            access: IdMap::default(),
        }
    }

    /// Capacity in chunks.
    pub fn capacity(&self) -> u64 {
        self.num_chunks
    }

    /// Chunks holding KV or being written (allocated and not free).
    pub fn used(&self) -> u64 {
        self.num_allocated - self.free_list.len() as u64
    }

    /// Chunks being stored.
    pub fn num_pending(&self) -> u64 {
        self.num_pending
    }

    /// `lookup`: read-only (no recency change, as vLLM's).
    pub fn lookup(&self, key: BlockHash) -> Lookup {
        match self.chunks.get(&key) {
            None => Lookup::Miss,
            Some(c) if c.ref_cnt < 0 => Lookup::HitPending,
            Some(_) => Lookup::Hit,
        }
    }

    /// Leading keys of `keys` the tier holds (ready or pending), and whether any is pending:
    /// the connector's `_maximal_prefix_lookup` over consecutive chunks.
    pub fn leading_hits(&self, keys: &[BlockHash]) -> (u32, bool) {
        let mut pending = false;
        let mut n = 0;
        for &k in keys {
            match self.lookup(k) {
                Lookup::Miss => break,
                Lookup::HitPending => pending = true,
                Lookup::Hit => {}
            }
            n += 1;
        }
        (n, pending)
    }

    fn observe(&mut self, req: u64, keys: impl IntoIterator<Item = (u32, BlockHash)>) {
        let a = self.access.entry(req).or_default();
        for (i, k) in keys {
            if a.seen.insert(k) {
                a.keys.push((i, k));
            }
        }
    }

    fn free_chunks(&self) -> u64 {
        self.free_list.len() as u64 + self.num_chunks - self.num_allocated
    }

    /// `prepare_store` of `keys` (`(block index, hash)`, in prefix order) for request `req`;
    /// `None` when the evictions it needs are impossible.
    pub fn prepare_store(&mut self, req: u64, keys: &[(u32, BlockHash)]) -> Option<Stored> {
        let mut to_store = Vec::new();
        let mut observed = Vec::new();
        for &(i, k) in keys {
            match self.chunks.get(&k) {
                None => {
                    to_store.push(k);
                    observed.push((i, k));
                }
                Some(c) if c.ref_cnt >= 0 => observed.push((i, k)),
                Some(_) => {}
            }
        }
        // vLLM records the access before any early return.
        self.observe(req, observed);
        if to_store.is_empty() {
            return Some(Stored::default());
        }
        let need = to_store.len() as u64;
        let mut evicted = Vec::new();
        if need > self.free_chunks() {
            let n = (need - self.free_chunks()) as usize;
            if n > self.evictable.len() {
                return None;
            }
            let protected: HashSet<BlockHash> = keys.iter().map(|&(_, k)| k).collect();
            let victims: Vec<(u64, BlockHash)> = self
                .evictable
                .iter()
                .filter(|(_, k)| !protected.contains(k))
                .take(n)
                .copied()
                .collect();
            if victims.len() < n {
                return None;
            }
            for entry in victims {
                self.evictable.remove(&entry);
                let c = self
                    .chunks
                    .remove(&entry.1)
                    .expect("evictable chunk is stored");
                self.free_list.push(c.chunk_id);
                evicted.push(entry.1);
            }
        }
        let fresh = need.min(self.num_chunks - self.num_allocated);
        let mut chunk_ids = Vec::with_capacity(to_store.len());
        for _ in 0..fresh {
            chunk_ids.push(self.num_allocated);
            self.num_allocated += 1;
        }
        for _ in fresh..need {
            chunk_ids.push(self.free_list.pop().expect("evictions freed enough"));
        }
        for (&k, &chunk_id) in to_store.iter().zip(&chunk_ids) {
            self.next_rank += 1;
            self.chunks.insert(
                k,
                Chunk {
                    ref_cnt: -1,
                    chunk_id,
                    rank: self.next_rank,
                },
            );
        }
        self.num_pending += need;
        Some(Stored {
            keys: to_store,
            chunk_ids,
            evicted,
        })
    }

    /// `complete_store(success=True)`: the chunks become readable and evictable.
    pub fn complete_store(&mut self, keys: &[BlockHash]) {
        for k in keys {
            if let Some(c) = self.chunks.get_mut(k)
                && c.ref_cnt < 0
            {
                c.ref_cnt = 0;
                self.num_pending -= 1;
                self.evictable.insert((c.rank, *k));
            }
        }
    }

    /// `prepare_load` of ready chunks for request `req`: protects them from eviction until
    /// [`Self::complete_load`].
    pub fn prepare_load(&mut self, req: u64, keys: &[(u32, BlockHash)]) {
        for &(_, k) in keys {
            let c = self.chunks.get_mut(&k).expect("a loaded chunk is stored");
            debug_assert!(c.ref_cnt >= 0, "loading a pending chunk");
            if c.ref_cnt == 0 {
                self.evictable.remove(&(c.rank, k));
            }
            c.ref_cnt += 1;
        }
        self.observe(req, keys.iter().copied());
    }

    /// `complete_load`.
    pub fn complete_load(&mut self, keys: &[BlockHash]) {
        for k in keys {
            let c = self.chunks.get_mut(k).expect("a loading chunk is stored");
            debug_assert!(c.ref_cnt > 0);
            c.ref_cnt -= 1;
            if c.ref_cnt == 0 {
                self.evictable.insert((c.rank, *k));
            }
        }
    }

    /// `on_request_finished`: every key `req` observed gets a new rank, tail first, so its
    /// head is the most recent.
    pub fn request_finished(&mut self, req: u64) {
        let Some(mut a) = self.access.remove(&req) else {
            return;
        };
        a.keys.sort_by_key(|&(i, _)| i);
        for &(_, k) in a.keys.iter().rev() {
            if let Some(c) = self.chunks.get_mut(&k) {
                self.next_rank += 1;
                if c.ref_cnt == 0 {
                    self.evictable.remove(&(c.rank, k));
                    self.evictable.insert((self.next_rank, k));
                }
                c.rank = self.next_rank;
            }
        }
    }

    /// The evictable keys, least recent first (the order evictions take them; tests).
    pub fn eviction_order(&self) -> Vec<BlockHash> {
        self.evictable.iter().map(|&(_, k)| k).collect()
    }

    /// Every stored or pending key with its chunk id, sorted (tests).
    pub fn chunk_map(&self) -> Vec<(BlockHash, u64)> {
        let mut out: Vec<_> = self.chunks.iter().map(|(k, c)| (*k, c.chunk_id)).collect();
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(r: std::ops::Range<u64>) -> Vec<(u32, BlockHash)> {
        r.map(|k| (k as u32, k)).collect()
    }

    #[test]
    fn stores_are_pending_until_completed() {
        let mut t = HostTier::new(4);
        let s = t.prepare_store(1, &keys(0..2)).unwrap();
        assert_eq!(s.keys, vec![0, 1]);
        assert_eq!(s.chunk_ids, vec![0, 1]);
        assert_eq!(t.lookup(0), Lookup::HitPending);
        assert_eq!(t.leading_hits(&[0, 1, 2]), (2, true));
        t.complete_store(&[0, 1]);
        assert_eq!(t.lookup(1), Lookup::Hit);
        assert_eq!(t.leading_hits(&[0, 1, 2]), (2, false));
    }

    #[test]
    fn evicts_least_recent_and_never_the_offer() {
        let mut t = HostTier::new(3);
        t.prepare_store(1, &keys(0..3)).unwrap();
        t.complete_store(&[0, 1, 2]);
        // Request 1 finishing re-ranks tail first: 2, 1, 0 (0 most recent).
        t.request_finished(1);
        assert_eq!(t.eviction_order(), vec![2, 1, 0]);
        // Offering 1 and a new key evicts 2 (least recent), not 1 (offered).
        let s = t.prepare_store(2, &[(0, 1), (1, 9)]).unwrap();
        assert_eq!(s.evicted, vec![2]);
        assert_eq!(s.chunk_ids, vec![2]);
        // A load pins: nothing evictable but 1 -> an offer of two new keys fails.
        t.complete_store(&[9]);
        t.prepare_load(3, &[(0, 0), (1, 9)]);
        assert!(t.prepare_store(4, &[(0, 7), (1, 8)]).is_none());
        t.complete_load(&[0, 9]);
        assert!(t.prepare_store(4, &[(0, 7), (1, 8)]).is_some());
    }
}
