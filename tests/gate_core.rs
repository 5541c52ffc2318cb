//! The sans-IO core under a deterministic clock: every branch of the decision tree and every
//! reason, ownership windows, revocation, FIFO, preemption, cancellation and counters.
use session_gate::Error;
use session_gate::gate::testing::usage_report;
use session_gate::gate::{
    Action, Admission, AttemptId, GateConfig, GateCore, PrefixReport, Pressure, ProbeKind, Reason,
    UsageReport,
};

/// 100 blocks of 16 tokens: the watermark line (0.85) is at 85 blocks.
const BLOCKS: u64 = 100;
const BS: usize = 16;

fn usage(u: f64) -> Result<UsageReport, String> {
    Ok(usage_report(u, BLOCKS, BS as u64))
}

fn hit(h: f64) -> Result<PrefixReport, String> {
    Ok(PrefixReport {
        hit_ratio: h,
        ..Default::default()
    })
}

fn core() -> GateCore {
    GateCore::new(GateConfig::default()).unwrap()
}

fn engine_core() -> GateCore {
    GateCore::new(GateConfig {
        pressure: Pressure::Engine,
        ..Default::default()
    })
    .unwrap()
}

/// What one attempt's driver saw until the core stopped asking for probes.
#[derive(Debug)]
struct Run {
    action: Action,
    usage_probes: u32,
    prefix_probes: u32,
}

impl Run {
    fn admitted(&self) -> &Admission {
        match &self.action {
            Action::Admit(a) => a,
            other => panic!("expected an admission, got {other:?}"),
        }
    }

    fn reason(&self) -> Reason {
        self.admitted().reason
    }

    fn waits(&self) -> f64 {
        match self.action {
            Action::Wait { until } => until,
            ref other => panic!("expected a wait, got {other:?}"),
        }
    }
}

/// Polls `id` at `now`, answering probes with `u` and `p`, until it is admitted, told to wait
/// or preempted.
fn drive(
    core: &mut GateCore,
    id: AttemptId,
    now: f64,
    u: Result<UsageReport, String>,
    p: Result<PrefixReport, String>,
) -> Run {
    let (mut usage_probes, mut prefix_probes) = (0, 0);
    for _ in 0..16 {
        match core.poll(id, now).unwrap() {
            Action::ProbeUsage => {
                usage_probes += 1;
                core.on_usage(id, u.clone(), now).unwrap();
            }
            Action::ProbePrefix => {
                prefix_probes += 1;
                core.on_prefix(id, p.clone(), now).unwrap();
            }
            action => {
                return Run {
                    action,
                    usage_probes,
                    prefix_probes,
                };
            }
        }
    }
    panic!("attempt {id:?} kept asking for probes");
}

/// `blocks` KV blocks of prompt (no max_tokens).
fn tokens(blocks: usize) -> usize {
    blocks * BS
}

/// Begins and drives an attempt with low usage and no resident prefix.
fn turn(core: &mut GateCore, session: &str, blocks: usize, retain: bool, now: f64) -> Run {
    let id = core.begin(session, tokens(blocks), 0, retain, now);
    drive(core, id, now, usage(0.1), hit(0.0))
}

fn lease_of(run: &Run) -> session_gate::gate::LeaseId {
    run.admitted().lease
}

#[test]
fn open_when_nothing_is_committed_and_every_admission_reserves() {
    let mut c = core();
    let run = turn(&mut c, "s1", 20, false, 0.0);
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.prefix_probes, 0);
    let a = run.admitted();
    assert!(a.reserved);
    assert_eq!(a.working_set_blocks, Some(20));
    assert_eq!(a.usage, Some(0.1));
    assert!((a.pressure.unwrap() - 0.2).abs() < 1e-9);
    assert_eq!(c.stats().committed_blocks, 20);
    assert!(c.has_reservation("s1"));
}

#[test]
fn working_set_counts_prompt_and_max_tokens_in_whole_blocks() {
    let mut c = core();
    let id = c.begin("s", 17, 16, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.0), hit(0.0));
    assert_eq!(run.admitted().working_set_blocks, Some(3));
    assert_eq!(c.stats().committed_blocks, 3);
}

#[test]
fn without_max_tokens_the_working_set_counts_default_max_tokens() {
    // A plain acquire(session_id, prompt_ids): 17 prompt tokens + the default 256 output
    // tokens, in blocks of 16, is 18 blocks.
    let mut c = core();
    assert_eq!(c.config().default_max_tokens, 256);
    let id = c.begin("s", 17, None, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.0), hit(0.0));
    assert_eq!(run.admitted().working_set_blocks, Some(18));
    let mut c = GateCore::new(GateConfig {
        default_max_tokens: 7,
        ..Default::default()
    })
    .unwrap();
    let id = c.begin("s", 17, None, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.0), hit(0.0));
    assert_eq!(run.admitted().working_set_blocks, Some(2));
}

#[test]
fn open_is_refused_when_committed_plus_working_set_would_cross_the_line() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let run = turn(&mut c, "cold", 6, false, 0.0);
    assert_eq!(run.prefix_probes, 1, "under pressure the prefix is probed");
    assert_eq!(run.waits(), 5.0);
    let run = turn(&mut c, "fits", 5, false, 0.0);
    assert!(
        matches!(run.action, Action::Wait { .. }),
        "a later cold session that would fit must not jump the queue"
    );
}

