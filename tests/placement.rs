//! The placement policy's rules (`session_gate::gate::placement`), as pure decisions over
//! replica views: new sessions, resident and cold returning sessions, slow and down replicas.
use session_gate::gate::placement::{
    PlaceReason, Placement, PlacementConfig, ReplicaView, SessionView, eta,
};

/// An idle, healthy replica of 1,000 blocks, all free.
fn idle() -> ReplicaView {
    ReplicaView {
        up: true,
        speed: 1.0,
        num_blocks: 1000,
        free_blocks: 1000,
        sessions: 0,
        queued: 0,
        new_waiting: 0,
    }
}

/// A turn of 100 prompt blocks (10 shared) adding 5.
const TURN: SessionView = SessionView {
    prompt_blocks: 100,
    output_blocks: 5,
    shared_blocks: 10,
};

fn policy() -> Placement {
    Placement::new(PlacementConfig::default())
}

#[test]
fn a_new_session_goes_where_it_would_be_admitted_now_with_the_fewest_sessions() {
    let mut p = policy();
    let views = [
        ReplicaView {
            sessions: 3,
            ..idle()
        },
        ReplicaView {
            sessions: 1,
            queued: 2,
            ..idle()
        }, // a queue: not now
        ReplicaView {
            sessions: 2,
            ..idle()
        },
        ReplicaView {
            sessions: 0,
            free_blocks: 50,
            ..idle()
        }, // no room for 105 blocks
    ];
    let placed = p.place_new(&views, &TURN, |_| 0).unwrap();
    assert_eq!(placed.replica, 2);
    assert_eq!(placed.reason, PlaceReason::New);
    assert_eq!(p.stats().new, 1);
}

#[test]
fn a_new_session_waits_behind_the_fewest_new_sessions_when_none_would_be_admitted_now() {
    let mut p = policy();
    let views = [
        ReplicaView {
            queued: 1,
            new_waiting: 1,
            ..idle()
        },
        ReplicaView {
            free_blocks: 10,
            ..idle()
        },
        ReplicaView {
            up: false,
            ..idle()
        },
    ];
    assert_eq!(p.place_new(&views, &TURN, |_| 0).unwrap().replica, 1);
}

#[test]
fn a_new_session_is_held_when_every_usable_replica_has_its_backlog_of_new_sessions() {
    let mut p = policy();
    let views = [
        ReplicaView {
            new_waiting: 2,
            ..idle()
        },
        ReplicaView {
            new_waiting: 3,
            queued: 3,
            ..idle()
        },
        ReplicaView {
            up: false,
            ..idle()
        },
        ReplicaView {
            speed: 0.5,
            ..idle()
        }, // slow
    ];
    assert_eq!(p.place_new(&views, &TURN, |_| 0), None);
    assert_eq!(p.stats().held, 1);
    assert_eq!(p.stats().new, 0);
}

#[test]
fn a_resident_shared_prefix_breaks_ties_and_counts_as_room() {
    let mut p = policy();
    // 100 free blocks: 105 needed cold, 95 with the 10 shared blocks resident.
    let views = [
        ReplicaView {
            free_blocks: 100,
            ..idle()
        },
        ReplicaView {
            free_blocks: 100,
            ..idle()
        },
    ];
    let placed = p.place_new(&views, &TURN, |r| if r == 1 { 10 } else { 0 });
    assert_eq!(placed.unwrap().replica, 1);
    let views = [idle(), idle()];
    let placed = p.place_new(&views, &TURN, |r| if r == 1 { 10 } else { 0 });
    assert_eq!(placed.unwrap().replica, 1, "equal load: the warm one");
}

#[test]
fn speed_weighs_the_load_and_a_slow_replica_takes_no_new_session() {
    let mut p = policy();
    let views = [
        ReplicaView {
            sessions: 4,
            speed: 1.0,
            ..idle()
        },
        ReplicaView {
            sessions: 1,
            speed: 0.5,
            ..idle()
        }, // slow: under 0.75 of the fastest
    ];
    assert_eq!(p.place_new(&views, &TURN, |_| 0).unwrap().replica, 0);
    let views = [
        ReplicaView {
            sessions: 4,
            speed: 1.0,
            ..idle()
        },
        ReplicaView {
            sessions: 2,
            speed: 0.8,
            ..idle()
        }, // 3 / 0.8 < 5 / 1
    ];
    assert_eq!(p.place_new(&views, &TURN, |_| 0).unwrap().replica, 1);
}

