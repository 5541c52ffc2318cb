//! Content fingerprints of token runs (XXH3-128), used to recognise a prompt prefix that was
//! already hashed without running the (much slower) vLLM hash again.
//!
//! XXH3 is not collision resistant against someone who knows the seed, so the seed is random
//! per process: prompts cannot be crafted to make a changed prefix look unchanged.
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::OnceLock;

use xxhash_rust::xxh3::{Xxh3, xxh3_128_with_seed};

/// This process's fingerprint seed (std's per-process random hash keys).
fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| RandomState::new().hash_one("session-gate chain fingerprint"))
}

/// The in-memory bytes of `tokens`.
///
/// Fingerprints never leave the process, so native byte order is fine.
fn token_bytes(tokens: &[u32]) -> &[u8] {
    // SAFETY: `u8` has alignment 1 and every bit pattern is a valid `u8`; the byte slice covers
    // exactly the memory of `tokens` and borrows it for the same lifetime.
    unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), size_of_val(tokens)) }
}

/// Fingerprint of one block's tokens.
pub(super) fn block_fp(tokens: &[u32]) -> u128 {
    xxh3_128_with_seed(token_bytes(tokens), seed())
}

/// A streaming fingerprint of a growing token prefix; [`PrefixFp::digest`] equals the
/// fingerprint of everything fed so far, whatever the chunking.
pub(super) struct PrefixFp {
    state: Xxh3,
    tokens: usize,
}

impl PrefixFp {
    pub(super) fn new() -> Self {
        Self {
            state: Xxh3::with_seed(seed()),
            tokens: 0,
        }
    }

    /// Number of tokens fed so far.
    pub(super) fn tokens(&self) -> usize {
        self.tokens
    }

    pub(super) fn update(&mut self, tokens: &[u32]) {
        self.state.update(token_bytes(tokens));
        self.tokens += tokens.len();
    }

    pub(super) fn digest(&self) -> u128 {
        self.state.digest128()
    }

    /// One-shot fingerprint of a whole prefix.
    pub(super) fn of(tokens: &[u32]) -> u128 {
        xxh3_128_with_seed(token_bytes(tokens), seed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_one_shot_for_any_chunking() {
        let tokens: Vec<u32> = (0..5000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        for chunk in [1, 7, 16, 64, 1000, 5000] {
            let mut fp = PrefixFp::new();
            for part in tokens.chunks(chunk) {
                fp.update(part);
            }
            assert_eq!(fp.tokens(), tokens.len());
            assert_eq!(fp.digest(), PrefixFp::of(&tokens), "chunk {chunk}");
        }
    }

    #[test]
    fn one_token_changes_the_fingerprint() {
        let a = [1u32, 2, 3, 4];
        let b = [1u32, 2, 3, 5];
        assert_ne!(block_fp(&a), block_fp(&b));
        assert_eq!(block_fp(&a), PrefixFp::of(&a));
    }
}
