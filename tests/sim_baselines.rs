//! The production baselines as modes of the twin's virtual-time driver: `aimd` cancels episodes
//! that then re-run from their first turn with the lost work counted, `pause` holds turns at
//! tool boundaries and releases them on a tick; every session finishes every turn exactly once.
use session_gate::baselines::{AimdConfig, PauseConfig};
use session_gate::sim::driver::{ModeSpec, SessionSpec, SimOutput, TurnSpec, simulate};

mod common;
use common::flat_replica;

/// `n` sessions of 6 turns on a 256-block (4,096-token) cache: ~1,500 tokens each at the end.
fn sessions(n: usize) -> Vec<SessionSpec> {
    (0..n)
        .map(|i| SessionSpec {
            session_id: format!("s{i}"),
            system_tokens: 256,
            task_tokens: 400,
            arrival: 0.0,
            turns: (0..6)
                .map(|t| TurnSpec {
                    append: if t == 0 { 0 } else { 120 },
                    output: 24,
                    tool_latency: 1.0 + 0.1 * (i % 5) as f64,
                })
                .collect(),
        })
        .collect()
}

fn run(n: usize, mode: ModeSpec) -> SimOutput {
    let mut m = mode.build(n).unwrap();
    simulate(sessions(n), 3, flat_replica(256), m.as_mut()).unwrap()
}

fn assert_every_turn_once(out: &SimOutput, n: usize) {
    let mut keys: Vec<(usize, u32)> = out.records.iter().map(|r| (r.session, r.turn)).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), out.records.len(), "a turn recorded twice");
    assert_eq!(keys.len(), n * 6);
}

#[test]
fn the_baselines_are_modes_the_driver_knows_by_name() {
    use session_gate::gate::GateConfig;
    assert!(matches!(
        ModeSpec::from_kind("aimd", 0, GateConfig::default()).unwrap(),
        ModeSpec::Aimd(c) if c == AimdConfig::default()
    ));
    assert!(matches!(
        ModeSpec::from_kind("pause", 0, GateConfig::default()).unwrap(),
        ModeSpec::Pause(c) if c == PauseConfig::default()
    ));
}

#[test]
fn aimd_with_published_knobs_finishes_everything_and_records_no_loss_without_cancels() {
    let out = run(8, ModeSpec::Aimd(AimdConfig::default()));
    assert_every_turn_once(&out, 8);
    if out.lost.cancellations == 0 {
        assert_eq!((out.lost.turns, out.lost.tokens), (0, 0));
    }
}

#[test]
fn aimd_cancellations_rerun_episodes_from_the_first_turn_and_count_lost_work() {
    // Hair trigger: any usage over 1% cuts to one episode and cancels the rest; a huge growth
    // factor lets everyone back in after each clear completion, so cancels keep happening.
    let config = AimdConfig {
        initial_inflight: Some(8.0),
        poll_interval_sec: 0.5,
        cut_usage: 0.01,
        cancel_usage: 0.02,
        cut_target: 0.001,
        cooldown_polls: 0,
        growth: 100.0,
        ..Default::default()
    };
    let out = run(8, ModeSpec::Aimd(config));
    assert_every_turn_once(&out, 8);
    assert!(out.lost.cancellations > 0);
    assert!(out.lost.turns > 0 && out.lost.tokens > 0, "{:?}", out.lost);
    assert!(out.records.iter().all(|r| r.reason == "aimd"));
}

#[test]
fn pause_holds_turns_and_resumes_them_on_ticks() {
    let config = PauseConfig {
        pause_threshold: 0.5,
        pause_target: 0.3,
        resume_hysteresis: 0.1,
        scheduler_interval_sec: 0.5,
        resume_timeout_sec: 5.0,
        ..Default::default()
    };
    let out = run(8, ModeSpec::Pause(config));
    assert_every_turn_once(&out, 8);
    let held: Vec<_> = out
        .records
        .iter()
        .filter(|r| r.reason != "active")
        .collect();
    assert!(
        !held.is_empty(),
        "sessions past half the cache must be held"
    );
    assert!(held.iter().all(|r| r.wait_sec > 0.0));
    let active = out.records.iter().filter(|r| r.reason == "active");
    assert!(active.clone().count() > 0 && active.into_iter().all(|r| r.wait_sec == 0.0));
}

#[test]
fn a_run_is_deterministic() {
    let a = run(8, ModeSpec::Pause(PauseConfig::default()));
    let b = run(8, ModeSpec::Pause(PauseConfig::default()));
    assert_eq!(a.records, b.records);
    assert_eq!(a.makespan_sec, b.makespan_sec);
}

#[test]
fn aimd_on_vllm_usage_does_not_see_prefix_thrash_between_turns() {
    // Eight episodes in flight on a cache that holds about three at their final size, prime-rl's
    // thresholds, its time constants x0.1 (polls every 0.5 s for turns of ~0.25 s and tools of
    // 1-1.4 s). The thrash is in the prefixes of sessions between turns: vLLM's usage counts
    // them as free, so no poll sees the soft cap, nothing is preempted, nothing is cancelled,
    // while the engine prefills four times what the capacity-started cap (two episodes) does.
    let scaled = |initial_inflight| AimdConfig {
        initial_inflight,
        poll_interval_sec: 0.5,
        grow_valid_sec: 1.5,
        meter_window_sec: 0.5,
        ..Default::default()
    };
    let eight = run(8, ModeSpec::Aimd(scaled(Some(8.0))));
    let from_capacity = run(8, ModeSpec::Aimd(scaled(None)));
    assert_every_turn_once(&eight, 8);
    let stats = eight.aimd_stats.clone().expect("aimd reports its counters");
    assert_eq!(eight.replica_stats.preemptions, 0);
    assert!(stats.polls > 10, "{stats:?}");
    assert!(
        stats.peak_usage < AimdConfig::default().cut_usage,
        "{stats:?}"
    );
    assert_eq!(
        (stats.soft_cuts, stats.hard_cuts, eight.lost.cancellations),
        (0, 0, 0)
    );
    let thrash = eight.replica_stats.prefill_tokens as f64
        / from_capacity.replica_stats.prefill_tokens as f64;
    assert!(
        thrash > 3.0,
        "prefill only {thrash:.2}x the capacity-started run's"
    );
    assert!(from_capacity.aimd_stats.unwrap().peak_usage < stats.peak_usage);
}
