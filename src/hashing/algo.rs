//! The four `prefix_caching_hash_algo` values vLLM accepts.
use crate::error::{Error, Result};

/// A vLLM prefix-caching hash algorithm (`--prefix-caching-hash-algo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// SHA-256 of the protocol-5 pickle (vLLM's default).
    Sha256,
    /// SHA-256 of the canonical CBOR encoding.
    Sha256Cbor,
    /// XXH3-128 of the protocol-5 pickle.
    Xxhash,
    /// XXH3-128 of the canonical CBOR encoding.
    XxhashCbor,
}

impl HashAlgo {
    /// Every algorithm, in vLLM's documentation order.
    pub const ALL: [HashAlgo; 4] = [
        HashAlgo::Sha256,
        HashAlgo::Sha256Cbor,
        HashAlgo::Xxhash,
        HashAlgo::XxhashCbor,
    ];

    /// Parses vLLM's name for the algorithm (`sha256`, `sha256_cbor`, `xxhash`, `xxhash_cbor`).
    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|algo| algo.name() == name)
            .ok_or_else(|| Error::UnsupportedHashAlgo(name.to_owned()))
    }

    /// vLLM's name for the algorithm.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::Xxhash => "xxhash",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Length in bytes of one block hash (32 for SHA-256, 16 for XXH3-128).
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => 32,
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => 16,
        }
    }

    /// Whether the object is serialised with CBOR (otherwise with pickle).
    pub(crate) fn uses_cbor(self) -> bool {
        matches!(self, HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for algo in HashAlgo::ALL {
            assert_eq!(HashAlgo::from_name(algo.name()).unwrap(), algo);
        }
    }

    #[test]
    fn unknown_name_is_rejected_with_the_name() {
        let err = HashAlgo::from_name("md5").unwrap_err();
        assert_eq!(err, Error::UnsupportedHashAlgo("md5".into()));
        // vLLM's names are case-sensitive; so are we.
        assert!(HashAlgo::from_name("SHA256").is_err());
    }
}
