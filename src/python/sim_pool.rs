//! The twin's KV-cache manager and cost model for Python tests and calibration:
//! `SimKvManager` (driven side by side with vLLM's real `KVCacheManager` in
//! `tests/python/test_sim_block_pool.py`), `SimReplica` (driven beside vLLM's real `Scheduler`
//! in `tests/python/test_sim_scheduler_vllm.py`), `sim_step_features` and `sim_profile_step_times`
//! (used by `session_gate.lab.sim.calibrate` to fit and check a profile with the Rust code that
//! runs it). A thin skin: no logic of its own.
use std::collections::HashMap;

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;

use super::guard::no_panic;
use crate::sim::block_pool::BlockId;
use crate::sim::kv_manager::{KvManager, ReqKv};
use crate::sim::{BlockHash, CostModel, Replica, ReplicaConfig, SimRequest, StepWork};

/// The twin's KV-cache manager with per-request block lists keyed by an integer id.
#[pyclass(name = "SimKvManager", module = "session_gate._native", unsendable)]
pub(crate) struct SimKvManager {
    kv: KvManager,
    reqs: HashMap<u64, ReqKv>,
    scratch: Vec<BlockId>,
}

#[pymethods]
impl SimKvManager {
    #[new]
    fn new(num_blocks: u32, block_size: u32, max_model_len: u32) -> PyResult<Self> {
        no_panic("SimKvManager()", || {
            if num_blocks < 2 || block_size == 0 {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "num_blocks must be >= 2 and block_size >= 1",
                ));
            }
            Ok(SimKvManager {
                kv: KvManager::new(num_blocks, block_size, max_model_len),
                reqs: HashMap::new(),
                scratch: Vec::new(),
            })
        })
    }

    /// Blocks of the longest prefix hit for a request of `num_tokens` tokens (read-only).
    fn lookup(&mut self, block_hashes: Vec<BlockHash>, num_tokens: u32) -> PyResult<Vec<u32>> {
        no_panic("SimKvManager.lookup", || {
            self.kv
                .find_longest_cache_hit(&block_hashes, num_tokens, &mut self.scratch);
            Ok(self.scratch.clone())
        })
    }

    /// `allocate_slots`; a request seen for the first time starts with no blocks. `hit` is the
    /// block list `lookup` returned (empty for a running request).
    #[pyo3(signature = (req_id, num_computed, num_new_tokens, hit, num_tokens, block_hashes, full_sequence_must_fit))]
    #[allow(clippy::too_many_arguments)]
    fn allocate(
        &mut self,
        req_id: u64,
        num_computed: u32,
        num_new_tokens: u32,
        hit: Vec<u32>,
        num_tokens: u32,
        block_hashes: Vec<BlockHash>,
        full_sequence_must_fit: bool,
    ) -> PyResult<bool> {
        no_panic("SimKvManager.allocate", || {
            let kv = self.reqs.entry(req_id).or_default();
            Ok(self.kv.allocate_slots(
                kv,
                num_computed,
                num_new_tokens,
                &hit,
                num_tokens,
                &block_hashes,
                full_sequence_must_fit,
            ))
        })
    }

    /// Frees a request's blocks, tail first.
    fn free(&mut self, req_id: u64) -> PyResult<()> {
        no_panic("SimKvManager.free", || {
            let mut kv = self
                .reqs
                .remove(&req_id)
                .ok_or_else(|| PyKeyError::new_err(format!("unknown request {req_id}")))?;
            self.kv.free(&mut kv);
            Ok(())
        })
    }

    /// A request's blocks in token order.
    fn req_blocks(&self, req_id: u64) -> Vec<u32> {
        self.reqs
            .get(&req_id)
            .map(|r| r.blocks.clone())
            .unwrap_or_default()
    }

    /// The free queue, front (allocated next) to back.
    fn free_queue(&self) -> Vec<u32> {
        self.kv.pool.free_queue()
    }

    /// The cached map as sorted `(hash, block)` pairs.
    fn cached_map(&self) -> Vec<(BlockHash, u32)> {
        self.kv.pool.cached_map()
    }

    /// Ref count of every block, by block id.
    fn ref_counts(&self) -> Vec<u32> {
        (0..self.kv.pool.num_blocks())
            .map(|b| self.kv.pool.ref_cnt(b))
            .collect()
    }

    /// `(num_free_blocks, num_cached_free_blocks, usage)`.
    fn usage(&self) -> (u32, u32, f64) {
        let p = &self.kv.pool;
        (p.num_free_blocks(), p.num_cached_free_blocks(), p.usage())
    }
}