#[test]
fn usage_above_the_watermark_is_pressure_even_with_little_committed() {
    let mut c = core();
    let id = c.begin("s1", tokens(10), 0, false, 0.0);
    let first = drive(&mut c, id, 0.0, usage(0.0), hit(0.0));
    assert_eq!(first.reason(), Reason::Open);
    let id = c.begin("s2", tokens(10), 0, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.9), hit(0.0));
    assert_eq!(run.prefix_probes, 1);
    assert!(matches!(run.action, Action::Wait { .. }));
}

#[test]
fn resident_prefix_admits_a_cold_session_under_pressure() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let id = c.begin("hot", tokens(20), 0, false, 1.0);
    let run = drive(&mut c, id, 1.0, usage(0.5), hit(0.8));
    assert_eq!(run.reason(), Reason::ResidentPrefix);
    assert_eq!(run.admitted().hit_ratio, Some(0.8));
    assert!(run.admitted().reserved);
    assert_eq!(c.stats().committed_blocks, 100);
}

/// A probe answer of a 320-token prompt with `gpu` tokens GPU-resident and `offloaded` more in
/// the host tier (`None`: no readable tier).
fn tiered(gpu: u64, offloaded: Option<u64>) -> Result<PrefixReport, String> {
    Ok(PrefixReport {
        hit_ratio: gpu as f64 / 320.0,
        hit_blocks: gpu / BS as u64,
        hit_tokens: gpu,
        prompt_tokens: 320,
        offloaded_tokens: offloaded,
    })
}

#[test]
fn a_prefix_in_the_host_tier_is_admitted_as_offloaded_prefix_when_it_fits() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    // 32 GPU-resident + 256 offloaded of 320 = 0.9 >= 0.7: admitted, and committed.
    let id = c.begin("warm", tokens(20), 0, false, 1.0);
    let run = drive(&mut c, id, 1.0, usage(0.5), tiered(32, Some(256)));
    assert_eq!(run.reason(), Reason::OffloadedPrefix);
    assert_eq!(run.admitted().hit_ratio, Some(0.1));
    assert!(run.admitted().reserved);
    assert_eq!(c.stats().committed_blocks, 100);
    assert_eq!(c.stats().admitted(Reason::OffloadedPrefix), 1);
}

#[test]
fn offloaded_prefix_needs_the_tier_the_threshold_and_room() {
    // No tier: the same GPU hit waits, as before tiers existed.
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let id = c.begin("warm", tokens(20), 0, false, 1.0);
    let run = drive(&mut c, id, 1.0, usage(0.5), tiered(32, None));
    assert!(matches!(run.action, Action::Wait { .. }));
    // Too little in the tier: (32 + 160) / 320 = 0.6 < 0.7.
    let id = c.begin("lukewarm", tokens(20), 0, false, 1.0);
    let run = drive(&mut c, id, 1.0, usage(0.5), tiered(32, Some(160)));
    assert!(matches!(run.action, Action::Wait { .. }));
    // Enough in the tier but no room in the whole cache: 90 + 11 > 100.
    let mut c = core();
    turn(&mut c, "big", 90, false, 0.0);
    let id = c.begin("warm", tokens(11), 0, false, 1.0);
    let run = drive(&mut c, id, 1.0, usage(0.5), tiered(0, Some(320)));
    assert!(matches!(run.action, Action::Wait { .. }));
}

#[test]
fn a_resident_prefix_stays_resident_prefix_with_a_tier() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let id = c.begin("hot", tokens(20), 0, false, 1.0);
    let run = drive(&mut c, id, 1.0, usage(0.5), tiered(256, Some(64)));
    assert_eq!(run.reason(), Reason::ResidentPrefix);
}

#[test]
fn resident_prefix_needs_the_working_set_to_fit_in_the_whole_cache() {
    let mut c = core();
    turn(&mut c, "big", 90, false, 0.0);
    let id = c.begin("hot", tokens(11), 0, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.5), hit(1.0));
    assert!(matches!(run.action, Action::Wait { .. }));
}

#[test]
fn a_hit_ratio_below_the_threshold_waits() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let id = c.begin("lukewarm", tokens(10), 0, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.5), hit(0.79));
    assert!(matches!(run.action, Action::Wait { .. }));
}

#[test]
fn an_erroring_prefix_probe_is_a_miss_that_probes_again_next_cycle() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let id = c.begin("s", tokens(10), 0, false, 0.0);
    let run = drive(
        &mut c,
        id,
        0.0,
        usage(0.5),
        Err("engine said unavailable".into()),
    );
    assert_eq!(run.prefix_probes, 1);
    assert_eq!(
        run.waits(),
        5.0,
        "committed mode waits instead of failing open"
    );
    // The next cycle asks again; an answer that finds the prefix admits it.
    let run = drive(&mut c, id, 5.0, usage(0.5), hit(0.9));
    assert_eq!((run.usage_probes, run.prefix_probes), (1, 1));
    assert_eq!(run.reason(), Reason::ResidentPrefix);
    assert_eq!(c.stats().admitted(Reason::PrefixProbeUnavailable), 0);
}

#[test]
fn engine_mode_fails_open_when_the_prefix_probe_errors() {
    let mut c = engine_core();
    let id = c.begin("s", tokens(10), 0, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.9), Err("no engine half".into()));
    assert_eq!(run.reason(), Reason::PrefixProbeUnavailable);
    assert_eq!(run.admitted().hit_ratio, None);
}

