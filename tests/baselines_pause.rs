//! ThunderAgent's tool-boundary pausing (the Dynamo port's defaults) as a sans-IO controller:
//! admission, the pause threshold and target, marking, resume hysteresis and order, forced resume
//! and idle expiry, each as a spec under a deterministic clock.
use session_gate::Error;
use session_gate::baselines::{PauseConfig, PauseController, PauseDecision};

/// 10,000 tokens of KV: pause above 9,500, down to 8,000; resume below 8,500.
const CAP: u64 = 10_000;

fn ctl() -> PauseController {
    PauseController::new(PauseConfig::default(), CAP).unwrap()
}

/// Admits a new program with a `tokens`-long first prompt and ends its first turn at the same
/// length, so it sits ACTING with `tokens` counted (+100 buffer).
fn acting(c: &mut PauseController, now: f64, id: &str, tokens: u64) {
    assert_eq!(c.before_request(now, id, tokens), PauseDecision::Admit);
    assert!(!c.after_request(now, id, tokens).unwrap());
}

#[test]
fn used_counts_reasoning_and_weighted_acting_tokens_plus_a_buffer_per_program() {
    let mut c = PauseController::new(
        PauseConfig {
            acting_token_weight: 0.5,
            ..Default::default()
        },
        CAP,
    )
    .unwrap();
    acting(&mut c, 0.0, "a", 1_000);
    assert_eq!(c.before_request(0.0, "b", 2_000), PauseDecision::Admit);
    assert_eq!(c.used(), 500 + 100 + 2_000 + 100);
}

#[test]
fn a_new_program_is_placed_only_when_it_fits_else_paused_admission_full() {
    let mut c = ctl();
    acting(&mut c, 0.0, "a", 9_000);
    // 10,000 - 9,100 = 900 free: 800 + 100 fits, 801 + 100 does not.
    assert_eq!(c.before_request(0.0, "b", 800), PauseDecision::Admit);
    assert_eq!(
        c.before_request(0.0, "c", 1),
        PauseDecision::Hold("admission_full")
    );
    assert!(c.is_paused("c"));
}

#[test]
fn new_programs_queue_behind_any_paused_program() {
    let mut c = ctl();
    acting(&mut c, 0.0, "a", 9_800);
    assert_eq!(
        c.before_request(0.0, "b", 50),
        PauseDecision::Hold("admission_full")
    );
    c.finish("a");
    // Room for everything now, but "b" is paused: "c" queues for fairness.
    assert_eq!(
        c.before_request(0.0, "c", 10),
        PauseDecision::Hold("queued")
    );
}

#[test]
fn an_active_program_is_never_gated_at_request_time() {
    let mut c = ctl();
    acting(&mut c, 0.0, "a", 5_000);
    acting(&mut c, 0.0, "b", 4_000);
    // Far over capacity now, but both are ACTIVE: their turns go through.
    assert_eq!(c.before_request(1.0, "a", 9_000), PauseDecision::Admit);
    assert_eq!(c.before_request(1.0, "b", 9_000), PauseDecision::Admit);
}

#[test]
fn nothing_is_paused_at_or_below_the_threshold() {
    let mut c = ctl();
    acting(&mut c, 0.0, "a", 4_650);
    acting(&mut c, 0.0, "b", 4_650); // used 9,500 = 0.95 x capacity exactly
    let t = c.tick(5.0);
    assert!(t.paused.is_empty() && t.marked.is_empty());
}

#[test]
fn above_the_threshold_the_smallest_acting_programs_pause_until_the_target() {
    let mut c = ctl();
    acting(&mut c, 0.0, "big", 5_000);
    acting(&mut c, 0.0, "mid", 2_500);
    acting(&mut c, 0.0, "small", 1_000);
    // Grow "big" past the line with a new turn in flight (REASONING 6,000).
    assert_eq!(c.before_request(1.0, "big", 6_000), PauseDecision::Admit);
    assert_eq!(c.used(), 6_100 + 2_600 + 1_100); // 9,800 > 9,500
    let t = c.tick(5.0);
    // small (9,800 -> 8,700 > 8,000), then mid (-> 6,100): stop at the target.
    assert_eq!(t.paused, vec!["small", "mid"]);
    assert!(t.marked.is_empty());
    assert_eq!(c.used(), 6_100);
}

#[test]
fn when_pausing_acting_programs_is_not_enough_every_reasoning_program_is_marked() {
    let mut c = ctl();
    acting(&mut c, 0.0, "tool", 500);
    assert_eq!(c.before_request(0.0, "r1", 4_000), PauseDecision::Admit);
    assert_eq!(c.before_request(0.0, "r2", 3_000), PauseDecision::Admit);
    c.before_request(1.0, "r1", 5_000);
    c.before_request(1.0, "r2", 4_000); // used = 600 + 5,100 + 4,100 = 9,800
    let t = c.tick(5.0);
    assert_eq!(t.paused, vec!["tool"]);
    assert_eq!(t.marked, vec!["r2", "r1"], "smallest first, all of them");
    // A marked program pauses when its response ends, not before.
    assert!(!c.is_paused("r1"));
    assert!(c.after_request(6.0, "r1", 5_032).unwrap());
    assert!(c.is_paused("r1"));
}

