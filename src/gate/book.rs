//! The engine gate's bookkeeping around [`GateCore`]: attempts by ticket, leases by holder,
//! clients by when they last called.
//!
//! The engine gate is one core shared by many clients (proxies, `HttpGate`s, API-server
//! processes) that reach it by utility calls. Beside the core's decisions it must know which
//! client asked for what, so that a client silent for a whole lease TTL loses its pending
//! attempts and its leases (a dead client never holds the cache for long), and so that a
//! `cancel(ticket)` that races the admission releases the lease its client will never see.
//! That bookkeeping ran in Python, cold, once per IPC hop; here it is one native call per
//! admit and per release.
//!
//! Sans-IO like the core: the host passes `now`, answers the core's probes through
//! [`BookProbes`] (read in-process, on the engine thread), and delivers the answers of
//! attempts that end later ([`EngineBook::take_resolved`]). Every decision is the core's.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::core::{GateCore, IdMap};
use super::knobs::{self, Knob, Value};
use super::metrics::GateStats;
use super::types::{Action, Admission, AttemptId, LeaseId, PrefixReport, ProbeKind, UsageReport};
use crate::error::{Error, Result};

/// The knob a book's lease TTL must meet (it is read in the engine core, not here).
const LEASE_TTL_SEC: &Knob = knobs::row("lease_ttl_sec");

/// What the engine gate reads from its engine while it drives an attempt.
pub trait BookProbes<T> {
    /// The O(1) usage probe (`Err`: unavailable).
    fn usage(&mut self) -> std::result::Result<UsageReport, String>;
    /// The prefix probe of `session_id`'s prompt, carried by the attempt's `payload`;
    /// returns the report and how long the probe took, in seconds.
    fn prefix(
        &mut self,
        session_id: &str,
        payload: &T,
    ) -> (std::result::Result<PrefixReport, String>, f64);
}

/// How an admit ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Admitted: a lease exists until released (or its client goes silent).
    Admitted(Admission),
    /// A newer admit of the same session took over.
    Preempted {
        /// Attempts of the session preempted so far.
        num_preempted: u32,
    },
    /// `cancel(ticket)` withdrew it.
    Cancelled,
    /// Its client went silent for a whole lease TTL.
    Expired,
}

/// An attempt that ended after the call that started it returned: the host answers its
/// deferred call.
#[derive(Debug)]
pub struct Resolved<T> {
    /// The admit's ticket.
    pub ticket: String,
    /// The admit's session.
    pub session_id: String,
    /// What the host attached to the attempt (its prompt, its deferred answer).
    pub payload: T,
    /// How it ended.
    pub answer: Answer,
}

/// A client declared dead by [`EngineBook::tick`], for the host's log.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpiredClient {
    /// Its id.
    pub client_id: String,
    /// Seconds since its last call.
    pub silent_sec: f64,
    /// Leases released for it.
    pub leases: usize,
    /// Pending admits cancelled for it.
    pub attempts: usize,
}

/// Counters of the bookkeeping (the core counts the rest).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BookCounters {
    /// Clients declared dead after the lease TTL.
    pub clients_expired: u64,
    /// Leases released because their client went silent.
    pub leases_expired: u64,
    /// Pending admits ended because their client went silent.
    pub attempts_expired: u64,
}

struct Pending<T> {
    client: String,
    session_id: String,
    attempt: AttemptId,
    payload: T,
    /// Set while parked in a `Wait`: its deadline and its place in the waiting order.
    waiting: Option<(f64, u64)>,
}

// A pending attempt is one that parked: only those enter `attempts`, and each is listed in
// its client's set of pending attempts from then on.

/// A lease's holder. Its session is the core's (`GateCore::lease_session`); the client and
/// the ticket are shared, not copied: an admit answered in its call allocates only its ticket.
struct Held {
    client: Arc<Holder>,
    ticket: Arc<str>,
}

/// What a client shares with the leases it holds: its id and their count, so that granting
/// or releasing a lease does not look the client up again (on the engine thread each lookup
/// is a hash and a few cache lines missed).
struct Holder {
    /// The same allocation as the client's key in `clients`.
    id: Arc<str>,
    /// Leases it holds (which ones: `held`, scanned only when it expires). Only the engine
    /// thread touches it; atomic because the book is `Send`.
    leases: AtomicUsize,
}

