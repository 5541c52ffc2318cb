//! Yielding idle room (module docs of `gate::core`), under a deterministic clock: a reservation
//! idle for eight of its session's own mean turn times, and for half of `idle_grace_sec`, gives
//! its room to the head of the queue, and only when that makes it fit.
use session_gate::gate::testing::usage_report;
use session_gate::gate::{
    Action, Admission, AttemptId, GateConfig, GateCore, LeaseId, PrefixReport, Reason, UsageReport,
};

/// 100 blocks of 16 tokens: the watermark line (0.85) is at 85 blocks.
const BLOCKS: u64 = 100;
const BS: usize = 16;

fn core() -> GateCore {
    GateCore::new(GateConfig::default()).unwrap()
}

/// Polls `id` at `now` (usage 0.1, no resident prefix) until it is admitted or told to wait.
fn drive(core: &mut GateCore, id: AttemptId, now: f64) -> Action {
    drive_with(core, id, now, usage_report(0.1, BLOCKS, BS as u64))
}

/// [`drive`] with the engine's scheduler reporting `running` and `waiting` requests.
fn drive_queues(
    core: &mut GateCore,
    id: AttemptId,
    now: f64,
    running: u64,
    waiting: u64,
) -> Action {
    let report = UsageReport {
        num_running_reqs: Some(running),
        num_waiting_reqs: Some(waiting),
        ..usage_report(0.1, BLOCKS, BS as u64)
    };
    drive_with(core, id, now, report)
}

fn drive_with(core: &mut GateCore, id: AttemptId, now: f64, report: UsageReport) -> Action {
    for _ in 0..16 {
        match core.poll(id, now).unwrap() {
            Action::ProbeUsage => core.on_usage(id, Ok(report), now).unwrap(),
            Action::ProbePrefix => core
                .on_prefix(id, Ok(PrefixReport::default()), now)
                .unwrap(),
            action => return action,
        }
    }
    panic!("attempt {id:?} kept asking for probes");
}

fn admitted(action: Action) -> Admission {
    match action {
        Action::Admit(a) => a,
        other => panic!("expected an admission, got {other:?}"),
    }
}

fn waits(action: &Action) -> bool {
    matches!(action, Action::Wait { .. })
}

/// One turn of `blocks` blocks of prompt (no max_tokens), with an ownership window.
fn turn(core: &mut GateCore, session: &str, blocks: usize, now: f64) -> (AttemptId, Action) {
    let id = core.begin(session, blocks * BS, 0, true, now);
    (id, drive(core, id, now))
}

fn lease(core: &mut GateCore, session: &str, blocks: usize, now: f64) -> LeaseId {
    admitted(turn(core, session, blocks, now).1).lease
}

/// A session whose turns take `turn_sec` each: one turn admitted at `now`, released after it.
fn one_turn(core: &mut GateCore, session: &str, blocks: usize, now: f64, turn_sec: f64) {
    let l = lease(core, session, blocks, now);
    assert!(core.release(l, now + turn_sec));
}

#[test]
fn an_idle_reservation_yields_to_the_head_after_half_the_grace_window() {
    let mut c = core();
    // s1's turn took 1 s: 8 turn times = 8 s, below the floor of 60 / 2 = 30 s idle.
    one_turn(&mut c, "s1", 50, 0.0, 1.0);
    let (id, action) = turn(&mut c, "s2", 50, 2.0);
    // The head is told to wake when s1 may yield (idle since 1 s, so at 31 s), before the
    // 5 s poll deadline would not matter and well before the window's end (61 s).
    assert!(waits(&action), "{action:?}");
    let action = drive(&mut c, id, 30.5);
    assert_eq!(action, Action::Wait { until: 31.0 });
    assert!(c.has_reservation("s1"));
    let a = admitted(drive(&mut c, id, 31.0));
    assert_eq!(a.reason, Reason::Open);
    assert!(!c.has_reservation("s1"));
    assert_eq!(c.stats().revocations, 1);
    assert_eq!(c.stats().committed_blocks, 50);
    c.check_invariants().unwrap();
}

