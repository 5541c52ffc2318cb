//! The limit mode: the same engine with a cache no run can exhaust. On a workload that thrashes
//! a small cache, the limit never evicts or preempts, every turn hits the whole previous
//! sequence, and its makespan is at most every mode's on the finite cache; only `num_blocks`
//! differs from the finite engine; a limit run on a cache too small is refused.
use session_gate::gate::GateConfig;
use session_gate::sim::driver::limit::{LIMIT_MODE, limit_config, unlimited_blocks};
use session_gate::sim::driver::{ModeSpec, SessionSpec, SimOutput, simulate_steps};
use session_gate::sim::{CostModel, Replica, ReplicaConfig};

mod common;
use common::session;

/// A small H200-7B-timed engine: 320 blocks of 16 tokens (5,120 tokens), far less than the
/// workload's live contexts, so every finite mode evicts.
fn small_shape() -> ReplicaConfig {
    ReplicaConfig {
        num_blocks: 320,
        block_size: 16,
        max_num_seqs: 8,
        max_num_batched_tokens: 2048,
    }
}

/// 12 sessions of 8 turns, a shared 512-token system prompt, ~2,500 tokens each at the end,
/// arriving over the first second, tools of 0.2-0.6 s.
fn workload() -> Vec<SessionSpec> {
    (0..12)
        .map(|i| {
            let turns: Vec<(u32, u32, f64)> = (0..8)
                .map(|t| {
                    let append = if t == 0 { 0 } else { 150 + 10 * (i % 3) };
                    (append, 48, 0.2 + 0.1 * f64::from(i % 5))
                })
                .collect();
            session(&format!("s{i}"), 512, 600, 0.08 * f64::from(i), &turns)
        })
        .collect()
}

fn cost() -> CostModel {
    CostModel::profile("h200-qwen2.5-7b").unwrap()
}

fn run_on(shape: ReplicaConfig, spec: &ModeSpec) -> session_gate::Result<SimOutput> {
    let out = simulate_steps(vec![workload()], 5, || Replica::new(shape, cost()), spec)?;
    Ok(out.into_iter().next().unwrap())
}

fn limit() -> SimOutput {
    let shape = limit_config(small_shape(), &[workload()]).unwrap();
    run_on(shape, &ModeSpec::Limit).unwrap()
}

#[test]
fn limit_is_a_mode_by_name_and_changes_only_the_pool_size() {
    assert_eq!(
        ModeSpec::from_kind(LIMIT_MODE, 0, GateConfig::default()).unwrap(),
        ModeSpec::Limit
    );
    let finite = small_shape();
    let unlimited = limit_config(finite, &[workload()]).unwrap();
    assert_eq!(
        ReplicaConfig {
            num_blocks: finite.num_blocks,
            ..unlimited
        },
        finite,
        "block size, max_num_seqs and the token budget stay the engine's"
    );
    // Every token of every session fits, with room to spare.
    let tokens: u64 = workload().iter().map(SessionSpec::final_tokens).sum();
    assert!(u64::from(unlimited.num_blocks) * 16 >= tokens);
}

#[test]
fn the_bound_counts_every_session_apart_and_the_largest_step() {
    let one = session("a", 16, 16, 0.0, &[(0, 16, 0.0), (16, 16, 0.0)]);
    // 80 tokens = 5 blocks, + 2 per turn, + the null block.
    assert_eq!(
        unlimited_blocks(std::slice::from_ref(&one), 16).unwrap(),
        1 + 5 + 4
    );
    let two = vec![one.clone(), one.clone()];
    assert_eq!(unlimited_blocks(&two, 16).unwrap(), 1 + 2 * 9);
    let shape = limit_config(small_shape(), &[vec![one], two]).unwrap();
    assert_eq!(shape.num_blocks, 19);
    assert!(unlimited_blocks(&[], 0).is_err());
}

#[test]
fn the_limit_never_evicts_and_every_turn_hits_its_whole_previous_sequence() {
    let out = limit();
    assert_eq!(out.replica_stats.evicted_blocks, 0);
    assert_eq!(out.replica_stats.preemptions, 0);
    assert_eq!(out.records.len(), 12 * 8);
    let sessions = workload();
    for r in out.records.iter().filter(|r| r.turn > 0) {
        let spec = &sessions[r.session];
        let previous = r.prompt_tokens - spec.turns[r.turn as usize].append;
        // vLLM caches the previous sequence's full blocks (its last token has no KV).
        let expected = (previous - 1) / 16 * 16;
        assert_eq!(
            r.cached_tokens, expected,
            "session {} turn {}: hit {} of a {}-token previous sequence",
            r.session, r.turn, r.cached_tokens, previous
        );
    }
}

#[test]
fn the_limit_is_a_floor_for_every_mode_on_the_finite_cache() {
    let limit = limit();
    let gate = GateConfig::default();
    let mut evicting = 0;
    for kind in ["none", "cap", "seed", "gate", "aimd", "pause", "sched"] {
        let spec = ModeSpec::from_kind(kind, 4, gate.clone()).unwrap();
        let out = run_on(small_shape(), &spec).unwrap();
        let over_limit = out.makespan_sec / limit.makespan_sec;
        assert!(
            over_limit >= 1.0,
            "{kind}: makespan {:.3} s under the limit's {:.3} s",
            out.makespan_sec,
            limit.makespan_sec
        );
        evicting += usize::from(out.replica_stats.evicted_blocks > 0);
    }
    assert!(
        evicting >= 5,
        "the finite cache must be small enough to evict"
    );
    let none = run_on(small_shape(), &ModeSpec::None).unwrap();
    assert!(
        none.makespan_sec > 1.2 * limit.makespan_sec,
        "no gate thrashes the small cache: {:.3} s against the limit's {:.3} s",
        none.makespan_sec,
        limit.makespan_sec
    );
}

#[test]
fn a_limit_run_on_a_cache_that_runs_out_is_refused() {
    let err = run_on(small_shape(), &ModeSpec::Limit)
        .unwrap_err()
        .to_string();
    assert!(err.contains("mode limit"), "{err}");
    assert!(err.contains("not unlimited"), "{err}");
}
