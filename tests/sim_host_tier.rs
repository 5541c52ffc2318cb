//! The twin's host KV tier inside a replica: a prefix evicted from the GPU comes back by a load
//! instead of a recompute, the probes report it, and the load takes its PCIe time.
use std::sync::Arc;

use session_gate::sim::offload::OffloadConfig;
use session_gate::sim::{CostModel, Replica, ReplicaConfig, SimRequest};

const BLOCKS: u32 = 65;

fn replica(tier: bool) -> Replica {
    let config = ReplicaConfig {
        num_blocks: BLOCKS,
        block_size: 16,
        max_num_seqs: 8,
        max_num_batched_tokens: 2048,
    };
    let r = Replica::new(config, CostModel::profile("h200-qwen2.5-7b").unwrap()).unwrap();
    if !tier {
        return r;
    }
    r.with_offload(OffloadConfig {
        num_chunks: 1000,
        bytes_per_block: 57_344 * 16,
        load_bytes_per_sec: 50e9,
        store_bytes_per_sec: 50e9,
    })
}

fn hashes(session: u64, blocks: u32) -> Arc<[u64]> {
    (0..blocks).map(|i| session << 32 | u64::from(i)).collect()
}

fn request(id: u64, session: u64, prompt: u32) -> SimRequest {
    SimRequest {
        id,
        prompt_tokens: prompt,
        max_tokens: 8,
        block_hashes: hashes(session, (prompt + 8) / 16),
    }
}

/// Runs to completion; returns the `num_cached_tokens` of every finished request.
fn drain(r: &mut Replica) -> Vec<(u64, u32)> {
    let mut out = Vec::new();
    while let Some(step) = r.step() {
        out.extend(step.finished.iter().map(|f| (f.id, f.num_cached_tokens)));
    }
    out
}

/// Session 1 (512 tokens) runs, session 2 (1,016 tokens, the whole cache) pushes it out of the 64-block GPU
/// cache, then session 1 returns with a longer prompt.
fn scenario(tier: bool) -> (Replica, Vec<(u64, u32)>) {
    let mut r = replica(tier);
    let mut done = Vec::new();
    for (id, session, prompt) in [(1, 1, 512), (2, 2, 1016)] {
        r.add_request(request(id, session, prompt)).unwrap();
        done.extend(drain(&mut r));
    }
    let probe = r.probe_prefix(&hashes(1, 40), 600);
    if tier {
        assert_eq!(probe.hit_tokens, 0, "the GPU lost session 1");
        assert_eq!(
            probe.offloaded_tokens,
            Some(512),
            "the tier holds its prompt blocks"
        );
        let usage = r.usage();
        assert_eq!(usage.offload_num_blocks, Some(1000));
        assert_eq!(usage.offload_used_blocks, Some(32 + 63));
    } else {
        assert_eq!(probe.offloaded_tokens, None);
        assert_eq!(r.usage().offload_num_blocks, None);
    }
    r.add_request(request(3, 1, 600)).unwrap();
    done.extend(drain(&mut r));
    (r, done)
}

#[test]
fn an_evicted_prefix_reloads_from_the_tier() {
    let (gpu_only, done) = scenario(false);
    assert_eq!(done.last(), Some(&(3, 0)), "no tier: recomputed");
    let (tiered, done) = scenario(true);
    assert_eq!(
        done.last(),
        Some(&(3, 512)),
        "tier: its 32 prompt blocks loaded"
    );
    let saved = gpu_only.stats().prefill_tokens - tiered.stats().prefill_tokens;
    assert_eq!(saved, 512);
    let off = tiered.offload_stats().unwrap();
    assert_eq!((off.loads, off.loaded_blocks), (1, 32));
}

#[test]
fn a_load_waits_for_its_transfer() {
    // The returning request's 32 blocks of 917,504 bytes load at 50 GB/s in 0.59 ms: vLLM's
    // engine runs one empty step until the load completes (no other request to run), so the
    // tiered replica runs one step more than the one that recomputes, and that step lasts
    // the transfer.
    let (tiered, _) = scenario(true);
    let (gpu_only, _) = scenario(false);
    assert_eq!(tiered.stats().steps, gpu_only.stats().steps + 1);
    assert_eq!(
        tiered.stats().scheduled_tokens + 512,
        gpu_only.stats().scheduled_tokens
    );
}
