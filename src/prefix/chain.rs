//! One session's hash chain and the lazy longest-prefix walk over it.
use super::fingerprint::{PrefixFp, block_fp};
use super::{Lookup, Residency, WalkResult, max_hit_blocks};
use crate::hashing::{BlockHash, BlockHasher};

/// Blocks per storage segment. Chains grow a turn at a time; fixed segments mean growing never
/// copies the chain (a realloc of ~100 KB cost more than the rest of a probe) and leaves at
/// most one partly used segment (3 KB with SHA-256) of slack, which the budget counts.
const SEGMENT_BLOCKS: usize = 64;

/// Storage for up to [`SEGMENT_BLOCKS`] consecutive blocks, allocated at full size.
#[derive(Debug)]
struct Segment<W> {
    /// Digests back to back, `stride` bytes each (all from one algorithm).
    hashes: Vec<u8>,
    fps: Vec<u128>,
    /// What the last lookup of each block found, if it was a hit with a witness.
    witnesses: Vec<Option<W>>,
}

impl<W> Segment<W> {
    fn new(stride: usize) -> Self {
        Self {
            hashes: Vec::with_capacity(SEGMENT_BLOCKS * stride),
            fps: Vec::with_capacity(SEGMENT_BLOCKS),
            witnesses: Vec::with_capacity(SEGMENT_BLOCKS),
        }
    }

    fn heap_bytes(&self) -> usize {
        self.hashes.capacity()
            + self.fps.capacity() * size_of::<u128>()
            + self.witnesses.capacity() * size_of::<Option<W>>()
    }
}

/// The vLLM hashes of the first blocks of one token sequence (the session's last prompt(s)),
/// with what is needed to tell, cheaply, whether a new prompt starts with the same blocks, and
/// the witnesses of the last walk's hits.
///
/// Invariant: block `i`'s fingerprint, vLLM hash and witness are at
/// `segments[i / SEGMENT_BLOCKS]`, slot `i % SEGMENT_BLOCKS`; `prefix_fp` is the fingerprint of
/// all `len` blocks' tokens in order; all blocks come from one token sequence. A witness is only
/// ever stored for the hash in the same slot (it is dropped whenever that hash is).
#[derive(Debug)]
pub(super) struct Chain<W> {
    segments: Vec<Segment<W>>,
    len: usize,
    prefix_fp: u128,
}

impl<W> Default for Chain<W> {
    fn default() -> Self {
        Self {
            segments: Vec::new(),
            len: 0,
            prefix_fp: 0,
        }
    }
}

impl<W> Chain<W> {
    /// Number of blocks in the chain.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held (capacity, not length: that is what the allocator gave us).
    pub(super) fn heap_bytes(&self) -> usize {
        self.segments.capacity() * size_of::<Segment<W>>()
            + self.segments.iter().map(Segment::heap_bytes).sum::<usize>()
    }

    /// Heap bytes of a chain of `blocks` blocks with `stride`-byte digests, at the least.
    pub(super) fn heap_bytes_for(blocks: usize, stride: usize) -> usize {
        let segments = blocks.div_ceil(SEGMENT_BLOCKS);
        let per_block = stride + size_of::<u128>() + size_of::<Option<W>>();
        segments * (size_of::<Segment<W>>() + SEGMENT_BLOCKS * per_block)
    }

    /// The most blocks a chain fits in `bytes`, in whole segments.
    pub(super) fn blocks_within(bytes: usize, stride: usize) -> usize {
        let segment = Self::heap_bytes_for(SEGMENT_BLOCKS, stride);
        bytes / segment * SEGMENT_BLOCKS
    }

    #[inline]
    pub(super) fn hash(&self, i: usize, stride: usize) -> BlockHash {
        let at = (i % SEGMENT_BLOCKS) * stride;
        BlockHash::from_digest(&self.segments[i / SEGMENT_BLOCKS].hashes[at..at + stride])
    }

    #[inline]
    fn fp(&self, i: usize) -> u128 {
        self.segments[i / SEGMENT_BLOCKS].fps[i % SEGMENT_BLOCKS]
    }

