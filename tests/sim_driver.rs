//! The twin's clients in virtual time (`src/sim/driver`): turn sequencing, tool waits,
//! arrivals, token identity as the prefix cache sees it, session caps, and the real gate core's
//! waits and wake-ups, all on a replica whose every step takes exactly 10 ms.
use session_gate::gate::GateConfig;
use session_gate::sim::Replica;
use session_gate::sim::driver::{ModeSpec, SessionSpec, TurnRecord, simulate, simulate_steps};

mod common;
use common::{STEP, flat_replica as replica, of, run, session};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn turns_follow_each_other_after_their_tool_calls() {
    let turns = [(0, 8, 1.5), (100, 8, 0.25), (40, 8, 2.0)];
    let out = run(
        vec![session("a", 0, 200, 0.0, &turns)],
        1024,
        ModeSpec::None,
    );
    let r = of(&out, 0);
    assert_eq!(r.len(), 3);
    assert_eq!(r[0].prompt_tokens, 200);
    assert_eq!(r[1].prompt_tokens, 200 + 8 + 100);
    assert_eq!(r[2].prompt_tokens, 308 + 8 + 40);
    for t in 0..2 {
        assert!(close(r[t + 1].ready_at, r[t].finished_at + turns[t].2));
    }
    for x in &r {
        // Alone on the replica: no wait, a whole number of 10 ms steps, at least one per token.
        assert_eq!(x.wait_sec, 0.0);
        assert_eq!(x.reason, "none");
        let steps = x.latency_sec / STEP;
        assert!(
            (steps - steps.round()).abs() < 1e-6 && steps.round() >= 8.0,
            "{steps}"
        );
    }
    // The session ends after its last tool call.
    assert!(close(out.makespan_sec, r[2].finished_at + 2.0));
}

#[test]
fn a_session_starts_at_its_arrival() {
    let out = run(
        vec![
            session("early", 0, 64, 0.0, &[(0, 4, 0.0)]),
            session("late", 0, 64, 5.0, &[(0, 4, 0.0)]),
        ],
        1024,
        ModeSpec::None,
    );
    assert_eq!(of(&out, 0)[0].ready_at, 0.0);
    assert_eq!(of(&out, 1)[0].ready_at, 5.0);
    assert!(out.makespan_sec > 5.0);
}

#[test]
fn later_turns_hit_the_whole_previous_sequence_when_nothing_is_evicted() {
    let turns = [(0, 20, 0.5), (37, 20, 0.5), (90, 20, 0.5)];
    let out = run(
        vec![session("a", 0, 300, 0.0, &turns)],
        1024,
        ModeSpec::None,
    );
    let r = of(&out, 0);
    assert_eq!(r[0].cached_tokens, 0);
    for t in 1..3 {
        // vLLM's rule: the previous sequence's full blocks (its last token has no KV), capped
        // at (prompt - 1) // block_size blocks.
        let prev = r[t - 1].prompt_tokens + 20;
        let ideal = ((prev - 1) / 16 * 16).min((r[t].prompt_tokens - 1) / 16 * 16);
        assert_eq!(r[t].cached_tokens, ideal, "turn {t}");
    }
}

#[test]
fn sessions_share_the_system_prompt_and_nothing_else() {
    // b arrives once a's first turn is done: a's system blocks (and task) are cached.
    let out = run(
        vec![
            session("a", 100, 200, 0.0, &[(0, 4, 0.0)]),
            session("b", 70, 200, 1.0, &[(0, 4, 0.0)]),
        ],
        1024,
        ModeSpec::None,
    );
    assert_eq!(of(&out, 0)[0].cached_tokens, 0);
    // b's 70 system tokens fill 4 whole blocks; the 5th mixes in b's own task.
    assert_eq!(of(&out, 1)[0].cached_tokens, 64);
}

#[test]
fn a_cap_holds_later_sessions_until_a_slot_frees() {
    let turns = [(0, 4, 1.0), (10, 4, 1.0)];
    let out = run(
        vec![
            session("a", 0, 64, 0.0, &turns),
            session("b", 0, 64, 0.0, &turns),
            session("c", 0, 64, 0.0, &turns),
        ],
        1024,
        ModeSpec::Cap(2),
    );
    let end_a = of(&out, 0)[1].finished_at + 1.0;
    let end_b = of(&out, 1)[1].finished_at + 1.0;
    assert_eq!(of(&out, 1)[0].ready_at, 0.0);
    // c gets the first slot to free, and its turns count no wait (the slot is not a turn's).
    let c = of(&out, 2);
    assert!(close(c[0].ready_at, end_a.min(end_b)));
    assert_eq!(c[0].wait_sec, 0.0);
    assert!(close(out.makespan_sec, c[1].finished_at + 1.0));
}

