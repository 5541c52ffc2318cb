//! Stress: 10,000 sessions with random acquire / release / finish / retry / cancel driven
//! through the core with a seeded RNG. At the end nothing leaks and the counters add up.
use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use session_gate::gate::testing::usage_report;
use session_gate::gate::{
    Action, AttemptId, GateConfig, GateCore, LeaseId, PrefixReport, Reason, UsageReport,
};

const SESSIONS: usize = 10_000;
const STEPS: usize = 300_000;
const BLOCKS: u64 = 200_000;
const BS: u64 = 16;

#[derive(Default)]
struct Tally {
    begun: u64,
    admitted: u64,
    preempted: u64,
    cancelled: u64,
    by_reason: HashMap<Reason, u64>,
}

struct Sim {
    core: GateCore,
    rng: StdRng,
    now: f64,
    /// Attempts the simulated drivers still hold: id → (session, expected to be preempted).
    attempts: Vec<(AttemptId, usize, bool)>,
    /// Newest attempt per session.
    newest: HashMap<usize, AttemptId>,
    leases: Vec<LeaseId>,
    released: Vec<LeaseId>,
    /// Each session's prompt grows every turn, as agent histories do.
    prompt: Vec<usize>,
    tally: Tally,
}

impl Sim {
    fn usage(&mut self) -> Result<UsageReport, String> {
        if self.rng.random_bool(0.05) {
            return Err("usage probe failed".into());
        }
        Ok(usage_report(self.rng.random_range(0.0..1.0), BLOCKS, BS))
    }

    fn prefix(&mut self) -> Result<PrefixReport, String> {
        if self.rng.random_bool(0.03) {
            return Err("unavailable".into());
        }
        let hit_ratio: f64 = self.rng.random_range(0.0..1.0);
        // Half the engines have a host KV tier holding part of the rest of the prompt.
        let prompt: u64 = 1000;
        let hit_tokens = (hit_ratio * prompt as f64) as u64;
        let offloaded_tokens = self
            .rng
            .random_bool(0.5)
            .then(|| self.rng.random_range(0..=prompt - hit_tokens));
        Ok(PrefixReport {
            hit_ratio,
            hit_tokens,
            prompt_tokens: prompt,
            offloaded_tokens,
            ..Default::default()
        })
    }

    fn begin(&mut self) {
        let s = self.rng.random_range(0..SESSIONS);
        if self.prompt[s] == 0 {
            self.prompt[s] = self.rng.random_range(500..3000);
        }
        self.prompt[s] += self.rng.random_range(50..1500);
        let prompt = self.prompt[s];
        let max = self.rng.random_range(0..512);
        let retain = self.rng.random_bool(0.7);
        let id = self
            .core
            .begin(&format!("s{s}"), prompt, max, retain, self.now);
        if let Some(old) = self.newest.insert(s, id)
            && let Some(a) = self.attempts.iter_mut().find(|a| a.0 == old)
        {
            a.2 = true;
        }
        self.attempts.push((id, s, false));
        self.tally.begun += 1;
    }

