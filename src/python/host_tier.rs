//! The host KV tier's half of the prefix probe: how many tokens after the GPU hit vLLM's
//! offloading connector would load from host memory for this prompt.
//!
//! vLLM's `OffloadingConnectorScheduler` keys one offloaded chunk (`blocks_per_chunk` blocks) by
//! the block hash of the chunk's last block followed by the 4-byte big-endian KV-cache group id
//! (`make_offload_key`: the same bytes as the GPU prefix map's keys), and its lookup walks the
//! chunks after the GPU hit until the first one its manager does not hold
//! (`_lookup_complete_chunks`). We answer that walk from the cache policy's own chunk dict
//! (`LRUCachePolicy.chunks`) with plain dict lookups through the CPython API: no Python call,
//! so neither the policy's LRU ranks nor the connector's statistics move.
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::residency::KeyBuf;
use crate::hashing::{BlockHash, BlockHasher};
use crate::prefix::ChainCache;

/// The geometry of one offloaded chunk, and the dict of chunks the tier holds.
pub(super) struct Tier<'a, 'py> {
    /// The cache policy's `chunks` dict: offload key → `ChunkStatus`.
    pub(super) chunks: &'a Bound<'py, PyDict>,
    /// GPU blocks per offloaded chunk (vLLM's `blocks_per_chunk`).
    pub(super) blocks_per_chunk: usize,
}

/// What the tier walk found and what it cost.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct TierHit {
    /// Tokens after the GPU hit that the connector would load (0 when less than one chunk).
    pub(super) offloaded_tokens: usize,
    /// Blocks this walk hashed (the session's chain held the others).
    pub(super) blocks_hashed: usize,
}

/// Everything the walk borrows from the probe.
pub(super) struct TierWalk<'a, 'py> {
    pub(super) tier: Tier<'a, 'py>,
    pub(super) chains: &'a ChainCache<super::residency::BlockWitness>,
    pub(super) session_id: Option<&'a str>,
    pub(super) hasher: &'a mut BlockHasher,
    pub(super) keys: &'a mut KeyBuf,
    pub(super) group_suffix: [u8; 4],
    pub(super) block_size: usize,
}

impl TierWalk<'_, '_> {
    /// The connector's answer for `tokens` after a GPU hit of `hit_blocks` blocks, as
    /// `get_num_new_matched_tokens(request, hit_blocks * block_size)` computes it for a single
    /// full-attention group: chunks from the one holding the first token after the hit, up to
    /// the prompt's last full chunk, until the first chunk the tier does not hold. A chunk whose
    /// store is still in flight counts (vLLM defers the request one step and then loads it).
    pub(super) fn run(mut self, tokens: &[u32], hit_blocks: usize) -> PyResult<TierHit> {
        let bs = self.block_size;
        let per_chunk = self.tier.blocks_per_chunk;
        if bs == 0 || per_chunk == 0 {
            return Err(crate::Error::InvalidInput(
                "block_size and blocks_per_chunk must be positive".into(),
            )
            .into());
        }
        let tokens_per_chunk = bs * per_chunk;
        let hit_tokens = hit_blocks * bs;
        let num_chunks = tokens.len() / tokens_per_chunk;
        let max_hit = tokens.len().min(num_chunks * tokens_per_chunk);
        if max_hit < hit_tokens + tokens_per_chunk {
            // vLLM: "We can only load less than a chunk, so skip."
            return Ok(TierHit::default());
        }
        let first_chunk = hit_tokens / tokens_per_chunk;
        let start = first_chunk * per_chunk;
        let end = num_chunks * per_chunk;
        // The session's chain (just walked by the GPU probe) holds every block up to the GPU
        // hit and often more: copy what it has from the block before the first chunk on, and
        // hash the rest. Without a chain, hash from block 0.
        let base = start.saturating_sub(1);
        let mut known = Vec::new();
        if let Some(session) = self.session_id {
            self.chains
                .copy_hashes(session, tokens, base, end, &mut known);
        }
        let mut hashed = 0;
        let mut parent: Option<BlockHash> = None;
        if start > 0 {
            parent = match known.first() {
                Some(h) => Some(*h),
                None => {
                    let mut p = None;
                    for b in 0..start {
                        p = Some(self.hash(tokens, b, p.as_ref()));
                    }
                    hashed += start;
                    p
                }
            };
        }
        let mut loaded_chunks = 0;
        let mut block = start;
        'chunks: for _ in first_chunk..num_chunks {
            for _ in 0..per_chunk {
                let h = match known.get(block - base) {
                    Some(h) => *h,
                    None => {
                        hashed += 1;
                        self.hash(tokens, block, parent.as_ref())
                    }
                };
                parent = Some(h);
                block += 1;
            }
            let last = parent.as_ref().expect("a chunk has at least one block");
            if !self.holds(last)? {
                break 'chunks;
            }
            loaded_chunks += 1;
        }
        let end = max_hit.min(tokens_per_chunk * (first_chunk + loaded_chunks));
        let offloaded = end.saturating_sub(hit_tokens);
        Ok(TierHit {
            offloaded_tokens: if offloaded < tokens_per_chunk {
                0
            } else {
                offloaded
            },
            blocks_hashed: hashed,
        })
    }

    /// Block `b`'s hash, chained to `parent` (block `b - 1`'s hash).
    fn hash(&mut self, tokens: &[u32], b: usize, parent: Option<&BlockHash>) -> BlockHash {
        let bs = self.block_size;
        self.hasher
            .hash_block(parent, &tokens[b * bs..(b + 1) * bs])
    }

    /// Whether the tier's chunk dict holds the chunk ending with the block hashed `last`.
    fn holds(&mut self, last: &BlockHash) -> PyResult<bool> {
        let py = self.tier.chunks.py();
        let key = self.keys.key(py, last.as_bytes(), &self.group_suffix)?;
        // SAFETY: we hold the GIL; `chunks` is a dict and `key` a live bytes object. The
        // borrowed result is only tested for NULL.
        unsafe {
            let found = ffi::PyDict_GetItemWithError(self.tier.chunks.as_ptr(), key);
            if found.is_null() {
                if !ffi::PyErr_Occurred().is_null() {
                    return Err(PyErr::fetch(py));
                }
                return Ok(false);
            }
        }
        Ok(true)
    }
}
