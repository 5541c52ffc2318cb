//! One session's hash chain and the lazy longest-prefix walk over it.
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
    /// The blocks' tokens back to back, `block_size` each: a new prompt is compared with them
    /// exactly (a whole segment is one `memcmp`, cheaper than fingerprinting the prompt).
    tokens: Vec<u32>,
    /// What the last lookup of each block found, if it was a hit with a witness.
    witnesses: Vec<Option<W>>,
}

impl<W> Segment<W> {
    fn new(stride: usize, block_size: usize) -> Self {
        Self {
            hashes: Vec::with_capacity(SEGMENT_BLOCKS * stride),
            tokens: Vec::with_capacity(SEGMENT_BLOCKS * block_size),
            witnesses: Vec::with_capacity(SEGMENT_BLOCKS),
        }
    }

    fn heap_bytes(&self) -> usize {
        self.hashes.capacity()
            + self.tokens.capacity() * size_of::<u32>()
            + self.witnesses.capacity() * size_of::<Option<W>>()
    }
}

/// The vLLM hashes of the first blocks of one token sequence (the session's last prompt(s)),
/// with the tokens they were computed from (so a new prompt is checked against them exactly),
/// and the witnesses of the last walk's hits.
///
/// Invariant: block `i`'s tokens, vLLM hash and witness are at `segments[i / SEGMENT_BLOCKS]`,
/// slot `i % SEGMENT_BLOCKS`; all blocks come from one token sequence, each `block_size` tokens
/// (one `ChainCache` configuration: it drops every chain when the block size changes). A witness
/// is only ever stored for the hash in the same slot (it is dropped whenever that hash is).
#[derive(Debug)]
pub(super) struct Chain<W> {
    segments: Vec<Segment<W>>,
    len: usize,
}