#[test]
fn resume_waits_for_the_hysteresis_line() {
    let mut c = ctl();
    acting(&mut c, 0.0, "a", 8_300);
    assert_eq!(
        c.before_request(0.0, "b", 1_600),
        PauseDecision::Hold("admission_full")
    );
    // headroom = int(10,000 x 0.85) - 8,400 = 100: not more than one buffer, nothing resumes.
    assert!(c.tick(5.0).resumed.is_empty());
    c.finish("a");
    assert_eq!(c.tick(10.0).resumed, vec!["b"]);
    assert_eq!(c.before_request(10.0, "b", 1_600), PauseDecision::Admit);
}

#[test]
fn resume_order_is_waiting_turns_then_new_programs_then_idle_ones_smallest_first() {
    let mut c = ctl();
    acting(&mut c, 0.0, "w_big", 1_500);
    acting(&mut c, 0.0, "w_small", 1_000);
    acting(&mut c, 0.0, "idle", 200);
    c.before_request(0.5, "idle", 300); // a second turn: no longer a new program
    c.after_request(0.5, "idle", 300).unwrap();
    acting(&mut c, 0.0, "filler", 6_700);
    c.before_request(1.0, "filler", 7_000); // used 1,600+1,100+400+7,100 = 10,200
    let t = c.tick(5.0);
    assert_eq!(t.paused, vec!["idle", "w_small", "w_big"]);
    // Two of them now want a turn (held), one new program arrives (queued).
    assert_eq!(
        c.before_request(6.0, "w_big", 1_600),
        PauseDecision::Hold("paused")
    );
    assert_eq!(
        c.before_request(6.0, "w_small", 1_100),
        PauseDecision::Hold("paused")
    );
    assert_eq!(
        c.before_request(6.0, "new", 200),
        PauseDecision::Hold("queued")
    );
    // Free exactly enough under the resume line (8,500) for w_small (1,200) + w_big (1,700).
    c.after_request(7.0, "filler", 5_500 - 100).unwrap(); // used 5,500
    let t = c.tick(10.0);
    // 3,000 of headroom: w_small 1,200, then w_big 1,700 (total 2,900); "new" (300) would not
    // fit after them, "idle" neither. Placement is largest first.
    assert_eq!(t.resumed, vec!["w_big", "w_small"]);
    assert!(c.is_paused("new") && c.is_paused("idle"));
}

#[test]
fn a_held_turn_is_forced_back_after_the_resume_timeout() {
    let mut c = ctl();
    // A turn in flight the whole time (REASONING never expires).
    assert_eq!(c.before_request(0.0, "hog", 9_600), PauseDecision::Admit);
    assert_eq!(
        c.before_request(10.0, "x", 500),
        PauseDecision::Hold("admission_full")
    );
    assert_eq!(c.next_forced_resume(), Some(1_810.0));
    assert!(c.tick(1_805.0).resumed.is_empty());
    let t = c.tick(1_810.0);
    assert_eq!(t.forced, vec!["x"]);
    assert_eq!(t.resumed[0], "x");
    assert_eq!(c.stats().forced_resumes, 1);
}

#[test]
fn idle_acting_programs_expire_after_the_ttl() {
    let mut c = ctl();
    acting(&mut c, 0.0, "a", 1_000);
    assert!(c.tick(599.0).expired.is_empty());
    assert_eq!(c.tick(600.0).expired, vec!["a"]);
    assert_eq!(c.used(), 0);
}

#[test]
fn ending_a_turn_of_an_unknown_program_is_refused() {
    let mut c = ctl();
    assert!(matches!(
        c.after_request(0.0, "ghost", 10),
        Err(Error::InvalidInput(_))
    ));
}

#[test]
fn bad_knobs_are_refused_by_name() {
    let cases = [
        (
            PauseConfig {
                pause_target: 0.99,
                ..Default::default()
            },
            "pause_target",
        ),
        (
            PauseConfig {
                pause_threshold: f64::NAN,
                ..Default::default()
            },
            "pause_threshold",
        ),
        (
            PauseConfig {
                scheduler_interval_sec: 0.0,
                ..Default::default()
            },
            "scheduler_interval_sec",
        ),
        (
            PauseConfig {
                acting_token_weight: -1.0,
                ..Default::default()
            },
            "acting_token_weight",
        ),
    ];
    for (cfg, name) in cases {
        match PauseController::new(cfg, CAP) {
            Err(Error::InvalidKnob { knob, .. }) => assert_eq!(knob, name),
            other => panic!("expected {name} refused, got {other:?}"),
        }
    }
    assert!(PauseController::new(PauseConfig::default(), 0).is_err());
}

#[test]
fn scaling_multiplies_the_tick_the_forced_resume_and_the_ttl() {
    let c = PauseConfig::default().scaled(0.1).unwrap();
    assert!((c.scheduler_interval_sec - 0.5).abs() < 1e-12);
    assert!((c.resume_timeout_sec - 180.0).abs() < 1e-9);
    assert!((c.idle_ttl_sec - 60.0).abs() < 1e-9);
    assert_eq!(c.pause_threshold, 0.95);
}
