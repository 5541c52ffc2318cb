//! prime-rl's adaptive concurrency as a sans-IO controller: each rule of the control law as a
//! spec (multiplicative decrease, geometric growth, cooldown, draining latch and escalation,
//! metered admission, youngest-first cancellation), under a deterministic clock.
use session_gate::Error;
use session_gate::baselines::{AimdConfig, AimdController, AimdSignals};

fn clear() -> AimdSignals {
    AimdSignals {
        kv_usage: 0.1,
        running: 1,
        ..Default::default()
    }
}

fn with_cap(cap: f64) -> AimdController {
    AimdController::new(AimdConfig {
        initial_inflight: Some(cap),
        ..Default::default()
    })
    .unwrap()
}

/// Submits `n` episodes named e0.. and starts as many as admission allows at `now`.
fn start(c: &mut AimdController, now: f64, names: &[&str]) -> Vec<String> {
    for n in names {
        c.submit(n).unwrap();
    }
    c.admit(now)
}

#[test]
fn starts_at_min_inflight_then_jumps_to_capacity_over_max_model_len_on_first_capacity_poll() {
    let mut c = AimdController::new(AimdConfig::default()).unwrap();
    assert_eq!(c.cap(), 1.0);
    let started = start(&mut c, 0.0, &["a", "b", "c"]);
    assert_eq!(started, vec!["a"], "cap 1 before any capacity is known");
    let cancels = c.on_poll(
        0.0,
        &AimdSignals {
            kv_capacity_tokens: Some(32_768),
            max_model_len: Some(8_192),
            ..clear()
        },
    );
    assert!(cancels.is_empty());
    assert_eq!(c.cap(), 4.0);
    assert_eq!(c.admit(0.0), vec!["b", "c"]);
}

#[test]
fn an_initial_inflight_is_kept_when_capacity_arrives() {
    let mut c = with_cap(3.0);
    c.on_poll(
        0.0,
        &AimdSignals {
            kv_capacity_tokens: Some(1_000_000),
            max_model_len: Some(1_000),
            ..clear()
        },
    );
    assert_eq!(c.cap(), 3.0);
}

#[test]
fn a_preemption_cuts_to_four_fifths_of_inflight_and_cancels_the_youngest() {
    let mut c = with_cap(10.0);
    c.on_poll(0.0, &clear());
    for (i, t) in [0.0, 1.0, 2.0, 3.0, 4.0].iter().enumerate() {
        let name = format!("e{i}");
        assert_eq!(start(&mut c, *t, &[&name]), vec![name]);
    }
    let cancels = c.on_poll(
        5.0,
        &AimdSignals {
            preemptions_total: 3,
            ..clear()
        },
    );
    // int(5 * 0.8) = 4: one episode cancelled, the one that started last.
    assert_eq!(cancels, vec!["e4"]);
    assert_eq!(c.cap(), 4.0);
    assert_eq!(c.inflight(), 4);
    assert!(c.draining());
    assert_eq!(c.stats().hard_cuts, 1);
}

#[test]
fn the_first_poll_sets_the_preemption_baseline_without_a_cut() {
    let mut c = with_cap(4.0);
    let cancels = c.on_poll(
        0.0,
        &AimdSignals {
            preemptions_total: 50,
            ..clear()
        },
    );
    assert!(cancels.is_empty());
    assert_eq!(c.cap(), 4.0);
}

#[test]
fn six_queueing_polls_are_a_hard_signal_with_a_nine_tenths_cut() {
    let mut c = with_cap(10.0);
    let names: Vec<String> = (0..10).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    assert_eq!(
        start(&mut c, 0.0, &refs).len(),
        8,
        "the meter allows 8 per window"
    );
    let queue = AimdSignals {
        kv_usage: 0.3,
        running: 4,
        waiting: 3,
        ..Default::default()
    };
    for i in 0..5 {
        assert!(
            c.on_poll(i as f64, &queue).is_empty(),
            "poll {i} is not yet overload"
        );
    }
    let cancels = c.on_poll(5.0, &queue);
    // int(8 * 0.9) = 7.
    assert_eq!(cancels.len(), 1);
    assert_eq!(c.cap(), 7.0);
}

#[test]
fn a_queue_that_empties_resets_the_queue_poll_count() {
    let mut c = with_cap(10.0);
    start(&mut c, 0.0, &["a", "b"]);
    let queue = AimdSignals {
        running: 4,
        waiting: 3,
        ..Default::default()
    };
    for i in 0..5 {
        c.on_poll(i as f64, &queue);
    }
    c.on_poll(5.0, &clear());
    for i in 6..11 {
        assert!(c.on_poll(i as f64, &queue).is_empty());
    }
    assert_eq!(c.stats().hard_cuts, 0);
}