#[test]
fn an_idle_engine_lets_an_idle_room_yield_after_four_of_its_turns() {
    let mut c = core();
    one_turn(&mut c, "s1", 50, 0.0, 1.0);
    // Nothing running or waiting in the engine: s1 (idle since 1 s, turns of 1 s) may yield
    // at 1 + 4 x 1 = 5 s, with no floor of half the grace window.
    let id = c.begin("s2", 50 * BS, 0, true, 2.0);
    assert_eq!(
        drive_queues(&mut c, id, 2.0, 0, 0),
        Action::Wait { until: 5.0 }
    );
    assert!(c.has_reservation("s1"));
    let a = admitted(drive_queues(&mut c, id, 5.0, 0, 0));
    assert_eq!(a.reason, Reason::Open);
    assert!(!c.has_reservation("s1"));
    let stats = c.stats();
    assert_eq!((stats.revocations, stats.idle_engine_yields), (1, 1));
    c.check_invariants().unwrap();
}

#[test]
fn a_busy_engine_keeps_the_usual_yield_schedule() {
    // One request running, or one waiting that the gate does not hold: the engine has work,
    // and s1 holds its room until the floor (31 s), as with no counts at all.
    for (running, waiting) in [(1, 0), (0, 1)] {
        let mut c = core();
        one_turn(&mut c, "s1", 50, 0.0, 1.0);
        let id = c.begin("s2", 50 * BS, 0, true, 2.0);
        assert_eq!(
            drive_queues(&mut c, id, 2.0, running, waiting),
            Action::Wait { until: 7.0 },
            "the 5 s poll comes first"
        );
        assert_eq!(
            drive_queues(&mut c, id, 20.0, running, waiting),
            Action::Wait { until: 25.0 }
        );
        assert!(c.has_reservation("s1"));
        // The engine went idle by the head's next poll: the room yields at once (idle 24 s;
        // four of its turns are 4 s).
        assert_eq!(
            admitted(drive_queues(&mut c, id, 25.0, 0, 0)).reason,
            Reason::Open
        );
        assert_eq!(c.stats().idle_engine_yields, 1);
        c.check_invariants().unwrap();
    }
}

#[test]
fn a_yield_the_usual_rule_allows_is_not_counted_as_an_idle_engine_one() {
    let mut c = core();
    one_turn(&mut c, "s1", 50, 0.0, 1.0);
    let id = c.begin("s2", 50 * BS, 0, true, 2.0);
    assert!(waits(&drive_queues(&mut c, id, 2.0, 0, 0)));
    assert_eq!(
        admitted(drive_queues(&mut c, id, 31.0, 0, 0)).reason,
        Reason::Open
    );
    let stats = c.stats();
    assert_eq!((stats.revocations, stats.idle_engine_yields), (1, 0));
}

#[test]
fn a_session_with_slow_turns_holds_its_room_for_eight_of_them() {
    let mut c = core();
    // s1's two turns took 4 s and 6 s: a mean of 5 s, so it yields after 40 s idle (> 30 s).
    one_turn(&mut c, "s1", 40, 0.0, 4.0);
    one_turn(&mut c, "s1", 50, 10.0, 6.0);
    let (id, action) = turn(&mut c, "s2", 50, 17.0);
    assert!(waits(&action), "{action:?}");
    // Idle since 16 s: at 50 s it has been idle 34 s, past the floor but not 8 turn times.
    let action = drive(&mut c, id, 50.0);
    assert_eq!(action, Action::Wait { until: 55.0 });
    assert!(c.has_reservation("s1"));
    let a = admitted(drive(&mut c, id, 56.0));
    assert_eq!(a.reason, Reason::Open);
    assert!(!c.has_reservation("s1"));
    c.check_invariants().unwrap();
}

