//! Prints how fast block hashing and the session chain cache are.
//!
//! Run with `cargo run --release --example hash_speed` on an otherwise idle machine: every
//! figure is the median (and the best) of many timed runs, but a busy neighbour still shows.
use std::hint::black_box;
use std::time::{Duration, Instant};

use session_gate::hashing::{BlockHash, BlockHasher, HashAlgo};
use session_gate::prefix::{ChainCache, WalkResult};

const BS: usize = 16;

/// Token ids below a 151,936-token vocabulary (most need a 5-byte `BININT` in the pickle).
fn vocab_tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 151_936)
        .collect()
}

fn time<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let start = Instant::now();
    let out = f();
    (start.elapsed(), out)
}

/// "median (best)" of the samples, in µs.
fn summary(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    format!(
        "{:8.1} µs median ({:.1} best)",
        us(samples[samples.len() / 2]),
        us(samples[0])
    )
}

/// Walks every session's prompt once, timing each walk.
///
/// The engine binding copies the prompt out of Python right before walking, so the prompt is
/// warm in cache; the session's chain is not (other probes ran in between). `resident` is
/// inlined, so the timings exclude the cost of real lookups.
fn probe(
    cache: &mut ChainCache,
    hasher: &mut BlockHasher,
    ids: &[String],
    samples: &mut Vec<Duration>,
    prompts: &[Vec<u32>],
    resident: impl Fn(&BlockHash) -> bool + Copy,
) -> WalkResult {
    let mut last = WalkResult::default();
    for (id, prompt) in ids.iter().zip(prompts) {
        let warm = black_box(prompt.clone());
        let (d, r) = time(|| cache.walk(Some(id), &warm, BS, hasher, &mut { resident }));
        samples.push(d);
        last = r;
    }
    last
}

/// Where one SHA-256 block hash goes, for a 32,768-token prompt of ids below 4,096 (what
/// `make bench-probe` probes): the serialisation alone, SHA-256 alone over the same bytes
/// (chained like vLLM's, each block's parent patched into the next block's pickle), and the
/// compression function alone, which is the floor (it runs on SHA-NI when the CPU has it).
fn sha256_breakdown() {
    use sha2::{Digest, Sha256};

    let tokens: Vec<u32> = (0..2048 * BS as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 4096)
        .collect();
    let mut h = BlockHasher::new(HashAlgo::Sha256, &[7; 32]).unwrap();
    let parent = BlockHash::from_bytes(&[9; 32]).unwrap();
    let messages: Vec<Vec<u8>> = tokens
        .chunks_exact(BS)
        .map(|b| h.serialize_block(Some(&parent), b).to_vec())
        .collect();
    let bytes = messages[0].len();
    // The pickle writes the parent right after PROTO, FRAME and SHORT_BINBYTES' length byte.
    let at = messages[0]
        .windows(32)
        .position(|w| w == parent.as_bytes())
        .expect("the parent is in the pickle");
    let compressions = (bytes + 9).div_ceil(64);
    #[cfg(target_arch = "x86_64")]
    let sha_ni = std::arch::is_x86_feature_detected!("sha");
    #[cfg(not(target_arch = "x86_64"))]
    let sha_ni = false;
    println!(
        "sha256 block hash, 2,048 blocks x 16 ids < 4,096: {bytes} bytes of pickle a block = \
         {compressions} SHA-256 compressions; CPU has SHA-NI: {sha_ni} (the sha2 crate picks it \
         at run time)"
    );
    let runs = 200;
    let serialise = (0..runs)
        .map(|_| {
            time(|| {
                for b in tokens.chunks_exact(BS) {
                    black_box(h.serialize_block(Some(&parent), black_box(b)).len());
                }
            })
            .0
        })
        .collect();
    let mut chained = messages.clone();
    let sha_only = (0..runs)
        .map(|_| {
            time(|| {
                let mut prev = [0u8; 32];
                for m in chained.iter_mut() {
                    m[at..at + 32].copy_from_slice(&prev);
                    prev = Sha256::digest(black_box(&m[..])).into();
                }
                black_box(prev);
            })
            .0
        })
        .collect();
    let blocks = vec![[0x5au8; 64]; 2048 * compressions];
    let compress_only = (0..runs)
        .map(|_| {
            let mut state = [0x6a09_e667u32; 8];
            time(|| sha2::block_api::compress256(&mut state, black_box(&blocks))).0
        })
        .collect();
    let mut out = Vec::with_capacity(2048);
    let full = (0..runs)
        .map(|_| {
            out.clear();
            time(|| h.hash_full_blocks(None, black_box(&tokens), BS, &mut out)).0
        })
        .collect();
    println!(
        "  serialisation only (pickle)        {}",
        summary(serialise)
    );
    println!(
        "  SHA-256 only (sha2 digest, chained) {}",
        summary(sha_only)
    );
    println!(
        "  compression function only ({} x 64 B) {}",
        2048 * compressions,
        summary(compress_only)
    );
    println!("  hash_full_blocks (both, ours)      {}\n", summary(full));
}

