//! `BlockHash`: one block's digest, stored inline so it is `Copy` and never allocates.
use std::fmt;

use crate::error::{Error, Result};

/// Longest digest any algorithm produces (SHA-256).
const MAX_LEN: usize = 32;

/// The hash of one KV block, exactly the bytes vLLM uses (16 or 32 of them).
///
/// Unused tail bytes are always zero, so the derived `Eq`/`Hash` only see the digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash {
    bytes: [u8; MAX_LEN],
    len: u8,
}

impl BlockHash {
    /// Wraps a digest of 1 to 32 bytes (vLLM's `BlockHash` is plain `bytes`).
    ///
    /// An empty hash is refused: vLLM treats an empty parent as "no parent" (`if not parent`),
    /// so it can never name a block.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.is_empty() || bytes.len() > MAX_LEN {
            return Err(Error::InvalidInput(format!(
                "a block hash is 1 to {MAX_LEN} bytes, got {}",
                bytes.len()
            )));
        }
        Ok(Self::from_digest(bytes))
    }

    /// Infallible constructor for digests we produced ourselves (length already known good).
    #[inline]
    pub(crate) fn from_digest(bytes: &[u8]) -> Self {
        debug_assert!(!bytes.is_empty() && bytes.len() <= MAX_LEN);
        let mut inline = [0u8; MAX_LEN];
        // Fixed-size copies for the two real digest lengths: a length-generic copy is a
        // `memcpy` call, which dominated walks over cached chains.
        match bytes.len() {
            32 => inline.copy_from_slice(bytes),
            16 => inline[..16].copy_from_slice(bytes),
            n => inline[..n].copy_from_slice(bytes),
        }
        Self {
            bytes: inline,
            len: bytes.len() as u8,
        }
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({self})")
    }
}

/// Lower-case hex, like Python's `bytes.hex()`.
impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.as_bytes() {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_formats_as_hex() {
        let h = BlockHash::from_bytes(&[0xde, 0xad, 0x01]).unwrap();
        assert_eq!(h.as_bytes(), &[0xde, 0xad, 0x01]);
        assert_eq!(h.to_string(), "dead01");
    }

    #[test]
    fn rejects_empty_and_oversized() {
        assert!(BlockHash::from_bytes(&[]).is_err());
        assert!(BlockHash::from_bytes(&[0; 33]).is_err());
        assert!(BlockHash::from_bytes(&[0; 32]).is_ok());
    }

    #[test]
    fn length_is_part_of_identity() {
        // A 16-byte digest must never equal a 32-byte one that starts with it.
        let short = BlockHash::from_bytes(&[7; 16]).unwrap();
        let mut long = [0u8; 32];
        long[..16].copy_from_slice(&[7; 16]);
        assert_ne!(short, BlockHash::from_bytes(&long).unwrap());
    }
}