#[test]
fn a_session_whose_turns_outlast_the_window_never_yields_before_it_ends() {
    let mut c = GateCore::new(GateConfig {
        idle_grace_sec: 20.0,
        ..GateConfig::default()
    })
    .unwrap();
    // 8 × 3 s = 24 s > the 20 s window: the window's end comes first, as without yielding.
    one_turn(&mut c, "s1", 50, 0.0, 3.0);
    let (id, action) = turn(&mut c, "s2", 50, 4.0);
    assert!(waits(&action), "{action:?}");
    let action = drive(&mut c, id, 22.0);
    assert!(waits(&action), "{action:?}");
    assert_eq!(c.stats().revocations, 0);
    let a = admitted(drive(&mut c, id, 23.0));
    assert_eq!(a.reason, Reason::Open);
    assert_eq!(c.stats().grace_expired, 1);
    assert_eq!(c.stats().revocations, 0);
    c.check_invariants().unwrap();
}

#[test]
fn nothing_yields_unless_it_makes_the_head_fit() {
    let mut c = core();
    one_turn(&mut c, "s1", 30, 0.0, 1.0);
    // s2 is in flight: a reservation in flight never yields.
    let _held = lease(&mut c, "s2", 40, 1.0);
    // s3 needs 50: without s1's 30 it would still be 40 + 50 = 90 > 85, so s1 keeps its room.
    let (id3, action) = turn(&mut c, "s3", 50, 40.0);
    assert!(waits(&action), "{action:?}");
    assert!(c.has_reservation("s1"));
    assert_eq!(c.stats().revocations, 0);
    // s3 gives up; s4 needs 30: without s1 it is 40 + 30 = 70 <= 85, so s1 yields.
    assert!(c.cancel(id3, 40.0));
    let a = admitted(turn(&mut c, "s4", 30, 41.0).1);
    assert_eq!(a.reason, Reason::Open);
    assert!(!c.has_reservation("s1"));
    assert!(c.has_reservation("s2"));
    assert_eq!(c.stats().revocations, 1);
    c.check_invariants().unwrap();
}

/// `sessions` sessions of 5 blocks each take turns that last 1 s with `gap` s between them,
/// `rounds` times, so the core learns the return gaps; all start at `t0`. Returns the time the
/// last turn was released.
fn learn_gaps(c: &mut GateCore, sessions: usize, rounds: usize, gap: f64, t0: f64) -> f64 {
    let mut now = t0;
    for _ in 0..rounds {
        for s in 0..sessions {
            one_turn(c, &format!("g{s}"), 5, now, 1.0);
        }
        now += 1.0 + gap;
    }
    now - gap
}

#[test]
fn a_session_idle_for_twice_the_usual_return_gap_yields_before_half_the_window() {
    let mut c = core();
    // Eight sessions come back 2 s after each turn: the 90th-percentile gap is 2 s.
    let end = learn_gaps(&mut c, 8, 3, 2.0, 0.0);
    for s in 0..8 {
        assert!(c.finish_session(&format!("g{s}"), end));
    }
    // s1 never calls finish (a plain client): idle from `end + 1`.
    one_turn(&mut c, "s1", 50, end, 1.0);
    let (id, action) = turn(&mut c, "s2", 50, end + 1.5);
    // Woken when s1 has been idle 2 x 2 s, long before the 30 s floor of the grace window.
    assert_eq!(action, Action::Wait { until: end + 5.0 });
    assert!(waits(&drive(&mut c, id, end + 4.9)));
    let a = admitted(drive(&mut c, id, end + 5.0));
    assert_eq!(a.reason, Reason::Open);
    assert!(!c.has_reservation("s1"));
    c.check_invariants().unwrap();
}

