//! Property tests of the gate core (proptest: random operation sequences, shrunk to a minimal
//! failing one). Properties:
//! - after every operation the core's books balance (`check_invariants`: committed blocks equal
//!   the sum of the reserved sessions' working sets, counts add up, the queue is not stale);
//! - no reservation outlives its session's window: once every lease is released and the idle
//!   grace has passed, nothing is reserved or committed;
//! - every waiter is eventually admitted, preempted or cancelled once room frees up;
//! - a waiter the core says would not wake (`would_wake`) answers a poll with a `Wait` and
//!   changes nothing;
//! - FIFO among cold waiters: whatever order the drivers poll them in, cold sessions that each
//!   need most of the cache are admitted in the order they arrived.
use proptest::prelude::*;
use session_gate::gate::testing::usage_report;
use session_gate::gate::{Action, AttemptId, GateConfig, GateCore, LeaseId, PrefixReport};

const BLOCKS: u64 = 100;
const BS: u64 = 16;
const SESSIONS: u8 = 6;
const GRACE: f64 = 60.0;

#[derive(Debug, Clone)]
enum Op {
    Begin {
        session: u8,
        blocks: u8,
        max_tokens: Option<u16>,
        retain: bool,
    },
    /// Drive attempt `pick` (modulo the live ones) with these probe answers.
    Step {
        pick: usize,
        usage: Option<f64>,
        hit: Option<f64>,
    },
    Release {
        pick: usize,
        dropped: bool,
    },
    Finish {
        session: u8,
    },
    Cancel {
        pick: usize,
    },
    Advance {
        secs: f64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..SESSIONS, 1u8..60, proptest::option::of(0u16..600), any::<bool>()).prop_map(
            |(session, blocks, max_tokens, retain)| Op::Begin { session, blocks, max_tokens, retain }
        ),
        5 => (any::<usize>(), proptest::option::of(0.0..1.0f64), proptest::option::of(0.0..1.0f64))
            .prop_map(|(pick, usage, hit)| Op::Step { pick, usage, hit }),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(pick, dropped)| Op::Release { pick, dropped }),
        1 => (0..SESSIONS).prop_map(|session| Op::Finish { session }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        1 => (0.0..100.0f64).prop_map(|secs| Op::Advance { secs }),
    ]
}

struct Driver {
    core: GateCore,
    now: f64,
    attempts: Vec<AttemptId>,
    leases: Vec<LeaseId>,
}

impl Driver {
    fn new() -> Self {
        let config = GateConfig {
            idle_grace_sec: GRACE,
            ..Default::default()
        };
        Self {
            core: GateCore::new(config).unwrap(),
            now: 0.0,
            attempts: Vec::new(),
            leases: Vec::new(),
        }
    }