impl<W> Default for Chain<W> {
    fn default() -> Self {
        Self {
            segments: Vec::new(),
            len: 0,
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

    /// Heap bytes of a chain of `blocks` blocks of `block_size` tokens with `stride`-byte
    /// digests, at the least.
    pub(super) fn heap_bytes_for(blocks: usize, stride: usize, block_size: usize) -> usize {
        let segments = blocks.div_ceil(SEGMENT_BLOCKS);
        let per_block = stride + block_size * size_of::<u32>() + size_of::<Option<W>>();
        segments * (size_of::<Segment<W>>() + SEGMENT_BLOCKS * per_block)
    }

    /// The most blocks a chain fits in `bytes`, in whole segments.
    pub(super) fn blocks_within(bytes: usize, stride: usize, block_size: usize) -> usize {
        let segment = Self::heap_bytes_for(SEGMENT_BLOCKS, stride, block_size);
        bytes / segment * SEGMENT_BLOCKS
    }

    #[inline]
    pub(super) fn hash(&self, i: usize, stride: usize) -> BlockHash {
        let at = (i % SEGMENT_BLOCKS) * stride;
        BlockHash::from_digest(&self.segments[i / SEGMENT_BLOCKS].hashes[at..at + stride])
    }

    /// How many consecutive blocks from `from` (up to `to` and the chain's end) hold exactly
    /// `tokens`' blocks at the same positions: a block's stored hash is `tokens`' hash there
    /// when every block before it is `tokens`' too, which the caller vouches for below `from`.
    pub(super) fn matching_blocks(
        &self,
        tokens: &[u32],
        block_size: usize,
        from: usize,
        to: usize,
    ) -> usize {
        let end = to.min(self.len).min(tokens.len() / block_size.max(1));
        (from..end)
            .take_while(|&i| {
                let at = (i % SEGMENT_BLOCKS) * block_size;
                self.segments[i / SEGMENT_BLOCKS].tokens[at..at + block_size]
                    == tokens[i * block_size..(i + 1) * block_size]
            })
            .count()
    }

    /// Block `i`'s tokens (`block_size` of them).
    #[cfg(test)]
    fn block_tokens(&self, i: usize, block_size: usize) -> &[u32] {
        let at = (i % SEGMENT_BLOCKS) * block_size;
        &self.segments[i / SEGMENT_BLOCKS].tokens[at..at + block_size]
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

    /// Starts pulling the hashes of blocks `from..to` into cache.
    fn prefetch_hashes(&self, from: usize, to: usize, stride: usize) {
        let mut i = from;
        while i < to {
            let segment = &self.segments[i / SEGMENT_BLOCKS];
            let at = i % SEGMENT_BLOCKS;
            let n = (to - i).min(SEGMENT_BLOCKS - at);
            prefetch(&segment.hashes[at * stride..(at + n) * stride]);
            i += n;
        }
    }

    /// Every hash in the chain, in block order.
    pub(super) fn hashes(&self, stride: usize) -> Vec<BlockHash> {
        (0..self.len).map(|i| self.hash(i, stride)).collect()
    }

    fn truncate(&mut self, blocks: usize, stride: usize, block_size: usize) {
        if blocks >= self.len {
            return;
        }
        self.segments.truncate(blocks.div_ceil(SEGMENT_BLOCKS));
        if let Some(last) = self.segments.last_mut() {
            let keep = blocks - (blocks - 1) / SEGMENT_BLOCKS * SEGMENT_BLOCKS;
            last.hashes.truncate(keep * stride);
            last.tokens.truncate(keep * block_size);
            last.witnesses.truncate(keep);
        }
        self.len = blocks;
    }

    fn push(&mut self, hash: &BlockHash, tokens: &[u32]) {
        let stride = hash.as_bytes().len();
        if self.len.is_multiple_of(SEGMENT_BLOCKS) {
            self.segments.push(Segment::new(stride, tokens.len()));
        }
        let last = self.segments.last_mut().expect("a segment with room");
        last.hashes.extend_from_slice(hash.as_bytes());
        last.tokens.extend_from_slice(tokens);
        last.witnesses.push(None);
        self.len += 1;
    }

    /// Keeps the first `blocks` blocks and returns freed segments to the allocator.
    pub(super) fn shrink_to(&mut self, blocks: usize, stride: usize, block_size: usize) {
        self.truncate(blocks, stride, block_size);
        self.segments.shrink_to_fit();
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

    /// vLLM's longest-prefix walk over `tokens`, reusing this chain's hashes where the prompt
    /// has the same blocks and hashing the rest lazily (only blocks the walk reaches).
    ///
    /// Afterwards the chain holds this prompt's blocks if any had to be hashed (a block that
    /// differs drops the chain from there on); otherwise its hashes are left as they were.
    /// Witnesses are refreshed by every lookup.
    #[cfg(test)]
    pub(super) fn walk<R: Residency<Witness = W>>(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        hasher: &mut BlockHasher,
        res: &mut R,
    ) -> WalkResult {
        let unchecked = |_: &[u32], _: usize| Ok::<(), std::convert::Infallible>(());
        match self.walk_checked(tokens, block_size, hasher, res, unchecked) {
            Ok(result) => result,
            Err(never) => match never {},
        }
    }

    /// [`Chain::walk`], after `check` accepted the tokens the chain does not already hold:
    /// `check(tail, offset)` gets `tokens[offset..]`, where `tokens[..offset]` equals tokens this
    /// chain stored, which passed the same check when they were stored (all of a chain's walks
    /// use one check). A 32K-token prompt grown by one turn is then validated over its new
    /// tokens only, instead of a second pass over all of them. If `check` fails, the chain is
    /// left as it was.
    pub(super) fn walk_checked<R: Residency<Witness = W>, E>(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        hasher: &mut BlockHasher,
        res: &mut R,
        check: impl FnOnce(&[u32], usize) -> Result<(), E>,
    ) -> Result<WalkResult, E> {
        let stride = hasher.algo().digest_len();
        let lookups = max_hit_blocks(tokens.len(), block_size);
        let vouched = self.shared_prefix(tokens, block_size, lookups);
        check(&tokens[vouched * block_size..], vouched * block_size)?;

        // Blocks the prompt shares with the chain: re-check the witnesses a segment at a time;
        // a block whose witness no longer holds is looked up by its stored hash. The hashes
        // are only read for those lookups: they are prefetched a segment ahead once lookups
        // start, not up front (with witnesses holding, that was 64 KB read for nothing).
        let mut hits = 0;
        let mut rechecked = 0;
        let mut missed = false;
        let mut prefetched = 0;
        // Each re-check reads one engine block object, scattered over the pool and cold after
        // a model step; the next segment's are requested before this one's are checked, so
        // their loads overlap the checks instead of waiting one at a time.
        let mut requested = 0;
        while hits < vouched {
            let end = vouched.min((hits / SEGMENT_BLOCKS + 1) * SEGMENT_BLOCKS);
            if requested < end {
                res.prefetch(self.witness_run(hits, end));
                requested = end;
            }
            if requested == end && end < vouched {
                let next = vouched.min(end + SEGMENT_BLOCKS);
                res.prefetch(self.witness_run(end, next));
                requested = next;
            }
            let proven = res.still_resident(self.witness_run(hits, end));
            hits += proven;
            rechecked += proven;
            if hits < end {
                if prefetched <= hits {
                    prefetched = (end + SEGMENT_BLOCKS).min(vouched);
                    self.prefetch_hashes(hits, prefetched, stride);
                }
                if !self.look_up(hits, stride, res) {
                    missed = true;
                    break;
                }
                hits += 1;
            }
        }
        let reused = hits + usize::from(missed);
        let mut hashed = 0;

        // The rest is not the chain's (the shared prefix ends here): drop the chain's tail from
        // here on and hash the prompt's blocks. Block i's parent is the chain's block i - 1.
        if !missed && hits < lookups {
            self.truncate(hits, stride, block_size);
        }
        while !missed && hits < lookups {
            let block = &tokens[hits * block_size..(hits + 1) * block_size];
            let parent = hits.checked_sub(1).map(|p| self.hash(p, stride));
            let hash = hasher.hash_block(parent.as_ref(), block);
            self.push(&hash, block);
            hashed += 1;
            missed = !self.look_up(hits, stride, res);
            hits += usize::from(!missed);
        }

        Ok(WalkResult {
            hit_blocks: hits,
            hit_tokens: hits * block_size,
            prompt_tokens: tokens.len(),
            blocks_hashed: hashed,
            blocks_reused: reused,
            blocks_rechecked: rechecked,
        })
    }

    /// How many leading blocks (at most `lookups`) `tokens` shares with the chain, compared
    /// exactly: a whole segment at a time (one `memcmp` of up to 4 KB at block 16), and block by
    /// block only inside the first segment that differs.
    fn shared_prefix(&self, tokens: &[u32], block_size: usize, lookups: usize) -> usize {
        let blocks = self.len.min(lookups);
        let mut shared = 0;
        for segment in &self.segments {
            let n = (blocks - shared).min(SEGMENT_BLOCKS);
            if n == 0 {
                break;
            }
            let stored = &segment.tokens[..n * block_size];
            let prompt = &tokens[shared * block_size..(shared + n) * block_size];
            if stored == prompt {
                shared += n;
                continue;
            }
            shared += stored
                .chunks_exact(block_size)
                .zip(prompt.chunks_exact(block_size))
                .take_while(|(a, b)| a == b)
                .count();
            break;
        }
        shared
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
            chain.push(h, &[i as u32; 4]);
        }
        assert_eq!(chain.hashes(16), hashes);
        assert_eq!(chain.heap_bytes(), Plain::heap_bytes_for(200, 16, 4));
        for keep in [199, 129, 128, 127, 64, 1, 0] {
            chain.truncate(keep, 16, 4);
            assert_eq!(chain.hashes(16), hashes[..keep], "keep {keep}");
            assert!((0..keep).all(|i| chain.block_tokens(i, 4) == [i as u32; 4]));
        }
        chain.push(&hashes[5], &[5; 4]);
        assert_eq!(chain.hashes(16), [hashes[5]]);
        assert_eq!(
            Plain::blocks_within(Plain::heap_bytes_for(130, 32, 16), 32, 16),
            192
        );
        assert_eq!(
            Plain::blocks_within(Plain::heap_bytes_for(128, 32, 16), 32, 16),
            128
        );
    }

    fn hasher() -> BlockHasher {
        BlockHasher::new(HashAlgo::Sha256, &[0x42; 32]).unwrap()
    }

    /// Every stored block's tokens, in order.
    fn stored(chain: &Plain, block_size: usize) -> Vec<u32> {
        (0..chain.len())
            .flat_map(|i| chain.block_tokens(i, block_size).to_vec())
            .collect()
    }

    #[test]
    fn stored_tokens_track_the_chain_after_every_change() {
        let mut h = hasher();
        let mut chain = Plain::default();
        // Block 4: 99 blocks looked up, two segments.
        let mut tokens: Vec<u32> = (0..400).collect();
        chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| true);
        assert_eq!(chain.len(), 99);
        assert_eq!(stored(&chain, 4), tokens[..396]);

        tokens.extend(400..440);
        let r = chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| true);
        assert_eq!((r.blocks_reused, r.blocks_hashed), (99, 10));
        assert_eq!(stored(&chain, 4), tokens[..436]);

        // A change in block 75 (second segment): blocks 0..75 are reused, the rest re-hashed,
        // and the stored tokens follow the new prompt.
        tokens[301] = 9999;
        let r = chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| true);
        assert_eq!((r.blocks_reused, r.blocks_hashed), (75, 34));
        assert_eq!(stored(&chain, 4), tokens[..436]);

        // A shorter prompt that differs in its first block shares nothing.
        let r = chain.walk(&[5; 9], 4, &mut h, &mut |_: &BlockHash| true);
        assert_eq!((r.blocks_reused, r.blocks_hashed), (0, 2));
        assert_eq!(stored(&chain, 4), [5; 8]);

        chain.walk(&tokens, 4, &mut h, &mut |_: &BlockHash| true);
        chain.shrink_to(5, 32, 4);
        assert_eq!(chain.len(), 5);
        assert_eq!(stored(&chain, 4), tokens[..20]);
        assert_eq!(chain.heap_bytes(), Plain::heap_bytes_for(5, 32, 4));
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
