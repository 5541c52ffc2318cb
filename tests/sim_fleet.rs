//! The twin as a fleet (`session_gate::sim::fleet`) on 4 flat replicas: sessions stay home while
//! resident, hashing scatters nothing, a lost replica's sessions move, and placement by the gate
//! beats hashing when one replica is a straggler.
mod common;

use std::collections::{HashMap, HashSet};

use common::{flat_replica, session};
use session_gate::gate::GateConfig;
use session_gate::sim::driver::{ModeSpec, SessionSpec};
use session_gate::sim::fleet::policy::PlacementKind;
use session_gate::sim::fleet::{FleetOutput, FleetSpec, simulate_fleet};

/// 32 sessions of 6 turns (64 shared + 200 task tokens, 100 appended and 50 generated a turn,
/// 0.5 s tools): 1,164 tokens at most each, 32 of them well within 4 x 1,024 blocks of 16.
fn sessions() -> Vec<SessionSpec> {
    (0..32)
        .map(|i| {
            let mut turns = vec![(0, 50, 0.5)];
            turns.extend([(100, 50, 0.5); 5]);
            session(&format!("s{i}"), 64, 200, 0.0, &turns)
        })
        .collect()
}

fn fleet(placement: PlacementKind, mode: ModeSpec, fleet: FleetSpec) -> FleetOutput {
    let spec = FleetSpec { placement, ..fleet };
    simulate_fleet(sessions(), 7, || Ok(flat_replica(1024)), &mode, &spec).unwrap()
}

fn four() -> FleetSpec {
    FleetSpec {
        replicas: 4,
        placement: PlacementKind::Gate,
        straggler: None,
        lose: None,
    }
}

fn gate() -> ModeSpec {
    ModeSpec::Gate(GateConfig::default())
}

/// Per session: the replicas that served its turns.
fn homes(out: &FleetOutput) -> HashMap<usize, HashSet<usize>> {
    let mut homes: HashMap<usize, HashSet<usize>> = HashMap::new();
    for (rec, &r) in out.records.iter().zip(&out.served_by) {
        homes.entry(rec.session).or_default().insert(r);
    }
    homes
}

#[test]
fn resident_sessions_stay_home_under_the_gate_placement() {
    let out = fleet(PlacementKind::Gate, gate(), four());
    assert_eq!(out.records.len(), 32 * 6);
    assert!(
        homes(&out).values().all(|h| h.len() == 1),
        "a session moved"
    );
    let p = out.placement;
    assert_eq!((p.new, p.moves()), (32, 0));
    assert_eq!(
        p.resident,
        32 * 5,
        "every later turn found its prefix at home"
    );
    // Spread over the fleet: every replica served sessions.
    assert!(
        out.sessions_served.iter().all(|&n| n > 0),
        "{:?}",
        out.sessions_served
    );
}

#[test]
fn hashing_scatters_nothing_with_or_without_a_gate() {
    for mode in [ModeSpec::None, gate()] {
        let out = fleet(PlacementKind::Hash, mode, four());
        let homes = homes(&out);
        assert!(
            homes.values().all(|h| h.len() == 1),
            "a session's turns scattered"
        );
        let used: HashSet<usize> = homes.values().flatten().copied().collect();
        assert!(used.len() > 1, "every session hashed to one replica");
        assert_eq!(out.placement.moves(), 0);
    }
}

#[test]
fn a_lost_replicas_sessions_move_and_nothing_is_served_there_after() {
    for placement in [
        PlacementKind::Gate,
        PlacementKind::Hash,
        PlacementKind::StickyLeastLoaded,
    ] {
        let lose = FleetSpec {
            lose: Some(0),
            ..four()
        };
        let out = fleet(placement, gate(), lose);
        let lost_at = out.lost_at.expect("replica 0 was lost");
        assert_eq!(
            out.records.len(),
            32 * 6,
            "{placement:?}: a turn went missing"
        );
        let mut moved = 0;
        for s in 0..32 {
            let turns: Vec<_> = out
                .records
                .iter()
                .zip(&out.served_by)
                .filter(|(rec, _)| rec.session == s)
                .collect();
            let on_lost = turns
                .iter()
                .any(|(rec, r)| **r == 0 && rec.finished_at <= lost_at);
            let later: Vec<_> = turns
                .iter()
                .filter(|(rec, _)| rec.finished_at > lost_at)
                .collect();
            assert!(
                later.iter().all(|(_, r)| **r != 0),
                "{placement:?}: served by the lost replica"
            );
            if on_lost && !later.is_empty() {
                moved += 1;
            }
        }
        assert!(
            moved > 0,
            "{placement:?}: no session of replica 0 had turns left"
        );
        assert!(
            out.placement.down_move >= moved,
            "{placement:?}: {:?}",
            out.placement
        );
    }
}