    /// One poll and, if asked, one probe answer. Returns false once the attempt is over.
    fn step(&mut self, i: usize, usage: Option<f64>) -> bool {
        let (id, s, doomed) = self.attempts[i];
        let action = self.core.poll(id, self.now).unwrap();
        if doomed {
            assert_eq!(
                action,
                Action::Preempted,
                "a superseded attempt must be preempted"
            );
        }
        match action {
            Action::ProbeUsage => {
                let r = match usage {
                    Some(u) => Ok(usage_report(u, BLOCKS, BS)),
                    None => self.usage(),
                };
                self.core.on_usage(id, r, self.now).unwrap();
                true
            }
            Action::ProbePrefix => {
                let r = self.prefix();
                self.core.on_prefix(id, r, self.now).unwrap();
                true
            }
            Action::Wait { until } => {
                assert!(until > self.now, "a wait always ends in the future");
                false
            }
            Action::Admit(a) => {
                self.leases.push(a.lease);
                self.tally.admitted += 1;
                *self.tally.by_reason.entry(a.reason).or_default() += 1;
                self.finish_attempt(i, s);
                false
            }
            Action::Preempted => {
                assert!(doomed, "only superseded attempts are preempted");
                self.tally.preempted += 1;
                self.finish_attempt(i, s);
                false
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    fn finish_attempt(&mut self, i: usize, s: usize) {
        let (id, ..) = self.attempts.swap_remove(i);
        if self.newest.get(&s) == Some(&id) {
            self.newest.remove(&s);
        }
    }

    fn drive(&mut self, i: usize, usage: Option<f64>) {
        let id = self.attempts[i].0;
        for _ in 0..8 {
            if !self.step(i, usage) {
                return;
            }
            // `step` may have swapped another attempt into slot i; stop if so.
            if self.attempts.get(i).map(|a| a.0) != Some(id) {
                return;
            }
        }
        panic!("attempt kept asking for probes");
    }

    fn cancel(&mut self, i: usize) {
        let (id, s, doomed) = self.attempts[i];
        assert!(self.core.cancel(id, self.now));
        if doomed {
            self.tally.preempted += 1;
        } else {
            self.tally.cancelled += 1;
        }
        self.finish_attempt(i, s);
    }

    fn release(&mut self) {
        let i = self.rng.random_range(0..self.leases.len());
        let lease = self.leases.swap_remove(i);
        let ok = if self.rng.random_bool(0.1) {
            self.core.release_dropped(lease, self.now)
        } else {
            self.core.release(lease, self.now)
        };
        assert!(ok);
        self.released.push(lease);
    }
}

#[test]
fn ten_thousand_sessions_with_random_traffic_leak_nothing_and_add_up() {
    let cfg = GateConfig {
        idle_grace_sec: 30.0,
        max_wait_sec: Some(60.0),
        ..Default::default()
    };
    let mut sim = Sim {
        core: GateCore::new(cfg).unwrap(),
        rng: StdRng::seed_from_u64(0x5e55_1011),
        now: 0.0,
        attempts: Vec::new(),
        newest: HashMap::new(),
        leases: Vec::new(),
        released: Vec::new(),
        prompt: vec![0; SESSIONS],
        tally: Tally::default(),
    };
    let mut peak_reserved = 0;
    let mut peak_waiting = 0;
    for step in 0..STEPS {
        match sim.rng.random_range(0..100) {
            0..22 => sim.begin(),
            22..65 if !sim.attempts.is_empty() => {
                let i = sim.rng.random_range(0..sim.attempts.len());
                sim.drive(i, None);
            }
            65..82 if !sim.leases.is_empty() => sim.release(),
            82..84 if !sim.released.is_empty() => {
                // Double release of an old lease: always a no-op.
                let i = sim.rng.random_range(0..sim.released.len());
                assert!(!sim.core.release(sim.released[i], sim.now));
            }
            84..88 => {
                let s = sim.rng.random_range(0..SESSIONS);
                sim.core.finish_session(&format!("s{s}"), sim.now);
                sim.prompt[s] = 0;
            }
            88..91 if !sim.attempts.is_empty() => {
                let i = sim.rng.random_range(0..sim.attempts.len());
                sim.cancel(i);
            }
            91..100 => sim.now += sim.rng.random_range(0.0..0.05),
            _ => {}
        }
        if step % 20_000 == 0 {
            sim.core.check_invariants().unwrap();
        }
        let s = sim.core.stats();
        peak_reserved = peak_reserved.max(s.reservations_held);
        peak_waiting = peak_waiting.max(s.waiting);
    }
    sim.core.check_invariants().unwrap();
    let mid = sim.core.stats();
    eprintln!(
        "peak reserved {peak_reserved}, peak waiting {peak_waiting}, admissions {:?}, \
         revocations {}, preemptions {}, cancellations {}, grace expired {}",
        mid.admissions, mid.revocations, mid.preemptions, mid.cancellations, mid.grace_expired
    );
    assert!(peak_waiting > 10, "the run must put waiters under pressure");
    assert!(peak_reserved > 50);
    assert!(mid.revocations > 0 && mid.preemptions > 0 && mid.cancellations > 0);
    assert!(mid.grace_expired > 0 && mid.sessions_finished > 0);
    for r in Reason::ALL {
        // Committed pressure counts a prefix probe that cannot answer as a miss: only engine
        // pressure fails open.
        let never = r == Reason::PrefixProbeUnavailable;
        assert_eq!(
            mid.admitted(r) == 0,
            never,
            "admissions with reason {}: {}",
            r.as_str(),
            mid.admitted(r)
        );
    }

    // Drain: release everything, let windows expire, and drive every waiter to its end with
    // an idle engine. Every waiter must be admitted (or was preempted/cancelled).
    for round in 0.. {
        assert!(round < 10_000, "waiters never drained");
        while !sim.leases.is_empty() {
            sim.release();
        }
        if sim.attempts.is_empty() {
            break;
        }
        sim.now += 31.0;
        for i in (0..sim.attempts.len()).rev() {
            if i < sim.attempts.len() {
                sim.drive(i, Some(0.0));
            }
        }
    }
    sim.now += 31.0;
    sim.core.expire(sim.now);
    sim.core.check_invariants().unwrap();

    let s = sim.core.stats();
    let t = &sim.tally;
    assert_eq!(
        (s.reservations_held, s.committed_blocks),
        (0, 0),
        "leaked reservations"
    );
    assert_eq!(
        (s.pending, s.waiting, s.leases_active, s.sessions),
        (0, 0, 0, 0)
    );
    assert_eq!(s.attempts, t.begun);
    assert_eq!(t.begun, t.admitted + t.preempted + t.cancelled);
    assert_eq!(s.admissions_total(), t.admitted);
    assert_eq!(s.preemptions, t.preempted);
    assert_eq!(s.cancellations, t.cancelled);
    for r in Reason::ALL {
        assert_eq!(s.admitted(r), t.by_reason.get(&r).copied().unwrap_or(0));
    }
    assert_eq!(
        s.leases_released + s.leases_dropped_unreleased,
        s.admissions_total()
    );
    assert_eq!(s.wait.count, s.admissions_total());
}
