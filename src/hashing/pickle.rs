//! Byte-exact `pickle.dumps((parent, tuple(tokens), None), protocol=5)` as CPython's C pickler
//! writes it.
//!
//! Shape of the output (opcode names from `pickletools`):
//! `PROTO 5`, then one or more frames (`FRAME <u64 LE length>` + body), where the body is
//! `SHORT_BINBYTES parent MEMOIZE`, the token tuple, `NONE TUPLE3 MEMOIZE STOP`. The token tuple
//! is `EMPTY_TUPLE` (never memoised), or the items then `TUPLE1..3 MEMOIZE`, or
//! `MARK` items `TUPLE MEMOIZE` from four items on. Ints take the smallest of `BININT1`,
//! `BININT2`, `BININT` (signed 32-bit) and `LONG1` (two's complement, so 2^31..2^32-1 need five
//! bytes).
//!
//! Framing follows `_Pickler_OpcodeBoundary`: before each object is saved, a frame whose body
//! has reached 64 KiB is closed and a new one begins; the last frame (which holds `STOP`) is
//! closed after `STOP`. A frame body shorter than 4 bytes is written without a `FRAME` header.
//! Only prompts of roughly 9,000+ tokens in one block cross a frame boundary, but when they do,
//! the split point decides the hash, so we reproduce it exactly.

const PROTO: u8 = 0x80;
const PROTOCOL: u8 = 5;
const FRAME: u8 = 0x95;
const SHORT_BINBYTES: u8 = b'C';
const MEMOIZE: u8 = 0x94;
const EMPTY_TUPLE: u8 = b')';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const NONE: u8 = b'N';
const STOP: u8 = b'.';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;

/// `FRAME` opcode plus its 8-byte length.
const FRAME_HEADER: usize = 9;
/// CPython's `FRAME_SIZE_MIN`: shorter frames are written without a header.
const FRAME_SIZE_MIN: usize = 4;
/// CPython's `FRAME_SIZE_TARGET`: a frame is closed at the first object boundary past this.
const FRAME_SIZE_TARGET: usize = 64 * 1024;
/// Longest encoding of one token (`LONG1 5 b0 b1 b2 b3 0`).
const MAX_INT_LEN: usize = 7;
/// Every int is written as one 8-byte store, so the buffer keeps this much slack at the end.
const STORE_SLACK: usize = 8;

/// How to write an int, by its count of leading zero bits (0..=32), packed as
/// `opcode bytes (16 bits) | value shift in bits (8 bits) << 16 | encoded length << 24`.
///
/// One table load per token replaces the compare chain CPython's `save_long` amounts to: real
/// prompts mix 2- and 4-byte ids at random, so branches mispredict, and even branch-free
/// compares cost more than the rest of the encoding.
static INT_ENCODING: [u32; 33] = int_encoding_table();

const fn int_encoding_table() -> [u32; 33] {
    let mut table = [0u32; 33];
    let mut leading_zeros = 0;
    while leading_zeros <= 32 {
        let bits = 32 - leading_zeros;
        let (head, shift, len) = if bits <= 8 {
            (BININT1 as u32, 8, 2)
        } else if bits <= 16 {
            (BININT2 as u32, 8, 3)
        } else if bits <= 31 {
            // BININT is a signed 32-bit int.
            (BININT as u32, 8, 5)
        } else {
            // LONG1 with a 5-byte two's-complement body; its top byte stays 0 (positive sign).
            (LONG1 as u32 | 5 << 8, 16, 7)
        };
        table[leading_zeros] = head | shift << 16 | len << 24;
        leading_zeros += 1;
    }
    table
}

/// Writes the pickle of `(parent, tuple(tokens), None)` to the start of `buf` and returns its
/// length. `buf` is grown (never shrunk) as needed, so a reused buffer is not re-zeroed.
///
/// `parent` is at most 255 bytes (a digest), so it is always `SHORT_BINBYTES`.
pub(crate) fn encode_block(buf: &mut Vec<u8>, parent: &[u8], tokens: &[u32]) -> usize {
    assert!(parent.len() <= 0xff, "a parent digest is at most 255 bytes");
    // Upper bound of the frame bodies, then room for one header per started 64 KiB.
    let body_max = 2 + parent.len() + 1 + MAX_INT_LEN * tokens.len() + 2 + 3 + 1;
    let frames_max = body_max / FRAME_SIZE_TARGET + 1;
    let total_max = 2 + frames_max * FRAME_HEADER + body_max + STORE_SLACK;
    // Writing through a pre-sized slice keeps the per-token path free of capacity checks.
    if buf.len() < total_max {
        buf.resize(total_max, 0);
    }

    let mut w = Writer {
        buf: buf.as_mut_slice(),
        pos: 0,
        frame_start: 0,
    };
    w.put(&[PROTO, PROTOCOL]);
    w.start_frame();

    w.boundary();
    w.put(&[SHORT_BINBYTES, parent.len() as u8]);
    // Fixed-size copies for the two digest lengths: a length-generic one is a `memcpy` call.
    match parent.len() {
        32 => w.put(<&[u8; 32]>::try_from(parent).unwrap()),
        16 => w.put(<&[u8; 16]>::try_from(parent).unwrap()),
        _ => w.put(parent),
    }
    w.put(&[MEMOIZE]);

    w.boundary();
    // Below 64 KiB of body no frame can fill up, so the per-token boundary check is skipped.
    let may_split = body_max >= FRAME_SIZE_TARGET;
    match tokens.len() {
        0 => w.put(&[EMPTY_TUPLE]),
        n @ 1..=3 => {
            w.put_ints(tokens, may_split);
            w.put(&[[TUPLE1, TUPLE2, TUPLE3][n - 1], MEMOIZE]);
        }
        _ => {
            w.put(&[MARK]);
            w.put_ints(tokens, may_split);
            w.put(&[TUPLE, MEMOIZE]);
        }
    }

    w.boundary();
    w.put(&[NONE, TUPLE3, MEMOIZE, STOP]);
    w.end_frame();
    w.pos
}