struct Client {
    holder: Arc<Holder>,
    last_seen: f64,
    attempts: HashSet<String>,
}

/// The core plus who holds what. `T` is the host's per-attempt payload.
pub struct EngineBook<T> {
    core: GateCore,
    lease_ttl_sec: f64,
    attempts: HashMap<String, Pending<T>>,
    /// Parked attempts in the order they parked (the order Python's dict kept).
    waiting: BTreeMap<u64, String>,
    next_wait: u64,
    held: IdMap<Held>,
    /// Every ticket admitted and not released: a cancel racing its grant releases the lease.
    ticket_lease: HashMap<Arc<str>, u64>,
    clients: HashMap<Arc<str>, Client>,
    epoch: u64,
    resolved: Vec<Resolved<T>>,
    /// The earliest deadline the host's timer holds, as far as this book asked for it.
    armed: f64,
    alarm: Option<f64>,
    counters: BookCounters,
}

impl<T> EngineBook<T> {
    /// A book over `core`; a client silent for `lease_ttl_sec` is declared dead.
    pub fn new(core: GateCore, lease_ttl_sec: f64) -> Result<Self> {
        LEASE_TTL_SEC.check(Value::Number(lease_ttl_sec))?;
        let epoch = core.epoch();
        Ok(Self {
            core,
            lease_ttl_sec,
            attempts: HashMap::new(),
            waiting: BTreeMap::new(),
            next_wait: 0,
            held: IdMap::default(),
            ticket_lease: HashMap::new(),
            clients: HashMap::new(),
            epoch,
            resolved: Vec::new(),
            armed: f64::INFINITY,
            alarm: None,
            counters: BookCounters::default(),
        })
    }

    /// Starts an admit and drives it as far as it goes now: `Some(answer)` if it ended in this
    /// call, `None` if it waits (its answer comes later through [`Self::take_resolved`]).
    /// A ticket still in use (pending, or admitted and not released) is refused.
    #[allow(clippy::too_many_arguments)]
    pub fn admit(
        &mut self,
        ticket: &str,
        client_id: &str,
        session_id: &str,
        prompt_tokens: usize,
        max_tokens: usize,
        retain_session: bool,
        payload: T,
        now: f64,
        probes: &mut impl BookProbes<T>,
    ) -> Result<Option<Answer>> {
        // (`attempts` holds only parked attempts: usually none, and then no hashing.)
        let pending = !self.attempts.is_empty() && self.attempts.contains_key(ticket);
        if pending || self.ticket_lease.contains_key(ticket) {
            return Err(Error::InvalidInput(format!(
                "ticket {ticket:?} is already in use; every admit needs a new one"
            )));
        }
        let holder = self.seen_holder(client_id, now);
        let attempt = self
            .core
            .begin(session_id, prompt_tokens, max_tokens, retain_session, now);
        let mut answer = self.drive_new(ticket, holder, session_id, attempt, payload, now, probes);
        self.settle(now, probes);
        if answer.is_none() {
            // Woken and ended by the settling of this same call: answer it now.
            if let Some(i) = self.resolved.iter().rposition(|r| r.ticket == ticket) {
                answer = Some(self.resolved.remove(i).answer);
            }
        }
        Ok(answer)
    }

    /// The host's payload of a pending attempt (to attach its deferred answer).
    pub fn payload_mut(&mut self, ticket: &str) -> Option<&mut T> {
        self.attempts.get_mut(ticket).map(|p| &mut p.payload)
    }

    /// One client call: marks `client_id` seen, runs `f`, then settles what `f` changed.
    fn on_call<R>(
        &mut self,
        client_id: Option<&str>,
        now: f64,
        probes: &mut impl BookProbes<T>,
        f: impl FnOnce(&mut Self) -> R,
    ) -> R {
        if let Some(c) = client_id {
            self.seen(c, now);
        }
        let out = f(self);
        self.settle(now, probes);
        out
    }

    /// Releases a lease; false if it was unknown or released already.
    pub fn release(
        &mut self,
        lease: u64,
        client_id: Option<&str>,
        now: f64,
        probes: &mut impl BookProbes<T>,
    ) -> bool {
        self.on_call(client_id, now, probes, |b| {
            b.release_lease(lease, now, false)
        })
    }

