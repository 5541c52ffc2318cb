//! Modes `sched` and `sched-infer` (`src/sim/driver/sched_modes.rs`): the gate core inside the
//! modelled scheduler. Held requests wait in the replica's waiting queue without blocking the
//! requests behind them, every hold is bounded by `max_wait`, leases end with their requests,
//! and the inferred sessions follow the true ones.
use session_gate::gate::GateConfig;
use session_gate::sim::driver::{
    ModeSpec, SCHED_MAX_WAIT_SEC, SessionSpec, SimOutput, simulate, simulate_steps,
};
use session_gate::sim::{CostModel, Replica, ReplicaConfig};

mod common;
use common::{flat_replica as replica, of, run, session};

fn sched(config: GateConfig) -> ModeSpec {
    ModeSpec::from_kind("sched", 0, config).unwrap()
}

/// a holds its room through a 20 s tool call after a ~1 s turn; c, small, arrives next and fits
/// beside it; b, nearly as large as a, arrives last and does not, so the gate holds it (and a's
/// room may yield to it only once idle four of a's turn times).
fn held_then_small() -> Vec<SessionSpec> {
    vec![
        session("a", 0, 250, 0.0, &[(0, 100, 20.0), (10, 8, 0.0)]),
        session("b", 0, 250, 0.001, &[(0, 8, 0.0)]),
        session("c", 0, 40, 0.0005, &[(0, 8, 0.3), (10, 8, 0.0)]),
    ]
}

#[test]
fn the_modes_are_known_by_name() {
    assert!(matches!(
        ModeSpec::from_kind("sched", 0, GateConfig::default()).unwrap(),
        ModeSpec::Sched(_)
    ));
    assert!(matches!(
        ModeSpec::from_kind("sched-infer", 0, GateConfig::default()).unwrap(),
        ModeSpec::SchedInfer(_)
    ));
    assert!(matches!(
        ModeSpec::from_kind("sched-nofinish", 0, GateConfig::default()).unwrap(),
        ModeSpec::SchedNoFinish(_)
    ));
    let err = ModeSpec::from_kind("schedule", 0, GateConfig::default()).unwrap_err();
    assert!(err.to_string().contains("sched-infer"), "{err}");
}

#[test]
fn a_held_request_does_not_block_a_later_request_of_another_session() {
    let config = GateConfig {
        max_wait_sec: Some(3.0),
        ..GateConfig::default()
    };
    let out = run(held_then_small(), 33, sched(config));
    let b = of(&out, 1)[0];
    let c = of(&out, 2);
    // b waits in the replica's queue until max_wait.
    assert_eq!(b.reason, "max_wait");
    assert!(b.wait_sec >= 3.0 && b.wait_sec < 3.1, "{b:?}");
    let b_admitted = b.ready_at + b.wait_sec;
    // c's second turn reaches the queue behind b, is admitted on its reservation at the
    // scheduler's first look, and runs to its end while b is still held.
    assert_eq!(c[0].reason, "open");
    assert_eq!(c[1].reason, "reserved_session");
    assert!(c[1].ready_at > b.ready_at + 0.1, "{:?}", c[1]);
    assert!(c[1].wait_sec < 1e-9, "{:?}", c[1]);
    assert!(c[1].finished_at < b_admitted, "{:?} vs {b_admitted}", c[1]);
}

#[test]
fn every_hold_is_bounded_by_the_scheduler_max_wait_by_default() {
    // a's room outlives a tool call longer than max_wait (a longer grace); b is held until
    // max_wait lets it in. b is larger than the line on its own (30 of 33 blocks), so a's
    // idle room, which may yield while the engine idles, could not make it fit.
    let config = GateConfig {
        idle_grace_sec: SCHED_MAX_WAIT_SEC * 10.0,
        ..GateConfig::default()
    };
    assert_eq!(config.max_wait_sec, None);
    let tool = SCHED_MAX_WAIT_SEC * 2.5;
    let sessions = vec![
        session("a", 0, 250, 0.0, &[(0, 8, tool), (10, 8, 0.0)]),
        session("b", 0, 472, 0.001, &[(0, 8, 0.0)]),
    ];
    let out = run(sessions, 33, sched(config));
    let b = of(&out, 1)[0];
    assert_eq!(b.reason, "max_wait");
    assert!(
        b.wait_sec >= SCHED_MAX_WAIT_SEC && b.wait_sec < SCHED_MAX_WAIT_SEC + 0.1,
        "{b:?}"
    );
}