#[test]
fn a_straggler_costs_hashing_far_more_than_the_gate_placement() {
    let straggler = FleetSpec {
        straggler: Some((0, 4.0)),
        ..four()
    };
    let hash = fleet(PlacementKind::Hash, gate(), straggler.clone());
    let ours = fleet(PlacementKind::Gate, gate(), straggler);
    // Hashing keeps a quarter of the sessions on a replica 4x slower; the gate placement moves
    // them off after its first step.
    assert!(
        ours.makespan_sec < 0.7 * hash.makespan_sec,
        "gate {} s, hash {} s",
        ours.makespan_sec,
        hash.makespan_sec
    );
    assert!(ours.placement.slow_move > 0);
}

/// A stream under pressure on 2 replicas of 256 blocks: 40 sessions arriving 0.5 s apart, every
/// fourth one of 10 turns (its working set grows to most of a replica), the rest of 2.
fn crowded_stream() -> Vec<SessionSpec> {
    (0..40)
        .map(|i| {
            let mut turns = vec![(0, 50, 1.0)];
            turns.extend(vec![(200, 50, 1.0); if i % 4 == 0 { 9 } else { 1 }]);
            session(&format!("s{i}"), 64, 200, 0.5 * i as f64, &turns)
        })
        .collect()
}

#[test]
fn turns_waiting_for_admission_move_to_a_replica_that_would_admit_them_now() {
    let two = FleetSpec {
        replicas: 2,
        ..four()
    };
    let total: usize = crowded_stream().iter().map(|s| s.turns.len()).sum();
    let run = |placement| {
        let spec = FleetSpec {
            placement,
            ..two.clone()
        };
        simulate_fleet(
            crowded_stream(),
            7,
            || Ok(flat_replica(256)),
            &gate(),
            &spec,
        )
        .unwrap()
    };
    let ours = run(PlacementKind::Gate);
    // A withdrawn turn is admitted once, where it went: every turn served exactly once.
    assert_eq!(ours.records.len(), total);
    let served: HashSet<(usize, u32)> = ours.records.iter().map(|r| (r.session, r.turn)).collect();
    assert_eq!(served.len(), total, "a turn was served twice");
    let p = ours.placement;
    assert!(p.new_move > 0, "no waiting first turn moved: {p:?}");
    // Only placement `gate` moves waiting turns; here it ends no later than sticky placement.
    let sticky = run(PlacementKind::StickyLeastLoaded);
    assert_eq!(sticky.placement.new_move, 0);
    assert_eq!(sticky.records.len(), total);
    assert!(
        ours.makespan_sec <= sticky.makespan_sec,
        "gate {} s, sticky {} s",
        ours.makespan_sec,
        sticky.makespan_sec
    );
}

#[test]
fn bad_fleets_are_refused_with_the_reason() {
    let spec = |replicas, lose| FleetSpec {
        replicas,
        lose,
        ..four()
    };
    let run = |f: FleetSpec, mode: ModeSpec| {
        simulate_fleet(sessions(), 7, || Ok(flat_replica(1024)), &mode, &f)
            .unwrap_err()
            .to_string()
    };
    assert!(run(spec(0, None), gate()).contains("at least 1 replica"));
    assert!(run(spec(4, Some(4)), gate()).contains("lost replica 4"));
    assert!(run(spec(4, None), ModeSpec::Cap(3)).contains("not a fleet mode"));
    assert!(PlacementKind::from_name("round-robin").is_err());
}
