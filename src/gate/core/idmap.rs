//! [`IdMap`]: a hash map keyed by the core's own sequence numbers (attempt and lease ids).
//!
//! The std map hashes every key with SipHash, built to resist keys an attacker picks. These
//! keys are counters the core hands out, so a multiply-and-fold is enough, and it is a few
//! instructions on the engine loop's admit and release (each touches these maps 5-6 times).
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map from a core-issued `u64` id to `V`.
pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Fibonacci hashing of one `u64`: consecutive ids spread over the high bits hashbrown reads
/// for its control bytes and over the low bits it uses for the bucket.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        let h = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^ (h >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys use this hasher; anything else still hashes correctly, slowly.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x100_0000_01B3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_ids_land_in_distinct_buckets_and_distinct_control_bytes() {
        let hash = |n: u64| {
            let mut h = IdHasher::default();
            h.write_u64(n);
            h.finish()
        };
        let buckets: std::collections::HashSet<u64> = (0..64).map(|n| hash(n) & 63).collect();
        assert!(buckets.len() > 32, "{} of 64 buckets", buckets.len());
        let tags: std::collections::HashSet<u64> = (0..64).map(|n| hash(n) >> 57).collect();
        assert!(tags.len() > 32, "{} of 64 tags", tags.len());
        let mut m: IdMap<u64> = IdMap::default();
        for n in 0..1000 {
            m.insert(n, n * 2);
        }
        assert!((0..1000).all(|n| m[&n] == n * 2));
    }
}
