//! The placement policy's rules (`session_gate::gate::placement`), as pure decisions over
//! replica views: new sessions, resident and cold returning sessions, turns that wait for
//! admission, slow and down replicas.
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
    // Live sessions 5, 1, 2, 4: a share of 3 a replica.
    let views = [
        ReplicaView {
            sessions: 5,
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
            sessions: 4,
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

#[test]
fn a_new_session_goes_only_to_a_replica_within_its_share_of_live_sessions() {
    let mut p = policy();
    // Live sessions 10 and 2: a share of 6. The idle replica over it gets nothing, even though
    // it would admit the session now; the one under it takes it into its backlog.
    let views = [
        ReplicaView {
            sessions: 10,
            ..idle()
        },
        ReplicaView {
            sessions: 2,
            queued: 1,
            ..idle()
        },
    ];
    assert!((p.share(&views) - 6.0).abs() < 1e-12);
    assert_eq!(p.place_new(&views, &TURN, |_| 0).unwrap().replica, 1);
    // Per unit of speed: 10 at full speed against 4 at 0.8 (5): a share of 7.5.
    let views = [
        ReplicaView {
            sessions: 10,
            ..idle()
        },
        ReplicaView {
            sessions: 4,
            speed: 0.8,
            queued: 1,
            ..idle()
        },
    ];
    assert_eq!(p.place_new(&views, &TURN, |_| 0).unwrap().replica, 1);
    // A down or slow replica does not count in the share.
    let views = [
        ReplicaView {
            sessions: 10,
            ..idle()
        },
        ReplicaView {
            sessions: 0,
            up: false,
            ..idle()
        },
        ReplicaView {
            sessions: 0,
            speed: 0.4,
            ..idle()
        },
    ];
    assert_eq!(p.place_new(&views, &TURN, |_| 0).unwrap().replica, 0);
}

/// A replica where `TURN` waits: it and one turn ahead of it queued, 3 live sessions.
fn busy_home() -> ReplicaView {
    ReplicaView {
        sessions: 3,
        queued: 2,
        new_waiting: 1,
        ..idle()
    }
}

#[test]
fn a_waiting_first_turn_moves_to_a_replica_that_would_admit_it_now() {
    let mut p = policy();
    let views = [
        busy_home(),
        ReplicaView {
            sessions: 2,
            queued: 1,
            ..idle()
        }, // a queue: not now either
        ReplicaView {
            sessions: 2,
            ..idle()
        },
    ];
    let placed = p.place_waiting(&views, &TURN, 0, 10, true, |_| 10).unwrap();
    assert_eq!((placed.replica, placed.reason), (2, PlaceReason::NewMove));
    assert!(placed.reason.is_move());
    let stats = p.stats();
    assert_eq!(stats.new_move, 1);
    assert_eq!(
        stats.moves(),
        0,
        "it had no cache to lose: not a move of a session"
    );
    let labels: Vec<&str> = stats.by_reason().iter().map(|(l, _)| *l).collect();
    assert!(labels.contains(&"new_move"));
}

#[test]
fn a_waiting_turn_stays_when_home_would_admit_it_now_or_nobody_would() {
    let mut p = policy();
    // Home has only this turn queued and room: it is about to be admitted there.
    let home = ReplicaView {
        queued: 1,
        ..busy_home()
    };
    let views = [home, idle()];
    assert_eq!(p.place_waiting(&views, &TURN, 0, 10, true, |_| 10), None);
    // Home would not, and neither would anyone else (a queue, or no room).
    let views = [
        busy_home(),
        ReplicaView {
            queued: 1,
            ..idle()
        },
        ReplicaView {
            free_blocks: 20,
            ..idle()
        },
    ];
    assert_eq!(p.place_waiting(&views, &TURN, 0, 10, true, |_| 0), None);
    assert_eq!(p.stats(), Default::default());
}

#[test]
fn a_waiting_first_turn_respects_the_backlog_and_the_share() {
    let mut p = policy();
    let full_backlog = ReplicaView {
        new_waiting: 2,
        ..idle()
    };
    let views = [busy_home(), full_backlog];
    assert_eq!(p.place_waiting(&views, &TURN, 0, 10, true, |_| 10), None);
    // Idle but over the share (9 against a share of 6).
    let crowded = ReplicaView {
        sessions: 9,
        ..idle()
    };
    let views = [busy_home(), crowded];
    assert_eq!(p.place_waiting(&views, &TURN, 0, 10, true, |_| 10), None);
    // A returning cold turn is no new session: the share and the backlog do not hold for it.
    let placed = p
        .place_waiting(&views, &TURN, 0, 10, false, |_| 10)
        .unwrap();
    assert_eq!((placed.replica, placed.reason), (1, PlaceReason::ColdMove));
}

#[test]
fn a_waiting_returning_turn_moves_only_when_cold() {
    let mut p = policy();
    let views = [busy_home(), idle()];
    // 60 of its 90 own blocks resident at home (10 shared + 60): it stays for its cache.
    assert_eq!(p.place_waiting(&views, &TURN, 0, 70, false, |_| 10), None);
    // 30 of 90: cold, it re-prefills wherever it goes; the idle replica admits it now.
    let placed = p
        .place_waiting(&views, &TURN, 0, 40, false, |_| 10)
        .unwrap();
    assert_eq!((placed.replica, placed.reason), (1, PlaceReason::ColdMove));
    assert_eq!(p.stats().cold_move, 1);
}

#[test]
fn may_move_waiting_says_yes_whenever_some_home_hit_would_move_and_counts_nothing() {
    let p = policy();
    let scenes: [[ReplicaView; 2]; 4] = [
        [busy_home(), idle()],
        [
            busy_home(),
            ReplicaView {
                queued: 1,
                ..idle()
            },
        ],
        [
            ReplicaView {
                queued: 1,
                ..busy_home()
            },
            idle(),
        ],
        [
            busy_home(),
            ReplicaView {
                sessions: 9,
                ..idle()
            },
        ],
    ];
    for views in &scenes {
        for first in [true, false] {
            let may = p.may_move_waiting(views, &TURN, 0, first, |_| 10);
            // Any home hit that moves the turn implies `may`; a cold home (hit 0) moves it
            // exactly when `may` says so.
            for hit in [0, 10, 40, 70, 100] {
                let moved = p
                    .clone()
                    .place_waiting(views, &TURN, 0, hit, first, |_| 10)
                    .is_some();
                assert!(!moved || may, "{views:?} first {first} hit {hit}");
                if hit == 0 {
                    assert_eq!(moved, may, "{views:?} first {first}");
                }
            }
        }
    }
    assert_eq!(p.stats(), Default::default());
}