#[test]
fn a_timed_out_prefix_probe_waits_until_room_frees() {
    let mut c = core();
    let big = turn(&mut c, "big", 80, false, 0.0);
    let id = c.begin("s", tokens(10), 0, false, 0.0);
    assert_eq!(c.poll(id, 0.0).unwrap(), Action::ProbeUsage);
    c.on_usage(id, usage(0.5), 0.0).unwrap();
    assert_eq!(c.poll(id, 0.0).unwrap(), Action::ProbePrefix);
    c.record_probe(ProbeKind::Prefix, 2.0, false);
    c.on_prefix(id, Err("timed out after 2 s".into()), 2.0)
        .unwrap();
    assert!(matches!(c.poll(id, 2.0).unwrap(), Action::Wait { .. }));
    assert_eq!(c.stats().probe(ProbeKind::Prefix).failures, 1);
    // The slow engine still releases turns: the freed room admits the waiter, probes or not.
    c.release(lease_of(&big), 3.0);
    c.finish_session("big", 3.0);
    let run = drive(&mut c, id, 3.0, usage(0.5), Err("timed out".into()));
    assert_eq!(run.prefix_probes, 0);
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.admitted().wait_sec, 3.0);
}

#[test]
fn a_malformed_prefix_report_counts_as_unavailable() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let id = c.begin("s", tokens(10), 0, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.5), hit(f64::NAN));
    assert!(matches!(run.action, Action::Wait { .. }), "a miss");
    let mut c = engine_core();
    let id = c.begin("s", tokens(10), 0, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.9), hit(f64::NAN));
    assert_eq!(run.reason(), Reason::PrefixProbeUnavailable);
}

#[test]
fn reserved_session_reenters_without_a_prefix_probe() {
    let mut c = core();
    let first = turn(&mut c, "agent", 20, true, 0.0);
    assert!(c.release(lease_of(&first), 1.0));
    assert!(
        c.has_reservation("agent"),
        "release opens an idle grace window"
    );
    assert_eq!(c.stats().reservations_idle, 1);
    turn(&mut c, "other", 60, false, 1.5);
    // Now 20 + 60 committed; the tool-result turn grows to 30 blocks: 90 > 85 is pressure.
    let id = c.begin("agent", tokens(30), 0, true, 2.0);
    let run = drive(&mut c, id, 2.0, usage(0.5), hit(0.0));
    assert_eq!(run.reason(), Reason::ReservedSession);
    assert_eq!(run.prefix_probes, 0);
    assert_eq!(run.admitted().wait_sec, 0.0);
    assert_eq!(c.stats().reservations_idle, 0, "back in flight");
    assert_eq!(c.stats().committed_blocks, 90);
}

#[test]
fn a_reserved_session_without_pressure_is_admitted_open() {
    let mut c = core();
    let first = turn(&mut c, "agent", 20, true, 0.0);
    c.release(lease_of(&first), 1.0);
    let run = turn(&mut c, "agent", 25, true, 2.0);
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(
        c.stats().reservations_held,
        1,
        "the same reservation is renewed"
    );
    assert_eq!(c.stats().committed_blocks, 25);
}

#[test]
fn release_without_retain_drops_the_reservation() {
    let mut c = core();
    let run = turn(&mut c, "s", 20, false, 0.0);
    assert!(c.release(lease_of(&run), 1.0));
    assert!(!c.has_reservation("s"));
    let s = c.stats();
    assert_eq!(
        (s.reservations_held, s.committed_blocks, s.sessions),
        (0, 0, 0)
    );
}

#[test]
fn a_waiter_is_admitted_open_after_a_release() {
    let mut c = core();
    let big = turn(&mut c, "big", 80, false, 0.0);
    let id = c.begin("cold", tokens(20), 0, false, 1.0);
    let until = drive(&mut c, id, 1.0, usage(0.5), hit(0.0)).waits();
    assert_eq!(until, 6.0);
    let epoch = c.epoch();
    assert_eq!(
        c.poll(id, 2.0).unwrap(),
        Action::Wait { until },
        "nothing changed yet"
    );
    c.release(lease_of(&big), 3.0);
    assert!(c.epoch() > epoch, "a release tells drivers to wake waiters");
    let run = drive(&mut c, id, 3.0, usage(0.5), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.admitted().wait_sec, 2.0);
    assert_eq!(c.stats().waiting, 0);
}

#[test]
fn a_waiter_looks_again_after_wait_poll_sec() {
    let mut c = engine_core();
    let id = c.begin("s", tokens(10), 0, false, 0.0);
    let until = drive(&mut c, id, 0.0, usage(0.9), hit(0.0)).waits();
    assert_eq!(until, 5.0);
    assert_eq!(c.poll(id, 4.9).unwrap(), Action::Wait { until: 5.0 });
    let run = drive(&mut c, id, 5.0, usage(0.2), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.usage_probes, 1);
}