#[test]
fn a_session_back_within_the_usual_gap_keeps_its_room() {
    let mut c = core();
    let end = learn_gaps(&mut c, 8, 3, 2.0, 0.0);
    for s in 0..8 {
        assert!(c.finish_session(&format!("g{s}"), end));
    }
    one_turn(&mut c, "s1", 50, end, 1.0);
    let (id, _) = turn(&mut c, "s2", 50, end + 1.5);
    // s1 returns 1.5 s after its release (under 2 x 2 s): still reserved, admitted at once
    // (as a reserved session: s2 waits ahead of it in line for free room).
    let a = admitted(turn(&mut c, "s1", 55, end + 2.5).1);
    assert_eq!(a.reason, Reason::ReservedSession);
    assert!(!a.revoked);
    assert!(waits(&drive(&mut c, id, end + 4.0)));
    assert_eq!(c.stats().revocations, 0);
    c.check_invariants().unwrap();
}

#[test]
fn an_idle_room_that_may_yield_goes_before_a_live_reservation_is_revoked() {
    let mut c = core();
    let end = learn_gaps(&mut c, 8, 3, 2.0, 0.0);
    for s in 0..8 {
        assert!(c.finish_session(&format!("g{s}"), end));
    }
    // old: 40 blocks, idle from end + 1 and gone (never returns). young: 40 blocks.
    one_turn(&mut c, "old", 40, end, 1.0);
    one_turn(&mut c, "young", 40, end, 1.5);
    // young comes back at end + 10 (old idle 9 s > 2 x 2 s) grown to 60: 40 + 60 > 85 would
    // revoke young, the youngest; instead old's idle room yields and young keeps its own.
    let a = admitted(turn(&mut c, "young", 60, end + 10.0).1);
    assert!(!a.revoked, "{a:?}");
    assert!(!c.has_reservation("old"));
    assert!(c.has_reservation("young"));
    assert_eq!(c.stats().revocations, 1);
    assert_eq!(c.stats().committed_blocks, 60);
    c.check_invariants().unwrap();
}

#[test]
fn sessions_that_lost_their_room_still_count_their_gap_when_they_return() {
    let mut c = core();
    // The usual gap is 2 s (16 gaps) ...
    let end = learn_gaps(&mut c, 8, 3, 2.0, 0.0);
    for s in 0..8 {
        assert!(c.finish_session(&format!("g{s}"), end));
    }
    // ... but two sessions stay away past their 60 s window and come back after 70 s: their
    // gaps count although they lost their room, and move the 90th percentile to 70 s.
    one_turn(&mut c, "d1", 5, end, 1.0);
    one_turn(&mut c, "d2", 5, end, 1.0);
    let back = end + 71.0;
    assert_eq!(c.expire(back), 2);
    one_turn(&mut c, "d1", 5, back, 1.0);
    one_turn(&mut c, "d2", 5, back, 1.0);
    assert!(c.finish_session("d1", back + 1.0));
    assert!(c.finish_session("d2", back + 1.0));
    // So an idle s1 holds its room for the usual half window (30 s), not 2 x 2 s.
    one_turn(&mut c, "s1", 50, back + 2.0, 1.0);
    let (_, action) = turn(&mut c, "s2", 50, back + 4.0);
    // (Woken by the 5 s poll, not when s1 may yield: with only the 2 s gaps that would be at
    // back + 3 + 4.)
    assert_eq!(action, Action::Wait { until: back + 9.0 });
    c.check_invariants().unwrap();
}

#[test]
fn idle_engine_turns_zero_turns_the_idle_engine_rule_off() {
    let mut c = GateCore::new(GateConfig {
        idle_engine_turns: 0,
        ..GateConfig::default()
    })
    .unwrap();
    one_turn(&mut c, "s1", 50, 0.0, 1.0);
    let id = c.begin("s2", 50 * BS, 0, true, 2.0);
    // The engine idles, yet s1 keeps its room until the floor (idle since 1 s: 31 s).
    assert_eq!(
        drive_queues(&mut c, id, 2.0, 0, 0),
        Action::Wait { until: 7.0 }
    );
    assert!(waits(&drive_queues(&mut c, id, 30.0, 0, 0)));
    assert!(c.has_reservation("s1"));
    assert_eq!(
        admitted(drive_queues(&mut c, id, 31.0, 0, 0)).reason,
        Reason::Open
    );
    assert_eq!(c.stats().idle_engine_yields, 0);
}
