//! The proxy's side of placement: what it knows about each replica and each turn, turned into
//! the views the sans-IO policy ([`crate::gate::placement`], the one the twin's fleet drives)
//! reads. Pure functions, so the glue is tested without a replica.
//!
//! What the proxy knows, and what it does not:
//! - **Health**: a replica that passed its last health check is up at full speed; one that only
//!   missed a check (slow to answer `/health`, no failed connection) is up at
//!   [`SLOW_SPEED`], below the policy's `slow_below`, so it takes no new sessions and its
//!   sessions move while a healthy replica exists (and keeps serving when none does, as the
//!   proxy always did); one that refused a connection, or that the replicas file no longer
//!   lists, is down.
//! - **Room**: the replica's last usage answer (each gated admission and each health check
//!   reads one) less what its gate in this proxy has committed: the free blocks are the room
//!   under the gate's line, `high_watermark × num_blocks − max(blocks in use, committed)`.
//!   With `--gate-at engine` nothing is committed in the proxy, so the room is vLLM's usage
//!   alone. With no usage answer yet (a replica just added), the room is unknown and taken as
//!   ample: the ranking then falls to backlogs and sessions per replica.
//! - **Queues**: the turns this proxy has waiting for admission there. That is the whole queue
//!   when the gate runs in the proxy; with `--gate-at engine` other clients' waiting turns are
//!   not seen (the engine gate's stats are not read per decision; a round trip per turn).
//! - **Prompt**: its full blocks and the blocks its output may add. Which leading blocks are
//!   shared with other sessions is known only for a session the proxy has not seen and looked
//!   for on every up replica ([`find_home`]): the blocks resident on all of them.
//! - **Sessions of other proxies**: a session this proxy has not seen may be a returning one
//!   that another proxy (or this one before a restart) placed. [`find_home`] reads the
//!   replicas' prefix probes for its prompt: one replica holding clearly more of it is its
//!   home.
use crate::gate::UsageReport;
use crate::gate::placement::{ReplicaView, SessionView};

/// The speed given a replica that only missed a health check: below the policy's default
/// `slow_below` (0.75) against a healthy one.
pub const SLOW_SPEED: f64 = 0.5;

/// vLLM's default block size, used until a replica tells its own.
pub const DEFAULT_BLOCK_SIZE: u64 = 16;

/// A replica's health as placement grades it (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grade {
    /// Passed its last health check.
    Healthy,
    /// Missed a health check but refused no connection.
    Slow,
    /// Refused a connection since its last passing check, or no longer listed.
    Down,
}

/// What the proxy knows about one replica when it places a turn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaFacts {
    /// Its health.
    pub grade: Grade,
    /// Its last usage answer, if any.
    pub usage: Option<UsageReport>,
    /// Blocks its gate in this proxy has committed (0 with `--gate-at engine`).
    pub committed_blocks: u64,
    /// The gate's line, a fraction of the replica's blocks.
    pub high_watermark: f64,
    /// Sessions this proxy has placed there.
    pub sessions: u32,
    /// Turns this proxy has waiting for admission there.
    pub queued: u32,
    /// New sessions placed there whose first turn is not admitted yet.
    pub new_waiting: u32,
}

/// The policy's view of a replica (module docs).
pub fn replica_view(facts: &ReplicaFacts) -> ReplicaView {
    let (num_blocks, free_blocks) = match facts.usage {
        Some(u) if u.num_blocks > 0 => {
            let line = (facts.high_watermark * u.num_blocks as f64).floor() as u64;
            let in_use = u.num_blocks.saturating_sub(u.num_free_blocks);
            let taken = in_use.max(facts.committed_blocks);
            (u.num_blocks, line.saturating_sub(taken))
        }
        _ => (0, u64::MAX),
    };
    ReplicaView {
        up: facts.grade != Grade::Down,
        speed: if facts.grade == Grade::Slow {
            SLOW_SPEED
        } else {
            1.0
        },
        num_blocks,
        free_blocks,
        sessions: facts.sessions,
        queued: facts.queued,
        new_waiting: facts.new_waiting,
    }
}