    /// Polls `id` and answers its probes until it waits or is over; returns the admitted
    /// lease, if any. `None` answers model a failed probe.
    fn drive(&mut self, id: AttemptId, usage: Option<f64>, hit: Option<f64>) -> Option<LeaseId> {
        for _ in 0..8 {
            match self.core.poll(id, self.now).unwrap() {
                Action::ProbeUsage => {
                    let r = usage
                        .map(|u| usage_report(u, BLOCKS, BS))
                        .ok_or_else(|| "usage failed".to_string());
                    self.core.on_usage(id, r, self.now).unwrap();
                }
                Action::ProbePrefix => {
                    let r = hit
                        .map(|h| PrefixReport {
                            hit_ratio: h,
                            ..Default::default()
                        })
                        .ok_or_else(|| "prefix failed".to_string());
                    self.core.on_prefix(id, r, self.now).unwrap();
                }
                Action::Wait { until } => {
                    assert!(until > self.now, "a wait ends in the future");
                    return None;
                }
                Action::Admit(a) => {
                    self.attempts.retain(|x| *x != id);
                    self.leases.push(a.lease);
                    return Some(a.lease);
                }
                Action::Preempted => {
                    self.attempts.retain(|x| *x != id);
                    return None;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        panic!("an attempt kept asking for probes");
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Begin {
                session,
                blocks,
                max_tokens,
                retain,
            } => {
                let prompt = usize::from(blocks) * BS as usize;
                let id = self.core.begin(
                    &format!("s{session}"),
                    prompt,
                    max_tokens.map(usize::from),
                    retain,
                    self.now,
                );
                self.attempts.push(id);
            }
            Op::Step { pick, usage, hit } if !self.attempts.is_empty() => {
                let id = self.attempts[pick % self.attempts.len()];
                self.drive(id, usage, hit);
            }
            Op::Release { pick, dropped } if !self.leases.is_empty() => {
                let lease = self.leases.swap_remove(pick % self.leases.len());
                let released = if dropped {
                    self.core.release_dropped(lease, self.now)
                } else {
                    self.core.release(lease, self.now)
                };
                assert!(released);
            }
            Op::Finish { session } => {
                self.core.finish_session(&format!("s{session}"), self.now);
            }
            Op::Cancel { pick } if !self.attempts.is_empty() => {
                let id = self.attempts.swap_remove(pick % self.attempts.len());
                // A preempted attempt the driver has not polled yet is cancelled too.
                assert!(self.core.cancel(id, self.now));
            }
            Op::Advance { secs } => {
                self.now += secs;
                self.core.expire(self.now);
            }
            _ => {}
        }
    }
}

proptest! {
    // No regression files: a failure prints its minimal input, which becomes a plain test.
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn books_balance_and_nothing_outlives_its_window_or_waits_forever(
        ops in proptest::collection::vec(op(), 1..120)
    ) {
        let mut d = Driver::new();
        for op in &ops {
            d.apply(op);
            prop_assert_eq!(d.core.check_invariants(), Ok(()), "after {:?}", op);
            // A waiter the core says would not wake answers a poll with its Wait and changes
            // nothing: the engine book leaves such waiters unpolled when the epoch moves.
            d.core.expire(d.now);
            for &id in &d.attempts {
                if !d.core.would_wake(id, d.now) {
                    let (epoch, stats) = (d.core.epoch(), d.core.stats());
                    let action = d.core.poll(id, d.now);
                    prop_assert!(matches!(action, Ok(Action::Wait { .. })), "{:?}", action);
                    prop_assert_eq!(d.core.epoch(), epoch);
                    prop_assert_eq!(d.core.stats(), stats);
                }
            }
        }

        // Room frees up: every lease is released. Each remaining waiter, driven with an empty
        // cache and its session finished once admitted, must be admitted or preempted.
        for lease in std::mem::take(&mut d.leases) {
            prop_assert!(d.core.release(lease, d.now));
        }
        for _ in 0..=ops.len() + 1 {
            for id in d.attempts.clone() {
                d.now += 0.01;
                if let Some(lease) = d.drive(id, Some(0.0), Some(0.0)) {
                    prop_assert!(d.core.release(lease, d.now));
                    d.leases.clear();
                }
            }
            if d.attempts.is_empty() {
                break;
            }
            // Waiters blocked only by idle reservations get in once their grace ends.
            d.now += GRACE + 1.0;
            d.core.expire(d.now);
            prop_assert_eq!(d.core.check_invariants(), Ok(()));
        }
        prop_assert!(d.attempts.is_empty(), "waiters left: {:?}", d.attempts);
        prop_assert_eq!(d.core.stats().pending, 0);

        // No reservation outlives its window: the grace passes, nothing is held.
        d.now += GRACE + 1.0;
        d.core.expire(d.now);
        let s = d.core.stats();
        prop_assert_eq!(s.reservations_held, 0);
        prop_assert_eq!(s.committed_blocks, 0);
        prop_assert_eq!(s.leases_active, 0);
    }

    #[test]
    fn cold_waiters_are_admitted_in_arrival_order_whatever_the_poll_order(
        waiters in 2usize..6,
        polls in proptest::collection::vec(any::<usize>(), 1..200),
    ) {
        let mut d = Driver::new();
        // A holder takes 60 of the 85 blocks under the line; each cold session needs 50, so
        // only one fits at a time and none fits beside the holder.
        let holder = d.core.begin("holder", 60 * BS as usize, 0, true, d.now);
        let holder_lease = d.drive(holder, Some(0.1), Some(0.0)).expect("holder is admitted");
        let mut cold = Vec::new();
        for i in 0..waiters {
            d.now += 0.1;
            let id = d.core.begin(&format!("c{i}"), 50 * BS as usize, 0, true, d.now);
            d.attempts.push(id);
            prop_assert_eq!(d.drive(id, Some(0.1), Some(0.0)), None, "c{} must wait", i);
            cold.push(id);
        }
        prop_assert!(d.core.release(holder_lease, d.now));
        d.core.finish_session("holder", d.now);

        // Every round polls every waiter once (a woken driver always polls), in an order the
        // random numbers shuffle.
        let mut admitted = Vec::new();
        let mut polls = polls.into_iter().cycle();
        for _ in 0..waiters * 4 {
            let mut order = d.attempts.clone();
            for i in (1..order.len()).rev() {
                order.swap(i, polls.next().unwrap() % (i + 1));
            }
            for id in order {
                if let Some(lease) = d.drive(id, Some(0.1), Some(0.0)) {
                    let i = cold.iter().position(|c| *c == id).unwrap();
                    admitted.push(i);
                    prop_assert!(d.core.release(lease, d.now));
                    d.core.finish_session(&format!("c{i}"), d.now);
                }
            }
        }
        prop_assert_eq!(admitted, (0..waiters).collect::<Vec<_>>());
    }
}
