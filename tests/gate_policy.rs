//! The committed policy's learned rule (module docs of `gate::core`, "Yielding idle room"), under
//! a deterministic clock: a reservation idle for eight mean turn times gives its room to the head
//! of the queue, and only when that makes it fit.
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

#[test]
fn an_idle_window_never_yields_within_one_poll_interval() {
    let mut c = core();
    // Released at once: the mean turn time is 0, so 8 turn times alone would be no wait at all.
    let l = lease(&mut c, "s1", 50, 0.0);
    c.release(l, 0.0);
    let (id, action) = turn(&mut c, "s2", 50, 1.0);
    assert!(waits(&action), "{action:?}");
    assert!(c.has_reservation("s1"));
    // At its next poll (wait_poll_sec = 5 s later) s1 has been idle 6 s >= 5 s: it yields.
    let a = admitted(drive(&mut c, id, 6.0));
    assert_eq!(a.reason, Reason::Open);
    assert!(!c.has_reservation("s1"));
    c.check_invariants().unwrap();
}