    /// Withdraws a pending admit (answered [`Answer::Cancelled`]) or releases the lease it
    /// won in the race; false if the ticket is unknown.
    pub fn cancel(
        &mut self,
        ticket: &str,
        client_id: Option<&str>,
        now: f64,
        probes: &mut impl BookProbes<T>,
    ) -> bool {
        self.on_call(client_id, now, probes, |b| {
            b.cancel_ticket(ticket, now, Answer::Cancelled)
        })
    }

    /// Grows the working set a held lease commits to (`GateCore::grow_lease`); whether it
    /// grew. No client call: only the holder inside the engine (the scheduler) knows a running
    /// request took more input.
    pub fn grow_lease(&mut self, lease: u64, ws_tokens: u64) -> bool {
        self.core.grow_lease(LeaseId(lease), ws_tokens)
    }

    /// Ends a session's ownership window; whether it had one.
    pub fn finish(
        &mut self,
        session_id: &str,
        client_id: Option<&str>,
        now: f64,
        probes: &mut impl BookProbes<T>,
    ) -> bool {
        self.on_call(client_id, now, probes, |b| {
            b.core.finish_session(session_id, now)
        })
    }

    /// A client's heartbeat; returns how many leases and pending admits it holds.
    pub fn renew(
        &mut self,
        client_id: &str,
        now: f64,
        probes: &mut impl BookProbes<T>,
    ) -> (usize, usize) {
        self.seen(client_id, now);
        let c = &self.clients[client_id];
        let held = (c.holder.leases.load(Ordering::Relaxed), c.attempts.len());
        self.settle(now, probes);
        held
    }

    /// Runs what is due: silent clients, grace windows that ended, waiters whose deadline
    /// passed; then asks for the timer at the earliest deadline left ([`Self::take_alarm`]).
    pub fn tick(&mut self, now: f64, probes: &mut impl BookProbes<T>) -> Vec<ExpiredClient> {
        self.armed = f64::INFINITY; // the timer fired: it holds nothing now
        let expired = self.expire_clients(now);
        self.core.expire(now);
        self.drive_parked(now, probes, |_, p| {
            p.waiting.is_some_and(|(until, _)| until <= now)
        });
        self.settle(now, probes);
        self.schedule();
        expired
    }

    /// The earliest deadline the host's timer must fire at, if it changed since last asked.
    pub fn take_alarm(&mut self) -> Option<f64> {
        self.alarm.take()
    }

    /// Answers of attempts that ended since last asked (waiters admitted, preempted,
    /// cancelled or expired).
    pub fn take_resolved(&mut self) -> Vec<Resolved<T>> {
        std::mem::take(&mut self.resolved)
    }

    /// Whether any answer waits for [`Self::take_resolved`].
    pub fn has_resolved(&self) -> bool {
        !self.resolved.is_empty()
    }

    /// The seconds a silent client's leases and attempts survive.
    pub fn lease_ttl_sec(&self) -> f64 {
        self.lease_ttl_sec
    }

    /// The bookkeeping's counters.
    pub fn counters(&self) -> BookCounters {
        self.counters
    }

    /// Clients alive (seen within the lease TTL, as of the last tick).
    pub fn num_clients(&self) -> usize {
        self.clients.len()
    }

    /// Leases issued and not released.
    pub fn num_held(&self) -> usize {
        self.held.len()
    }

    /// Admits not answered yet.
    pub fn num_pending(&self) -> usize {
        self.attempts.len()
    }

    /// The core's counters and gauges.
    pub fn stats(&self) -> GateStats {
        self.core.stats()
    }

    /// The core's Prometheus text.
    pub fn prometheus(&self) -> String {
        self.core.prometheus()
    }

    /// The core (read only).
    pub fn core(&self) -> &GateCore {
        &self.core
    }

    // -- internals ------------------------------------------------------------------------

    fn arm(&mut self, at: f64) {
        if at < self.armed {
            self.armed = at;
            self.alarm = Some(at);
        }
    }