    /// Block `i`'s witness slot.
    #[inline]
    fn witness_mut(&mut self, i: usize) -> &mut Option<W> {
        &mut self.segments[i / SEGMENT_BLOCKS].witnesses[i % SEGMENT_BLOCKS]
    }

    /// Witnesses of blocks `from..to`, which must lie in one segment.
    #[inline]
    fn witness_run(&self, from: usize, to: usize) -> &[Option<W>] {
        let segment = &self.segments[from / SEGMENT_BLOCKS];
        let at = from % SEGMENT_BLOCKS;
        &segment.witnesses[at..at + (to - from)]
    }

    /// Drops every witness (they were taken against another map); the hashes stay.
    pub(super) fn clear_witnesses(&mut self) {
        for segment in &mut self.segments {
            segment.witnesses.iter_mut().for_each(|w| *w = None);
        }
    }

    /// Starts pulling the hashes of the first `blocks` blocks into cache (whole segments).
    fn prefetch_hashes(&self, blocks: usize) {
        for segment in self.segments.iter().take(blocks.div_ceil(SEGMENT_BLOCKS)) {
            prefetch(&segment.hashes);
        }
    }

    /// Every hash in the chain, in block order.
    pub(super) fn hashes(&self, stride: usize) -> Vec<BlockHash> {
        (0..self.len).map(|i| self.hash(i, stride)).collect()
    }

    fn truncate(&mut self, blocks: usize, stride: usize) {
        if blocks >= self.len {
            return;
        }
        self.segments.truncate(blocks.div_ceil(SEGMENT_BLOCKS));
        if let Some(last) = self.segments.last_mut() {
            let keep = blocks - (blocks - 1) / SEGMENT_BLOCKS * SEGMENT_BLOCKS;
            last.hashes.truncate(keep * stride);
            last.fps.truncate(keep);
            last.witnesses.truncate(keep);
        }
        self.len = blocks;
    }

    fn push(&mut self, hash: &BlockHash, fp: u128) {
        let stride = hash.as_bytes().len();
        if self.len.is_multiple_of(SEGMENT_BLOCKS) {
            self.segments.push(Segment::new(stride));
        }
        let last = self.segments.last_mut().expect("a segment with room");
        last.hashes.extend_from_slice(hash.as_bytes());
        last.fps.push(fp);
        last.witnesses.push(None);
        self.len += 1;
    }

    /// Keeps the first `blocks` blocks and returns freed segments to the allocator.
    /// `tokens` must be the sequence the chain was built from (at least `blocks` blocks).
    pub(super) fn shrink_to(
        &mut self,
        blocks: usize,
        stride: usize,
        tokens: &[u32],
        block_size: usize,
    ) {
        self.truncate(blocks, stride);
        self.segments.shrink_to_fit();
        self.prefix_fp = PrefixFp::of(&tokens[..self.len * block_size]);
    }

    /// Looks block `i`'s stored hash up and keeps what the lookup found as its witness.
    fn look_up<R: Residency<Witness = W>>(&mut self, i: usize, stride: usize, res: &mut R) -> bool {
        let (hit, witness) = match res.lookup(&self.hash(i, stride)) {
            Lookup::Miss => (false, None),
            Lookup::Hit(w) => (true, w),
        };
        *self.witness_mut(i) = witness;
        hit
    }

    /// Whether block `i` is resident: its witness re-checked if it has one that still holds
    /// (counted in `rechecked`), else a lookup.
    fn check<R: Residency<Witness = W>>(
        &mut self,
        i: usize,
        stride: usize,
        res: &mut R,
        rechecked: &mut usize,
    ) -> bool {
        if res.still_resident(self.witness_run(i, i + 1)) == 1 {
            *rechecked += 1;
            return true;
        }
        self.look_up(i, stride, res)
    }

