//! A turn waiting for admission on its replica, and its move while it waits.
//!
//! Placement decides where a turn goes when it arrives; that decision goes stale while the turn
//! waits in its replica's gate. Under placement `gate`, a waiting turn with nothing of its own
//! resident where it waits (a new session's first turn, or a returning one whose prefix was
//! evicted there) moves as soon as another replica would admit it now and its own would not
//! ([`Placement::place_waiting`](crate::gate::placement::Placement::place_waiting), the rule the
//! twin's fleet runs): it re-prefills either way, and starts sooner. Near the end of a stream
//! this is what keeps one replica's held turns from waiting while another runs dry.
//!
//! While the gate's answer is pending, the turn asks again whenever something placement reads
//! changed (a turn admitted or finished anywhere, a replica's health or the list) and every
//! `wait_poll_sec`. Each ask is first answered from what the proxy already knows
//! ([`Replicas::may_move_waiting`](super::replicas::Replicas::may_move_waiting)); only when a
//! move is possible is home's prefix probe asked what is still resident there, at most every
//! [`ASK_EVERY`]. Moving drops the pending admission, which withdraws the turn from its gate
//! (the proxy's own gate forgets the attempt; an engine's gate is sent a cancel).
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Proxy;
use super::forward::{Spot, Turn, home_hit};
use super::replica_gate::{AdmitError, ReplicaLease};
use super::replicas::Replica;

/// The least time between two probes of home for one waiting turn: a busy fleet changes many
/// times a second, and each probe hashes the prompt in the replica's engine.
pub(super) const ASK_EVERY: Duration = Duration::from_millis(500);

/// How a turn's wait for admission ended.
pub(super) enum Admission {
    /// The replica's gate answered: a lease, or why not.
    Answered(Result<ReplicaLease, AdmitError>),
    /// It moved before its gate answered: admit it there.
    Moved(Spot),
}

/// Waits for `replica`'s gate to admit the turn at `spot` (`prompt_ids` tokenized there) and,
/// while it waits, moves it where placement says (module docs) when `may_move`.
pub(super) async fn admit_or_move(
    proxy: &Arc<Proxy>,
    replica: &Replica,
    t: Turn<'_>,
    prompt_ids: &[u32],
    spot: &Spot,
    may_move: bool,
) -> Admission {
    let admit = proxy
        .replica_gate
        .admit(replica, t.session, prompt_ids, t.max_tokens);
    tokio::pin!(admit);
    if !may_move {
        return Admission::Answered(admit.await);
    }
    let (home, first) = (spot.route.index, spot.route.is_first());
    let poll = Duration::from_secs_f64(proxy.config.gate.wait_poll_sec);
    let mut asked: Option<Instant> = None;
    loop {
        let changed = proxy.replicas.changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        tokio::select! {
            biased;
            answered = &mut admit => return Admission::Answered(answered),
            _ = tokio::time::timeout(poll, changed) => {}
        }
        if !proxy
            .replicas
            .may_move_waiting(t.session, &spot.view, home, first, &spot.hits)
        {
            continue;
        }
        if let Some(last) = asked {
            let early = ASK_EVERY.saturating_sub(last.elapsed());
            if !early.is_zero() {
                tokio::select! {
                    biased;
                    answered = &mut admit => return Admission::Answered(answered),
                    _ = tokio::time::sleep(early) => {}
                }
            }
        }
        asked = Some(Instant::now());
        let resident = tokio::select! {
            biased;
            answered = &mut admit => return Admission::Answered(answered),
            hit = home_hit(proxy, t.session, prompt_ids, &spot.view) => hit,
        };
        let moved = proxy
            .replicas
            .place_waiting(t.session, &spot.view, home, resident, first, &spot.hits);
        if let Some(route) = moved {
            return Admission::Moved(Spot {
                route,
                view: spot.view,
                hits: spot.hits.clone(),
            });
        }
    }
}
