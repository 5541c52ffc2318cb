//! `GateCore`: the sans-IO admission state machine. It never reads a clock and never does I/O;
//! drivers pass `now` (monotonic seconds) into every call and carry out the [`Action`]s it returns.
//!
//! # Decision tree
//!
//! Every poll cycle of an attempt starts with a usage probe, and then, per
//! [`Pressure`]:
//!
//! **Committed** (default). `line = high_watermark × num_blocks`; `ws` = blocks of prompt +
//! max_tokens; `committed` = working sets of every reserved session (in flight or idle).
//! 0. The engine has a readable host KV tier that holds `committed + ws` (the session's own
//!    reservation counted once), and FIFO allows it → `open`, whatever the usage and the line:
//!    the gate steps aside (see "With a host KV tier").
//! 1. The session holds a reservation: if older reservations are committed and their working
//!    sets plus this `ws` exceed `line`, the reservation is *revoked* (counted; the lease says
//!    `revoked`) and the attempt goes on as a cold one, but keeps its session's place in line
//!    (see FIFO). The oldest reservation is never revoked: with nothing older there is nobody
//!    to yield to. Otherwise it is admitted at once, no prefix probe: `open` if usage <
//!    watermark, the updated committed set fits under `line` and FIFO allows it, else
//!    `reserved_session`.
//! 2. Cold, and FIFO allows it (see below): `open` when nothing is committed (so an oversize
//!    session never waits forever), or when usage < watermark and `committed + ws ≤ line`, or
//!    when usage < watermark and idle reservations may yield enough room (see "Yielding idle
//!    room").
//! 3. Otherwise a prefix probe: unavailable (an error, or no answer within
//!    `probe_timeout_sec`) → a miss (see "A probe that does not answer"); `hit_ratio ≥
//!    hit_threshold` and `committed + ws ≤ num_blocks` → `resident_prefix`; else, when the
//!    engine has a readable host KV tier, `(hit_tokens + offloaded_tokens) ÷ prompt_tokens ≥
//!    hit_threshold` and `committed + ws ≤ num_blocks` → `offloaded_prefix` (the prefix
//!    reloads over PCIe in milliseconds instead of being recomputed: warm at its reload
//!    cost). A report with `offloaded_tokens: None` (no tier) never gives it.
//! 4. Otherwise `max_wait` if the attempt has waited `max_wait_sec`, else wait.
//!
//! Every admission takes (or renews) the session's reservation.
//!
//! **Yielding idle room.** A reservation in its idle grace window (its session is between
//! turns, e.g. running a tool) may give its room to the attempt at the head of the queue once
//! it has been idle for both
//! - [`YIELD_AFTER_TURNS`] (8) of its session's own mean turn times (admission to release of
//!   the leases that held this reservation), and
//! - [`YIELD_FLOOR_OF_GRACE`] (half) of `idle_grace_sec`,
//!
//! or, sooner, once idle [`GONE_AFTER_GAPS`] (2) times the 90th percentile of the recent
//! return gaps (release of a session's turn to its next `begin`, over all sessions, once 8 were
//! seen; a session that lost its room counts its gap when it returns): a session away that long is more likely finished than in a tool call, and a client
//! that never calls `finish_session` (a plain HTTP client behind the middleware) cannot say so.
//!
//! It yields only to a cold attempt that FIFO lets take free room and that does not fit
//! otherwise, longest idle first, and only if dropping them makes it fit; otherwise nothing is
//! dropped. A yielded reservation counts as a revocation; its session's next turn is a cold
//! attempt like a new one. The head of the queue is woken when the next idle reservation may
//! yield. Why: re-prefilling a session's context costs at most about one of its turns, so once
//! it has been idle for many of its turns, holding its room has cost the waiters more than
//! its re-prefill will. So `idle_grace_sec` means: a session between turns holds its room for
//! at least half of `idle_grace_sec` (more if its turns are slow) and at most all of it; with
//! nobody waiting, or a head that would not fit anyway, it holds the whole window. With the
//! default 60 s, sessions whose tools return within 30 s, and within twice the usual return
//! gap, never lose their room to a waiter.
//!
//! **An idle engine.** A usage report may carry the engine scheduler's request counts
//! (`num_running_reqs`, `num_waiting_reqs`: vLLM's running list and waiting queue, not
//! counting requests the engine gate holds back in scheduler mode). When both are 0 the engine
//! has nothing to do, and an idle reservation may yield to the head of the queue once idle
//! `idle_engine_turns` (a knob, default 4; 0 turns the rule off) of its session's own mean
//! turn times, with no floor
//! (the grace-window floor and the 8 turns above still apply while the engine is busy; they
//! are counted in `idle_engine_yields` as well as in `revocations`). Why: the rule above prices
//! a re-prefill at about one turn and waits many turns because a waiter admitted early competes
//! with the engine's work; with no work in the engine, a waiter held back for a tool call that
//! runs many of the sessions' turns long only leaves the engine idle. Turn times measure the
//! hardware: on a CPU where re-prefilling the tiny model takes milliseconds (AMX), four turns
//! are a fraction of a tool call and rooms yield often; on the H200 profiles, where the engine
//! is never idle while sessions wait, nothing changes. Measured on the twin
//! (`docs/lab-notes/idle-engine.md`): 0.83x / 0.94x the makespan of the rule without it on
//! `default` / `mixed` with a profile fitted on an AMX VM, identical on the shipped `cpu-tiny`
//! and every H200 row but `long-tool` (+1.8%). Rejected on the same runs: admitting the head
//! over the line while the engine is idle (4% slower on `mixed` with the shipped profile,
//! hit 0.74), and 1-3 turns (1 is slower on the shipped profile; 3 is within 2% of 4). A
//! report without the counts (an older plugin, a C probe that leaves `has_num_reqs` false)
//! never shows an idle engine.
//!
//! **With a host KV tier** that holds every committed working set (step 0), the gate steps
//! aside: a prefix evicted from the GPU reloads from the tier (vLLM stores every computed
//! prompt block there) in milliseconds instead of being recomputed, so holding a turn back to
//! keep prefixes resident costs batch size and saves little. The committed set still counts
//! every admitted session (each `open` admission reserves) until its idle window ends, so it
//! measures the live working sets the tier must hold; once they outgrow the tier the decision
//! tree is as without one. Measured on the twin (`docs/lab-notes/host-tier.md`): no slower
//! than no gate (within 0.1%) on every H200 row whose tier holds the working sets, where the
//! tree alone was up to 11% slower, and 6-9% faster than the tree alone on 32B with a 512 GiB
//! tier that holds a fifth of them (the gate steps aside until the sessions outgrow it). The
//! cost: on 7B `rl-async` stepping aside is 2% slower than the GPU-only gate (no gate with the
//! tier is too). Rejected on the same runs: yielding idle rooms at once (loses 50% where the
//! tier cannot hold the working sets), and admitting `open` while the tier is not full (a tier
//! fills once and stays full, so in a long-running engine that rule does nothing). The yield
//! rule is the same with or without a tier. A prefix that did leave the GPU but sits in the
//! tier comes back as `offloaded_prefix` (step 3).
//!
//! Idle reservations that may yield also go before a revocation (step 1): when a returning
//! session's grown working set would revoke it, idle rooms that may yield are dropped first if
//! that lets it keep its own.
//!
//! **Engine** (the original design's rule, literally): usage < watermark and FIFO allows it → `open`; else a
//! reserved session → `reserved_session`; else the prefix probe as in 3 (no capacity check) and
//! 4. `open` takes no reservation unless the session already holds one; admissions under
//! pressure take one when `retain_session` is set; nothing is revoked.
//!
//! **A probe that does not answer.** The seed admits a turn whose prefix probe is unavailable
//! (`prefix_probe_unavailable`, fail open), and engine mode still does: it decides on the probes
//! alone, and waiting on a dead one could wait forever. Committed mode counts blocks itself, and
//! room under the line frees as turns release and idle windows end whatever the probes say, so
//! there an unavailable prefix probe is a miss: the attempt waits (up to `max_wait_sec`) and
//! probes again next cycle. Why: probes are answered between engine steps, and one times out
//! when steps run longer than `probe_timeout_sec` (long prefills on a slow CPU), which is when
//! the cache is under pressure. Admitting those turns blind re-prefilled their contexts and
//! lengthened the next steps: on a 2-core AVX2 VM `gate` failed open 30 times on `mixed` and
//! kept 0.64x the ideal hit rate (`docs/lab-notes/scheduler-mode.md`). Probe failures are
//! counted in the probes' stats (`failures`). A plugin that answers nothing never blocks a turn
//! either: until a usage report has told the geometry, working sets count 0 blocks, the
//! committed set stays empty, and every turn is `open`.
//!
//! A usage probe that fails leaves the usage unknown: committed mode then decides on the
//! committed set alone, engine mode assumes pressure. Until a usage report has told the block
//! size, working sets are unknown and the capacity checks are skipped.
//!
//! # FIFO, precisely
//!
//! Each attempt has an order key: its arrival (begin) order, inherited by a retry from the
//! attempt it preempts, so a retry keeps the session's place in line. A revoked attempt takes
//! the key of the attempt that obtained the lost reservation (and a reservation obtained with
//! that key keeps it), so a revoked session waits ahead of every session that arrived after it:
//! its prefix is still resident when room frees up, theirs is cold. Attempts that were told to
//! wait sit in a queue by that key. A cold attempt may take free room (`open`) only when no
//! queued attempt has a smaller key: a later waiter never takes room ahead of an earlier one
//! that is still blocked, even when only the later one would fit. Admissions that do not take
//! free room — `reserved_session`, `resident_prefix`, `prefix_probe_unavailable`, `max_wait` —
//! are not ordered: preferring sessions whose prefix is resident is the point of the gate, and
//! reserved sessions re-entering never queue.
//!
//! # Waking waiters
//!
//! [`GateCore::epoch`] increases whenever something happens that may let a waiting attempt
//! proceed or end it: a release, `finish_session`, an expired grace window, a revocation, a
//! preemption, or the head of the queue leaving. A driver keeps one broadcast notification: after
//! any call that changed the epoch it wakes every waiter, and each waiter polls again. The core
//! answers a spurious wake-up with the same `Wait` without asking for a probe, so only the
//! waiters that can gain (the head of the queue, preempted attempts) do any work. A driver
//! that keeps its waiters in one place can skip even those polls: [`GateCore::would_wake`] says
//! which waiters a poll would answer with anything else (the engine's book polls only them).
//!
//! `Wait { until }` is the earliest of `now + wait_poll_sec`, `begin + max_wait_sec`, and — for
//! the head of the queue — the end of the next idle grace window, whose purge may let it in,
//! and the next time an idle reservation may yield.
//! A usage reading taken before the epoch last moved is not trusted for a decision to wait: the
//! attempt starts a fresh cycle instead (usage is cached for one cycle, never across a release).
use std::collections::BTreeMap;