#[test]
fn the_draining_latch_ignores_hard_signals_until_inflight_fits_the_cap() {
    let mut c = with_cap(10.0);
    c.on_poll(0.0, &clear());
    let names: Vec<String> = (0..5).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    start(&mut c, 0.0, &refs);
    let preempt = |n| AimdSignals {
        preemptions_total: n,
        ..clear()
    };
    assert_eq!(c.on_poll(1.0, &preempt(1)).len(), 1); // cap 4, 4 in flight
    // More preemptions while draining: ignored. Lower the cap under inflight without a cancel
    // by asking for more than fits: inflight 4 <= cap 4, no hard signal on the next poll clears.
    assert!(c.on_poll(2.0, &preempt(2)).is_empty());
    assert!(c.draining(), "a hard signal keeps the latch");
    assert_eq!(c.cap(), 4.0);
    assert!(c.on_poll(3.0, &preempt(2)).is_empty());
    assert!(
        !c.draining(),
        "inflight <= cap and no hard signal clears the latch"
    );
}

#[test]
fn overload_within_the_grace_after_a_drain_escalates_to_half() {
    let mut c = with_cap(20.0);
    c.on_poll(0.0, &clear());
    let names: Vec<String> = (0..8).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    start(&mut c, 0.0, &refs);
    let preempt = |n| AimdSignals {
        preemptions_total: n,
        ..clear()
    };
    assert_eq!(c.on_poll(1.0, &preempt(1)).len(), 2); // int(8*0.8) = 6
    assert!(c.on_poll(2.0, &preempt(1)).is_empty()); // latch clears, grace starts
    assert!(!c.draining());
    let cancels = c.on_poll(3.0, &preempt(2));
    assert_eq!(cancels.len(), 3, "int(6 * 0.5) = 3");
    assert_eq!(c.cap(), 3.0);
}

#[test]
fn a_full_grace_without_overload_disarms_the_escalation() {
    let mut c = with_cap(20.0);
    c.on_poll(0.0, &clear());
    let names: Vec<String> = (0..10).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    start(&mut c, 0.0, &refs[..8]);
    let preempt = |n| AimdSignals {
        preemptions_total: n,
        ..clear()
    };
    assert_eq!(c.on_poll(1.0, &preempt(1)).len(), 2); // 8 -> 6
    c.on_poll(2.0, &preempt(1)); // latch clears
    for t in 3..9 {
        c.on_poll(t as f64, &preempt(1)); // six quiet polls of grace
    }
    let cancels = c.on_poll(9.0, &preempt(2));
    assert_eq!(cancels.len(), 2, "int(6 * 0.8) = 4 again, not 3");
}

#[test]
fn usage_over_the_soft_cap_resizes_without_cancelling_then_cools_down() {
    let mut c = with_cap(10.0);
    c.on_poll(0.0, &clear());
    let names: Vec<String> = (0..8).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    start(&mut c, 0.0, &refs);
    let hot = AimdSignals {
        kv_usage: 0.875,
        running: 8,
        ..Default::default()
    };
    assert!(
        c.on_poll(1.0, &hot).is_empty(),
        "below 0.9 nothing is cancelled"
    );
    assert_eq!(c.cap(), 6.0, "int(8 * 0.7 / 0.875) = 6");
    assert_eq!(
        c.inflight(),
        8,
        "the cap is under inflight; admission just blocks"
    );
    c.submit("late").unwrap();
    assert!(c.admit(1.0).is_empty());
    for t in 2..7 {
        c.on_poll(t as f64, &hot);
        assert_eq!(c.cap(), 6.0, "cooldown: no resize on poll {t}");
    }
    c.on_poll(7.0, &hot);
    assert_eq!(c.cap(), 6.0_f64.min((8.0_f64 * 0.7 / 0.875).floor()));
    assert_eq!(
        c.stats().soft_cuts,
        2,
        "the cooldown of six polls has run out"
    );
}

#[test]
fn usage_over_the_hard_cap_cancels_down_to_the_target() {
    let mut c = with_cap(10.0);
    c.on_poll(0.0, &clear());
    let names: Vec<String> = (0..8).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    start(&mut c, 0.0, &refs);
    let cancels = c.on_poll(
        1.0,
        &AimdSignals {
            kv_usage: 0.95,
            running: 8,
            ..Default::default()
        },
    );
    // int(8 * 0.7 / 0.95) = 5: the three youngest go (all started at 0: latest admitted first).
    assert_eq!(cancels, vec!["e7", "e6", "e5"]);
    assert_eq!(c.inflight(), 5);
}