    /// Arms the timer for the earliest deadline (a scan: only at ticks).
    fn schedule(&mut self) {
        let mut at = f64::INFINITY;
        for ticket in self.waiting.values() {
            if let Some((until, _)) = self.attempts.get(ticket).and_then(|p| p.waiting) {
                at = at.min(until);
            }
        }
        if let Some(oldest) = self
            .clients
            .values()
            .map(|c| c.last_seen)
            .min_by(f64::total_cmp)
        {
            // The first client to go silent for a whole TTL is checked exactly then.
            at = at.min(oldest + self.lease_ttl_sec);
        }
        if at.is_finite() {
            self.arm(at);
        }
    }

    /// A call from `client_id` at `now` (one lookup for a known client).
    fn seen(&mut self, client_id: &str, now: f64) {
        if let Some(c) = self.clients.get_mut(client_id) {
            c.last_seen = now;
            return;
        }
        self.add_client(client_id, now);
    }

    /// [`Self::seen`], returning the client's holder (for the lease an admit may grant).
    fn seen_holder(&mut self, client_id: &str, now: f64) -> Arc<Holder> {
        if let Some(c) = self.clients.get_mut(client_id) {
            c.last_seen = now;
            return c.holder.clone();
        }
        self.add_client(client_id, now)
    }

    fn add_client(&mut self, client_id: &str, now: f64) -> Arc<Holder> {
        // Its silence is checked one TTL from now (a known client's deadline only moves
        // later while it calls, so the armed one is early enough).
        self.arm(now + self.lease_ttl_sec);
        let id: Arc<str> = client_id.into();
        let holder = Arc::new(Holder {
            id: id.clone(),
            leases: AtomicUsize::new(0),
        });
        self.clients.insert(
            id,
            Client {
                holder: holder.clone(),
                last_seen: now,
                attempts: HashSet::new(),
            },
        );
        holder
    }

    /// Drives a new attempt as far as it goes in its own call. Until it parks nothing but
    /// this call refers to it, so it enters the pending table (and its client's set) only
    /// then: an admit answered in its call copies no id but its ticket's.
    #[allow(clippy::too_many_arguments)]
    fn drive_new(
        &mut self,
        ticket: &str,
        holder: Arc<Holder>,
        session_id: &str,
        attempt: AttemptId,
        payload: T,
        now: f64,
        probes: &mut impl BookProbes<T>,
    ) -> Option<Answer> {
        let client_id = &*holder.id;
        match poll_until_decided(&mut self.core, attempt, session_id, &payload, now, probes) {
            Settled::Waits(until) => {
                let order = self.park(ticket, until);
                self.attempts.insert(
                    ticket.to_string(),
                    Pending {
                        client: client_id.to_string(),
                        session_id: session_id.to_string(),
                        attempt,
                        payload,
                        waiting: Some((until, order)),
                    },
                );
                if let Some(c) = self.clients.get_mut(client_id) {
                    c.attempts.insert(ticket.to_string());
                }
                None
            }
            Settled::Admitted(admission) => {
                self.hold(admission.lease.0, ticket.into(), holder);
                Some(Answer::Admitted(admission))
            }
            Settled::Preempted => {
                let num_preempted = self.core.num_preempted(session_id);
                Some(Answer::Preempted { num_preempted })
            }
            // Unknown to the core (cannot happen: it began above): it ends here.
            Settled::Unknown => Some(Answer::Cancelled),
        }
    }

    /// Puts a waiting attempt in the waiting order and arms the timer for its deadline.
    fn park(&mut self, ticket: &str, until: f64) -> u64 {
        let order = self.next_wait;
        self.next_wait += 1;
        self.waiting.insert(order, ticket.to_string());
        self.arm(until);
        order
    }

    /// Records a granted lease's holder.
    fn hold(&mut self, lease: u64, ticket: Arc<str>, client: Arc<Holder>) {
        client.leases.fetch_add(1, Ordering::Relaxed);
        self.ticket_lease.insert(ticket.clone(), lease);
        self.held.insert(lease, Held { client, ticket });
    }

    /// [`Self::hold`] for a parked attempt's client, looked up by id.
    fn hold_for(&mut self, lease: u64, ticket: Arc<str>, client_id: &str) {
        let client = match self.clients.get(client_id) {
            Some(c) => c.holder.clone(),
            // Cannot happen: a parked attempt is cancelled when its client expires.
            None => Arc::new(Holder {
                id: client_id.into(),
                leases: AtomicUsize::new(0),
            }),
        };
        self.hold(lease, ticket, client);
    }