mod audit;
mod decide;
mod gaps;
mod idmap;

pub(crate) use idmap::IdMap;

use self::gaps::ReturnGaps;
use super::config::{GateConfig, Pressure};
use super::ledger::Ledger;
use super::metrics::GateStats;
use super::session::{Reservation, Sessions};
use super::types::{
    Action, Admission, AttemptId, LeaseId, PrefixReport, ProbeKind, Reason, UsageReport,
};
use crate::error::{Error, Result};

/// An idle reservation may yield once idle this many of its session's own mean turn times
/// (module docs, "Yielding idle room"). Not a knob: chosen once on the whole twin matrix.
pub(crate) const YIELD_AFTER_TURNS: f64 = 8.0;
/// ... and at least this fraction of `idle_grace_sec` (module docs, as above).
pub(crate) const YIELD_FLOOR_OF_GRACE: f64 = 0.5;
/// Or, sooner, once idle this many times the recent 90th percentile of return gaps: by then
/// the session is more likely gone than in a tool call (module docs, as above).
pub(crate) const GONE_AFTER_GAPS: f64 = 2.0;

/// Cache geometry from the latest valid usage report.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Geometry {
    num_blocks: u64,
    block_size: u64,
    /// The host KV tier's capacity in GPU blocks, if the engine has a readable one.
    tier_blocks: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// A new cycle: the next poll asks for a usage probe.
    AwaitUsage,
    /// The usage answer is in; the next poll decides.
    Decide,
    AwaitPrefix,
    /// The prefix answer is in; the next poll decides.
    DecidePrefix,
    Waiting {
        until: f64,
        seen_epoch: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Hit {
    NotAsked,
    Unavailable,
    /// The GPU-resident hit ratio, and the ratio of GPU-resident plus host-tier tokens when
    /// the engine has a readable host tier.
    Ratio(f64, Option<f64>),
}

#[derive(Debug)]
struct Attempt {
    slot: u32,
    /// FIFO key (see the module docs).
    order: u64,
    ws_tokens: u64,
    started: f64,
    phase: Phase,
    /// This cycle's vLLM usage; `None` = the probe failed.
    usage: Option<f64>,
    /// This cycle's usage report said the engine had nothing running or waiting.
    engine_idle: bool,
    /// Epoch when this cycle's usage was taken: a decision to wait on data older than the last
    /// release starts a fresh cycle instead.
    usage_epoch: u64,
    hit: Hit,
    retain: bool,
    preempted: bool,
    queued: bool,
    revoked: bool,
}

#[derive(Debug)]
struct LeaseRec {
    slot: u32,
    /// Age of the reservation this lease holds, if any. A lease outliving its reservation
    /// (finished, revoked) must not touch the session's next one.
    reservation: Option<u64>,
    /// When it was admitted: its duration is one of its session's turn times.
    admitted_at: f64,
}

enum Step {
    Admit(Reason),
    Prefix,
    Wait,
    Restart,
}

/// GPU-resident plus host-tier tokens over the prompt, when the report has a tier.
fn tiered_ratio(r: &PrefixReport) -> Option<f64> {
    let offloaded = r.offloaded_tokens?;
    if r.prompt_tokens == 0 {
        return Some(r.hit_ratio);
    }
    let tiered = (r.hit_tokens + offloaded) as f64 / r.prompt_tokens as f64;
    Some(tiered.clamp(r.hit_ratio, 1.0))
}

/// The sans-IO admission gate. See the module docs for the decision tree, FIFO and waking.
#[derive(Debug)]
pub struct GateCore {
    cfg: GateConfig,
    sessions: Sessions,
    ledger: Ledger,
    attempts: IdMap<Attempt>,
    /// order key → attempt, for attempts told to wait.
    queue: BTreeMap<u64, u64>,
    leases: IdMap<LeaseRec>,
    geometry: Option<Geometry>,
    next_attempt: u64,
    next_lease: u64,
    epoch: u64,
    pending: u64,
    /// Sessions' recent return gaps (between turns), for "Yielding idle room".
    gaps: ReturnGaps,
    stats: GateStats,
}

impl GateCore {
    /// A core with these knobs, validated.
    pub fn new(config: GateConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            cfg: config,
            sessions: Sessions::default(),
            ledger: Ledger::default(),
            attempts: IdMap::default(),
            queue: BTreeMap::new(),
            leases: IdMap::default(),
            geometry: None,
            next_attempt: 1,
            next_lease: 1,
            epoch: 0,
            pending: 0,
            gaps: ReturnGaps::default(),
            stats: GateStats::new(),
        })
    }

    /// The knobs.
    pub fn config(&self) -> &GateConfig {
        &self.cfg
    }

    /// Starts an admission attempt for one turn of `session_id`. Older attempts of the same
    /// session that are not admitted yet are preempted: their next poll answers
    /// [`Action::Preempted`], and this attempt takes over their place in the FIFO.
    ///
    /// `max_tokens` is the turn's output budget (a number, or `None` for a plain
    /// `acquire(session_id, prompt_ids)`: the working set then counts
    /// [`GateConfig::default_max_tokens`]).
    pub fn begin(
        &mut self,
        session_id: &str,
        prompt_tokens: usize,
        max_tokens: impl Into<Option<usize>>,
        retain_session: bool,
        now: f64,
    ) -> AttemptId {
        let max_tokens = max_tokens.into().unwrap_or(self.cfg.default_max_tokens);
        self.expire(now);
        let slot = self.sessions.get_or_insert(session_id);
        self.note_return(slot, now);
        let id = self.next_attempt;
        self.next_attempt += 1;
        let mut order = id;
        let mut queued = false;
        if let Some(old_id) = self.sessions.get(slot).pending {
            let old = self
                .attempts
                .get_mut(&old_id)
                .expect("pending attempt exists");
            old.preempted = true;
            order = old.order;
            if old.queued {
                old.queued = false;
                queued = true;
                self.queue.insert(order, id);
            }
            self.sessions.get_mut(slot).num_preempted += 1;
            self.pending -= 1;
            self.stats.preemptions += 1;
            // The old attempt may be asleep in a Wait: wake it so it learns.
            self.epoch += 1;
        }
        let session = self.sessions.get_mut(slot);
        session.pending = Some(id);
        session.attempts += 1;
        self.attempts.insert(
            id,
            Attempt {
                slot,
                order,
                ws_tokens: prompt_tokens as u64 + max_tokens as u64,
                started: now,
                phase: Phase::AwaitUsage,
                usage: None,
                engine_idle: false,
                usage_epoch: self.epoch,
                hit: Hit::NotAsked,
                retain: retain_session,
                preempted: false,
                queued,
                revoked: false,
            },
        );
        self.pending += 1;
        self.stats.attempts += 1;
        AttemptId(id)
    }

    /// What the driver must do next for `attempt`. Purges expired grace windows first.
    /// `Err(StaleHandle)` if the attempt is unknown (already admitted, preempted or cancelled).
    pub fn poll(&mut self, attempt: AttemptId, now: f64) -> Result<Action> {
        self.expire(now);
        let id = attempt.0;
        let Some(a) = self.attempts.get(&id) else {
            return Err(stale_attempt(attempt));
        };
        if a.preempted {
            let slot = a.slot;
            self.attempts.remove(&id);
            self.sessions.get_mut(slot).attempts -= 1;
            self.sessions.gc(slot);
            return Ok(Action::Preempted);
        }
        let step = match a.phase {
            Phase::AwaitUsage => return Ok(Action::ProbeUsage),
            Phase::AwaitPrefix => return Ok(Action::ProbePrefix),
            Phase::Waiting { until, seen_epoch } => {
                let woken = seen_epoch != self.epoch && self.may_open(a.order);
                if now < until && !woken {
                    return Ok(Action::Wait { until });
                }
                Step::Restart
            }
            Phase::Decide => self.decide_on_usage(id, now),
            Phase::DecidePrefix => self.decide_on_prefix(id, now),
        };
        Ok(match step {
            Step::Admit(reason) => Action::Admit(self.admit(id, reason, now)),
            Step::Prefix => {
                self.attempt_mut(id).phase = Phase::AwaitPrefix;
                Action::ProbePrefix
            }
            Step::Wait => Action::Wait {
                until: self.wait(id, now),
            },
            Step::Restart => {
                let a = self.attempt_mut(id);
                a.phase = Phase::AwaitUsage;
                a.hit = Hit::NotAsked;
                Action::ProbeUsage
            }
        })
    }

    /// The usage probe's answer for `attempt` (`Err` = unavailable, timed out included). An
    /// answer the attempt is not waiting for is ignored.
    pub fn on_usage(
        &mut self,
        attempt: AttemptId,
        report: std::result::Result<UsageReport, String>,
        _now: f64,
    ) -> Result<()> {
        let epoch = self.epoch;
        let a = self
            .attempts
            .get_mut(&attempt.0)
            .ok_or_else(|| stale_attempt(attempt))?;
        if a.phase != Phase::AwaitUsage || a.preempted {
            return Ok(());
        }
        let report = report.ok().filter(|r| r.problem().is_none());
        a.usage = report.map(|r| r.kv_cache_usage);
        a.engine_idle = report.is_some_and(|r| r.engine_idle());
        a.usage_epoch = epoch;
        a.phase = Phase::Decide;
        if let Some(r) = report {
            self.set_geometry(Geometry {
                num_blocks: r.num_blocks,
                block_size: r.block_size,
                tier_blocks: r.offload_num_blocks,
            });
        }
        Ok(())
    }

    /// The prefix probe's answer for `attempt` (`Err` = unavailable, timed out included). An
    /// answer the attempt is not waiting for is ignored.
    pub fn on_prefix(
        &mut self,
        attempt: AttemptId,
        report: std::result::Result<PrefixReport, String>,
        _now: f64,
    ) -> Result<()> {
        let a = self
            .attempts
            .get_mut(&attempt.0)
            .ok_or_else(|| stale_attempt(attempt))?;
        if a.phase != Phase::AwaitPrefix || a.preempted {
            return Ok(());
        }
        a.hit = match report {
            Ok(r) if r.problem().is_none() => Hit::Ratio(r.hit_ratio, tiered_ratio(&r)),
            _ => Hit::Unavailable,
        };
        a.phase = Phase::DecidePrefix;
        Ok(())
    }

    /// Records one probe call's latency; `ok = false` counts a failure (error or timeout).
    pub fn record_probe(&mut self, kind: ProbeKind, secs: f64, ok: bool) {
        let p = &mut self.stats.probes[kind.index()];
        p.latency.observe(secs);
        if !ok {
            p.failures += 1;
        }
    }

    /// The attempt's caller went away: forget it completely (queue slot included). Returns
    /// false if the attempt was unknown. A cancelled preempted attempt stays counted as
    /// preempted.
    pub fn cancel(&mut self, attempt: AttemptId, now: f64) -> bool {
        self.expire(now);
        let Some(a) = self.attempts.remove(&attempt.0) else {
            return false;
        };
        if !a.preempted {
            self.pending -= 1;
            self.stats.cancellations += 1;
            let session = self.sessions.get_mut(a.slot);
            if session.pending == Some(attempt.0) {
                session.pending = None;
            }
        }
        self.sessions.get_mut(a.slot).attempts -= 1;
        self.dequeue(&a);
        self.sessions.gc(a.slot);
        true
    }

    /// Releases a lease. With `retain_session` its reservation turns into an idle grace window
    /// of `idle_grace_sec`; otherwise it is dropped. Returns false (and does nothing) if the
    /// lease is unknown, e.g. released already.
    pub fn release(&mut self, lease: LeaseId, now: f64) -> bool {
        self.release_inner(lease, now, false)
    }

    /// Like [`GateCore::release`], for a lease its holder dropped without releasing; counted
    /// in `leases_dropped_unreleased`.
    pub fn release_dropped(&mut self, lease: LeaseId, now: f64) -> bool {
        self.release_inner(lease, now, true)
    }

    /// Ends the session's ownership window at once (in flight or idle). Returns whether there
    /// was one. The driver then calls the probe's optional `forget`.
    pub fn finish_session(&mut self, session_id: &str, now: f64) -> bool {
        self.expire(now);
        let Some(slot) = self.sessions.slot_of(session_id) else {
            return false;
        };
        let ended = self.drop_reservation(slot);
        if ended {
            self.stats.sessions_finished += 1;
            self.epoch += 1;
        }
        self.sessions.gc(slot);
        ended
    }

    /// Purges grace windows that ended by `now`; returns how many. Every `begin`, `poll`,
    /// `cancel` and `finish_session` does this first, so calling it is optional: expired
    /// windows are purged lazily by whichever caller looks next.
    pub fn expire(&mut self, now: f64) -> usize {
        let mut n = 0;
        while let Some((slot, age)) = self.ledger.pop_expired(now) {
            let session = self.sessions.get_mut(slot);
            let Some(res) = session.reservation.take_if(|r| r.age == age) else {
                continue;
            };
            self.ledger.close(res.age, None);
            if let Some(until) = res.idle_until {
                self.note_departed(slot, until);
            }
            self.stats.grace_expired += 1;
            self.sessions.gc(slot);
            n += 1;
        }
        if n > 0 {
            self.epoch += 1;
        }
        n
    }

    /// Whether a [`Self::poll`] of `attempt` at `now` (after [`Self::expire`]) would do more
    /// than answer the same `Wait` it last gave: true unless it waits, its deadline is ahead
    /// and nothing it can gain from happened. A driver waking its waiters after the epoch moved
    /// polls only these: the others' answer is known, and asking costs each one a poll.
    pub fn would_wake(&self, attempt: AttemptId, now: f64) -> bool {
        match self.attempts.get(&attempt.0) {
            Some(a) if !a.preempted => match a.phase {
                Phase::Waiting { until, seen_epoch } => {
                    now >= until || (seen_epoch != self.epoch && self.may_open(a.order))
                }
                _ => true,
            },
            _ => true,
        }
    }

    /// Increases whenever waiters should poll again (see the module docs).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// When the earliest idle grace window ends, i.e. when a purge will be due. Waiters are
    /// also given their own deadline in [`Action::Wait`].
    pub fn next_deadline(&self) -> Option<f64> {
        self.ledger.next_expiry()
    }

    /// How many attempts of this session were preempted while the core has known it (state is
    /// dropped once a session holds nothing and has nothing pending).
    pub fn num_preempted(&self, session_id: &str) -> u32 {
        self.sessions
            .slot_of(session_id)
            .map_or(0, |slot| self.sessions.get(slot).num_preempted)
    }

    /// The session a lease (issued and not released) was admitted for.
    pub fn lease_session(&self, lease: LeaseId) -> Option<&str> {
        let rec = self.leases.get(&lease.0)?;
        Some(&self.sessions.get(rec.slot).id)
    }

    /// Grows the working set a lease's reservation commits to `ws_tokens` (prompt + max_tokens)
    /// while the lease runs: a request that takes more input without a new admission (vLLM's
    /// streaming-input sessions: each chunk extends the same request) commits what it now
    /// holds. Never shrinks (a shorter chunk frees no block the request holds) and wakes
    /// nobody (less room cannot admit anyone). Returns whether the commitment grew; false for
    /// an unknown lease or one without a reservation (engine pressure mode's `open`).
    pub fn grow_lease(&mut self, lease: LeaseId, ws_tokens: u64) -> bool {
        let Some(rec) = self.leases.get(&lease.0) else {
            return false;
        };
        let blocks = self.blocks(ws_tokens);
        let session = self.sessions.get_mut(rec.slot);
        let Some(res) = session.reservation.as_mut() else {
            return false;
        };
        if rec.reservation != Some(res.age) || ws_tokens <= res.ws_tokens {
            return false;
        }
        let blocks = blocks.unwrap_or(0);
        self.ledger.resize(res.age, res.ws_blocks, blocks);
        res.ws_tokens = ws_tokens;
        res.ws_blocks = blocks;
        true
    }

    /// Whether the session currently holds a reservation (in flight or idle).
    pub fn has_reservation(&self, session_id: &str) -> bool {
        self.sessions
            .slot_of(session_id)
            .is_some_and(|slot| self.sessions.get(slot).reservation.is_some())
    }

    /// A snapshot of every counter and gauge.
    pub fn stats(&self) -> GateStats {
        let mut s = self.stats.clone();
        s.leases_active = self.leases.len() as u64;
        s.reservations_held = self.ledger.len() as u64;
        s.reservations_idle = self.ledger.idle_len() as u64;
        s.committed_blocks = self.ledger.committed();
        s.pending = self.pending;
        s.waiting = self.queue.len() as u64;
        s.sessions = self.sessions.len() as u64;
        s
    }

    /// Prometheus text exposition of [`GateCore::stats`].
    pub fn prometheus(&self) -> String {
        self.stats().prometheus()
    }

    // ---- state changes ---------------------------------------------------------------------

    /// A session back from its idle window: its return gap is one sample of how long sessions
    /// stay away (see [`GONE_AFTER_GAPS`]). A preempting retry is not a return.
    fn note_return(&mut self, slot: u32, now: f64) {
        let session = self.sessions.get(slot);
        if session.pending.is_some() {
            return;
        }
        match &session.reservation {
            Some(res) => {
                if let Some(until) = res.idle_until {
                    self.gaps.record(now - (until - self.cfg.idle_grace_sec));
                }
            }
            None => self.gaps.returned(&session.id, now),
        }
    }

    /// The idle reservation of `slot`, whose window ends at `until`, is taken away (it yielded
    /// or its window ended): remember when its session went idle, so its gap counts if it
    /// comes back.
    fn note_departed(&mut self, slot: u32, until: f64) {
        let since = until - self.cfg.idle_grace_sec;
        self.gaps.departed(&self.sessions.get(slot).id, since);
    }

    fn attempt_mut(&mut self, id: u64) -> &mut Attempt {
        self.attempts.get_mut(&id).expect("live attempt")
    }

    fn wait(&mut self, id: u64, now: f64) -> f64 {
        let poll = now + self.cfg.wait_poll_sec;
        let max_wait = self.cfg.max_wait_sec;
        let epoch = self.epoch;
        let a = self.attempts.get_mut(&id).expect("live attempt");
        if !a.queued {
            a.queued = true;
            self.queue.insert(a.order, id);
        }
        let mut until = poll;
        if let Some(m) = max_wait {
            until = until.min(a.started + m);
        }
        let order = a.order;
        // The head also wakes when a grace window ends, or an idle reservation may yield,
        // since either can free room for it.
        if self.may_open(order) {
            if let Some(t) = self.ledger.next_expiry() {
                until = until.min(t.max(now));
            }
            let idle = self.attempts[&id].engine_idle;
            if let Some(t) = self.next_yield(now, idle) {
                until = until.min(t);
            }
        }
        let a = self.attempt_mut(id);
        a.phase = Phase::Waiting {
            until,
            seen_epoch: epoch,
        };
        until
    }

    fn dequeue(&mut self, a: &Attempt) {
        if a.queued {
            let was_head = self.queue.keys().next() == Some(&a.order);
            self.queue.remove(&a.order);
            if was_head {
                // The next in line may fit now.
                self.epoch += 1;
            }
        }
    }

    fn admit(&mut self, id: u64, reason: Reason, now: f64) -> Admission {
        let a = self.attempts.remove(&id).expect("live attempt");
        self.dequeue(&a);
        self.pending -= 1;
        let ws_blocks = self.blocks(a.ws_tokens);
        let session = self.sessions.get_mut(a.slot);
        session.attempts -= 1;
        session.leases += 1;
        if session.pending == Some(id) {
            session.pending = None;
        }
        let takes = match self.cfg.pressure {
            Pressure::Committed => true,
            Pressure::Engine => {
                session.reservation.is_some() || (reason != Reason::Open && a.retain)
            }
        };
        let mut reservation = None;
        if takes {
            let blocks = ws_blocks.unwrap_or(0);
            match &mut session.reservation {
                Some(res) => {
                    self.ledger.resize(res.age, res.ws_blocks, blocks);
                    if let Some(t) = res.idle_until.take() {
                        self.ledger.clear_idle(res.age, t);
                    }
                    res.ws_tokens = a.ws_tokens;
                    res.ws_blocks = blocks;
                    res.holders += 1;
                    res.retain = a.retain;
                    reservation = Some(res.age);
                }
                None => {
                    let age = self.ledger.open(blocks);
                    session.reservation = Some(Reservation {
                        age,
                        order: a.order,
                        ws_tokens: a.ws_tokens,
                        ws_blocks: blocks,
                        holders: 1,
                        retain: a.retain,
                        idle_until: None,
                        turn_sec_sum: 0.0,
                        turns: 0,
                    });
                    reservation = Some(age);
                }
            }
        }
        let num_preempted = session.num_preempted;
        let lease = self.next_lease;
        self.next_lease += 1;
        self.leases.insert(
            lease,
            LeaseRec {
                slot: a.slot,
                reservation,
                admitted_at: now,
            },
        );
        let wait_sec = (now - a.started).max(0.0);
        self.stats.admissions[reason.index()] += 1;
        self.stats.wait.observe(wait_sec);
        let pressure = match (self.cfg.pressure, self.geometry) {
            (Pressure::Engine, _) => a.usage,
            (Pressure::Committed, Some(g)) => {
                let committed = self.ledger.committed() as f64 / g.num_blocks as f64;
                Some(a.usage.unwrap_or(0.0).max(committed))
            }
            (Pressure::Committed, None) => None,
        };
        Admission {
            lease: LeaseId(lease),
            reason,
            wait_sec,
            usage: a.usage,
            pressure,
            hit_ratio: match a.hit {
                Hit::Ratio(h, _) => Some(h),
                _ => None,
            },
            retain_session: a.retain,
            reserved: reservation.is_some(),
            revoked: a.revoked,
            working_set_blocks: ws_blocks,
            num_preempted,
        }
    }

    fn release_inner(&mut self, lease: LeaseId, now: f64, dropped: bool) -> bool {
        let Some(rec) = self.leases.remove(&lease.0) else {
            return false;
        };
        let grace = self.cfg.idle_grace_sec;
        let session = self.sessions.get_mut(rec.slot);
        session.leases -= 1;
        let mut drop_it = false;
        if let Some(res) = &mut session.reservation
            && rec.reservation == Some(res.age)
        {
            res.holders -= 1;
            res.turn_sec_sum += (now - rec.admitted_at).max(0.0);
            res.turns += 1;
            if res.holders == 0 {
                if res.retain && grace > 0.0 {
                    let until = now + grace;
                    res.idle_until = Some(until);
                    self.ledger.set_idle(res.age, until, rec.slot);
                } else {
                    drop_it = true;
                }
            }
        }
        if drop_it {
            self.drop_reservation(rec.slot);
        }
        self.sessions.gc(rec.slot);
        if dropped {
            self.stats.leases_dropped_unreleased += 1;
        } else {
            self.stats.leases_released += 1;
        }
        // Released work lowers vLLM's usage even when no reservation moved.
        self.epoch += 1;
        true
    }

    /// Ends the session's reservation, if any; does not free the slot.
    fn drop_reservation(&mut self, slot: u32) -> bool {
        match self.sessions.get_mut(slot).reservation.take() {
            Some(res) => {
                self.ledger.close(res.age, res.idle_until);
                true
            }
            None => false,
        }
    }

    fn set_geometry(&mut self, g: Geometry) {
        let block_size_changed = self.geometry.map(|old| old.block_size) != Some(g.block_size);
        self.geometry = Some(g);
        if block_size_changed {
            // Working sets were counted with another (or no) block size: recount them all.
            for s in self.sessions.iter_mut() {
                if let Some(res) = &mut s.reservation {
                    let blocks = res.ws_tokens.div_ceil(g.block_size);
                    self.ledger.resize(res.age, res.ws_blocks, blocks);
                    res.ws_blocks = blocks;
                }
            }
        }
    }
}

fn stale_attempt(attempt: AttemptId) -> Error {
    Error::StaleHandle(format!("attempt {}", attempt.0))
}