/// The policy's view of a turn of `prompt_tokens` tokens that may add `max_tokens`, on replicas
/// of `block_size` tokens a block, nothing known to be shared (the caller sets `shared_blocks`
/// when the replicas told it: [`find_home`]).
pub fn session_view(prompt_tokens: usize, max_tokens: usize, block_size: u64) -> SessionView {
    SessionView::from_tokens(
        prompt_tokens as u64,
        max_tokens as u64,
        0,
        block_size.max(1),
    )
}

/// What the replicas' prefix probes say of a session this proxy has not seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Its prefix is resident on this replica, clearly more than on any other: it is a
    /// returning session, and stays there.
    Home(usize),
    /// A new session; `shared_blocks` of its prompt are resident on every replica that
    /// answered (a shared system prompt).
    New {
        /// The smallest hit of the replicas that answered.
        shared_blocks: u64,
    },
}

/// Fraction of its prompt blocks a session must have resident on one replica to be taken for a
/// returning one (the policy's `resident_fraction`): a hit only one block larger than every
/// other replica's can be a system prompt that only one replica has served yet, and sending
/// every new session there would pile them on it.
pub const FOUND_FRACTION: f64 = 0.5;

/// Where a session this proxy has not seen lives, from `hits`: per up replica, the leading
/// blocks of its prompt (`prompt_blocks` full blocks) resident there, `None` when its probe did
/// not answer. Its home is the replica whose hit exceeds every other answer by at least one
/// block and covers at least [`FOUND_FRACTION`] of the prompt; with fewer than two answers
/// nothing can be told apart, and the session is new with nothing known to be shared.
pub fn find_home(hits: &[Option<u64>], prompt_blocks: u64) -> Lookup {
    let answers: Vec<(usize, u64)> = hits
        .iter()
        .enumerate()
        .filter_map(|(r, h)| h.map(|h| (r, h)))
        .collect();
    if answers.len() < 2 {
        return Lookup::New { shared_blocks: 0 };
    }
    let shared_blocks = answers.iter().map(|&(_, h)| h).min().unwrap_or(0);
    let (top, top_hit) = answers
        .iter()
        .copied()
        .max_by_key(|&(r, h)| (h, std::cmp::Reverse(r)))
        .unwrap_or((0, 0));
    let runner_up = answers
        .iter()
        .filter(|&&(r, _)| r != top)
        .map(|&(_, h)| h)
        .max()
        .unwrap_or(0);
    let clear = top_hit > runner_up;
    let enough = top_hit as f64 >= FOUND_FRACTION * prompt_blocks as f64;
    if clear && enough {
        Lookup::Home(top)
    } else {
        Lookup::New { shared_blocks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::placement::{PlaceReason, Placement, PlacementConfig, eta};
    use crate::gate::testing::usage_report;

    fn usage(num_blocks: u64, free: u64) -> UsageReport {
        let report = usage_report(1.0 - free as f64 / num_blocks as f64, num_blocks, 16);
        assert_eq!(report.num_free_blocks, free);
        report
    }

    fn facts(grade: Grade, usage: Option<UsageReport>, committed: u64) -> ReplicaFacts {
        ReplicaFacts {
            grade,
            usage,
            committed_blocks: committed,
            high_watermark: 0.9,
            sessions: 3,
            queued: 1,
            new_waiting: 2,
        }
    }

    #[test]
    fn room_is_under_the_line_less_the_larger_of_use_and_commitment() {
        // 100 blocks, line at 90; 30 in use, 50 committed: 40 under the line.
        let v = replica_view(&facts(Grade::Healthy, Some(usage(100, 70)), 50));
        assert_eq!((v.num_blocks, v.free_blocks), (100, 40));
        assert_eq!((v.sessions, v.queued, v.new_waiting), (3, 1, 2));
        assert!(v.up && v.speed == 1.0);
        // In use beyond the commitment (another client's turns): use counts.
        let v = replica_view(&facts(Grade::Healthy, Some(usage(100, 20)), 10));
        assert_eq!(v.free_blocks, 10);
        // Over the line: no room, never an underflow.
        let v = replica_view(&facts(Grade::Healthy, Some(usage(100, 0)), 200));
        assert_eq!(v.free_blocks, 0);
    }

    #[test]
    fn no_usage_answer_means_room_unknown_taken_as_ample() {
        let v = replica_view(&facts(Grade::Healthy, None, 0));
        assert_eq!((v.num_blocks, v.free_blocks), (0, u64::MAX));
        let turn = session_view(4096, 256, 16);
        let idle = ReplicaView { queued: 0, ..v };
        assert_eq!(
            eta(&idle, &turn, 0),
            0.0,
            "an idle unknown replica admits now"
        );
    }

    #[test]
    fn grades_map_to_up_and_speed_and_the_policy_moves_off_slow_and_down() {
        let healthy = replica_view(&facts(Grade::Healthy, Some(usage(100, 100)), 0));
        let slow = replica_view(&facts(Grade::Slow, Some(usage(100, 100)), 0));
        let down = replica_view(&facts(Grade::Down, Some(usage(100, 100)), 0));
        assert!(slow.up && slow.speed == SLOW_SPEED);
        assert!(!down.up);
        let turn = session_view(320, 32, 16);
        let mut p = Placement::new(PlacementConfig::default());
        let views = [slow, healthy, down];
        assert!(!p.usable(&views, 0), "slow next to a healthy replica");
        let moved = p.place_returning(&views, &turn, 0, 20).unwrap();
        assert_eq!((moved.replica, moved.reason), (1, PlaceReason::SlowMove));
        let moved = p.place_returning(&views, &turn, 2, 20).unwrap();
        assert_eq!((moved.replica, moved.reason), (1, PlaceReason::DownMove));
        // With no healthy replica the slow one serves, as the proxy always did.
        let views = [slow, down];
        assert!(p.usable(&views, 0));
        let fresh = ReplicaView {
            new_waiting: 0,
            ..slow
        };
        assert_eq!(
            p.place_new(&[fresh, down], &turn, |_| 0).unwrap().replica,
            0
        );
    }

    #[test]
    fn a_turn_counts_full_prompt_blocks_and_rounds_its_output_up() {
        let v = session_view(100, 17, 16);
        assert_eq!(
            (v.prompt_blocks, v.output_blocks, v.shared_blocks),
            (6, 2, 0)
        );
        assert_eq!(
            session_view(0, 0, 0).output_blocks,
            0,
            "block size 0 is taken as 1"
        );
    }

    #[test]
    fn a_session_clearly_resident_on_one_replica_is_found_there() {
        // Prompt of 20 blocks; 15 resident on replica 1, the 2-block system prompt elsewhere.
        assert_eq!(
            find_home(&[Some(2), Some(15), Some(2)], 20),
            Lookup::Home(1)
        );
        // One block more than every other is enough.
        assert_eq!(find_home(&[Some(11), Some(10)], 20), Lookup::Home(0));
        // A replica whose probe did not answer is left out, not counted as a miss.
        assert_eq!(find_home(&[None, Some(2), Some(15)], 20), Lookup::Home(2));
    }

    #[test]
    fn a_tie_or_a_small_hit_is_a_new_session_sharing_the_common_hit() {
        // Tied at the top: nothing tells the replicas apart; 2 blocks are on every one.
        assert_eq!(
            find_home(&[Some(12), Some(12), Some(2)], 20),
            Lookup::New { shared_blocks: 2 }
        );
        // The system prompt served by one replica only: not a returning session.
        assert_eq!(
            find_home(&[Some(4), Some(0)], 20),
            Lookup::New { shared_blocks: 0 }
        );
        // Nothing anywhere.
        assert_eq!(
            find_home(&[Some(0), Some(0)], 20),
            Lookup::New { shared_blocks: 0 }
        );
    }

    #[test]
    fn fewer_than_two_answers_tell_nothing() {
        assert_eq!(find_home(&[Some(18)], 20), Lookup::New { shared_blocks: 0 });
        assert_eq!(
            find_home(&[Some(18), None], 20),
            Lookup::New { shared_blocks: 0 }
        );
        assert_eq!(find_home(&[], 20), Lookup::New { shared_blocks: 0 });
    }
}