    /// vLLM's longest-prefix walk over `tokens`, reusing this chain's hashes where the prompt
    /// has the same blocks and hashing the rest lazily (only blocks the walk reaches).
    ///
    /// Afterwards the chain holds this prompt's blocks if any had to be hashed (a block that
    /// differs drops the chain from there on); otherwise its hashes are left as they were.
    /// Witnesses are refreshed by every lookup.
    pub(super) fn walk<R: Residency<Witness = W>>(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        hasher: &mut BlockHasher,
        res: &mut R,
    ) -> WalkResult {
        let stride = hasher.algo().digest_len();
        let lookups = max_hit_blocks(tokens.len(), block_size);
        // The chain is usually cold (other sessions were probed since): start loading its
        // hashes now, so that happens while the fingerprint below reads the (warm) prompt.
        self.prefetch_hashes(lookups.min(self.len));
        let (mut stream, vouched) = self.shared_prefix(tokens, block_size, lookups);

        // Blocks the whole-prefix fingerprint vouched for: re-check the witnesses a segment at
        // a time; a block whose witness no longer holds is looked up by its stored hash.
        let mut hits = 0;
        let mut rechecked = 0;
        let mut missed = false;
        while hits < vouched {
            let end = vouched.min((hits / SEGMENT_BLOCKS + 1) * SEGMENT_BLOCKS);
            let proven = res.still_resident(self.witness_run(hits, end));
            hits += proven;
            rechecked += proven;
            if hits < end {
                if !self.look_up(hits, stride, res) {
                    missed = true;
                    break;
                }
                hits += 1;
            }
        }
        let mut reused = hits + usize::from(missed);
        let mut hashed = 0;

        // The rest: reuse a stored block only if its own fingerprint matches, else hash it.
        // Block i's parent is always the chain's block i - 1, reused or just pushed.
        let mut changed = false;
        while !missed && hits < lookups {
            let block = &tokens[hits * block_size..(hits + 1) * block_size];
            let resident = if hits < self.len && self.fp(hits) == block_fp(block) {
                reused += 1;
                self.check(hits, stride, res, &mut rechecked)
            } else {
                // The chain's block `hits` (if any) differs, so it is stale from here on.
                self.truncate(hits, stride);
                let parent = hits.checked_sub(1).map(|p| self.hash(p, stride));
                let hash = hasher.hash_block(parent.as_ref(), block);
                self.push(&hash, block_fp(block));
                hashed += 1;
                changed = true;
                self.look_up(hits, stride, res)
            };
            missed = !resident;
            hits += usize::from(resident);
        }

        if changed {
            // The chain is now exactly this prompt's first `len` blocks.
            let end = self.len * block_size;
            if stream.tokens() > end {
                stream = PrefixFp::new();
            }
            stream.update(&tokens[stream.tokens()..end]);
            self.prefix_fp = stream.digest();
        }
        WalkResult {
            hit_blocks: hits,
            hit_tokens: hits * block_size,
            prompt_tokens: tokens.len(),
            blocks_hashed: hashed,
            blocks_reused: reused,
            blocks_rechecked: rechecked,
        }
    }

    /// How many leading blocks (at most `lookups`) `tokens` provably shares with the chain
    /// by the fast check, and the fingerprint stream it read (over `tokens`' own prefix).
    ///
    /// The fast check covers the common case, a prompt that repeats or extends the chain's
    /// sequence: one streaming fingerprint over the chain's whole token span, instead of one
    /// per block. If it fails (or the prompt is shorter than the chain) it vouches for
    /// nothing and the walk falls back to per-block fingerprints.
    fn shared_prefix(
        &self,
        tokens: &[u32],
        block_size: usize,
        lookups: usize,
    ) -> (PrefixFp, usize) {
        let mut stream = PrefixFp::new();
        let covered = self.len * block_size;
        if lookups == 0 || self.len == 0 || covered > tokens.len() {
            return (stream, 0);
        }
        stream.update(&tokens[..covered]);
        let vouched = if stream.digest() == self.prefix_fp {
            self.len.min(lookups)
        } else {
            0
        };
        (stream, vouched)
    }
}