/// A cursor over the pre-sized output that tracks the open frame.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
    /// Offset of the open frame's (reserved) header.
    frame_start: usize,
}

impl Writer<'_> {
    #[inline(always)]
    fn put(&mut self, bytes: &[u8]) {
        self.buf[self.pos..self.pos + bytes.len()].copy_from_slice(bytes);
        self.pos += bytes.len();
    }

    /// The tuple's items; each one is its own object, so a frame may end before it.
    #[inline(always)]
    fn put_ints(&mut self, tokens: &[u32], may_split: bool) {
        if may_split {
            for &token in tokens {
                self.boundary();
                self.put_int(token);
            }
        } else {
            for &token in tokens {
                self.put_int(token);
            }
        }
    }

    /// One int, with the opcode CPython's `save_long` picks.
    #[inline(always)]
    fn put_int(&mut self, v: u32) {
        let encoding = INT_ENCODING[v.leading_zeros() as usize];
        // Opcode and little-endian argument packed into one word, stored in one go.
        let word = u64::from(encoding & 0xffff) | u64::from(v) << ((encoding >> 16) & 0xff);
        self.buf[self.pos..self.pos + 8].copy_from_slice(&word.to_le_bytes());
        self.pos += (encoding >> 24) as usize;
    }

    fn start_frame(&mut self) {
        self.frame_start = self.pos;
        self.pos += FRAME_HEADER;
    }

    /// Called where CPython's `save()` checks `_Pickler_OpcodeBoundary`: before each object.
    #[inline(always)]
    fn boundary(&mut self) {
        if self.pos - self.frame_start - FRAME_HEADER >= FRAME_SIZE_TARGET {
            self.end_frame();
            // Something is always written after a boundary, so the next frame opens now.
            self.start_frame();
        }
    }

    /// `_Pickler_CommitFrame`: fill in the header, or drop it for a tiny frame. (For our
    /// object the last frame always holds at least `NONE TUPLE3 MEMOIZE STOP`, so the tiny
    /// case cannot happen; it is kept so the writer stays CPython's.)
    #[inline]
    fn end_frame(&mut self) {
        let body_start = self.frame_start + FRAME_HEADER;
        let body_len = self.pos - body_start;
        if body_len >= FRAME_SIZE_MIN {
            self.buf[self.frame_start] = FRAME;
            self.buf[self.frame_start + 1..body_start]
                .copy_from_slice(&(body_len as u64).to_le_bytes());
        } else {
            self.buf.copy_within(body_start..self.pos, self.frame_start);
            self.pos -= FRAME_HEADER;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::test_util::{encoded, hex};

    fn pickle(parent: &[u8], tokens: &[u32]) -> Vec<u8> {
        encoded(encode_block, parent, tokens)
    }

    // Expected bytes from `pickle.dumps((b"\0" * 32, tuple(tokens), None), protocol=5).hex()`.
    #[test]
    fn empty_tuple_is_not_memoised() {
        assert_eq!(
            hex(&pickle(&[0; 32], &[])),
            "80059528000000000000004320000000000000000000000000000000000000000000000000000000000000000094294e87942e"
        );
    }

    #[test]
    fn short_tuples_use_tuple1_to_3() {
        assert_eq!(
            hex(&pickle(&[0; 32], &[1, 2, 3])),
            "8005952f0000000000000043200000000000000000000000000000000000000000000000000000000000000000944b014b024b0387944e87942e"
        );
        assert_eq!(
            hex(&pickle(&[0; 32], &[1, 2, 3, 4])),
            "80059532000000000000004320000000000000000000000000000000000000000000000000000000000000000094284b014b024b034b0474944e87942e"
        );
    }

    #[test]
    fn int_opcodes_at_every_width_edge() {
        let tokens = [
            0,
            255,
            256,
            65535,
            65536,
            0x7fff_ffff,
            0x8000_0000,
            u32::MAX,
        ];
        assert_eq!(
            hex(&pickle(&[0; 16], &tokens)),
            "8005953c0000000000000043100000000000000000000000000000000094284b004bff4d00014dffff4a000001004affffff7f8a0500000080008a05ffffffff0074944e87942e"
        );
    }

    #[test]
    fn a_reused_longer_buffer_gives_the_same_bytes() {
        let mut buf = Vec::new();
        encode_block(&mut buf, &[9; 32], &[u32::MAX; 500]);
        let len = encode_block(&mut buf, &[3; 16], &[1, 300, 70_000]);
        assert_eq!(&buf[..len], pickle(&[3; 16], &[1, 300, 70_000]));
    }

    #[test]
    fn frame_closes_before_none_when_tuple_ends_at_64k() {
        // 13,098 five-byte ints + 4 two-byte ints: the first frame body reaches exactly 64 KiB
        // after `TUPLE MEMOIZE`, so `NONE TUPLE3 MEMOIZE STOP` gets its own 4-byte frame.
        let mut tokens = vec![65536u32; 13_098];
        tokens.extend([1; 4]);
        let out = pickle(&[0x11; 32], &tokens);
        assert_eq!(out.len(), 65_560);
        assert_eq!(&out[2..11], &[FRAME, 0, 0, 1, 0, 0, 0, 0, 0]);
        assert_eq!(hex(&out[out.len() - 13..]), "9504000000000000004e87942e");
    }
}
