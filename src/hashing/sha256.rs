//! SHA-256 over the scratch buffer, padded in place.
//!
//! `Sha256::digest` copies the tail of the message into its own block buffer and runs the
//! compression function twice (body, then padding). A vLLM block is only two or three 64-byte
//! blocks long, so that overhead is a sizeable share; writing the padding right after the
//! message in our own buffer lets one `compress256` call (SHA-NI when the CPU has it) do it all.
use sha2::block_api::compress256;

/// FIPS 180-4 initial hash value for SHA-256.
const IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// SHA-256 of `buf[..len]`. Bytes of `buf` after `len` are overwritten with the padding
/// (`buf` grows if it has less than 72 spare bytes).
pub(crate) fn digest_in_place(buf: &mut Vec<u8>, len: usize) -> [u8; 32] {
    // Message, 0x80, zeros, 64-bit big-endian bit length; a whole number of 64-byte blocks.
    let padded = (len + 1 + 8).div_ceil(64) * 64;
    // The zeros are written as one fixed 64-byte store (a length-generic fill is a `memset`
    // call), so keep room for it past the 0x80 byte.
    let room = padded.max(len + 1 + 64);
    if buf.len() < room {
        buf.resize(room, 0);
    }
    buf[len] = 0x80;
    let zeros: &mut [u8; 64] = (&mut buf[len + 1..len + 1 + 64]).try_into().unwrap();
    *zeros = [0; 64];
    let bits = (len as u64) * 8;
    buf[padded - 8..padded].copy_from_slice(&bits.to_be_bytes());

    let mut state = IV;
    let (blocks, rest) = buf[..padded].as_chunks::<64>();
    debug_assert!(rest.is_empty());
    compress256(&mut state, blocks);

    let mut out = [0u8; 32];
    for (bytes, word) in out.chunks_exact_mut(4).zip(state) {
        bytes.copy_from_slice(&word.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    #[test]
    fn equals_the_sha2_crate_at_every_padding_edge() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 37 % 251) as u8).collect();
        let mut buf = Vec::new();
        for len in 0..data.len() {
            // Leave garbage past the message to prove the padding overwrites it.
            buf.clear();
            buf.extend_from_slice(&data[..len]);
            buf.extend_from_slice(&[0xee; 3]);
            let expected: [u8; 32] = Sha256::digest(&data[..len]).into();
            assert_eq!(digest_in_place(&mut buf, len), expected, "len {len}");
        }
    }
}