/// Hints the CPU to start loading `bytes` into the L2 cache; a no-op off x86-64.
#[inline]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // SAFETY: SSE is in the x86-64 baseline, and a prefetch is only a hint: it never faults
        // and has no observable effect (the pointer comes from a live slice anyway).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// vLLM's longest-prefix walk with nothing cached: hash block by block, stop at the first miss.
pub(super) fn walk_uncached<R: Residency>(
    tokens: &[u32],
    block_size: usize,
    hasher: &mut BlockHasher,
    res: &mut R,
) -> WalkResult {
    let lookups = max_hit_blocks(tokens.len(), block_size);
    let mut result = WalkResult {
        prompt_tokens: tokens.len(),
        ..WalkResult::default()
    };
    let mut parent: Option<BlockHash> = None;
    for block in tokens.chunks_exact(block_size.max(1)).take(lookups) {
        let hash = hasher.hash_block(parent.as_ref(), block);
        result.blocks_hashed += 1;
        if let Lookup::Miss = res.lookup(&hash) {
            break;
        }
        result.hit_blocks += 1;
        parent = Some(hash);
    }
    result.hit_tokens = result.hit_blocks * block_size;
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::HashAlgo;
    use crate::prefix::NoWitness;

    type Plain = Chain<NoWitness>;

    #[test]
    fn segments_hold_exactly_what_was_pushed() {
        let hashes: Vec<BlockHash> = (0..200u8)
            .map(|i| BlockHash::from_bytes(&[i; 16]).unwrap())
            .collect();
        let mut chain = Plain::default();
        for (i, h) in hashes.iter().enumerate() {
            chain.push(h, i as u128);
        }
        assert_eq!(chain.hashes(16), hashes);
        assert_eq!(chain.heap_bytes(), Plain::heap_bytes_for(200, 16));
        for keep in [199, 129, 128, 127, 64, 1, 0] {
            chain.truncate(keep, 16);
            assert_eq!(chain.hashes(16), hashes[..keep], "keep {keep}");
            assert!((0..keep).all(|i| chain.fp(i) == i as u128));
        }
        chain.push(&hashes[5], 5);
        assert_eq!(chain.hashes(16), [hashes[5]]);
        assert_eq!(
            Plain::blocks_within(Plain::heap_bytes_for(130, 32), 32),
            192
        );
        assert_eq!(
            Plain::blocks_within(Plain::heap_bytes_for(128, 32), 32),
            128
        );
    }

    fn hasher() -> BlockHasher {
        BlockHasher::new(HashAlgo::Sha256, &[0x42; 32]).unwrap()
    }

    #[test]
    fn prefix_fp_tracks_the_chain_after_every_change() {
        let mut h = hasher();
        let mut chain = Plain::default();
        let mut tokens: Vec<u32> = (0..100).collect();
        chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| true);
        assert_eq!(chain.len(), 24);
        assert_eq!(chain.prefix_fp, PrefixFp::of(&tokens[..96]));

        tokens.extend(100..140);
        chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| true);
        assert_eq!(chain.len(), 34);
        assert_eq!(chain.prefix_fp, PrefixFp::of(&tokens[..136]));

        tokens[10] = 9999;
        chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| true);
        assert_eq!(chain.len(), 34);
        assert_eq!(chain.prefix_fp, PrefixFp::of(&tokens[..136]));

        chain.shrink_to(5, 32, &tokens, 4);
        assert_eq!(chain.len(), 5);
        assert_eq!(chain.prefix_fp, PrefixFp::of(&tokens[..20]));
        assert_eq!(chain.heap_bytes(), Plain::heap_bytes_for(5, 32));
    }

    #[test]
    fn a_miss_inside_a_reused_prefix_leaves_the_chain_alone() {
        let mut h = hasher();
        let mut chain = Plain::default();
        let tokens: Vec<u32> = (0..65).collect();
        chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| true);
        let before = chain.hashes(32);
        let r = chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| false);
        assert_eq!((r.hit_blocks, r.blocks_hashed, r.blocks_reused), (0, 0, 1));
        assert_eq!(chain.hashes(32), before);
    }
}
