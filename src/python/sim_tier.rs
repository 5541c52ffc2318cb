//! The twin's host KV tier for Python tests: `SimHostTier`, driven side by side with vLLM's
//! real `CPUOffloadingManager` (LRU policy) in `tests/python/test_sim_host_tier.py`. A thin
//! skin over [`HostTier`]: no logic of its own.
use pyo3::prelude::*;

use super::guard::no_panic;
use crate::sim::BlockHash;
use crate::sim::host_tier::{HostTier, Lookup};

/// `prepare_store`'s answer: `(keys stored, their chunk ids, keys evicted)`.
type StoreTuple = (Vec<BlockHash>, Vec<u64>, Vec<BlockHash>);

/// The twin's host-tier block accounting, keyed by integer block hashes and request ids.
#[pyclass(name = "SimHostTier", module = "session_gate._native", unsendable)]
pub(crate) struct SimHostTier {
    tier: HostTier,
}

#[pymethods]
impl SimHostTier {
    #[new]
    fn new(num_chunks: u64) -> PyResult<Self> {
        no_panic("SimHostTier()", || {
            Ok(SimHostTier {
                tier: HostTier::new(num_chunks),
            })
        })
    }

    /// `"miss"`, `"hit"` or `"hit_pending"`.
    fn lookup(&self, key: BlockHash) -> PyResult<&'static str> {
        no_panic("SimHostTier.lookup", || {
            Ok(match self.tier.lookup(key) {
                Lookup::Miss => "miss",
                Lookup::Hit => "hit",
                Lookup::HitPending => "hit_pending",
            })
        })
    }

    /// `prepare_store` of `(block index, key)` pairs; `None` when it is refused.
    fn prepare_store(
        &mut self,
        req_id: u64,
        keys: Vec<(u32, BlockHash)>,
    ) -> PyResult<Option<StoreTuple>> {
        no_panic("SimHostTier.prepare_store", || {
            Ok(self
                .tier
                .prepare_store(req_id, &keys)
                .map(|s| (s.keys, s.chunk_ids, s.evicted)))
        })
    }

    /// `complete_store(success=True)`.
    fn complete_store(&mut self, keys: Vec<BlockHash>) -> PyResult<()> {
        no_panic("SimHostTier.complete_store", || {
            self.tier.complete_store(&keys);
            Ok(())
        })
    }

    /// `prepare_load` of ready `(block index, key)` pairs.
    fn prepare_load(&mut self, req_id: u64, keys: Vec<(u32, BlockHash)>) -> PyResult<()> {
        no_panic("SimHostTier.prepare_load", || {
            self.tier.prepare_load(req_id, &keys);
            Ok(())
        })
    }

    /// `complete_load`.
    fn complete_load(&mut self, keys: Vec<BlockHash>) -> PyResult<()> {
        no_panic("SimHostTier.complete_load", || {
            self.tier.complete_load(&keys);
            Ok(())
        })
    }

    /// `on_request_finished`.
    fn request_finished(&mut self, req_id: u64) -> PyResult<()> {
        no_panic("SimHostTier.request_finished", || {
            self.tier.request_finished(req_id);
            Ok(())
        })
    }

    /// Evictable keys, least recent first.
    fn eviction_order(&self) -> Vec<BlockHash> {
        self.tier.eviction_order()
    }

    /// Every stored or pending key with its chunk id, sorted.
    fn chunk_map(&self) -> Vec<(BlockHash, u64)> {
        self.tier.chunk_map()
    }

    /// Chunks holding KV or being written.
    fn used(&self) -> u64 {
        self.tier.used()
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SimHostTier>()?;
    Ok(())
}
