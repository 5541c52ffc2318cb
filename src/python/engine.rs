//! The engine-side probe: runs inside vLLM's engine core and reads the block pool directly.
//!
//! Python (`session_gate.engine`) hands over vLLM's own objects — the prefix map's inner dict
//! (`BlockPool.cached_block_hash_to_block._cache`), the block list and `cached_block_hashes_by_block`
//! — and this module reads them through the CPython API, without calling any Python function per
//! block and without touching anything vLLM would notice (no ref counts, no LRU order, no stats).
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyType};

use super::guard::{no_panic, no_panic_then};
use super::host_tier::{Tier, TierHit, TierWalk};
use super::residency::{BlockWitness, HashSlot, KeyBuf, MapResidency};
use super::tokens::{TokenLimits, check_length, check_vocab, read_prompt};
use crate::hashing::{BlockHash, BlockHasher, HashAlgo};
use crate::prefix::ChainCache;

/// Residency probe bound to one engine's hashing configuration.
#[pyclass(module = "session_gate._native")]
pub(crate) struct ProbeEngine {
    hasher: BlockHasher,
    chains: ChainCache<BlockWitness>,
    block_size: usize,
    /// vLLM's map key is the block hash followed by the 4-byte big-endian KV-cache group id.
    group_suffix: [u8; 4],
    limits: TokenLimits,
    keys: KeyBuf,
    /// Where `KVCacheBlock` keeps its hash; `None` when no block type was given or its layout
    /// is not plain slots: then every block is looked up (still exact, only slower).
    hash_slot: Option<HashSlot>,
    /// The map the chains' witnesses were taken from. Held, so its address cannot be reused by
    /// another dict while witnesses point into it.
    witness_map: Option<Py<PyAny>>,
}

#[pymethods]
impl ProbeEngine {
    /// Creates a probe for one engine: its hash algorithm, NONE_HASH, block size, KV-cache group,
    /// vocabulary size, context length and the byte budget of the per-session chain cache.
    /// `block_type` is vLLM's `KVCacheBlock` class: with it, session probes remember the blocks
    /// they found and re-check them without a lookup next time.
    #[new]
    #[pyo3(signature = (hash_algo, none_hash, block_size, vocab_size, max_model_len, chain_cache_bytes, group_id=0, block_type=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        hash_algo: &str,
        none_hash: &[u8],
        block_size: usize,
        vocab_size: u64,
        max_model_len: usize,
        chain_cache_bytes: usize,
        group_id: u32,
        block_type: Option<&Bound<'_, PyType>>,
    ) -> PyResult<Self> {
        no_panic("ProbeEngine()", || {
            if block_size == 0 {
                return Err(
                    crate::Error::InvalidInput("block_size must be positive".into()).into(),
                );
            }
            let algo = HashAlgo::from_name(hash_algo)?;
            Ok(Self {
                hasher: BlockHasher::new(algo, none_hash)?,
                chains: ChainCache::new(chain_cache_bytes),
                block_size,
                group_suffix: group_id.to_be_bytes(),
                limits: TokenLimits {
                    vocab_size,
                    max_model_len,
                },
                keys: KeyBuf::default(),
                hash_slot: block_type.and_then(HashSlot::resolve),
                witness_map: None,
            })
        })
    }

    /// Longest resident prefix of `token_ids` in `cached_map` (vLLM's `BlockHashToBlockMap._cache`).
    ///
    /// Returns `(hit_blocks, hit_tokens, prompt_tokens, blocks_hashed, blocks_reused,
    /// blocks_rechecked)`. `session_id=None` probes without remembering the chain.
    #[pyo3(signature = (cached_map, session_id, token_ids))]
    fn probe(
        &mut self,
        cached_map: &Bound<'_, PyDict>,
        session_id: Option<&str>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<ProbeTuple> {
        let budget = self.chains.budget_bytes();
        let mut panicked = false;
        let result = no_panic_then(
            "session_gate_probe",
            || {
                self.probe_inner(cached_map, None, session_id, token_ids)
                    .map(|(walk, _)| walk)
            },
            || panicked = true,
        );
        if panicked {
            // A panic may have left a chain half extended: start from a clean cache.
            self.chains = ChainCache::new(budget);
        }
        result
    }

    /// [`probe`](Self::probe), then the host KV tier's half: `tier_chunks` is the offloading
    /// manager's cache-policy dict of chunks (`LRUCachePolicy.chunks`), `blocks_per_chunk` the
    /// connector's chunk size in blocks. Returns the probe's tuple followed by
    /// `(offloaded_tokens, tier_blocks_hashed)`: the tokens after the GPU hit the connector
    /// would load, and the blocks the tier walk hashed. Reads the dict only (no Python call).
    #[pyo3(signature = (cached_map, tier_chunks, blocks_per_chunk, session_id, token_ids))]
    fn probe_tiered(
        &mut self,
        cached_map: &Bound<'_, PyDict>,
        tier_chunks: &Bound<'_, PyDict>,
        blocks_per_chunk: usize,
        session_id: Option<&str>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<TieredTuple> {
        let budget = self.chains.budget_bytes();
        let mut panicked = false;
        let tier = Tier {
            chunks: tier_chunks,
            blocks_per_chunk,
        };
        let result = no_panic_then(
            "session_gate_probe",
            || self.probe_inner(cached_map, Some(tier), session_id, token_ids),
            || panicked = true,
        );
        if panicked {
            self.chains = ChainCache::new(budget);
        }
        let ((a, b, c, d, e, f), tier) = result?;
        let tier = tier.unwrap_or_default();
        Ok((a, b, c, d, e, f, tier.offloaded_tokens, tier.blocks_hashed))
    }

    /// Drops a session's remembered hash chain; returns whether one was held.
    fn forget(&mut self, session_id: &str) -> PyResult<bool> {
        no_panic("session_gate_forget", || Ok(self.chains.forget(session_id)))
    }

    /// Bytes held by the per-session chain cache.
    #[getter]
    fn chain_cache_bytes(&self) -> usize {
        self.chains.bytes()
    }

    /// Sessions held by the per-session chain cache.
    #[getter]
    fn chain_cache_sessions(&self) -> usize {
        self.chains.len()
    }

    /// The hash algorithm's vLLM name.
    #[getter]
    fn hash_algo(&self) -> &'static str {
        self.hasher.algo().name()
    }

    /// Whether session probes keep witnesses (a `block_type` with a plain `_block_hash` slot).
    #[getter]
    fn witnesses(&self) -> bool {
        self.hash_slot.is_some()
    }
}