    fn unpark(&mut self, ticket: &str) {
        if let Some(p) = self.attempts.get_mut(ticket)
            && let Some((_, order)) = p.waiting.take()
        {
            self.waiting.remove(&order);
        }
    }

    /// Polls `ticket` until it waits or ends; an ending removes it and returns its payload.
    fn drive(
        &mut self,
        ticket: &str,
        now: f64,
        probes: &mut impl BookProbes<T>,
    ) -> Option<(T, Answer)> {
        let p = self.attempts.get(ticket)?;
        let settled = poll_until_decided(
            &mut self.core,
            p.attempt,
            &p.session_id,
            &p.payload,
            now,
            probes,
        );
        match settled {
            Settled::Waits(until) => {
                let order = self.park(ticket, until);
                let p = self
                    .attempts
                    .get_mut(ticket)
                    .expect("driven attempt is pending");
                p.waiting = Some((until, order));
                None
            }
            Settled::Admitted(admission) => {
                let p = self.forget(ticket);
                self.hold_for(admission.lease.0, ticket.into(), &p.client);
                Some((p.payload, Answer::Admitted(admission)))
            }
            // The core already counted it and forgot the attempt.
            Settled::Preempted => {
                let session = &self.attempts[ticket].session_id;
                let num_preempted = self.core.num_preempted(session);
                Some(self.end(ticket, Answer::Preempted { num_preempted }))
            }
            // Unknown to the core (cannot happen while the book holds it): end it.
            Settled::Unknown => Some(self.end(ticket, Answer::Cancelled)),
        }
    }

    /// Drives a parked attempt; an ending goes to the host's resolved list.
    fn drive_and_record(&mut self, ticket: &str, now: f64, probes: &mut impl BookProbes<T>) {
        let session_id = match self.attempts.get(ticket) {
            Some(p) => p.session_id.clone(),
            None => return,
        };
        if let Some((payload, answer)) = self.drive(ticket, now, probes) {
            self.resolved.push(Resolved {
                ticket: ticket.to_string(),
                session_id,
                payload,
                answer,
            });
        }
    }

    /// The attempt is over: forget it.
    fn end(&mut self, ticket: &str, answer: Answer) -> (T, Answer) {
        (self.forget(ticket).payload, answer)
    }

    /// Removes a pending attempt from every index (waiting order, its client's set).
    fn forget(&mut self, ticket: &str) -> Pending<T> {
        let p = self
            .attempts
            .remove(ticket)
            .expect("ended attempt is pending");
        if let Some((_, order)) = p.waiting {
            self.waiting.remove(&order);
        }
        if let Some(c) = self.clients.get_mut(p.client.as_str()) {
            c.attempts.remove(ticket);
        }
        p
    }

    /// Wakes the waiters the epoch's move may concern while it moves: the ones the core would
    /// answer with something other than the same `Wait` ([`GateCore::would_wake`]: the head of
    /// the queue, preempted attempts, deadlines passed). The others stay parked as they are,
    /// unpolled: in the engine loop every admit and release moves the epoch while a queue of
    /// held turns waits, and a poll of each costs more than its look.
    fn settle(&mut self, now: f64, probes: &mut impl BookProbes<T>) {
        if self.waiting.is_empty() {
            // Nobody to wake (the common case after a release): just note the epoch.
            self.epoch = self.core.epoch();
            return;
        }
        while self.core.epoch() != self.epoch {
            // A poll purges ended grace windows first; so does this, once for all of them.
            self.core.expire(now);
            self.epoch = self.core.epoch();
            self.drive_parked(now, probes, |b, p| b.core.would_wake(p.attempt, now));
        }
    }