/// Two sessions whose working sets (17 blocks each) cannot both fit under the watermark
/// (0.85 x 33 blocks): b must wait for a.
fn contending(a_turns: &[(u32, u32, f64)]) -> Vec<SessionSpec> {
    vec![
        session("a", 0, 250, 0.0, a_turns),
        session("b", 0, 250, 0.001, &[(0, 8, 0.0)]),
    ]
}

#[test]
fn the_gate_wakes_a_waiter_when_the_session_ahead_finishes() {
    // a's turn (100 tokens: ~1 s) is longer than a quarter of its tool call, so its room
    // does not yield while the engine idles (core docs, "An idle engine").
    let out = run(
        contending(&[(0, 100, 1.0)]),
        33,
        ModeSpec::Gate(GateConfig::default()),
    );
    let a_end = of(&out, 0)[0].finished_at + 1.0;
    let b = of(&out, 1)[0];
    // Woken by finish_session (an epoch move) at a's end, well before the 5 s poll.
    assert!(close(b.ready_at + b.wait_sec, a_end), "{b:?} vs {a_end}");
    assert!(b.wait_sec > 0.5 && b.wait_sec < 5.0);
    assert_eq!(b.reason, "open");
    let stats = out.gate_stats.unwrap();
    assert_eq!(stats.sessions_finished, 2);
    assert_eq!(stats.admissions_total(), 2);
    assert_eq!(stats.pending, 0);
}

#[test]
fn the_gate_keeps_its_deadlines_in_virtual_time() {
    // a holds its reservation for 20 s of tool calls; b's attempt gives up at max_wait, with
    // the engine idle, before a's room may yield to it (4 of a's ~0.09 s turns after it ended).
    let config = GateConfig {
        max_wait_sec: Some(0.3),
        ..GateConfig::default()
    };
    let out = run(
        contending(&[(0, 8, 20.0), (10, 8, 0.0)]),
        33,
        ModeSpec::Gate(config),
    );
    let b = of(&out, 1)[0];
    assert_eq!(b.reason, "max_wait");
    assert!(close(b.wait_sec, 0.3), "{b:?}");
}

#[test]
fn the_gate_wakes_the_head_waiter_when_a_grace_window_ends() {
    // a's idle grace window ends 0.3 s into its 20 s tool call; nothing else happens then, so
    // only the deadline the core gave the head of the queue lets b in, at that instant.
    let config = GateConfig {
        idle_grace_sec: 0.3,
        ..GateConfig::default()
    };
    let out = run(
        contending(&[(0, 8, 20.0), (10, 8, 0.0)]),
        33,
        ModeSpec::Gate(config),
    );
    let a0 = of(&out, 0)[0];
    let b = of(&out, 1)[0];
    assert!(
        close(b.ready_at + b.wait_sec, a0.finished_at + 0.3),
        "{b:?} {a0:?}"
    );
    assert_eq!(out.gate_stats.unwrap().grace_expired, 1);
}

#[test]
fn the_gate_polls_again_after_wait_poll_sec() {
    // b waits behind a's first turn (~1 s, the engine busy), then behind a's reservation
    // during its 20 s tool call with no event to wake it: the engine idles, so a's room may
    // yield once idle four of a's turn times (~4 s). b polls every 2 s meanwhile, and is
    // admitted at the yield, long before a's tool call ends.
    let config = GateConfig {
        wait_poll_sec: 2.0,
        ..GateConfig::default()
    };
    let out = run(
        contending(&[(0, 100, 20.0), (10, 8, 0.0)]),
        33,
        ModeSpec::Gate(config),
    );
    let a0 = of(&out, 0)[0];
    let b = of(&out, 1)[0];
    let turn = a0.latency_sec;
    assert!(turn > 0.9, "{a0:?}");
    assert!(
        close(b.ready_at + b.wait_sec, a0.finished_at + 4.0 * turn),
        "{b:?} {a0:?}"
    );
    assert_eq!(b.reason, "open");
    let stats = out.gate_stats.clone().unwrap();
    assert_eq!((stats.idle_engine_yields, stats.revocations), (1, 1));
    // Each 2 s deadline made b poll again: the first look, a's release, then every 2 s.
    let usage_probes = stats
        .probe(session_gate::gate::ProbeKind::Usage)
        .latency
        .count;
    assert!(usage_probes >= 4, "{usage_probes}");
}