#[test]
fn leases_end_with_their_requests_and_every_turn_is_gated_once() {
    let sessions: Vec<_> = (0..6)
        .map(|i| {
            session(
                &format!("s{i}"),
                64,
                150,
                i as f64 * 0.1,
                &[(0, 6, 0.3), (50, 6, 0.7), (80, 6, 0.2)],
            )
        })
        .collect();
    let out = run(sessions.clone(), 40, sched(GateConfig::default()));
    assert_eq!(out.records.len(), 18);
    let stats = out.gate_stats.clone().unwrap();
    assert_eq!(stats.admissions_total(), 18);
    assert_eq!(stats.leases_released, 18);
    assert_eq!(stats.leases_active, 0);
    assert_eq!(stats.pending, 0);
    // The scheduler sees requests, not sessions: only the clients' finish calls end them.
    assert_eq!(stats.sessions_finished, 6);
    let ids_only = run(
        sessions.clone(),
        40,
        ModeSpec::SchedNoFinish(GateConfig::default()),
    );
    assert_eq!(ids_only.gate_stats.unwrap().sessions_finished, 0);
    assert!(out.infer_stats.is_none());
    // Deterministic.
    let again = run(sessions, 40, sched(GateConfig::default()));
    assert_eq!(out.records, again.records);
}

/// Sessions that share a 512-token system prompt, with `turns` turns each.
fn shared_system(n: usize, turns: usize) -> Vec<SessionSpec> {
    (0..n)
        .map(|i| {
            let t: Vec<_> = (0..turns)
                .map(|k| {
                    let append = if k == 0 {
                        0
                    } else {
                        40 + (i * 7 + k * 13) as u32 % 90
                    };
                    // An answer fills at least one block of its own: what the inference keys.
                    (append, 24, 0.05 + (i % 5) as f64 * 0.03)
                })
                .collect();
            session(&format!("s{i}"), 512, 60, i as f64 * 0.02, &t)
        })
        .collect()
}

#[test]
fn sched_infer_continues_the_true_sessions() {
    let sessions = shared_system(12, 8);
    let mode = ModeSpec::from_kind("sched-infer", 0, GateConfig::default()).unwrap();
    let out = run(sessions, 1024, mode);
    assert_eq!(out.records.len(), 96);
    let inf = out.infer_stats.expect("sched-infer reports its inference");
    assert_eq!(inf.turns, 96);
    assert_eq!(inf.first_new, 12);
    assert_eq!(inf.first_merged, 0);
    assert_eq!(inf.later_turns(), 84);
    assert!(inf.continued_fraction() >= 0.99, "{inf:?}");
    assert_eq!(inf.counts.new, 12);
    assert!(out.gate_stats.is_some());
}

#[test]
fn sched_infer_keeps_its_inference_across_rl_steps() {
    let steps = vec![shared_system(6, 4), shared_system(6, 4)];
    let spec = ModeSpec::from_kind("sched-infer", 0, GateConfig::default()).unwrap();
    let outs = simulate_steps(steps, 3, || Ok(replica(1024)), &spec).unwrap();
    for out in &outs {
        let inf = out.infer_stats.unwrap();
        assert!(inf.continued_fraction() >= 0.99, "{inf:?}");
    }
    // Cumulative: the second step's counts include the first's.
    assert_eq!(outs[1].infer_stats.unwrap().turns, 48);
}