    /// Drives the parked attempts `pick` chooses, in waiting order; each one still parked when
    /// its turn comes (an earlier one's drive may have ended it) is unparked first, and an
    /// ending goes to the resolved list.
    fn drive_parked(
        &mut self,
        now: f64,
        probes: &mut impl BookProbes<T>,
        pick: impl Fn(&Self, &Pending<T>) -> bool,
    ) {
        let picked: Vec<String> = self
            .waiting
            .values()
            .filter(|t| self.attempts.get(t.as_str()).is_some_and(|p| pick(self, p)))
            .cloned()
            .collect();
        for ticket in picked {
            let still = self
                .attempts
                .get(&ticket)
                .is_some_and(|p| p.waiting.is_some());
            if still {
                self.unpark(&ticket);
                self.drive_and_record(&ticket, now, probes);
            }
        }
    }

    fn release_lease(&mut self, lease: u64, now: f64, dropped: bool) -> bool {
        if let Some(h) = self.held.remove(&lease) {
            self.ticket_lease.remove(&h.ticket);
            // Its client's count, through the lease (no lookup).
            let leases = &h.client.leases;
            leases.store(
                leases.load(Ordering::Relaxed).saturating_sub(1),
                Ordering::Relaxed,
            );
        }
        if dropped {
            self.core.release_dropped(LeaseId(lease), now)
        } else {
            self.core.release(LeaseId(lease), now)
        }
    }

    fn cancel_ticket(&mut self, ticket: &str, now: f64, answer: Answer) -> bool {
        if let Some(p) = self.attempts.get(ticket) {
            let attempt = p.attempt;
            let session_id = p.session_id.clone();
            self.core.cancel(attempt, now);
            let (payload, answer) = self.end(ticket, answer);
            self.resolved.push(Resolved {
                ticket: ticket.to_string(),
                session_id,
                payload,
                answer,
            });
            return true;
        }
        if let Some(&lease) = self.ticket_lease.get(ticket) {
            // Admitted while the client gave up: it never saw the lease, so release it here.
            return self.release_lease(lease, now, true);
        }
        false
    }

    fn expire_clients(&mut self, now: f64) -> Vec<ExpiredClient> {
        let ttl = self.lease_ttl_sec;
        let dead: Vec<Arc<str>> = self
            .clients
            .iter()
            .filter(|(_, c)| now - c.last_seen >= ttl)
            .map(|(id, _)| id.clone())
            .collect();
        let mut expired = Vec::with_capacity(dead.len());
        for client_id in dead {
            let client = self.clients.remove(&client_id).expect("listed above");
            self.counters.clients_expired += 1;
            for ticket in &client.attempts {
                if self.cancel_ticket(ticket, now, Answer::Expired) {
                    self.counters.attempts_expired += 1;
                }
            }
            let leases: Vec<u64> = self
                .held
                .iter()
                .filter(|(_, h)| h.client.id == client_id)
                .map(|(&lease, _)| lease)
                .collect();
            let mut sessions = HashSet::new();
            for &lease in &leases {
                if let Some(s) = self.core.lease_session(LeaseId(lease)) {
                    sessions.insert(s.to_string());
                }
                if self.release_lease(lease, now, true) {
                    self.counters.leases_expired += 1;
                }
            }
            for session_id in sessions {
                let live = self
                    .held
                    .keys()
                    .any(|&l| self.core.lease_session(LeaseId(l)) == Some(session_id.as_str()))
                    || self.attempts.values().any(|p| p.session_id == session_id);
                if !live {
                    // Its idle grace window would hold the cache for a client that is gone.
                    self.core.finish_session(&session_id, now);
                }
            }
            expired.push(ExpiredClient {
                client_id: client_id.to_string(),
                silent_sec: now - client.last_seen,
                leases: leases.len(),
                attempts: client.attempts.len(),
            });
        }
        expired
    }
}

/// Where one attempt's polling stopped: it waits, or it ended one of three ways.
enum Settled {
    Waits(f64),
    Admitted(Admission),
    Preempted,
    /// The core does not know the attempt.
    Unknown,
}

/// Polls `attempt`, answering the core's probe requests, until it waits or ends: the one
/// poll loop behind both a new attempt's call and a parked attempt's wake-up.
fn poll_until_decided<T>(
    core: &mut GateCore,
    attempt: AttemptId,
    session_id: &str,
    payload: &T,
    now: f64,
    probes: &mut impl BookProbes<T>,
) -> Settled {
    loop {
        match core.poll(attempt, now) {
            Err(_) => return Settled::Unknown,
            Ok(action @ (Action::ProbeUsage | Action::ProbePrefix)) => {
                probe(core, attempt, action, session_id, payload, now, probes)
            }
            Ok(Action::Wait { until }) => return Settled::Waits(until),
            Ok(Action::Admit(admission)) => return Settled::Admitted(admission),
            Ok(Action::Preempted) => return Settled::Preempted,
        }
    }
}

