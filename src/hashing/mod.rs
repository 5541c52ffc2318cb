//! vLLM-exact prefix-cache block hashing, done natively.
//!
//! vLLM (0.32) names every full KV block by
//! `hash_fn((parent_block_hash, tuple(block_token_ids), extra_keys))`, where the parent of block 0
//! is the engine's `NONE_HASH` and `hash_fn` is picked by `prefix_caching_hash_algo`:
//!
//! | name          | serialisation                        | digest            |
//! |---------------|--------------------------------------|-------------------|
//! | `sha256`      | `pickle.dumps(obj, protocol=5)`      | SHA-256 (32 B)    |
//! | `sha256_cbor` | `cbor2.dumps(obj, canonical=True)`   | SHA-256 (32 B)    |
//! | `xxhash`      | `pickle.dumps(obj, protocol=5)`      | XXH3-128 (16 B)   |
//! | `xxhash_cbor` | `cbor2.dumps(obj, canonical=True)`   | XXH3-128 (16 B)   |
//!
//! We reproduce the serialisers byte for byte for exactly the one object shape vLLM hashes on our
//! path (`extra_keys` is `None`: no multimodal inputs, LoRA or cache salt), so the probe can
//! name the same blocks as the engine without calling into Python.

mod algo;
mod block_hash;
mod cbor;
mod hasher;
mod pickle;
mod sha256;

pub use algo::HashAlgo;
pub use block_hash::BlockHash;
pub use hasher::BlockHasher;

/// Helpers shared by the serialisers' unit tests.
#[cfg(test)]
mod test_util {
    /// Runs an `encode_block` function and returns exactly the bytes it produced.
    pub(super) fn encoded(
        encode: fn(&mut Vec<u8>, &[u8], &[u32]) -> usize,
        parent: &[u8],
        tokens: &[u32],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        let len = encode(&mut out, parent, tokens);
        out.truncate(len);
        out
    }

    /// Lower-case hex, as Python's `bytes.hex()` prints it.
    pub(super) fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}