#[test]
fn the_seed_gate_runs_the_core_with_engine_pressure() {
    let out = run(
        contending(&[(0, 8, 1.0)]),
        33,
        ModeSpec::from_kind("seed", 0, GateConfig::default()).unwrap(),
    );
    // Engine pressure: usage is low while a's prompt is not scheduled, so b is let in.
    assert_eq!(of(&out, 1)[0].reason, "open");
    assert!(out.gate_stats.is_some());
}

#[test]
fn probes_asked_while_the_engine_steps_are_answered_at_the_next_step_boundary() {
    // b arrives 1 ms into a's first 10 ms step: vLLM's engine core serves the probe between
    // steps, so its usage answer comes at 10 ms, and its admission no earlier.
    let out = run(
        contending(&[(0, 8, 1.0)]),
        33,
        ModeSpec::from_kind("seed", 0, GateConfig::default()).unwrap(),
    );
    let b = of(&out, 1)[0];
    assert_eq!(b.reason, "open");
    assert!(close(b.wait_sec, STEP - 0.001), "{b:?}");
    let stats = out.gate_stats.unwrap();
    let usage = stats.probe(session_gate::gate::ProbeKind::Usage);
    assert_eq!(usage.failures, 0);
    // a's probe found an idle engine (answered at once), b's waited 9 ms.
    assert_eq!(usage.latency.count, 2);
    assert!(close(usage.latency.sum, STEP - 0.001), "{usage:?}");
}

#[test]
fn without_async_scheduling_a_probe_sees_the_pool_before_the_next_step_is_scheduled() {
    // a runs; c's turn, admitted at the 10 ms boundary, waits for the step that starts at
    // 20 ms; b asks its usage probe at 15 ms. With vLLM's async scheduling (GPU engines) the
    // probe is served with the 20 ms step already scheduled, c's 16 blocks included: usage
    // 32/36, above the seed's 0.85, so b waits. Without it (the CPU engine, `EngineCore.step`)
    // it is served before that step is scheduled: usage 16/36, b is let in at once.
    let sessions = vec![
        session("a", 0, 250, 0.0, &[(0, 8, 1.0)]),
        session("c", 0, 250, 0.002, &[(0, 8, 0.0)]),
        session("b", 0, 250, 0.015, &[(0, 8, 0.0)]),
    ];
    let b_of = |async_scheduling: bool| {
        let cost = common::flat_cost_with(&format!("async_scheduling = {async_scheduling}"));
        assert_eq!(cost.shape.async_scheduling, async_scheduling);
        let mut r = replica(37);
        r = Replica::new(*r.config(), cost).unwrap();
        let mut m = ModeSpec::from_kind("seed", 0, GateConfig::default())
            .unwrap()
            .build(3)
            .unwrap();
        let out = simulate(sessions.clone(), 7, r, m.as_mut()).unwrap();
        (*of(&out, 2)[0]).clone()
    };
    let sync = b_of(false);
    assert_eq!(sync.reason, "open");
    assert!(close(sync.wait_sec, 2.0 * STEP - 0.015), "{sync:?}");
    let overlapped = b_of(true);
    assert!(overlapped.wait_sec > 2.0 * STEP, "{overlapped:?}");
}

#[test]
fn a_probe_the_engine_cannot_answer_within_probe_timeout_fails() {
    // Steps of 10 ms, a 4 ms probe timeout: b's probe, asked 1 ms into a step, times out at
    // 5 ms, as the production drivers time it out; the seed then treats usage as unknown.
    let config = GateConfig {
        probe_timeout_sec: 0.004,
        ..GateConfig::default()
    };
    let out = run(
        contending(&[(0, 8, 1.0)]),
        33,
        ModeSpec::from_kind("seed", 0, config).unwrap(),
    );
    let stats = out.gate_stats.clone().unwrap();
    let usage = stats.probe(session_gate::gate::ProbeKind::Usage);
    assert!(usage.failures >= 1, "{usage:?}");
    let b = of(&out, 1)[0];
    assert!(b.wait_sec >= 0.004 - 1e-9, "{b:?}");
    assert_eq!(stats.admissions_total(), 2);
}