#[test]
fn finish_session_ends_the_window_and_wakes_a_waiter() {
    let mut c = core();
    let agent = turn(&mut c, "agent", 80, true, 0.0);
    c.release(lease_of(&agent), 1.0);
    let id = c.begin("cold", tokens(20), 0, false, 1.0);
    drive(&mut c, id, 1.0, usage(0.0), hit(0.0)).waits();
    let epoch = c.epoch();
    assert!(c.finish_session("agent", 2.0));
    assert!(c.epoch() > epoch);
    assert!(!c.finish_session("agent", 2.0), "nothing left to finish");
    assert_eq!(c.poll(id, 2.0).unwrap(), Action::ProbeUsage);
    let run = drive(&mut c, id, 2.0, usage(0.0), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    let s = c.stats();
    assert_eq!((s.sessions_finished, s.grace_expired), (1, 0));
}

#[test]
fn finishing_a_session_in_flight_leaves_its_lease_releasable() {
    let mut c = core();
    let run = turn(&mut c, "agent", 30, true, 0.0);
    assert!(c.finish_session("agent", 1.0));
    assert_eq!(c.stats().committed_blocks, 0);
    assert!(c.release(lease_of(&run), 2.0));
    assert!(
        !c.has_reservation("agent"),
        "an ended window does not come back"
    );
    assert_eq!(c.stats().sessions, 0);
}

#[test]
fn grace_expiry_is_purged_by_the_next_waiter() {
    let mut c = GateCore::new(GateConfig {
        wait_poll_sec: 100.0,
        ..Default::default()
    })
    .unwrap();
    let agent = turn(&mut c, "agent", 80, true, 0.0);
    c.release(lease_of(&agent), 10.0);
    assert_eq!(c.next_deadline(), Some(70.0));
    let id = c.begin("cold", tokens(20), 0, false, 20.0);
    let until = drive(&mut c, id, 20.0, usage(0.0), hit(0.0)).waits();
    assert_eq!(until, 70.0, "the head wakes when the grace window ends");
    assert!(c.has_reservation("agent"));
    assert_eq!(c.poll(id, 69.0).unwrap(), Action::Wait { until: 70.0 });
    let run = drive(&mut c, id, 70.0, usage(0.0), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert!(!c.has_reservation("agent"));
    let s = c.stats();
    assert_eq!(s.grace_expired, 1);
    assert_eq!(s.committed_blocks, 20);
}

#[test]
fn the_youngest_reservation_is_revoked_when_contexts_grow_past_the_line() {
    let mut c = core();
    let old = turn(&mut c, "old", 30, true, 0.0);
    let young = turn(&mut c, "young", 30, true, 1.0);
    c.release(lease_of(&old), 2.0);
    c.release(lease_of(&young), 2.0);
    // The young session grows to 60 blocks: 30 older + 60 = 90 > 85.
    let id = c.begin("young", tokens(60), 0, true, 3.0);
    let run = drive(&mut c, id, 3.0, usage(0.3), hit(0.0));
    assert!(
        matches!(run.action, Action::Wait { .. }),
        "waits like a cold session"
    );
    assert_eq!(run.prefix_probes, 1);
    assert!(!c.has_reservation("young"));
    assert_eq!(c.stats().revocations, 1);
    assert_eq!(c.stats().committed_blocks, 30);
    // The old one grows too, and keeps going: nothing older than it.
    let id_old = c.begin("old", tokens(50), 0, true, 4.0);
    let run = drive(&mut c, id_old, 4.0, usage(0.3), hit(0.0));
    assert_eq!(run.reason(), Reason::ReservedSession);
    assert!(!run.admitted().revoked);
    // When the old session finishes, the revoked one is admitted and says it was revoked.
    c.release(lease_of(&run), 5.0);
    c.finish_session("old", 5.0);
    let run = drive(&mut c, id, 5.0, usage(0.3), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert!(run.admitted().revoked);
    assert!(c.prometheus().contains("session_gate_revocations_total 1"));
}

#[test]
fn a_revoked_session_with_a_resident_prefix_rejoins_as_the_youngest() {
    let mut c = core();
    let old = turn(&mut c, "old", 30, true, 0.0);
    let young = turn(&mut c, "young", 30, true, 0.0);
    c.release(lease_of(&old), 1.0);
    c.release(lease_of(&young), 1.0);
    let id = c.begin("young", tokens(60), 0, true, 2.0);
    let run = drive(&mut c, id, 2.0, usage(0.3), hit(0.95));
    assert_eq!(run.reason(), Reason::ResidentPrefix);
    assert!(run.admitted().revoked);
    assert_eq!(c.stats().revocations, 1);
    assert_eq!(c.stats().committed_blocks, 90);
}

#[test]
fn a_revoked_session_keeps_its_place_in_line_ahead_of_later_arrivals() {
    let mut c = core();
    let old = turn(&mut c, "old", 30, true, 0.0);
    let mid = turn(&mut c, "mid", 30, true, 1.0);
    // "late" arrives after "mid" obtained its reservation: 60 + 40 > 85, it waits.
    let late = c.begin("late", tokens(40), 0, false, 2.0);
    drive(&mut c, late, 2.0, usage(0.1), hit(0.0)).waits();
    c.release(lease_of(&old), 3.0);
    c.release(lease_of(&mid), 3.0);
    // "mid" grows past the line and is revoked (30 older + 60 > 85) ...
    let id = c.begin("mid", tokens(60), 0, true, 4.0);
    drive(&mut c, id, 4.0, usage(0.1), hit(0.0)).waits();
    assert_eq!(c.stats().revocations, 1);
    // ... and waits in the place of its first admission: "late" would fit now (30 + 40 <= 85)
    // but may not take the room ahead of it.
    let run = drive(&mut c, late, 4.5, usage(0.1), hit(0.0));
    assert!(matches!(run.action, Action::Wait { .. }));
    assert_eq!(run.usage_probes, 0, "not the head: sleeps without probing");
    c.finish_session("old", 5.0);
    let run = drive(&mut c, id, 5.0, usage(0.1), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert!(run.admitted().revoked);
    // Then "late", which no longer fits next to it (60 + 40 > 85), waits on.
    assert!(matches!(
        drive(&mut c, late, 5.0, usage(0.1), hit(0.0)).action,
        Action::Wait { .. }
    ));
}

#[test]
fn the_oldest_reservation_is_never_revoked() {
    let mut c = core();
    let old = turn(&mut c, "old", 10, true, 0.0);
    c.release(lease_of(&old), 1.0);
    // Alone past the line: nobody older to yield to.
    let run = turn(&mut c, "old", 95, true, 2.0);
    assert_eq!(run.reason(), Reason::ReservedSession);
    assert_eq!(c.stats().revocations, 0);
}

#[test]
fn a_later_waiter_does_not_jump_an_earlier_blocked_one() {
    let mut c = core();
    let holder = turn(&mut c, "holder", 60, false, 0.0);
    let a = c.begin("a", tokens(40), 0, false, 1.0);
    drive(&mut c, a, 1.0, usage(0.0), hit(0.0)).waits();
    let b = c.begin("b", tokens(10), 0, false, 2.0);
    let run = drive(&mut c, b, 2.0, usage(0.0), hit(0.0));
    assert!(
        matches!(run.action, Action::Wait { .. }),
        "b would fit (60 + 10 <= 85) but a is ahead"
    );
    assert_eq!(c.stats().waiting, 2);
    c.release(lease_of(&holder), 3.0);
    // b is woken too but is not the head: it sleeps again without probing.
    let run_b = drive(&mut c, b, 3.0, usage(0.0), hit(0.0));
    assert_eq!(run_b.usage_probes, 0);
    assert!(matches!(run_b.action, Action::Wait { .. }));
    let run_a = drive(&mut c, a, 3.0, usage(0.0), hit(0.0));
    assert_eq!(run_a.reason(), Reason::Open);
    // a leaving the head of the queue wakes b, which now fits next to a.
    let run_b = drive(&mut c, b, 3.0, usage(0.0), hit(0.0));
    assert_eq!(run_b.reason(), Reason::Open);
    assert_eq!(run_b.usage_probes, 1);
}

#[test]
fn a_resident_prefix_may_pass_a_blocked_cold_waiter() {
    let mut c = core();
    turn(&mut c, "holder", 60, false, 0.0);
    let a = c.begin("a", tokens(40), 0, false, 1.0);
    drive(&mut c, a, 1.0, usage(0.0), hit(0.0)).waits();
    let hot = c.begin("hot", tokens(10), 0, false, 2.0);
    let run = drive(&mut c, hot, 2.0, usage(0.0), hit(0.9));
    assert_eq!(run.reason(), Reason::ResidentPrefix);
}

#[test]
fn an_oversize_session_is_admitted_when_nothing_is_committed() {
    let mut c = core();
    let run = turn(&mut c, "huge", 120, false, 0.0);
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.admitted().working_set_blocks, Some(120));
}

#[test]
fn an_oversize_session_waits_for_the_committed_set_to_drain_and_goes_first() {
    let mut c = core();
    let small = turn(&mut c, "small", 10, false, 0.0);
    let huge = c.begin("huge", tokens(120), 0, false, 1.0);
    drive(&mut c, huge, 1.0, usage(0.0), hit(0.0)).waits();
    let later = c.begin("later", tokens(5), 0, false, 2.0);
    assert!(matches!(
        drive(&mut c, later, 2.0, usage(0.0), hit(0.0)).action,
        Action::Wait { .. }
    ));
    c.release(lease_of(&small), 3.0);
    let run = drive(&mut c, huge, 3.0, usage(0.0), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
}

#[test]
fn a_newer_attempt_preempts_one_about_to_probe_usage() {
    let mut c = core();
    let first = c.begin("s", tokens(10), 0, false, 0.0);
    let second = c.begin("s", tokens(11), 0, false, 0.5);
    assert_eq!(c.poll(first, 1.0).unwrap(), Action::Preempted);
    assert!(matches!(c.poll(first, 1.0), Err(Error::StaleHandle(_))));
    assert_eq!(c.num_preempted("s"), 1);
    let run = drive(&mut c, second, 1.0, usage(0.0), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.admitted().num_preempted, 1);
    c.check_invariants().unwrap();
}

#[test]
fn a_newer_attempt_preempts_one_about_to_probe_the_prefix() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let first = c.begin("s", tokens(10), 0, false, 0.0);
    assert_eq!(c.poll(first, 0.0).unwrap(), Action::ProbeUsage);
    c.on_usage(first, usage(0.5), 0.0).unwrap();
    c.begin("s", tokens(10), 0, false, 0.1);
    assert_eq!(c.poll(first, 0.1).unwrap(), Action::Preempted);
    assert_eq!(c.stats().preemptions, 1);
}

#[test]
fn a_prefix_answer_arriving_after_preemption_is_ignored() {
    let mut c = core();
    turn(&mut c, "big", 80, false, 0.0);
    let first = c.begin("s", tokens(10), 0, false, 0.0);
    c.poll(first, 0.0).unwrap();
    c.on_usage(first, usage(0.5), 0.0).unwrap();
    assert_eq!(c.poll(first, 0.0).unwrap(), Action::ProbePrefix);
    c.begin("s", tokens(10), 0, false, 0.1);
    c.on_prefix(first, hit(1.0), 0.2).unwrap();
    assert_eq!(c.poll(first, 0.2).unwrap(), Action::Preempted);
    assert_eq!(c.stats().admissions_total(), 1);
}

#[test]
fn a_newer_attempt_preempts_a_waiting_one_and_keeps_its_place_in_line() {
    let mut c = core();
    let holder = turn(&mut c, "holder", 60, false, 0.0);
    let first = c.begin("s", tokens(40), 0, false, 1.0);
    drive(&mut c, first, 1.0, usage(0.0), hit(0.0)).waits();
    let other = c.begin("other", tokens(10), 0, false, 2.0);
    drive(&mut c, other, 2.0, usage(0.0), hit(0.0)).waits();
    let epoch = c.epoch();
    let retry = c.begin("s", tokens(20), 0, false, 3.0);
    assert!(
        c.epoch() > epoch,
        "the preempted waiter is woken to learn it lost"
    );
    assert_eq!(c.poll(first, 3.0).unwrap(), Action::Preempted);
    c.release(lease_of(&holder), 4.0);
    // The retry holds s's old place, ahead of `other`.
    assert!(matches!(
        drive(&mut c, other, 4.0, usage(0.0), hit(0.0)).action,
        Action::Wait { .. }
    ));
    let run = drive(&mut c, retry, 4.0, usage(0.0), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(
        run.admitted().wait_sec,
        1.0,
        "wait counts from the retry's begin"
    );
    let s = c.stats();
    assert_eq!((s.preemptions, s.pending, s.waiting), (1, 1, 1));
    c.check_invariants().unwrap();
}

#[test]
fn an_admitted_attempt_is_not_preempted() {
    let mut c = core();
    let first = turn(&mut c, "s", 10, false, 0.0);
    let retry = turn(&mut c, "s", 10, false, 1.0);
    assert_eq!(retry.reason(), Reason::Open);
    assert_eq!(c.stats().preemptions, 0);
    assert!(c.release(lease_of(&first), 2.0));
    assert!(c.has_reservation("s"), "the retry still holds it");
    assert!(c.release(lease_of(&retry), 2.0));
    assert!(!c.has_reservation("s"));
}

#[test]
fn double_release_is_a_no_op() {
    let mut c = core();
    let run = turn(&mut c, "s", 10, true, 0.0);
    assert!(c.release(lease_of(&run), 1.0));
    let before = c.stats();
    assert!(!c.release(lease_of(&run), 2.0));
    assert!(!c.release_dropped(lease_of(&run), 2.0));
    let after = c.stats();
    assert_eq!(before.leases_released, 1);
    assert_eq!(after, before);
}

#[test]
fn a_dropped_lease_is_counted_separately() {
    let mut c = core();
    let run = turn(&mut c, "s", 10, false, 0.0);
    assert!(c.release_dropped(lease_of(&run), 1.0));
    let s = c.stats();
    assert_eq!((s.leases_released, s.leases_dropped_unreleased), (0, 1));
}

#[test]
fn cancelling_a_waiter_leaves_no_trace_in_the_queue() {
    let mut c = core();
    let holder = turn(&mut c, "holder", 80, false, 0.0);
    let a = c.begin("a", tokens(20), 0, false, 1.0);
    drive(&mut c, a, 1.0, usage(0.0), hit(0.0)).waits();
    let b = c.begin("b", tokens(20), 0, false, 1.0);
    drive(&mut c, b, 1.0, usage(0.0), hit(0.0)).waits();
    let epoch = c.epoch();
    assert!(c.cancel(a, 2.0));
    assert!(c.epoch() > epoch, "the next in line is woken");
    assert!(!c.cancel(a, 2.0));
    assert!(matches!(c.poll(a, 2.0), Err(Error::StaleHandle(_))));
    let s = c.stats();
    assert_eq!(
        (s.waiting, s.pending, s.cancellations, s.sessions),
        (1, 1, 1, 2)
    );
    c.release(lease_of(&holder), 3.0);
    assert_eq!(
        drive(&mut c, b, 3.0, usage(0.0), hit(0.0)).reason(),
        Reason::Open
    );
    c.check_invariants().unwrap();
}

#[test]
fn max_wait_admits_a_waiter_past_its_limit() {
    let mut c = GateCore::new(GateConfig {
        max_wait_sec: Some(7.0),
        ..Default::default()
    })
    .unwrap();
    turn(&mut c, "holder", 80, false, 0.0);
    let id = c.begin("s", tokens(20), 0, false, 0.0);
    assert_eq!(drive(&mut c, id, 0.0, usage(0.0), hit(0.0)).waits(), 5.0);
    assert_eq!(drive(&mut c, id, 5.0, usage(0.0), hit(0.0)).waits(), 7.0);
    let run = drive(&mut c, id, 7.0, usage(0.0), hit(0.0));
    assert_eq!(run.reason(), Reason::MaxWait);
    assert_eq!(run.admitted().wait_sec, 7.0);
}

#[test]
fn without_max_wait_a_blocked_waiter_keeps_waiting() {
    let mut c = core();
    turn(&mut c, "holder", 80, false, 0.0);
    let id = c.begin("s", tokens(20), 0, false, 0.0);
    for t in [0.0, 5.0, 1000.0, 1e6] {
        assert!(matches!(
            drive(&mut c, id, t, usage(0.0), hit(0.0)).action,
            Action::Wait { .. }
        ));
    }
}

#[test]
fn a_stale_usage_reading_is_not_used_across_a_release() {
    let mut c = core();
    let holder = turn(&mut c, "holder", 80, false, 0.0);
    let id = c.begin("s", tokens(20), 0, false, 1.0);
    assert_eq!(c.poll(id, 1.0).unwrap(), Action::ProbeUsage);
    c.on_usage(id, usage(0.0), 1.0).unwrap();
    assert_eq!(c.poll(id, 1.0).unwrap(), Action::ProbePrefix);
    c.release(lease_of(&holder), 1.1);
    c.on_prefix(id, hit(0.0), 1.2).unwrap();
    assert_eq!(
        c.poll(id, 1.2).unwrap(),
        Action::ProbeUsage,
        "a release happened after the usage probe: look again instead of sleeping"
    );
    c.on_usage(id, usage(0.0), 1.2).unwrap();
    assert!(matches!(c.poll(id, 1.2).unwrap(), Action::Admit(a) if a.reason == Reason::Open));
}

#[test]
fn committed_mode_decides_on_the_committed_set_when_the_usage_probe_fails() {
    let mut c = core();
    turn(&mut c, "first", 10, false, 0.0);
    let id = c.begin("s", tokens(10), 0, false, 1.0);
    let run = drive(&mut c, id, 1.0, Err("engine gone".into()), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.admitted().usage, None);
}

#[test]
fn with_no_usage_ever_known_the_first_session_is_not_held() {
    let mut c = core();
    let id = c.begin("s", tokens(10), 0, false, 0.0);
    let run = drive(&mut c, id, 0.0, Err("engine starting".into()), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.admitted().working_set_blocks, None);
    // Once the block size is known the reservation is counted in blocks.
    turn(&mut c, "t", 5, false, 1.0);
    assert_eq!(c.stats().committed_blocks, 15);
}

#[test]
fn a_malformed_usage_report_counts_as_unavailable() {
    let mut c = engine_core();
    let id = c.begin("s", tokens(10), 0, false, 0.0);
    let bad = UsageReport {
        kv_cache_usage: 0.1,
        num_blocks: 0,
        ..Default::default()
    };
    let run = drive(&mut c, id, 0.0, Ok(bad), hit(0.9));
    assert_eq!(
        run.prefix_probes, 1,
        "engine mode assumes pressure without usage"
    );
    assert_eq!(run.reason(), Reason::ResidentPrefix);
}

#[test]
fn engine_mode_open_takes_no_reservation() {
    let mut c = engine_core();
    let run = turn(&mut c, "s", 95, true, 0.0);
    assert_eq!(run.reason(), Reason::Open);
    assert!(!run.admitted().reserved);
    c.release(lease_of(&run), 1.0);
    let s = c.stats();
    assert_eq!(
        (s.reservations_held, s.committed_blocks, s.sessions),
        (0, 0, 0)
    );
}

#[test]
fn engine_mode_compares_only_vllm_usage_with_the_watermark() {
    let mut c = engine_core();
    turn(&mut c, "a", 80, false, 0.0);
    // Far more than the line would allow in committed mode, but usage says 0.1.
    assert_eq!(turn(&mut c, "b", 80, false, 0.0).reason(), Reason::Open);
    let id = c.begin("c", tokens(1), 0, false, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.85), hit(0.0));
    assert!(
        matches!(run.action, Action::Wait { .. }),
        "usage >= watermark is pressure"
    );
}

#[test]
fn engine_mode_pressure_admission_with_retain_opens_a_window() {
    let mut c = engine_core();
    let id = c.begin("s", tokens(10), 0, true, 0.0);
    let run = drive(&mut c, id, 0.0, usage(0.9), hit(0.9));
    assert_eq!(run.reason(), Reason::ResidentPrefix);
    assert!(run.admitted().reserved);
    c.release(lease_of(&run), 1.0);
    let id = c.begin("s", tokens(12), 0, true, 2.0);
    let run = drive(&mut c, id, 2.0, usage(0.95), hit(0.0));
    assert_eq!(run.reason(), Reason::ReservedSession);
    assert_eq!(run.prefix_probes, 0);
    let id = c.begin("nr", tokens(10), 0, false, 2.0);
    let run = drive(&mut c, id, 2.0, usage(0.9), hit(0.9));
    assert!(!run.admitted().reserved, "no retain, no window");
}

#[test]
fn engine_mode_never_revokes() {
    let mut c = engine_core();
    for s in ["a", "b"] {
        let id = c.begin(s, tokens(40), 0, true, 0.0);
        let run = drive(&mut c, id, 0.0, usage(0.9), hit(0.9));
        c.release(lease_of(&run), 0.5);
    }
    let id = c.begin("b", tokens(90), 0, true, 1.0);
    let run = drive(&mut c, id, 1.0, usage(0.9), hit(0.0));
    assert_eq!(run.reason(), Reason::ReservedSession);
    assert_eq!(c.stats().revocations, 0);
}

#[test]
fn unknown_handles_are_refused_or_ignored() {
    let mut c = core();
    assert!(matches!(
        c.poll(AttemptId(42), 0.0),
        Err(Error::StaleHandle(_))
    ));
    assert!(matches!(
        c.on_usage(AttemptId(42), usage(0.0), 0.0),
        Err(Error::StaleHandle(_))
    ));
    assert!(!c.cancel(AttemptId(42), 0.0));
    assert!(!c.release(session_gate::gate::LeaseId(42), 0.0));
    assert!(!c.finish_session("nobody", 0.0));
    // An answer nobody asked for is ignored.
    let id = c.begin("s", 16, 0, false, 0.0);
    c.on_prefix(id, hit(1.0), 0.0).unwrap();
    assert_eq!(c.poll(id, 0.0).unwrap(), Action::ProbeUsage);
}

#[test]
fn stats_and_prometheus_report_reasons_waits_and_probes() {
    let mut c = core();
    let holder = turn(&mut c, "holder", 80, false, 0.0);
    let id = c.begin("cold", tokens(20), 0, false, 0.0);
    drive(&mut c, id, 0.0, usage(0.0), hit(0.0));
    c.release(lease_of(&holder), 3.0);
    drive(&mut c, id, 3.0, usage(0.0), hit(0.0));
    c.record_probe(ProbeKind::Usage, 0.0004, true);
    c.record_probe(ProbeKind::Prefix, 2.0, false);
    let s = c.stats();
    assert_eq!(s.admitted(Reason::Open), 2);
    assert_eq!(s.wait.count, 2);
    assert_eq!(s.wait.sum, 3.0);
    let text = c.prometheus();
    assert!(text.contains("session_gate_admissions_total{reason=\"open\"} 2"));
    assert!(text.contains("session_gate_admissions_total{reason=\"resident_prefix\"} 0"));
    assert!(text.contains("session_gate_wait_seconds_bucket{le=\"5\"} 2"));
    assert!(text.contains("session_gate_wait_seconds_bucket{le=\"2\"} 1"));
    assert!(text.contains("session_gate_wait_seconds_count 2"));
    assert!(text.contains("session_gate_probe_failures_total{probe=\"prefix\"} 1"));
    assert!(text.contains("session_gate_probe_seconds_bucket{probe=\"usage\",le=\"0.0005\"} 1"));
    assert!(text.contains("session_gate_leases_active 1"));
    assert!(text.contains("session_gate_committed_blocks 20"));
    for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
        let name = line.split_whitespace().nth(2).unwrap();
        assert!(name.starts_with("session_gate_"));
        assert_eq!(text.matches(&format!("# TYPE {name} ")).count(), 1);
    }
}

#[test]
fn session_state_is_dropped_once_nothing_refers_to_it() {
    let mut c = core();
    let runs: Vec<_> = (0..50)
        .map(|i| turn(&mut c, &format!("s{i}"), 1, true, 0.0))
        .collect();
    for r in &runs {
        c.release(lease_of(r), 1.0);
    }
    assert_eq!(c.stats().sessions, 50);
    c.expire(61.0);
    let s = c.stats();
    assert_eq!(
        (s.sessions, s.reservations_held, s.grace_expired),
        (0, 0, 50)
    );
    c.check_invariants().unwrap();
}

#[test]
fn a_running_lease_grows_its_commitment_and_never_shrinks_it() {
    // vLLM's streaming-input session: one request, each chunk extends its prompt.
    let mut c = core();
    let lease = lease_of(&turn(&mut c, "stream", 20, true, 0.0));
    assert_eq!(c.stats().committed_blocks, 20);
    assert!(c.grow_lease(lease, tokens(30) as u64 + 1));
    assert_eq!(c.stats().committed_blocks, 31, "whole blocks, rounded up");
    assert!(
        !c.grow_lease(lease, tokens(25) as u64),
        "a shorter chunk frees nothing"
    );
    assert_eq!(c.stats().committed_blocks, 31);
    // The grown set is what a cold newcomer is weighed against: 31 + 60 > the 85-block line.
    let id = c.begin("other", tokens(60), 0, false, 1.0);
    let waits = drive(&mut c, id, 1.0, usage(0.1), hit(0.0));
    assert!(matches!(waits.action, Action::Wait { .. }), "{waits:?}");
    // Released, the idle window keeps the grown set; the lease is gone for good.
    assert!(c.release(lease, 2.0));
    assert_eq!(c.stats().committed_blocks, 31);
    assert!(
        !c.grow_lease(lease, tokens(40) as u64),
        "a released lease grows nothing"
    );
    assert_eq!(c.stats().committed_blocks, 31);
    c.cancel(id, 2.0);
}

#[test]
fn a_lease_that_outlived_its_reservation_grows_nothing() {
    let mut c = core();
    let lease = lease_of(&turn(&mut c, "s", 10, true, 0.0));
    assert!(c.finish_session("s", 1.0));
    assert!(!c.grow_lease(lease, tokens(50) as u64));
    assert_eq!(c.stats().committed_blocks, 0);
    assert!(c.release(lease, 2.0));
}

/// A usage answer of an engine whose host KV tier holds `tier` GPU blocks.
fn usage_with_tier(u: f64, tier: u64) -> Result<UsageReport, String> {
    let mut r = usage_report(u, BLOCKS, BS as u64);
    r.offload_num_blocks = Some(tier);
    r.offload_used_blocks = Some(tier);
    Ok(r)
}

#[test]
fn the_gate_steps_aside_while_the_host_tier_holds_every_committed_working_set() {
    let mut c = core();
    turn(&mut c, "big", 80, true, 0.0);
    // 80 + 60 > the 85-block line and usage is over the watermark, but the tier holds 140.
    let id = c.begin("cold", tokens(60), 0, true, 1.0);
    let run = drive(&mut c, id, 1.0, usage_with_tier(0.95, 140), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert_eq!(run.prefix_probes, 0);
    assert_eq!(c.stats().committed_blocks, 140);
    // A returning session is counted once: 140 - 60 + 70 = 150 fits a 150-block tier.
    let id = c.begin("cold", tokens(70), 0, true, 2.0);
    let run = drive(&mut c, id, 2.0, usage_with_tier(0.95, 150), hit(0.0));
    assert_eq!(run.reason(), Reason::Open);
    assert!(!run.admitted().revoked);
}

#[test]
fn a_tier_too_small_for_the_committed_working_sets_leaves_the_gate_as_it_was() {
    let mut c = core();
    turn(&mut c, "big", 80, true, 0.0);
    // 80 + 60 = 140 > a 139-block tier: the decision tree as without a tier.
    let id = c.begin("cold", tokens(60), 0, true, 1.0);
    let run = drive(&mut c, id, 1.0, usage_with_tier(0.5, 139), hit(0.0));
    assert!(matches!(run.action, Action::Wait { .. }), "{run:?}");
    assert_eq!(run.prefix_probes, 1);
    c.cancel(id, 1.0);
}
