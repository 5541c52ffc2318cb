//! The committed policy's two learned rules (module docs of `gate::core`, "Growth" and "Yielding
//! idle room"), under a deterministic clock: a reservation covers three more turns of growth,
//! and a reservation idle for eight mean turn times gives its room to the head of the queue.
use session_gate::gate::testing::usage_report;
use session_gate::gate::{
    Action, Admission, AttemptId, GateConfig, GateCore, LeaseId, PrefixReport, Reason,
};

/// 100 blocks of 16 tokens: the watermark line (0.85) is at 85 blocks.
const BLOCKS: u64 = 100;
const BS: usize = 16;

fn core() -> GateCore {
    GateCore::new(GateConfig::default()).unwrap()
}

/// Polls `id` at `now` (usage 0.1, no resident prefix) until it is admitted or told to wait.
fn drive(core: &mut GateCore, id: AttemptId, now: f64) -> Action {
    for _ in 0..16 {
        match core.poll(id, now).unwrap() {
            Action::ProbeUsage => core
                .on_usage(id, Ok(usage_report(0.1, BLOCKS, BS as u64)), now)
                .unwrap(),
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

#[test]
fn a_reservation_covers_three_more_turns_of_its_last_growth() {
    let mut c = core();
    let l = lease(&mut c, "s1", 10, 0.0);
    // Nothing has grown yet: the first turn reserves its working set.
    assert_eq!(c.stats().committed_blocks, 10);
    c.release(l, 1.0);
    let a = admitted(turn(&mut c, "s1", 15, 2.0).1);
    // Grew 5 blocks: 15 + 3 x 5 reserved; the admission still reports the real working set.
    assert_eq!(a.working_set_blocks, Some(15));
    assert_eq!(c.stats().committed_blocks, 30);
    // A new session is expected to grow by the mean growth (5): 10 + 15.
    admitted(turn(&mut c, "s2", 10, 3.0).1);
    assert_eq!(c.stats().committed_blocks, 55);
    // 20 + 15 no longer fits under the line (55 + 35 > 85), though 20 alone would (75).
    let (_, action) = turn(&mut c, "s3", 20, 4.0);
    assert!(waits(&action), "{action:?}");
    c.check_invariants().unwrap();
}

#[test]
fn a_grown_session_is_revoked_when_its_expected_growth_no_longer_fits() {
    let mut c = core();
    let l1 = lease(&mut c, "s1", 30, 0.0);
    let l2 = lease(&mut c, "s2", 10, 0.0);
    c.release(l1, 1.0);
    c.release(l2, 1.0);
    // s2 grows 10 blocks: 20 + 3 x 10 = 50 reserved behind s1's 30 is 80 <= 85: kept.
    let l2 = admitted(turn(&mut c, "s2", 20, 2.0).1).lease;
    assert_eq!(c.stats().committed_blocks, 80);
    c.release(l2, 3.0);
    // Another 10: 30 + 3 x 10 = 60 behind 30 is 90 > 85: revoked, although its working set
    // alone (30 + 30 = 60) would fit.
    let (_, action) = turn(&mut c, "s2", 30, 4.0);
    assert!(waits(&action), "{action:?}");
    assert_eq!(c.stats().revocations, 1);
    assert!(!c.has_reservation("s2"));
    c.check_invariants().unwrap();
}

#[test]
fn an_idle_reservation_yields_to_the_head_of_the_queue_after_eight_turn_times() {
    let mut c = core();
    let l = lease(&mut c, "s1", 50, 0.0);
    // The first lease takes 1 s: the mean turn time is 1 s.
    c.release(l, 1.0);
    let (id, action) = turn(&mut c, "s2", 50, 2.0);
    assert!(waits(&action), "{action:?}");
    // Idle 6 s (< 8 turn times): s1 keeps its room.
    let action = drive(&mut c, id, 7.0);
    assert!(waits(&action), "{action:?}");
    assert!(c.has_reservation("s1"));
    // Idle 11 s at the next poll: s1's reservation yields and s2 takes the room, `open`.
    let a = admitted(drive(&mut c, id, 12.0));
    assert_eq!(a.reason, Reason::Open);
    assert!(!c.has_reservation("s1"));
    assert_eq!(c.stats().revocations, 1);
    assert_eq!(c.stats().committed_blocks, 50);
    c.check_invariants().unwrap();
}

#[test]
fn nothing_yields_unless_it_makes_the_head_fit() {
    let mut c = core();
    let l = lease(&mut c, "s1", 30, 0.0);
    c.release(l, 1.0);
    // s2 is in flight: an active reservation never yields.
    let _held = lease(&mut c, "s2", 40, 1.0);
    // s3 needs 50: without s1's 30 it would still be 40 + 50 = 90 > 85, so s1 keeps its room.
    let (id3, action) = turn(&mut c, "s3", 50, 20.0);
    assert!(waits(&action), "{action:?}");
    assert!(c.has_reservation("s1"));
    assert_eq!(c.stats().revocations, 0);
    // s3 gives up; s4 needs 30: without s1 it is 40 + 30 = 70 <= 85, so s1 yields.
    assert!(c.cancel(id3, 20.0));
    let a = admitted(turn(&mut c, "s4", 30, 21.0).1);
    assert_eq!(a.reason, Reason::Open);
    assert!(!c.has_reservation("s1"));
    assert_eq!(c.stats().revocations, 1);
    c.check_invariants().unwrap();
}