/// A workload like Python's `default` (16 sessions x 10 turns, 512 shared + 1,000 task tokens,
/// 32 output tokens, 200-600 tool tokens and 0.3-1.5 s tools a turn) from a fixed LCG.
fn default_like() -> Vec<SessionSpec> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) as f64 / (1u64 << 31) as f64
    };
    (0..16)
        .map(|i| {
            let turns: Vec<_> = (0..10)
                .map(|k| {
                    let append = if k == 0 {
                        0
                    } else {
                        200 + (next() * 400.0) as u32
                    };
                    (append, 32, 0.3 + next() * 1.2)
                })
                .collect();
            session(&format!("s{i}"), 512, 1000, 0.0, &turns)
        })
        .collect()
}

fn cpu_tiny(mode: ModeSpec) -> SimOutput {
    let config = ReplicaConfig {
        num_blocks: 1024,
        block_size: 32,
        max_num_seqs: 16,
        max_num_batched_tokens: 8192,
    };
    let sessions = default_like();
    let mut m = mode.build(sessions.len()).unwrap();
    let replica = Replica::new(config, CostModel::profile("cpu-tiny").unwrap()).unwrap();
    simulate(sessions, 0, replica, m.as_mut()).unwrap()
}

#[test]
fn sched_makespan_on_the_default_workload_is_close_to_the_gate_once_session_ends_are_known() {
    let gate = cpu_tiny(ModeSpec::Gate(GateConfig::default()));
    let finishing = cpu_tiny(ModeSpec::Sched(GateConfig::default()));
    let nofinish = cpu_tiny(ModeSpec::SchedNoFinish(GateConfig::default()));
    let infer = cpu_tiny(ModeSpec::from_kind("sched-infer", 0, GateConfig::default()).unwrap());
    let ratio = |a: &SimOutput, b: &SimOutput| a.makespan_sec / b.makespan_sec;
    eprintln!(
        "makespan gate {:.2} s, sched {:.2} s, sched-nofinish {:.2} s, sched-infer {:.2} s",
        gate.makespan_sec, finishing.makespan_sec, nofinish.makespan_sec, infer.makespan_sec
    );
    // Same gate, inside the scheduler: within a few % when it learns session ends as `gate`
    // does (the finish call).
    let r = ratio(&finishing, &gate);
    assert!((r - 1.0).abs() < 0.05, "sched / gate = {r:.3}");
    assert!(finishing.gate_stats.as_ref().unwrap().sessions_finished > 0);
    // Ids alone never tell it: ended sessions keep their room until it yields (twice the
    // usual return gap), so waiters wait longer; never faster than knowing.
    assert!(nofinish.makespan_sec >= finishing.makespan_sec);
    assert_eq!(nofinish.gate_stats.as_ref().unwrap().sessions_finished, 0);
    // Inferred sessions follow the true ones, so the gate decides as with ids alone.
    let r = ratio(&infer, &nofinish);
    assert!(
        (r - 1.0).abs() < 0.05,
        "sched-infer / sched-nofinish = {r:.3}"
    );
    assert!(infer.infer_stats.unwrap().continued_fraction() >= 0.99);
}

#[test]
fn a_request_held_in_the_queue_is_not_work_so_an_idle_rooms_place_goes_to_it() {
    // a's room is idle through its 20 s tool call; b, held in the replica's waiting queue, is
    // the only request there: the engine counts as idle (held requests are taken off the
    // waiting count), so a's room yields to b once idle four of a's turn times.
    let sessions = vec![
        session("a", 0, 250, 0.0, &[(0, 8, 20.0), (10, 8, 0.0)]),
        session("b", 0, 250, 0.001, &[(0, 8, 0.0)]),
    ];
    let out = run(sessions, 33, sched(GateConfig::default()));
    let a0 = of(&out, 0)[0];
    let b = of(&out, 1)[0];
    assert_eq!(b.reason, "open");
    let admitted = b.ready_at + b.wait_sec;
    assert!(
        admitted >= a0.finished_at + 4.0 * a0.latency_sec - 1e-9 && admitted < 1.0,
        "{b:?} {a0:?}"
    );
    let stats = out.gate_stats.unwrap();
    assert_eq!((stats.idle_engine_yields, stats.revocations), (1, 1));
}