#[test]
fn a_resident_returning_session_stays_even_when_home_is_busier() {
    let mut p = policy();
    let views = [
        ReplicaView {
            queued: 9,
            sessions: 50,
            free_blocks: 0,
            ..idle()
        },
        idle(),
    ];
    let placed = p.place_returning(&views, &TURN, 0, 60).unwrap();
    assert_eq!(placed.replica, 0);
    assert_eq!(placed.reason, PlaceReason::Resident);
    assert_eq!(p.stats().resident, 1);
}

#[test]
fn a_cold_returning_session_moves_only_to_where_it_is_admitted_sooner() {
    let mut p = policy();
    // Only its shared blocks (10 of 100) and a few own ones are resident at home: cold.
    let busy_home = [
        ReplicaView {
            queued: 3,
            ..idle()
        },
        idle(),
    ];
    let placed = p.place_returning(&busy_home, &TURN, 0, 20).unwrap();
    assert_eq!(placed.replica, 1);
    assert_eq!(placed.reason, PlaceReason::ColdMove);
    assert!(placed.reason.is_move());
    // Home would admit it now: it stays, cold.
    let placed = p.place_returning(&[idle(), idle()], &TURN, 0, 20).unwrap();
    assert_eq!(placed.replica, 0);
    assert_eq!(placed.reason, PlaceReason::ColdStay);
    // Nowhere sooner: it stays.
    let all_busy = [
        ReplicaView {
            queued: 1,
            ..idle()
        },
        ReplicaView {
            queued: 4,
            ..idle()
        },
    ];
    let placed = p.place_returning(&all_busy, &TURN, 0, 20).unwrap();
    assert_eq!(placed.reason, PlaceReason::ColdStay);
    let s = p.stats();
    assert_eq!((s.cold_move, s.cold_stay, s.moves()), (1, 2, 1));
}

#[test]
fn sessions_leave_a_down_or_slow_replica_even_when_resident() {
    let mut p = policy();
    let down = [
        ReplicaView {
            up: false,
            ..idle()
        },
        idle(),
        ReplicaView {
            queued: 2,
            ..idle()
        },
    ];
    let placed = p.place_returning(&down, &TURN, 0, 100).unwrap();
    assert_eq!((placed.replica, placed.reason), (1, PlaceReason::DownMove));
    let slow = [
        ReplicaView {
            speed: 0.5,
            ..idle()
        },
        ReplicaView {
            queued: 1,
            ..idle()
        },
    ];
    let placed = p.place_returning(&slow, &TURN, 0, 100).unwrap();
    assert_eq!((placed.replica, placed.reason), (1, PlaceReason::SlowMove));
    // A slow replica with nowhere else to go still serves; a down one cannot.
    let placed = p.place_returning(
        &[ReplicaView {
            speed: 0.5,
            ..idle()
        }],
        &TURN,
        0,
        100,
    );
    assert_eq!(placed.unwrap().replica, 0);
    assert_eq!(
        p.place_returning(
            &[ReplicaView {
                up: false,
                ..idle()
            }],
            &TURN,
            0,
            100
        ),
        None
    );
    let s = p.stats();
    assert_eq!((s.down_move, s.slow_move), (1, 1));
}

#[test]
fn eta_is_zero_only_with_no_queue_and_room() {
    assert_eq!(eta(&idle(), &TURN, 0), 0.0);
    // 105 blocks needed, 42 free: it lacks 63, 0.6 of them.
    let short = ReplicaView {
        free_blocks: 42,
        ..idle()
    };
    assert!((eta(&short, &TURN, 0) - 0.6).abs() < 1e-12);
    // With its 10 shared blocks resident it needs 95 and lacks 53.
    assert!((eta(&short, &TURN, 10) - 53.0 / 95.0).abs() < 1e-12);
    let queued = ReplicaView {
        queued: 2,
        speed: 0.5,
        ..idle()
    };
    assert_eq!(eta(&queued, &TURN, 0), 4.0);
}
