//! The replica facade: probes answer like the real plugin, and a step costs O(scheduled work),
//! not O(cache size).
use std::sync::Arc;
use std::time::Instant;

use session_gate::sim::{CostModel, Replica, ReplicaConfig, SimRequest};

fn replica(num_blocks: u32) -> Replica {
    let config = ReplicaConfig {
        num_blocks,
        block_size: 16,
        max_num_seqs: 64,
        max_num_batched_tokens: 2048,
    };
    Replica::new(config, CostModel::profile("h200-qwen2.5-7b").unwrap()).unwrap()
}

/// 200 sessions x 5 turns, every turn's prompt extending the session's history.
fn run(r: &mut Replica) -> (u64, u64, Vec<u32>) {
    let mut cached = Vec::new();
    for turn in 0..5u32 {
        for s in 0..200u64 {
            let prompt = 300 + turn * 200;
            let hashes: Arc<[u64]> = (0..(prompt + 64) / 16)
                .map(|i| s << 32 | u64::from(i))
                .collect();
            r.add_request(SimRequest {
                id: s << 8 | u64::from(turn),
                prompt_tokens: prompt,
                max_tokens: 64,
                block_hashes: hashes,
            })
            .unwrap();
        }
        while let Some(out) = r.step() {
            cached.extend(out.finished.iter().map(|f| f.num_cached_tokens));
        }
    }
    (r.stats().steps, r.stats().preemptions, cached)
}

#[test]
fn step_cost_does_not_grow_with_the_cache_size() {
    let mut best = [f64::MAX; 2];
    let mut results = Vec::new();
    for _ in 0..3 {
        for (k, blocks) in [20_000u32, 2_000_000].into_iter().enumerate() {
            let mut r = replica(blocks);
            let t = Instant::now();
            results.push(run(&mut r));
            best[k] = best[k].min(t.elapsed().as_secs_f64());
        }
    }
    // Without pressure both pools run the same steps and hit the same prefixes.
    assert!(results.windows(2).all(|w| w[0] == w[1]));
    let (_, preemptions, cached) = &results[0];
    assert_eq!(*preemptions, 0);
    assert!(
        cached[200..].iter().all(|&c| c > 0),
        "later turns hit their history"
    );
    let ratio = best[1] / best[0];
    println!("100x the blocks: {ratio:.2}x the time");
    assert!(
        ratio < 4.0,
        "a 100x larger pool made steps {ratio:.1}x slower"
    );
}

#[test]
fn probes_answer_what_the_pool_holds() {
    let mut r = replica(100);
    let hashes: Arc<[u64]> = (0..10).collect();
    let before = r.probe_prefix(&hashes, 160);
    assert_eq!(
        (before.hit_blocks, before.hit_tokens, before.hit_ratio),
        (0, 0, 0.0)
    );
    r.add_request(SimRequest {
        id: 1,
        prompt_tokens: 150,
        max_tokens: 1,
        block_hashes: hashes.clone(),
    })
    .unwrap();
    r.step().unwrap();
    // 150 tokens: 9 full blocks cached; a 160-token prompt may hit (160-1)//16 = 9 of them.
    let after = r.probe_prefix(&hashes, 160);
    assert_eq!(
        (after.hit_blocks, after.hit_tokens, after.prompt_tokens),
        (9, 144, 160)
    );
    assert!((after.hit_ratio - 144.0 / 160.0).abs() < 1e-12);
    // The probe is read-only: it neither touches nor reorders the pool.
    let u = r.usage();
    assert_eq!(r.probe_prefix(&hashes, 160), after);
    assert_eq!(r.usage(), u);
    assert_eq!(
        (u.num_blocks, u.num_free_blocks, u.num_cached_free_blocks),
        (99, 99, 9)
    );
    assert_eq!(u.block_size, 16);
    assert!(u.problem().is_none());
}