/// `(hit_blocks, hit_tokens, prompt_tokens, blocks_hashed, blocks_reused, blocks_rechecked)`.
type ProbeTuple = (usize, usize, usize, usize, usize, usize);

/// [`ProbeTuple`] followed by `(offloaded_tokens, tier_blocks_hashed)`.
type TieredTuple = (usize, usize, usize, usize, usize, usize, usize, usize);

impl ProbeEngine {
    fn probe_inner(
        &mut self,
        cached_map: &Bound<'_, PyDict>,
        tier: Option<Tier<'_, '_>>,
        session_id: Option<&str>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<(ProbeTuple, Option<TierHit>)> {
        // The vocabulary check (a pass over every id) runs inside the walk, over the ids the
        // session's chain does not already hold: they were checked when it stored them.
        let tokens = read_prompt(token_ids, None)?;
        check_length(&tokens, self.limits)?;
        let limits = self.limits;
        if self
            .witness_map
            .as_ref()
            .is_none_or(|m| !m.is(cached_map.as_any()))
        {
            // Another map (another pool, or the one `reset_prefix_cache` made): the blocks the
            // witnesses name may not be in it.
            self.chains.invalidate_witnesses();
            self.witness_map = Some(cached_map.clone().into_any().unbind());
        }
        let mut residency = MapResidency {
            map: cached_map.as_any(),
            keys: &mut self.keys,
            group_suffix: self.group_suffix,
            // Witnesses are only kept for sessions: taking one costs two reference counts
            // (two more cache lines written) per hit, for nothing on a one-off probe.
            slot: self.hash_slot.as_ref().filter(|_| session_id.is_some()),
            error: None,
        };
        let walk = self.chains.walk_checked(
            session_id,
            &tokens,
            self.block_size,
            &mut self.hasher,
            &mut residency,
            |tail, offset| check_vocab(tail, offset, limits),
        )?;
        if let Some(err) = residency.error {
            return Err(err);
        }
        let tier_hit = match tier {
            Some(tier) => Some(
                TierWalk {
                    tier,
                    chains: &self.chains,
                    session_id,
                    hasher: &mut self.hasher,
                    keys: &mut self.keys,
                    group_suffix: self.group_suffix,
                    block_size: self.block_size,
                }
                .run(&tokens, walk.hit_blocks)?,
            ),
            None => None,
        };
        let probe = (
            walk.hit_blocks,
            walk.hit_tokens,
            walk.prompt_tokens,
            walk.blocks_hashed,
            walk.blocks_reused,
            walk.blocks_rechecked,
        );
        Ok((probe, tier_hit))
    }
}

/// Counts cached blocks whose ref count is 0 (free, but still holding a prefix), from
/// `BlockPool.blocks` and `BlockPool.cached_block_hashes_by_block`.
#[pyfunction]
fn count_cached_free_blocks(
    blocks: &Bound<'_, PyList>,
    cached_block_hashes_by_block: &Bound<'_, PyDict>,
) -> PyResult<usize> {
    no_panic("count_cached_free_blocks", || {
        super::block_pool::count_cached_free(blocks, cached_block_hashes_by_block)
    })
}

/// vLLM's `hash_block_tokens(hash_fn, parent, tokens, None)`, natively.
#[pyfunction]
#[pyo3(signature = (hash_algo, none_hash, parent, token_ids))]
fn hash_block<'py>(
    py: Python<'py>,
    hash_algo: &str,
    none_hash: &[u8],
    parent: Option<&[u8]>,
    token_ids: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    no_panic("hash_block", || {
        let mut hasher = BlockHasher::new(HashAlgo::from_name(hash_algo)?, none_hash)?;
        let parent = parent.map(BlockHash::from_bytes).transpose()?;
        let tokens = read_prompt(token_ids, None)?;
        let hash = hasher.hash_block(parent.as_ref(), &tokens);
        Ok(PyBytes::new(py, hash.as_bytes()))
    })
}