fn main() {
    sha256_breakdown();
    println!("hash_full_blocks, 2,048 blocks x 16 tokens (100 runs):");
    for algo in HashAlgo::ALL {
        let mut h = BlockHasher::new(algo, &vec![7; algo.digest_len()]).unwrap();
        for (label, tokens) in [
            ("vocab ids < 151,936", vocab_tokens(2048 * BS, 1)),
            (
                "ids < 256",
                (0..2048 * BS as u32).map(|i| i % 256).collect(),
            ),
        ] {
            let mut out = Vec::with_capacity(2048);
            let samples = (0..100)
                .map(|_| {
                    out.clear();
                    time(|| h.hash_full_blocks(None, black_box(&tokens), BS, &mut out)).0
                })
                .collect();
            println!("  {:<12} {label:<20} {}", algo.name(), summary(samples));
        }
    }

    // Sessions whose chains hold a 32,768-token prompt, then one more 512-token turn each.
    let mut h = BlockHasher::new(HashAlgo::Sha256, &[7; 32]).unwrap();
    let sessions = 100;
    let rounds = 5;
    let ids: Vec<String> = (0..sessions).map(|s| format!("session-{s}")).collect();
    let turn1: Vec<Vec<u32>> = (0..sessions as u32)
        .map(|s| vocab_tokens(32_768, s))
        .collect();
    let turn2: Vec<Vec<u32>> = turn1
        .iter()
        .enumerate()
        .map(|(s, t)| [t.clone(), vocab_tokens(512, 1000 + s as u32)].concat())
        .collect();
    let edited: Vec<Vec<u32>> = turn2
        .iter()
        .map(|t| {
            let mut t = t.clone();
            t[16_000] ^= 1;
            t
        })
        .collect();
    let all = |_: &BlockHash| true;
    let none = |_: &BlockHash| false;

    let mut first = Vec::new();
    let mut extend = Vec::new();
    let mut repeat = Vec::new();
    let mut miss = Vec::new();
    let mut diverge = Vec::new();
    let mut per_session = 0;
    for _ in 0..rounds {
        let mut cache = ChainCache::new(1 << 30);
        probe(&mut cache, &mut h, &ids, &mut first, &turn1, all);
        let last = probe(&mut cache, &mut h, &ids, &mut extend, &turn2, all);
        assert_eq!((last.blocks_hashed, last.blocks_reused), (32, 2047));
        probe(&mut cache, &mut h, &ids, &mut repeat, &turn2, all);
        probe(&mut cache, &mut h, &ids, &mut miss, &turn2, none);
        probe(&mut cache, &mut h, &ids, &mut diverge, &edited, all);
        per_session = cache.bytes() / cache.len();
    }
    println!(
        "\nChainCache.walk, sha256, block 16, lookups answered by `|_| true` ({rounds} x {sessions} probes):"
    );
    println!(
        "  first probe, 32,768 tokens (2,047 hashed)      {}",
        summary(first)
    );
    println!(
        "  + one 512-token turn (32 hashed, 2,047 reused) {}",
        summary(extend)
    );
    println!(
        "  same 33,280 tokens again (all reused)          {}",
        summary(repeat)
    );
    println!(
        "  same prompt, miss at block 0                   {}",
        summary(miss)
    );
    println!(
        "  token 16,000 changed (1,080 re-hashed)         {}",
        summary(diverge)
    );
    println!("\nchain cache memory: {per_session} bytes per session at 33,280 tokens / block 16");
}