/// One modelled replica, step by step (tests; the driver's simulations go through `sim.rs`).
#[pyclass(name = "SimReplica", module = "session_gate._native", unsendable)]
pub(crate) struct SimReplica {
    inner: Replica,
}

/// `(scheduled [(id, tokens)], finished [(id, num_cached_tokens)], preempted [id], seconds)`.
type StepTuple = (Vec<(u64, u32)>, Vec<(u64, u32)>, Vec<u64>, f64);

#[pymethods]
impl SimReplica {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, profile="cpu-tiny"))]
    fn new(
        num_blocks: u32,
        block_size: u32,
        max_num_seqs: u32,
        max_num_batched_tokens: u32,
        profile: &str,
    ) -> PyResult<Self> {
        no_panic("SimReplica()", || {
            let config = ReplicaConfig {
                num_blocks,
                block_size,
                max_num_seqs,
                max_num_batched_tokens,
            };
            Ok(SimReplica {
                inner: Replica::new(config, CostModel::profile(profile)?)?,
            })
        })
    }

    /// Adds a request at the back of the waiting queue.
    fn add_request(
        &mut self,
        id: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        block_hashes: Vec<BlockHash>,
    ) -> PyResult<()> {
        no_panic("SimReplica.add_request", || {
            let block_hashes = block_hashes.into();
            Ok(self.inner.add_request(SimRequest {
                id,
                prompt_tokens,
                max_tokens,
                block_hashes,
            })?)
        })
    }

    /// Runs one step; `None` when there is nothing to run.
    fn step(&mut self) -> PyResult<Option<StepTuple>> {
        no_panic("SimReplica.step", || {
            Ok(self.inner.step().map(|out| {
                let scheduled = self
                    .inner
                    .last_scheduled()
                    .iter()
                    .map(|e| (e.0, e.1))
                    .collect();
                let finished = out
                    .finished
                    .iter()
                    .map(|f| (f.id, f.num_cached_tokens))
                    .collect();
                (scheduled, finished, out.preempted, out.duration_sec)
            }))
        })
    }

    /// Aborts a request; whether it was live.
    fn abort_request(&mut self, id: u64) -> bool {
        self.inner.abort_request(id)
    }
}

fn work_of(entries: &[(u32, u32, u32, u32)]) -> StepWork {
    let mut w = StepWork::default();
    for &(n, before, num_tokens, num_output) in entries {
        w.add(n, before, num_tokens, num_output);
    }
    w
}

/// The cost model's regressors for one step, from `(scheduled tokens, computed before,
/// num_tokens, num_output_tokens)` per scheduled request.
#[pyfunction]
fn sim_step_features(entries: Vec<(u32, u32, u32, u32)>) -> PyResult<Vec<f64>> {
    no_panic("sim_step_features", || {
        Ok(work_of(&entries).features().to_vec())
    })
}

/// Step times a profile (TOML text; `path` names it in errors) predicts for these steps.
#[pyfunction]
fn sim_profile_step_times(
    path: &str,
    text: &str,
    steps: Vec<Vec<(u32, u32, u32, u32)>>,
) -> PyResult<Vec<f64>> {
    no_panic("sim_profile_step_times", || {
        let model = CostModel::from_toml(path, text)?;
        Ok(steps.iter().map(|s| model.step_time(&work_of(s))).collect())
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SimKvManager>()?;
    m.add_class::<SimReplica>()?;
    m.add_function(wrap_pyfunction!(sim_step_features, m)?)?;
    m.add_function(wrap_pyfunction!(sim_profile_step_times, m)?)?;
    Ok(())
}