#[test]
fn completions_while_clear_and_binding_grow_the_cap_geometrically() {
    let mut c = with_cap(4.0);
    c.on_poll(0.0, &clear());
    start(&mut c, 0.0, &["a", "b", "c", "d"]);
    c.on_poll(
        1.0,
        &AimdSignals {
            waiting: 0,
            ..clear()
        },
    );
    c.on_complete(2.0, "a").unwrap();
    // n = 4 in flight counting the finished one: cap * 1.25^(1/4).
    let expected = 4.0 * 1.25_f64.powf(0.25);
    assert!((c.cap() - expected).abs() < 1e-9, "cap {}", c.cap());
    assert_eq!(c.stats().grown, 1);
}

/// Four episodes in flight under cap 4 after a poll at 0 s that said `signals`.
fn binding_after(signals: AimdSignals) -> AimdController {
    let mut c = with_cap(4.0);
    c.on_poll(0.0, &signals);
    start(&mut c, 0.0, &["a", "b", "c", "d"]);
    c
}

#[test]
fn no_growth_when_the_licence_expired() {
    let mut c = binding_after(clear());
    c.on_complete(16.0, "a").unwrap(); // the clear poll licensed growth until 15 s
    assert_eq!(c.cap(), 4.0);
}

#[test]
fn no_growth_when_the_engine_had_requests_waiting() {
    let mut c = binding_after(AimdSignals {
        waiting: 1,
        ..clear()
    });
    c.on_complete(1.0, "a").unwrap();
    assert_eq!(c.cap(), 4.0);
}

#[test]
fn no_growth_when_usage_was_above_the_soft_line() {
    let mut c = binding_after(AimdSignals {
        kv_usage: 0.65,
        ..clear()
    });
    c.on_complete(1.0, "a").unwrap();
    assert_eq!(c.cap(), 4.0);
}

#[test]
fn no_growth_when_the_cap_does_not_bind() {
    let mut c = binding_after(clear());
    c.on_complete(1.0, "a").unwrap(); // n = 4: grows
    let grown = c.cap();
    c.on_complete(1.0, "b").unwrap(); // n = 3 < 0.9 * 4.2
    assert_eq!(c.cap(), grown);
}

#[test]
fn admission_is_metered_per_window_and_completions_refund() {
    let mut c = with_cap(100.0);
    c.on_poll(0.0, &clear());
    let names: Vec<String> = (0..30).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    // max(8, 100 // 10) = 10 per window.
    assert_eq!(start(&mut c, 0.0, &refs).len(), 10);
    assert!(c.admit(1.0).is_empty());
    c.on_complete(2.0, "e0").unwrap();
    assert_eq!(
        c.admit(2.0),
        vec!["e10"],
        "one completion refunds one start"
    );
    assert_eq!(c.admit(5.0).len(), 10, "a new window");
}

#[test]
fn submitting_twice_or_completing_an_unknown_episode_is_refused() {
    let mut c = with_cap(2.0);
    c.submit("a").unwrap();
    assert!(matches!(c.submit("a"), Err(Error::InvalidInput(_))));
    assert!(matches!(
        c.on_complete(0.0, "zz"),
        Err(Error::InvalidInput(_))
    ));
}

#[test]
fn bad_knobs_are_refused_by_name() {
    let bad = [
        AimdConfig {
            poll_interval_sec: 0.0,
            ..Default::default()
        },
        AimdConfig {
            cut_usage: 1.5,
            ..Default::default()
        },
        AimdConfig {
            preempt_factor: 0.0,
            ..Default::default()
        },
        AimdConfig {
            growth: 0.9,
            ..Default::default()
        },
        AimdConfig {
            min_inflight: 8.0,
            max_inflight: 4.0,
            ..Default::default()
        },
    ];
    let names = [
        "poll_interval_sec",
        "cut_usage",
        "preempt_factor",
        "growth",
        "min_inflight",
    ];
    for (cfg, name) in bad.into_iter().zip(names) {
        match AimdController::new(cfg) {
            Err(Error::InvalidKnob { knob, .. }) => assert_eq!(knob, name),
            other => panic!("expected {name} refused, got {other:?}"),
        }
    }
}

#[test]
fn scaling_multiplies_every_time_constant_and_nothing_else() {
    let c = AimdConfig::default().scaled(0.1).unwrap();
    assert!((c.poll_interval_sec - 0.5).abs() < 1e-12);
    assert!((c.grow_valid_sec - 1.5).abs() < 1e-12);
    assert!((c.meter_window_sec - 0.5).abs() < 1e-12);
    assert_eq!(c.queue_polls, 6);
    assert_eq!(c.cut_usage, 0.8);
}