/// Answers the core's probe request `action` for `attempt` (usage or prefix).
#[allow(clippy::too_many_arguments)]
fn probe<T>(
    core: &mut GateCore,
    attempt: AttemptId,
    action: Action,
    session_id: &str,
    payload: &T,
    now: f64,
    probes: &mut impl BookProbes<T>,
) {
    if let Action::ProbeUsage = action {
        let report = probes.usage();
        // The core cannot refuse an answer it asked for; a stale one is ignored.
        let _ = core.on_usage(attempt, report, now);
    } else {
        let (report, secs) = probes.prefix(session_id, payload);
        core.record_probe(ProbeKind::Prefix, secs, report.is_ok());
        let _ = core.on_prefix(attempt, report, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::{GateConfig, Reason};

    /// A pool of 100 blocks of 16 tokens at a fixed usage; no prefix is resident.
    struct Fixed {
        usage: f64,
    }

    impl BookProbes<()> for Fixed {
        fn usage(&mut self) -> std::result::Result<UsageReport, String> {
            Ok(UsageReport {
                kv_cache_usage: self.usage,
                num_blocks: 100,
                num_free_blocks: ((1.0 - self.usage) * 100.0) as u64,
                num_cached_free_blocks: None,
                block_size: 16,
                ..Default::default()
            })
        }
        fn prefix(&mut self, _: &str, _: &()) -> (std::result::Result<PrefixReport, String>, f64) {
            (
                Ok(PrefixReport {
                    prompt_tokens: 160,
                    ..Default::default()
                }),
                0.0,
            )
        }
    }

    fn book() -> EngineBook<()> {
        let cfg = GateConfig {
            idle_grace_sec: 100.0,
            max_wait_sec: Some(50.0),
            ..Default::default()
        };
        EngineBook::new(GateCore::new(cfg).unwrap(), 3.0).unwrap()
    }

    fn admitted(answer: Option<Answer>) -> Admission {
        match answer {
            Some(Answer::Admitted(a)) => a,
            other => panic!("expected an admission, got {other:?}"),
        }
    }

    /// Admits session `hog` for `client` at 0: 95 blocks committed, over the 85-block line.
    fn admit_hog(b: &mut EngineBook<()>, p: &mut Fixed, client: &str, retain: bool) -> Admission {
        admitted(
            b.admit("h", client, "hog", 1500, 16, retain, (), 0.0, p)
                .unwrap(),
        )
    }

    /// Asks to admit `session` (`ticket`, `client`, `tokens`) at `now` and checks it waits.
    fn parks(b: &mut EngineBook<()>, p: &mut Fixed, ids: [&str; 3], tokens: usize, now: f64) {
        let [ticket, client, session] = ids;
        let answer = b.admit(ticket, client, session, tokens, 16, true, (), now, p);
        assert_eq!(answer.unwrap(), None, "{ticket} waits");
    }

    #[test]
    fn an_open_gate_admits_in_the_call_and_the_release_frees_the_ticket() {
        let mut b = book();
        let mut p = Fixed { usage: 0.1 };
        let a = admitted(
            b.admit("t1", "c", "s", 160, 16, true, (), 0.0, &mut p)
                .unwrap(),
        );
        assert_eq!(a.reason, Reason::Open);
        assert_eq!((b.num_held(), b.num_pending()), (1, 0));
        let reused = b.admit("t1", "c", "s", 160, 16, true, (), 0.1, &mut p);
        assert!(reused.unwrap_err().to_string().contains("already in use"));
        assert!(b.release(a.lease.0, Some("c"), 0.2, &mut p));
        assert!(!b.release(a.lease.0, Some("c"), 0.3, &mut p));
        assert_eq!(b.num_held(), 0);
    }

    #[test]
    fn a_silent_clients_leases_and_attempts_end_one_ttl_after_its_last_call() {
        let mut b = book();
        let mut p = Fixed { usage: 0.1 };
        let hog = admit_hog(&mut b, &mut p, "dead", true);
        parks(&mut b, &mut p, ["w", "dead", "w"], 160, 0.5);
        assert_eq!(
            b.take_alarm(),
            Some(3.0),
            "the dead client's TTL is the first deadline"
        );
        b.renew("alive", 2.9, &mut p);
        // Its last call was at 0.5: still alive at 3.0, dead at 3.5.
        assert!(b.tick(3.0, &mut p).is_empty());
        assert_eq!(b.take_alarm(), Some(3.5));
        let expired = b.tick(3.5, &mut p);
        assert_eq!(expired.len(), 1);
        assert_eq!((expired[0].leases, expired[0].attempts), (1, 1));
        let resolved = b.take_resolved();
        assert_eq!(resolved.len(), 1);
        assert_eq!(
            (resolved[0].ticket.as_str(), &resolved[0].answer),
            ("w", &Answer::Expired)
        );
        assert!(
            !b.release(hog.lease.0, None, 3.6, &mut p),
            "released by the expiry"
        );
        let c = b.counters();
        assert_eq!(
            (c.clients_expired, c.leases_expired, c.attempts_expired),
            (1, 1, 1)
        );
        assert!(
            !b.core().has_reservation("hog"),
            "its grace window ended with its client"
        );
        assert_eq!(b.num_clients(), 1);
    }

    #[test]
    fn a_waiter_is_admitted_by_a_release_and_answered_through_the_resolved_list() {
        let mut b = book();
        let mut p = Fixed { usage: 0.1 };
        let hog = admit_hog(&mut b, &mut p, "c", false);
        parks(&mut b, &mut p, ["w", "c", "w"], 160, 0.1);
        assert!(!b.has_resolved());
        assert!(b.release(hog.lease.0, Some("c"), 0.2, &mut p));
        let resolved = b.take_resolved();
        assert_eq!(resolved.len(), 1);
        assert!(matches!(resolved[0].answer, Answer::Admitted(_)));
        assert_eq!((b.num_held(), b.num_pending()), (1, 0));
    }

    #[test]
    fn a_clients_pending_count_lists_only_parked_attempts_and_forgets_them_when_they_end() {
        let mut b = book();
        let mut p = Fixed { usage: 0.1 };
        let hog = admit_hog(&mut b, &mut p, "c", false);
        assert_eq!(b.renew("c", 0.05, &mut p), (1, 0));
        parks(&mut b, &mut p, ["w", "c", "w"], 160, 0.1);
        assert_eq!(b.renew("c", 0.15, &mut p), (1, 1));
        assert!(
            b.release(hog.lease.0, Some("c"), 0.2, &mut p),
            "admits the waiter"
        );
        assert_eq!(b.take_resolved().len(), 1);
        assert_eq!(
            b.renew("c", 0.25, &mut p),
            (1, 0),
            "the admitted waiter left its client's pending set"
        );
    }

    #[test]
    fn a_cancel_that_races_the_admission_releases_the_lease_as_dropped() {
        let mut b = book();
        let mut p = Fixed { usage: 0.1 };
        admitted(
            b.admit("t", "c", "s", 160, 16, true, (), 0.0, &mut p)
                .unwrap(),
        );
        assert!(b.cancel("t", Some("c"), 0.1, &mut p));
        assert_eq!(b.num_held(), 0);
        assert_eq!(b.stats().leases_dropped_unreleased, 1);
        assert!(
            !b.cancel("t", Some("c"), 0.2, &mut p),
            "the ticket is spent"
        );
    }

    #[test]
    fn a_newer_admit_preempts_the_older_waiting_one() {
        let mut b = book();
        let mut p = Fixed { usage: 0.1 };
        admit_hog(&mut b, &mut p, "c", true);
        parks(&mut b, &mut p, ["a1", "c", "s"], 160, 0.1);
        parks(&mut b, &mut p, ["a2", "c", "s"], 170, 0.2);
        let resolved = b.take_resolved();
        assert_eq!(resolved.len(), 1);
        assert_eq!(resolved[0].ticket, "a1");
        assert_eq!(resolved[0].answer, Answer::Preempted { num_preempted: 1 });
        assert_eq!(b.num_pending(), 1);
    }
}