/// The chained hashes of every full block of `token_ids`, as vLLM's request block hasher computes them.
#[pyfunction]
#[pyo3(signature = (hash_algo, none_hash, token_ids, block_size))]
fn hash_blocks<'py>(
    py: Python<'py>,
    hash_algo: &str,
    none_hash: &[u8],
    token_ids: &Bound<'py, PyAny>,
    block_size: usize,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    no_panic("hash_blocks", || {
        if block_size == 0 {
            return Err(crate::Error::InvalidInput("block_size must be positive".into()).into());
        }
        let mut hasher = BlockHasher::new(HashAlgo::from_name(hash_algo)?, none_hash)?;
        let tokens = read_prompt(token_ids, None)?;
        let mut out = Vec::with_capacity(tokens.len() / block_size);
        hasher.hash_full_blocks(None, &tokens, block_size, &mut out);
        Ok(out.iter().map(|h| PyBytes::new(py, h.as_bytes())).collect())
    })
}

/// The hash of the last full block of `token_ids` (vLLM's chained block hashes, computed like
/// [`hash_blocks`] but keeping only the tip): the hashing a full probe must do, without building
/// a bytes object per block. `make bench-probe` times it as the hashing floor of a probe.
#[pyfunction]
#[pyo3(signature = (hash_algo, none_hash, token_ids, block_size))]
fn hash_chain_tip<'py>(
    py: Python<'py>,
    hash_algo: &str,
    none_hash: &[u8],
    token_ids: &Bound<'py, PyAny>,
    block_size: usize,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    no_panic("hash_chain_tip", || {
        if block_size == 0 {
            return Err(crate::Error::InvalidInput("block_size must be positive".into()).into());
        }
        let mut hasher = BlockHasher::new(HashAlgo::from_name(hash_algo)?, none_hash)?;
        let tokens = read_prompt(token_ids, None)?;
        let mut tip: Option<BlockHash> = None;
        for block in tokens.chunks_exact(block_size) {
            tip = Some(hasher.hash_block(tip.as_ref(), block));
        }
        Ok(tip.map(|h| PyBytes::new(py, h.as_bytes())))
    })
}

/// Validates a prompt exactly as the native probe does and returns it as a list of ints
/// (used by the Python fallback path so both paths refuse the same prompts).
#[pyfunction]
fn validate_prompt(
    token_ids: &Bound<'_, PyAny>,
    vocab_size: u64,
    max_model_len: usize,
) -> PyResult<Vec<u32>> {
    no_panic("validate_prompt", || {
        let limits = TokenLimits {
            vocab_size,
            max_model_len,
        };
        Ok(read_prompt(token_ids, Some(limits))?.into_owned())
    })
}

/// Validates a prompt exactly as [`validate_prompt`] does and returns only its length: the
/// engine gate needs the count on every admit and must not build a list of ints for it.
#[pyfunction]
fn prompt_length(
    token_ids: &Bound<'_, PyAny>,
    vocab_size: u64,
    max_model_len: usize,
) -> PyResult<usize> {
    no_panic("prompt_length", || {
        let limits = TokenLimits {
            vocab_size,
            max_model_len,
        };
        Ok(read_prompt(token_ids, Some(limits))?.len())
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ProbeEngine>()?;
    m.add_function(wrap_pyfunction!(count_cached_free_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(hash_block, m)?)?;
    m.add_function(wrap_pyfunction!(validate_prompt, m)?)?;
    m.add_function(wrap_pyfunction!(prompt_length, m)?)?;
    m.add_function(wrap_pyfunction!(hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(hash_chain_tip, m)?)?;
    Ok(())
}
