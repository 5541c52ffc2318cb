//! Byte-exact `cbor2.dumps((parent, tuple(tokens), None), canonical=True)`.
//!
//! cbor2 writes a tuple as a definite-length array and every length and unsigned int in its
//! shortest form (RFC 8949 preferred serialisation); `canonical=True` only changes maps, sets
//! and floats, none of which occur here. Output: `array(3)`, `bytes(parent)`,
//! `array(n)` of uints, `null` (0xf6).

/// Major type 0 (unsigned int).
const UINT: u8 = 0x00;
/// Major type 2 (byte string).
const BYTES: u8 = 0x40;
/// Major type 4 (array).
const ARRAY: u8 = 0x80;
/// Simple value `null` (Python `None`).
const NULL: u8 = 0xf6;
/// Every int is written as one 8-byte store, so the buffer keeps this much slack at the end.
const STORE_SLACK: usize = 8;

/// Writes the CBOR of `(parent, tuple(tokens), None)` to the start of `buf` and returns its
/// length. `buf` is grown (never shrunk) as needed, so a reused buffer is not re-zeroed.
pub(crate) fn encode_block(buf: &mut Vec<u8>, parent: &[u8], tokens: &[u32]) -> usize {
    // Headers are at most 9 bytes; a u32 token at most 5.
    let total_max = 1 + 9 + parent.len() + 9 + 5 * tokens.len() + 1 + STORE_SLACK;
    if buf.len() < total_max {
        buf.resize(total_max, 0);
    }
    let buf = buf.as_mut_slice();

    let mut pos = 0;
    buf[pos] = ARRAY | 3;
    pos += 1;
    pos += put_head(&mut buf[pos..], BYTES, parent.len() as u64);
    buf[pos..pos + parent.len()].copy_from_slice(parent);
    pos += parent.len();
    pos += put_head(&mut buf[pos..], ARRAY, tokens.len() as u64);
    for &token in tokens {
        pos += put_uint32(&mut buf[pos..pos + 8], UINT, token);
    }
    buf[pos] = NULL;
    pos + 1
}

/// Writes a head (major type + argument) for lengths, which may exceed `u32`.
fn put_head(buf: &mut [u8], major: u8, arg: u64) -> usize {
    match u32::try_from(arg) {
        Ok(small) => put_uint32(&mut buf[..8], major, small),
        Err(_) => {
            buf[0] = major | 27;
            buf[1..9].copy_from_slice(&arg.to_be_bytes());
            9
        }
    }
}

/// Additional-information value of each width class (0 = the value itself fits the head).
const ARG_INFO: [u64; 4] = [0, 24, 25, 26];
/// Right shift that keeps the class's argument bytes of the byte-swapped (big-endian) value.
const ARG_SHIFT: [u32; 4] = [32, 24, 16, 0];

/// Writes a head whose argument fits in `u32`, as one 8-byte store; returns its length.
///
/// Branch-free like the pickle ints: token widths in real prompts are unpredictable.
#[inline(always)]
fn put_uint32(buf: &mut [u8], major: u8, v: u32) -> usize {
    let class = (usize::from(v > 23) + usize::from(v > 0xff) + usize::from(v > 0xffff)) & 3;
    // Small values live in the head byte itself; otherwise the head is followed by the
    // argument in big-endian order, which after the little-endian store below means the
    // byte-swapped value, shifted down to its width.
    let head = if class == 0 {
        u64::from(v)
    } else {
        ARG_INFO[class]
    };
    let arg = u64::from(v.swap_bytes()) >> ARG_SHIFT[class];
    let word = u64::from(major) | head | arg << 8;
    buf[..8].copy_from_slice(&word.to_le_bytes());
    // 1, 2, 3 or 5 bytes, from compares rather than a table load: the caller's position is a
    // dependency chain through every token.
    1 + usize::from(v > 23) + usize::from(v > 0xff) + 2 * usize::from(v > 0xffff)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::test_util::{encoded, hex};

    fn cbor(parent: &[u8], tokens: &[u32]) -> Vec<u8> {
        encoded(encode_block, parent, tokens)
    }

    #[test]
    fn matches_cbor2_at_every_width_edge() {
        // cbor2.dumps((b"\0" * 32, (0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1), None),
        //             canonical=True).hex()
        let out = cbor(&[0; 32], &[0, 1, 23, 24, 255, 256, 65535, 65536, u32::MAX]);
        assert_eq!(
            hex(&out),
            "835820000000000000000000000000000000000000000000000000000000000000000089000117181818ff19010019ffff1a000100001afffffffff6"
        );
    }

    #[test]
    fn short_parent_and_empty_tuple() {
        let out = cbor(&[0xab; 16], &[]);
        assert_eq!(hex(&out), format!("8350{}80f6", "ab".repeat(16)));
    }

    #[test]
    fn a_reused_longer_buffer_gives_the_same_bytes() {
        let mut buf = Vec::new();
        encode_block(&mut buf, &[9; 32], &[u32::MAX; 500]);
        let len = encode_block(&mut buf, &[3; 16], &[1, 300, 70_000]);
        assert_eq!(&buf[..len], cbor(&[3; 16], &[1, 300, 70_000]));
    }

    #[test]
    fn long_array_heads() {
        let out = cbor(&[1; 16], &[0; 24]);
        assert_eq!(out[18..20], [0x98, 24]);
        let out = cbor(&[1; 16], &[0; 70_000]);
        assert_eq!(out[18..23], [0x9a, 0x00, 0x01, 0x11, 0x70]);
        assert_eq!(out.len(), 1 + 17 + 5 + 70_000 + 1);
    }
}
