//! `BlockHasher`: vLLM's `hash_block_tokens` with a reusable serialisation buffer.
use xxhash_rust::xxh3::xxh3_128;

use super::{BlockHash, HashAlgo, cbor, pickle, sha256};
use crate::error::{Error, Result};

/// Computes vLLM block hashes for one engine configuration (algorithm + `NONE_HASH`).
///
/// Holds a scratch buffer that every block is serialised into, so hashing allocates nothing
/// once the buffer has grown to the largest block seen (it never shrinks: a 20,000-token block
/// leaves ~140 KB behind).
#[derive(Clone, Debug)]
pub struct BlockHasher {
    algo: HashAlgo,
    none_hash: BlockHash,
    scratch: Vec<u8>,
}

impl BlockHasher {
    /// A hasher for `algo` seeded with the engine's `NONE_HASH`
    /// (`vllm.v1.core.kv_cache_utils.NONE_HASH`), which must be `algo.digest_len()` bytes.
    pub fn new(algo: HashAlgo, none_hash: &[u8]) -> Result<Self> {
        if none_hash.len() != algo.digest_len() {
            return Err(Error::InvalidInput(format!(
                "NONE_HASH is {} bytes but {} digests are {} bytes",
                none_hash.len(),
                algo.name(),
                algo.digest_len()
            )));
        }
        Ok(Self {
            algo,
            none_hash: BlockHash::from_bytes(none_hash)?,
            // Room for a 16-token block of the widest ints: the common case never grows it.
            scratch: vec![0; 256],
        })
    }

    /// The algorithm this hasher computes.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The `NONE_HASH` used as the parent of the first block.
    pub fn none_hash(&self) -> &BlockHash {
        &self.none_hash
    }

    /// The hash of one block: `hash_block_tokens(hash_fn, parent, tokens, None)`.
    ///
    /// `parent` is the previous block's hash, or `None` for the first block (then `NONE_HASH`
    /// is used). vLLM only hashes full blocks, but any length is accepted here.
    pub fn hash_block(&mut self, parent: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
        let len = self.encode(parent, tokens);
        match self.algo {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => {
                BlockHash::from_digest(&sha256::digest_in_place(&mut self.scratch, len))
            }
            // `xxhash.xxh3_128_digest` is the canonical (big-endian) form of the 128-bit value.
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => {
                BlockHash::from_digest(&xxh3_128(&self.scratch[..len]).to_be_bytes())
            }
        }
    }

    /// The bytes [`BlockHasher::hash_block`] digests for this block: vLLM's serialisation of
    /// `(parent, tuple(tokens), None)` (for diagnostics and benchmarks).
    pub fn serialize_block(&mut self, parent: Option<&BlockHash>, tokens: &[u32]) -> &[u8] {
        let len = self.encode(parent, tokens);
        &self.scratch[..len]
    }

    /// Serialises the block into the scratch buffer; returns its length.
    fn encode(&mut self, parent: Option<&BlockHash>, tokens: &[u32]) -> usize {
        let parent = parent.unwrap_or(&self.none_hash).as_bytes();
        if self.algo.uses_cbor() {
            cbor::encode_block(&mut self.scratch, parent, tokens)
        } else {
            pickle::encode_block(&mut self.scratch, parent, tokens)
        }
    }

    /// Hashes every full block of `tokens` (`block_size` tokens each), chaining from `parent`,
    /// and appends the hashes to `out`. A trailing partial block is ignored, as in vLLM; a
    /// `block_size` of 0 hashes nothing.
    pub fn hash_full_blocks(
        &mut self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        block_size: usize,
        out: &mut Vec<BlockHash>,
    ) {
        if block_size == 0 {
            return;
        }
        out.reserve(tokens.len() / block_size);
        let mut parent = parent.copied();
        for block in tokens.chunks_exact(block_size) {
            let hash = self.hash_block(parent.as_ref(), block);
            out.push(hash);
            parent = Some(hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_hash_length_must_match_the_algorithm() {
        let err = BlockHasher::new(HashAlgo::Xxhash, &[0; 32]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("32") && msg.contains("16") && msg.contains("xxhash"),
            "{msg}"
        );
        assert!(BlockHasher::new(HashAlgo::Sha256, &[0; 32]).is_ok());
    }

    #[test]
    fn none_parent_means_none_hash() {
        let mut h = BlockHasher::new(HashAlgo::Sha256, &[9; 32]).unwrap();
        let seed = *h.none_hash();
        assert_eq!(
            h.hash_block(None, &[1, 2]),
            h.hash_block(Some(&seed), &[1, 2])
        );
    }

    #[test]
    fn full_blocks_chain_and_drop_the_partial_tail() {
        for algo in HashAlgo::ALL {
            let mut h = BlockHasher::new(algo, &vec![3; algo.digest_len()]).unwrap();
            let tokens: Vec<u32> = (0..37).collect();
            let mut out = Vec::new();
            h.hash_full_blocks(None, &tokens, 16, &mut out);
            assert_eq!(out.len(), 2);
            let b0 = h.hash_block(None, &tokens[..16]);
            assert_eq!(out[0], b0);
            assert_eq!(out[1], h.hash_block(Some(&b0), &tokens[16..32]));
            assert_eq!(out[0].as_bytes().len(), algo.digest_len());
            h.hash_full_blocks(None, &tokens, 0, &mut out);
            assert_eq!(out.len(), 2);
        }
    }
}