#[test]
fn runs_are_deterministic() {
    let sessions = || {
        (0..6)
            .map(|i| {
                session(
                    &format!("s{i}"),
                    64,
                    150,
                    i as f64 * 0.1,
                    &[(0, 6, 0.3), (50, 6, 0.7), (80, 6, 0.2)],
                )
            })
            .collect::<Vec<_>>()
    };
    let a = run(sessions(), 40, ModeSpec::Gate(GateConfig::default()));
    let b = run(sessions(), 40, ModeSpec::Gate(GateConfig::default()));
    assert_eq!(a.records, b.records);
    assert_eq!(a.records.len(), 18);
}

#[test]
fn bad_specs_and_impossible_prompts_are_errors() {
    let mut m = ModeSpec::None.build(1).unwrap();
    let bad = session("x", 0, 10, 0.0, &[(5, 4, 0.0)]);
    let err = simulate(vec![bad], 0, replica(64), m.as_mut()).unwrap_err();
    assert!(
        err.to_string().contains("session `x`: turn 0: append"),
        "{err}"
    );
    let huge = session("y", 0, 64 * 16, 0.0, &[(0, 4, 0.0)]);
    let mut m = ModeSpec::None.build(1).unwrap();
    assert!(simulate(vec![huge], 0, replica(64), m.as_mut()).is_err());
    assert!(ModeSpec::from_kind("fast", 0, GateConfig::default()).is_err());
    assert!(ModeSpec::from_kind("cap", 0, GateConfig::default()).is_err());
}

/// A record's fields, times to the microsecond.
fn key(r: &TurnRecord) -> (usize, u32, u32, u32, &'static str, u64, u64) {
    let ms = |t: f64| (t * 1e6).round() as u64;
    (
        r.session,
        r.turn,
        r.prompt_tokens,
        r.cached_tokens,
        r.reason,
        ms(r.ready_at),
        ms(r.finished_at),
    )
}

#[test]
fn rl_steps_run_on_fresh_replicas_with_one_gate_object() {
    // Two identical steps of two contending sessions. Each step starts on an empty replica (the
    // prefix cache is reset between steps), so every step replays the single-step run exactly,
    // turn for turn, in every mode; the gate core is the same object across steps, so its
    // counters add up; a stateless mode is built afresh.
    let step = || contending(&[(0, 8, 1.0), (40, 8, 0.5)]);
    for mode in [
        ModeSpec::Gate(GateConfig::default()),
        ModeSpec::Cap(1),
        ModeSpec::None,
    ] {
        let single = run(step(), 33, mode.clone());
        let outs =
            simulate_steps(vec![step(), step(), step()], 7, || Ok(replica(33)), &mode).unwrap();
        assert_eq!(outs.len(), 3);
        let want: Vec<_> = single.records.iter().map(key).collect();
        for out in &outs {
            let got: Vec<_> = out.records.iter().map(key).collect();
            assert_eq!(got, want, "{mode:?}");
            assert!(close(out.makespan_sec, single.makespan_sec));
        }
        if let ModeSpec::Gate(_) = mode {
            let one = single.gate_stats.unwrap();
            for (k, out) in outs.iter().enumerate() {
                let s = out.gate_stats.as_ref().unwrap();
                let k = k as u64 + 1;
                assert_eq!(s.sessions_finished, k * one.sessions_finished);
                assert_eq!(s.admissions_total(), k * one.admissions_total());
                assert_eq!((s.pending, s.reservations_held), (0, 0));
            }
        }
    }
}

#[test]
fn a_bad_step_fails_the_whole_rl_run() {
    let mode = ModeSpec::Gate(GateConfig::default());
    // A bad spec in a later step fails the whole run, naming what was wrong.
    let bad = vec![session("x", 0, 10, 0.0, &[])];
    let err = simulate_steps(
        vec![contending(&[(0, 8, 0.0)]), bad],
        7,
        || Ok(replica(33)),
        &mode,
    )
    .unwrap_err();
    assert!(err.to_string().contains("`x`: has no turns"), "{err}");
}
