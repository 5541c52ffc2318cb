//! Replicas, their health, and where each session's turns go.
//!
//! Each replica owns one [`Gate`] over its own [`HttpProbe`]. Where a turn goes is decided by
//! the policy `--placement` names ([`crate::gate::routers`]: `gate`, `hash` or
//! `sticky-least-loaded`, the code the twin's fleet drives), over the views
//! [`placing`] builds from what the proxy knows: health, usage answers, its
//! gates' commitments, sessions and turns waiting per replica, and the requests it has in
//! flight or waiting on each (the routers' load). A session this proxy has not seen but the
//! replicas' prefix probes found on one of them ([`placing::find_home`]) goes there, counted
//! `found`, whatever the policy. Under `gate`, a new session goes
//! where it would be admitted soonest, or is held (late binding) while every replica has its
//! backlog of new sessions; a returning session stays home while its prefix is resident there,
//! and moves when it is cold and another replica would admit it sooner, or when its home is
//! slow, down, or no longer listed; a turn waiting for admission with nothing of its own cached
//! where it waits moves where it would be admitted now ([`Replicas::place_waiting`], driven by
//! `super::waiting`).
//!
//! Unhealthy has two grades. A replica that could not be connected to (by a request or a health
//! check) is *unreachable*: down until a health check passes. One that only missed a health
//! check (a busy CPU engine can take longer than the check's two seconds to answer `/health`)
//! is *slow*: it takes nothing while a healthy replica exists, and still serves when none does:
//! refusing every request with 503 because the one replica was slow to say it is alive would
//! stop serving for nothing.
//!
//! The list only grows: a replica the replicas file no longer lists stays in it, unlisted (its
//! streams in flight finish, its sessions move at their next turn, and it takes nothing new),
//! so that indices held by sessions stay valid; listed again, it takes sessions again.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request};
use tokio::sync::Notify;

use super::config::{ProxyConfig, ReplicaUrl};
use super::http_probe::HttpProbe;
use super::placing::{self, Grade, Lookup, ReplicaFacts};
use super::upstream::Client;
use super::usage_cache::CachedProbe;
use crate::gate::placement::{PlaceReason, Placed, PlacementStats, ReplicaView, SessionView};
use crate::gate::routers::{self, Router, Snapshot};
use crate::gate::{Gate, Probe};

/// One `vllm serve` replica.
#[derive(Debug)]
pub struct Replica {
    /// Base URL (`http://host:port`), also the `replica` metrics label.
    pub url: ReplicaUrl,
    /// This replica's gate.
    pub gate: Gate,
    /// This replica's probe: [`HttpProbe`] behind the usage cache (kept for its last usage
    /// answer, and told about releases).
    pub probe: Arc<CachedProbe>,
    healthy: AtomicBool,
    /// False from a failed connection until the next passing health check.
    reachable: AtomicBool,
    /// Listed by the configuration (false once the replicas file dropped it).
    listed: AtomicBool,
    /// Turns placed here whose admission is pending.
    queued: AtomicU32,
    /// New sessions placed here whose first turn is not admitted yet.
    new_waiting: AtomicU32,
    /// Requests of this proxy sent here whose answer has not ended.
    in_flight: AtomicU32,
    /// Told of every change placement may be waiting for (shared by all replicas).
    changed: Arc<Notify>,
}

impl Replica {
    /// Whether the last health check passed (true until the first one fails).
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Whether the configuration lists it (false: it takes no new turns).
    pub fn is_listed(&self) -> bool {
        self.listed.load(Ordering::Relaxed)
    }

    /// Marks the replica unhealthy and unreachable at once (a connection to it just failed);
    /// the next health check that passes marks it healthy again.
    pub fn mark_unhealthy(&self, why: &str) {
        self.reachable.store(false, Ordering::Relaxed);
        self.set_healthy(false, why);
        self.changed.notify_waiters();
    }

    /// Whether it may take requests when no replica is healthy: it failed no connection since
    /// its last passing health check (see the module docs).
    fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Its grade for placement (see [`placing`]).
    pub fn grade(&self) -> Grade {
        if !self.is_listed() || !self.is_reachable() {
            Grade::Down
        } else if self.is_healthy() {
            Grade::Healthy
        } else {
            Grade::Slow
        }
    }

    /// Records a health check's outcome.
    fn checked(&self, health: Health) {
        match health {
            Health::Ok => self.reachable.store(true, Ordering::Relaxed),
            Health::Unreachable => self.reachable.store(false, Ordering::Relaxed),
            Health::Failed => {}
        }
        self.set_healthy(health == Health::Ok, "health check");
    }

    /// Records a health change, saying why; a replica that went away or came back also loses
    /// its usage readings, which would steer new sessions away from (or towards) it.
    fn set_healthy(&self, ok: bool, why: &str) {
        if self.healthy.swap(ok, Ordering::Relaxed) != ok {
            self.probe.forget_usage();
            let state = if ok { "healthy again" } else { "unhealthy" };
            eprintln!(
                "session-gate proxy: replica {} is {state} ({why})",
                self.url.base
            );
        }
    }

    /// What placement knows about it, `sessions` being placed there.
    fn facts(&self, sessions: u32, ignore_backlog: bool) -> ReplicaFacts {
        let config = self.gate.inspect(|core| core.config().high_watermark);
        ReplicaFacts {
            grade: self.grade(),
            usage: self.probe.last_usage(),
            committed_blocks: self.gate.stats().committed_blocks,
            high_watermark: config,
            sessions,
            queued: self.queued.load(Ordering::Relaxed),
            new_waiting: if ignore_backlog {
                0
            } else {
                self.new_waiting.load(Ordering::Relaxed)
            },
        }
    }

    /// Requests of this proxy waiting for admission or in flight here (the routers' load).
    pub fn load(&self) -> u32 {
        self.queued.load(Ordering::Relaxed) + self.in_flight.load(Ordering::Relaxed)
    }

    /// Counts a request in flight here until the returned guard is dropped.
    pub fn in_flight(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            replica: self.clone(),
        }
    }

    /// Counts a turn waiting for admission here until the returned guard is dropped (`new`:
    /// the first turn of a session placed here).
    pub fn awaiting_admission(self: &Arc<Self>, new: bool) -> Awaiting {
        self.queued.fetch_add(1, Ordering::Relaxed);
        Awaiting {
            replica: self.clone(),
            new,
        }
    }
}

/// A turn waiting for admission on a replica (see [`Replica::awaiting_admission`]).
#[derive(Debug)]
pub struct Awaiting {
    replica: Arc<Replica>,
    new: bool,
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        let r = &self.replica;
        let _ = r
            .queued
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if self.new {
            let _ = r
                .new_waiting
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
        r.changed.notify_waiters();
    }
}

/// A request in flight on a replica (see [`Replica::in_flight`]).
#[derive(Debug)]
pub struct InFlight {
    replica: Arc<Replica>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let _ = self
            .replica
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}

#[derive(Debug)]
struct Sticky {
    replica: usize,
    turns: u64,
    last_seen: Instant,
}

/// Sessions and the policy, changed together under one lock (a burst of new sessions is
/// placed one after another, each seeing the ones before it).
#[derive(Debug)]
struct Placer {
    sessions: HashMap<String, Sticky>,
    /// Sessions per replica index.
    pinned: Vec<u32>,
    placement: Box<dyn routers::Placer>,
    /// Sessions not seen before, found resident on a replica ([`PlaceReason::Found`]).
    found: u64,
    /// New sessions placed past the backlogs because they were held for `max_wait_sec`.
    hold_timeouts: u64,
}

impl Placer {
    fn unpin(&mut self, replica: usize) {
        if let Some(n) = self.pinned.get_mut(replica) {
            *n = n.saturating_sub(1);
        }
    }
}

/// One placement decision's state: the replica list, the placer locked for the decision, and
/// the views and loads the policy reads ([`Replicas::deciding`]).
struct Deciding<'a> {
    list: Vec<Arc<Replica>>,
    placer: MutexGuard<'a, Placer>,
    views: Vec<ReplicaView>,
    load: Vec<u32>,
}

/// Per replica, the shared blocks `hits` says are resident there (0 where unknown).
fn shared_hits(hits: &[Option<u64>]) -> impl FnMut(usize) -> u64 + '_ {
    |r| hits.get(r).copied().flatten().unwrap_or(0)
}

/// The replicas and where sessions are.
#[derive(Debug)]
pub struct Replicas {
    /// In the order they were first listed; never shrinks (module docs).
    list: RwLock<Vec<Arc<Replica>>>,
    placer: Mutex<Placer>,
    next_ungated: AtomicUsize,
    changed: Arc<Notify>,
    /// The replicas always listed (flags, TOML `replicas`).
    static_urls: Vec<ReplicaUrl>,
    /// What a replica added later is built with.
    config: ProxyConfig,
    client: Client,
    /// Times the replica list was changed while running.
    list_changes: AtomicU64,
}

/// Where a request goes.
#[derive(Debug, Clone)]
pub struct Route {
    /// Index into the replica list ([`Replicas::get`]).
    pub index: usize,
    /// 1-based turn index of this request within its session (0 when ungated).
    pub turn: u64,
    /// The replica the session was placed on before this request moved it, if it moved.
    pub moved_from: Option<usize>,
    /// Why it goes there (`None` when ungated).
    pub reason: Option<PlaceReason>,
}

impl Route {
    /// Whether this is its session's first turn, placed as a new session (counted in the
    /// replica's backlog of new sessions while it waits).
    pub fn is_first(&self) -> bool {
        matches!(self.reason, Some(PlaceReason::New | PlaceReason::NewMove))
    }
}

/// What placement answered for a turn.
#[derive(Debug, Clone)]
pub enum Placing {
    /// Go there.
    Route(Route),
    /// A new session no replica would take now: hold it and ask again when something changes.
    Hold,
    /// No replica is up.
    NoReplica,
}

impl Replicas {
    /// One replica (gate and probe) per configured URL.
    pub fn new(config: &ProxyConfig, client: &Client) -> crate::Result<Self> {
        let changed = Arc::new(Notify::new());
        let mut list = Vec::with_capacity(config.replicas.len());
        for url in &config.replicas {
            list.push(Arc::new(build(config, client, url, &changed)?));
        }
        let n = list.len();
        Ok(Self {
            list: RwLock::new(list),
            placer: Mutex::new(Placer {
                sessions: HashMap::new(),
                pinned: vec![0; n],
                placement: config.placement.build(n),
                found: 0,
                hold_timeouts: 0,
            }),
            next_ungated: Default::default(),
            changed,
            static_urls: config.static_replicas.clone(),
            config: config.clone(),
            client: client.clone(),
            list_changes: AtomicU64::new(0),
        })
    }

    fn placer(&self) -> MutexGuard<'_, Placer> {
        self.placer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every replica ever listed, in order (unlisted ones included: [`Replica::is_listed`]).
    pub fn snapshot(&self) -> Vec<Arc<Replica>> {
        self.list.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The replica at `index` (indices never change).
    pub fn get(&self, index: usize) -> Arc<Replica> {
        self.list.read().unwrap_or_else(|e| e.into_inner())[index].clone()
    }

    /// The listed replicas.
    pub fn listed(&self) -> Vec<Arc<Replica>> {
        let mut list = self.snapshot();
        list.retain(|r| r.is_listed());
        list
    }

    /// Resolves when something placement may be waiting for changed (a turn admitted or
    /// finished, a replica's health or the list). Create it before looking, then await it.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Wakes every turn held by placement to look again.
    pub fn notify_changed(&self) {
        self.changed.notify_waiters();
    }

    /// Makes the listed replicas `static ∪ urls`: new URLs are added (they take new sessions),
    /// listed ones no longer in it are unlisted (module docs). Returns how many were added and
    /// how many unlisted.
    pub fn set_listed(&self, urls: &[ReplicaUrl]) -> (usize, usize) {
        let wanted = |base: &str| {
            self.static_urls.iter().any(|u| u.base == base) || urls.iter().any(|u| u.base == base)
        };
        let (mut added, mut unlisted) = (0, 0);
        {
            let mut list = self.list.write().unwrap_or_else(|e| e.into_inner());
            for r in list.iter() {
                let want = wanted(&r.url.base);
                if r.listed.swap(want, Ordering::Relaxed) != want {
                    let what = if want {
                        "listed again"
                    } else {
                        "no longer listed"
                    };
                    eprintln!("session-gate proxy: replica {} is {what}", r.url.base);
                    if want {
                        added += 1;
                    } else {
                        unlisted += 1;
                    }
                }
            }
            for url in urls {
                if list.iter().any(|r| r.url.base == url.base) {
                    continue;
                }
                match build(&self.config, &self.client, url, &self.changed) {
                    Ok(r) => {
                        eprintln!("session-gate proxy: replica {} added", url.base);
                        list.push(Arc::new(r));
                        added += 1;
                    }
                    Err(e) => eprintln!(
                        "session-gate proxy: replica {} could not be added: {e}",
                        url.base
                    ),
                }
            }
            let n = list.len();
            let mut placer = self.placer();
            placer.pinned.resize(n, 0);
            placer.placement.grow(n);
        }
        if added + unlisted > 0 {
            self.list_changes.fetch_add(1, Ordering::Relaxed);
            self.notify_changed();
        }
        (added, unlisted)
    }

    /// Times the list changed while running.
    pub fn list_changes(&self) -> u64 {
        self.list_changes.load(Ordering::Relaxed)
    }

    /// The placement views of `list`, `pinned` sessions on each.
    fn views(list: &[Arc<Replica>], pinned: &[u32], ignore_backlog: bool) -> Vec<ReplicaView> {
        list.iter()
            .enumerate()
            .map(|(i, r)| {
                let sessions = pinned.get(i).copied().unwrap_or(0);
                placing::replica_view(&r.facts(sessions, ignore_backlog))
            })
            .collect()
    }

    /// Block size of the replicas (the first one that told its own), vLLM's default before any
    /// did.
    pub fn block_size(&self) -> u64 {
        self.snapshot()
            .iter()
            .find_map(|r| r.probe.last_usage().map(|u| u.block_size))
            .filter(|&b| b > 0)
            .unwrap_or(placing::DEFAULT_BLOCK_SIZE)
    }

    /// The placement policy this proxy runs.
    pub fn policy(&self) -> Router {
        self.config.placement
    }

    /// Places this turn of `session` (`turn`: its blocks; `home_hit`: its prompt blocks resident
    /// on its home, when it has one; `lookup`: what the replicas' prefix probes said of a
    /// session this proxy has not seen, with `hits` per replica). `ignore_backlog`: a new
    /// session held long enough goes where it would go if no replica had new sessions waiting.
    pub fn place(
        &self,
        session_id: &str,
        turn: &SessionView,
        home_hit: u64,
        lookup: Option<(Lookup, &[Option<u64>])>,
        ignore_backlog: bool,
    ) -> Placing {
        let Deciding {
            list,
            mut placer,
            views,
            load,
        } = self.deciding(ignore_backlog);
        let snap = Snapshot::of(&views, &load);
        let routed = Self::routed(session_id, turn);
        let home = placer.sessions.get(session_id).map(|s| s.replica);
        let placed = match (home, lookup) {
            (None, Some((Lookup::Home(r), _))) if views.get(r).is_some_and(|v| v.up) => {
                placer.found += 1;
                Some(Placed {
                    replica: r,
                    reason: PlaceReason::Found,
                })
            }
            (None, lookup) => {
                let hits = lookup.map_or(&[][..], |(_, hits)| hits);
                placer
                    .placement
                    .place_new(&snap, &routed, &mut shared_hits(hits))
            }
            (Some(h), _) => placer
                .placement
                .place_returning(&snap, &routed, h, &mut || home_hit),
        };
        let Some(placed) = placed else {
            return if home.is_none() && views.iter().any(|v| v.up) {
                Placing::Hold
            } else {
                Placing::NoReplica
            };
        };
        if ignore_backlog && placed.reason == PlaceReason::New {
            placer.hold_timeouts += 1;
        }
        let now = Instant::now();
        let to = placed.replica;
        if home != Some(to) {
            if let Some(h) = home {
                placer.unpin(h);
            }
            placer.pinned[to] += 1;
        }
        let sticky = placer
            .sessions
            .entry(session_id.to_string())
            .or_insert(Sticky {
                replica: to,
                turns: 0,
                last_seen: now,
            });
        sticky.replica = to;
        sticky.turns += 1;
        sticky.last_seen = now;
        let turn_index = sticky.turns;
        if placed.reason == PlaceReason::New {
            list[to].new_waiting.fetch_add(1, Ordering::Relaxed);
        }
        Placing::Route(Route {
            index: to,
            turn: turn_index,
            moved_from: home.filter(|&h| h != to),
            reason: Some(placed.reason),
        })
    }

    /// Whether a turn of `session_id` waiting for admission at `home` could move under this
    /// proxy's policy, whatever is resident at home (nothing is asked of a replica:
    /// [`routers::Placer::may_move_waiting`]); `first`: its session's first turn; `hits`: per
    /// replica, its shared blocks resident there, where known.
    pub fn may_move_waiting(
        &self,
        session_id: &str,
        turn: &SessionView,
        home: usize,
        first: bool,
        hits: &[Option<u64>],
    ) -> bool {
        let d = self.deciding(false);
        d.placer.placement.may_move_waiting(
            &Snapshot::of(&d.views, &d.load),
            &Self::routed(session_id, turn),
            home,
            first,
            &mut shared_hits(hits),
        )
    }

    /// Moves a turn of `session_id` waiting for admission at `home` (`home_hit` of its prompt
    /// blocks resident there) where the policy says ([`routers::Placer::place_waiting`]): the
    /// session's home, and its pin, go with it. `None`: it stays, or the session's home is no
    /// longer `home` (another of its turns moved it).
    pub fn place_waiting(
        &self,
        session_id: &str,
        turn: &SessionView,
        home: usize,
        home_hit: u64,
        first: bool,
        hits: &[Option<u64>],
    ) -> Option<Route> {
        let Deciding {
            list,
            mut placer,
            views,
            load,
        } = self.deciding(false);
        if placer.sessions.get(session_id).map(|s| s.replica) != Some(home) {
            return None;
        }
        let placed = placer.placement.place_waiting(
            &Snapshot::of(&views, &load),
            &Self::routed(session_id, turn),
            home,
            home_hit,
            first,
            &mut shared_hits(hits),
        )?;
        let to = placed.replica;
        placer.unpin(home);
        placer.pinned[to] += 1;
        let sticky = placer.sessions.get_mut(session_id)?;
        sticky.replica = to;
        sticky.last_seen = Instant::now();
        let turn_index = sticky.turns;
        if first {
            list[to].new_waiting.fetch_add(1, Ordering::Relaxed);
        }
        Some(Route {
            index: to,
            turn: turn_index,
            moved_from: Some(home),
            reason: Some(placed.reason),
        })
    }

    /// The placer, locked, and what its policy reads: every replica's view (`ignore_backlog`
    /// as for [`Replicas::place`]) and load (this proxy's requests waiting or in flight there).
    fn deciding(&self, ignore_backlog: bool) -> Deciding<'_> {
        let list = self.snapshot();
        let mut placer = self.placer();
        placer.pinned.resize(list.len(), 0);
        let views = Self::views(&list, &placer.pinned, ignore_backlog);
        let load = list.iter().map(|r| r.load()).collect();
        Deciding {
            list,
            placer,
            views,
            load,
        }
    }

    /// The policy's view of a turn of `session_id`.
    fn routed<'a>(session_id: &'a str, turn: &SessionView) -> routers::Turn<'a> {
        routers::Turn {
            session_id,
            session: 0,
            prompt_tokens: 0,
            system_tokens: 0,
            view: *turn,
        }
    }

    /// Placements and moves by reason so far, and how many held sessions were placed past the
    /// backlogs after `max_wait_sec`.
    pub fn placement_stats(&self) -> (PlacementStats, u64) {
        let placer = self.placer();
        let stats = PlacementStats {
            found: placer.found,
            ..placer.placement.stats()
        };
        (stats, placer.hold_timeouts)
    }

    /// The replica a session is placed on, if any.
    pub fn session_replica(&self, session_id: &str) -> Option<usize> {
        self.placer().sessions.get(session_id).map(|s| s.replica)
    }

    /// The replica to tokenize a turn of `session_id` on: its home while that is up, else the
    /// one an ungated request would go to (every replica serves the same model).
    pub fn tokenizer(&self, session_id: &str) -> Option<usize> {
        let home = self.session_replica(session_id);
        match home {
            Some(h) if self.get(h).grade() != Grade::Down => Some(h),
            _ => self.route_ungated().map(|r| r.index),
        }
    }

    /// Forgets where the session is (after `/sess/{id}/finish`).
    pub fn forget_session(&self, session_id: &str) -> Option<usize> {
        let mut placer = self.placer();
        let gone = placer.sessions.remove(session_id).map(|s| s.replica);
        if let Some(r) = gone {
            placer.unpin(r);
        }
        gone
    }

    /// A healthy listed replica for an ungated request (round robin); with none healthy, a
    /// reachable one.
    pub fn route_ungated(&self) -> Option<Route> {
        let list = self.snapshot();
        let n = list.len();
        let start = self.next_ungated.fetch_add(1, Ordering::Relaxed);
        [Grade::Healthy, Grade::Slow]
            .into_iter()
            .find_map(|grade| {
                (0..n)
                    .map(|k| (start + k) % n)
                    .find(|&i| list[i].grade() == grade)
            })
            .map(|index| Route {
                index,
                turn: 0,
                moved_from: None,
                reason: None,
            })
    }

    /// Forgets sessions idle for longer than `ttl` (bounded memory for abandoned ones).
    pub fn expire_sessions(&self, ttl: Duration) {
        let mut placer = self.placer();
        let now = Instant::now();
        let Placer {
            sessions, pinned, ..
        } = &mut *placer;
        sessions.retain(|_, s| {
            let keep = now.duration_since(s.last_seen) < ttl;
            if !keep && let Some(n) = pinned.get_mut(s.replica) {
                *n = n.saturating_sub(1);
            }
            keep
        });
    }

    /// Number of sessions placed.
    pub fn num_sessions(&self) -> usize {
        self.placer().sessions.len()
    }
}

/// One replica's gate and probe.
fn build(
    config: &ProxyConfig,
    client: &Client,
    url: &ReplicaUrl,
    changed: &Arc<Notify>,
) -> crate::Result<Replica> {
    let http = Arc::new(HttpProbe::new(
        client.clone(),
        &url.base,
        &url.authority,
        config.replica_authorization.as_deref(),
    ));
    let probe = Arc::new(CachedProbe::new(
        http,
        Duration::from_millis(config.usage_cache_ms),
        config.gate.high_watermark,
    ));
    let gate = Gate::new(probe.clone(), config.gate.clone())?;
    Ok(Replica {
        url: url.clone(),
        gate,
        probe,
        healthy: AtomicBool::new(true),
        reachable: AtomicBool::new(true),
        listed: AtomicBool::new(true),
        queued: AtomicU32::new(0),
        new_waiting: AtomicU32::new(0),
        in_flight: AtomicU32::new(0),
        changed: changed.clone(),
    })
}

/// A health check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// `GET /health` answered 200 within two seconds.
    Ok,
    /// Connected, but no 200 in time (slow, or an error status).
    Failed,
    /// No connection could be opened.
    Unreachable,
}

/// One health check: `GET /health` answered 200 within two seconds.
pub async fn check(client: &Client, replica: &Replica) -> Health {
    let request = Request::builder()
        .method(Method::GET)
        .uri(format!("{}/health", replica.url.base))
        .header(hyper::header::HOST, &replica.url.authority)
        .body(Full::new(Bytes::new()));
    let Ok(request) = request else {
        return Health::Unreachable;
    };
    match tokio::time::timeout(Duration::from_secs(2), client.request(request)).await {
        Ok(Ok(r)) if r.status().is_success() => Health::Ok,
        Ok(Err(e)) if e.is_connect() => Health::Unreachable,
        _ => Health::Failed,
    }
}

/// Checks every listed replica every `interval`, reads the usage of each healthy one (so that
/// placement knows the room of a replica no turn went to lately), and expires long-idle
/// sessions, forever.
pub async fn health_loop(replicas: Arc<Replicas>, client: Client, interval: Duration) {
    loop {
        for r in replicas.listed() {
            r.checked(check(&client, &r).await);
            if r.is_healthy() {
                let probe_timeout = Duration::from_secs(2);
                let _ = tokio::time::timeout(probe_timeout, r.probe.usage()).await;
            }
        }
        replicas.notify_changed();
        replicas.expire_sessions(Duration::from_secs(3600));
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::config::{ProxyArgs, ProxyConfig, parse_replica};

    fn replicas(n: usize) -> Replicas {
        replicas_with(n, "gate")
    }

    fn replicas_with(n: usize, placement: &str) -> Replicas {
        let args = ProxyArgs {
            replicas: (0..n)
                .map(|i| format!("http://127.0.0.1:{}", 9 + i))
                .collect(),
            placement: Some(placement.into()),
            ..Default::default()
        };
        let config = ProxyConfig::from_toml(&args, "").unwrap();
        let client = super::super::upstream::client(Duration::from_secs(1));
        Replicas::new(&config, &client).unwrap()
    }

    fn turn() -> SessionView {
        placing::session_view(320, 32, 16)
    }

    /// Places a turn and, as the proxy does once the gate answered, ends its admission wait.
    fn route(r: &Replicas, session: &str, home_hit: u64) -> Option<Route> {
        match r.place(session, &turn(), home_hit, None, false) {
            Placing::Route(route) => {
                let replica = r.get(route.index);
                drop(replica.awaiting_admission(route.is_first()));
                Some(route)
            }
            Placing::Hold => panic!("held"),
            Placing::NoReplica => None,
        }
    }

    /// Places a turn and keeps it waiting for admission there (the guard the proxy holds).
    fn waiting(r: &Replicas, session: &str) -> (Route, Awaiting) {
        match r.place(session, &turn(), 0, None, false) {
            Placing::Route(route) => {
                let guard = r.get(route.index).awaiting_admission(route.is_first());
                (route, guard)
            }
            other => panic!("{session}: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_first_turn_waiting_behind_another_moves_to_a_replica_that_would_admit_it_now() {
        let r = replicas(2);
        // Both new sessions go where nothing waits: one on each replica.
        let (a, _a_wait) = waiting(&r, "a");
        let (b, b_wait) = waiting(&r, "b");
        assert_ne!(a.index, b.index);
        // A third waits behind one of them (a tie: the lowest index, `a`'s).
        let (c, c_wait) = waiting(&r, "c");
        let home = c.index;
        assert_eq!(home, a.index);
        // While `b` waits on the other replica, nothing would admit `c` sooner there.
        assert!(!r.may_move_waiting("c", &turn(), home, true, &[]));
        assert!(r.place_waiting("c", &turn(), home, 0, true, &[]).is_none());
        // `b` is admitted: the other replica's queue is empty, and `c` goes there.
        drop(b_wait);
        assert!(r.may_move_waiting("c", &turn(), home, true, &[]));
        let moved = r.place_waiting("c", &turn(), home, 0, true, &[]).unwrap();
        assert_eq!(moved.index, b.index);
        assert_eq!(moved.moved_from, Some(home));
        assert_eq!(moved.reason, Some(PlaceReason::NewMove));
        assert!(moved.is_first());
        assert_eq!(moved.turn, c.turn, "a move is the same turn");
        assert_eq!(r.session_replica("c"), Some(b.index), "its home follows");
        // It counts in the new replica's backlog of new sessions from the move on.
        assert_eq!(r.get(b.index).new_waiting.load(Ordering::Relaxed), 1);
        drop(c_wait);
        let (stats, _) = r.placement_stats();
        assert_eq!(stats.new_move, 1, "{stats:?}");
        // Asked again from its old home, nothing moves (the session is no longer there).
        assert!(r.place_waiting("c", &turn(), home, 0, true, &[]).is_none());
    }

    #[tokio::test]
    async fn a_waiting_returning_turn_moves_only_when_cold_at_home() {
        let r = replicas(2);
        let first = route(&r, "s", 0).unwrap();
        let home = first.index;
        // Its next turn waits at home behind another session's turn.
        let (_queued, _q_wait) = loop {
            let (route, guard) = waiting(&r, &format!("x{}", r.placement_stats().0.new));
            if route.index == home {
                break (route, guard);
            }
        };
        let Placing::Route(next) = r.place("s", &turn(), turn().prompt_blocks, None, false) else {
            panic!("s");
        };
        assert_eq!(
            (next.index, next.reason),
            (home, Some(PlaceReason::Resident))
        );
        let _s_wait = r.get(home).awaiting_admission(false);
        // The sessions placed on the other replica were admitted: its queue is empty.
        assert_eq!(r.get(1 - home).queued.load(Ordering::Relaxed), 0);
        assert!(r.may_move_waiting("s", &turn(), home, false, &[]));
        // Resident at home: it stays, though the other replica would admit it now.
        let resident = turn().prompt_blocks;
        assert!(
            r.place_waiting("s", &turn(), home, resident, false, &[])
                .is_none()
        );
        // Evicted at home while it waited: it moves, counted as a cold move.
        let moved = r.place_waiting("s", &turn(), home, 0, false, &[]).unwrap();
        assert_eq!(moved.reason, Some(PlaceReason::ColdMove));
        assert!(!moved.is_first());
        assert_eq!(r.session_replica("s"), Some(1 - home));
        assert_eq!(r.placement_stats().0.cold_move, 1);
    }

    #[tokio::test]
    async fn only_placement_gate_moves_waiting_turns() {
        for placement in ["hash", "sticky-least-loaded"] {
            let r = replicas_with(2, placement);
            let (a, _a_wait) = waiting(&r, "a");
            let (_b, _b_wait) = waiting(&r, "b");
            let _more = r.get(a.index).awaiting_admission(false);
            assert!(
                !r.may_move_waiting("a", &turn(), a.index, true, &[]),
                "{placement}"
            );
            assert!(
                r.place_waiting("a", &turn(), a.index, 0, true, &[])
                    .is_none(),
                "{placement}"
            );
        }
    }

    #[tokio::test]
    async fn a_burst_of_new_sessions_is_spread_over_idle_replicas() {
        let r = replicas(3);
        let mut per_replica = [0; 3];
        for k in 0..12 {
            per_replica[route(&r, &format!("s{k}"), 0).unwrap().index] += 1;
        }
        assert_eq!(per_replica, [4, 4, 4]);
        // A resident session stays where it is.
        let home = r.session_replica("s5").unwrap();
        let again = route(&r, "s5", 20).unwrap();
        assert_eq!(
            (again.index, again.reason),
            (home, Some(PlaceReason::Resident))
        );
        assert_eq!(route(&r, "s5", 20).unwrap().turn, 3);
        let (stats, _) = r.placement_stats();
        assert_eq!((stats.new, stats.resident), (12, 2));
    }

    #[tokio::test]
    async fn new_sessions_are_held_while_every_replica_has_its_backlog() {
        let r = replicas(2);
        // Two new sessions per replica waiting for their first admission (the default backlog).
        let mut waiting = Vec::new();
        for k in 0..4 {
            let Placing::Route(route) = r.place(&format!("s{k}"), &turn(), 0, None, false) else {
                panic!("s{k} not placed");
            };
            waiting.push(r.get(route.index).awaiting_admission(true));
        }
        assert!(matches!(
            r.place("late", &turn(), 0, None, false),
            Placing::Hold
        ));
        assert_eq!(r.placement_stats().0.held, 1);
        // Held past max_wait: placed anyway, counted.
        assert!(matches!(
            r.place("late", &turn(), 0, None, true),
            Placing::Route(_)
        ));
        assert_eq!(r.placement_stats().1, 1);
        // One admitted: room in the backlog again.
        waiting.pop();
        assert!(matches!(
            r.place("later", &turn(), 0, None, false),
            Placing::Route(_)
        ));
    }

    #[tokio::test]
    async fn a_session_on_an_unhealthy_replica_moves_and_says_from_where() {
        let r = replicas(2);
        let first = route(&r, "a", 0).unwrap();
        assert_eq!(first.moved_from, None);
        r.get(first.index).mark_unhealthy("test");
        let next = route(&r, "a", 20).unwrap();
        assert_eq!(next.moved_from, Some(first.index));
        assert_eq!(next.reason, Some(PlaceReason::DownMove));
        assert_ne!(next.index, first.index);
        assert_eq!(next.turn, 2);
        r.get(next.index).mark_unhealthy("test");
        assert!(route(&r, "a", 20).is_none(), "no reachable replica left");
        assert!(route(&r, "b", 0).is_none());
        assert!(r.route_ungated().is_none());
    }

    #[tokio::test]
    async fn a_replica_that_only_missed_a_health_check_serves_while_none_is_healthy() {
        let r = replicas(2);
        let home = route(&r, "a", 0).unwrap().index;
        let other = 1 - home;
        // Both miss a health check (busy, not gone): the session stays home, new work still
        // goes somewhere.
        r.get(home).checked(Health::Failed);
        r.get(other).checked(Health::Failed);
        let again = route(&r, "a", 20).unwrap();
        assert_eq!((again.index, again.moved_from), (home, None));
        assert!(route(&r, "b", 0).is_some());
        assert!(r.route_ungated().is_some());
        // A healthy replica is preferred to a slow one: the session moves.
        r.get(other).checked(Health::Ok);
        let moved = route(&r, "a", 20).unwrap();
        assert_eq!((moved.index, moved.moved_from), (other, Some(home)));
        assert_eq!(moved.reason, Some(PlaceReason::SlowMove));
        // A failed connection (or a check that could not connect) rules a replica out.
        r.get(other).mark_unhealthy("test");
        r.get(home).checked(Health::Unreachable);
        assert!(route(&r, "a", 20).is_none());
        assert!(r.route_ungated().is_none());
        // Until a health check passes.
        r.get(home).checked(Health::Ok);
        assert_eq!(route(&r, "a", 20).unwrap().index, home);
    }

    #[tokio::test]
    async fn a_replica_added_takes_new_sessions_and_an_unlisted_ones_sessions_move() {
        let r = replicas(1);
        let a = route(&r, "a", 0).unwrap();
        assert_eq!(a.index, 0);
        let added = parse_replica("test", "http://127.0.0.1:20").unwrap();
        assert_eq!(r.set_listed(std::slice::from_ref(&added)), (1, 0));
        assert_eq!(r.snapshot().len(), 2);
        // The new replica has no session: the next new one goes there.
        assert_eq!(route(&r, "b", 0).unwrap().index, 1);
        // The static replica stays listed whatever the file says; the file's replica goes.
        assert_eq!(r.set_listed(&[]), (0, 1));
        assert!(!r.get(1).is_listed() && r.get(0).is_listed());
        assert_eq!(r.listed().len(), 1);
        let b = route(&r, "b", 20).unwrap();
        assert_eq!((b.index, b.reason), (0, Some(PlaceReason::DownMove)));
        assert_eq!(route(&r, "c", 0).unwrap().index, 0);
        // Listed again: the same slot, sessions come back to it.
        assert_eq!(r.set_listed(&[added]), (1, 0));
        assert_eq!(r.snapshot().len(), 2);
        assert_eq!(route(&r, "d", 0).unwrap().index, 1);
        assert_eq!(r.list_changes(), 3);
        // Session counts follow moves and finishes.
        assert_eq!(r.placer().pinned, vec![3, 1]);
        r.forget_session("a");
        assert_eq!(r.placer().pinned, vec![2, 1]);
    }

    #[tokio::test]
    async fn a_session_found_on_a_replica_goes_there_and_then_returns_as_any_other() {
        let r = replicas(3);
        let hits = [Some(2), Some(2), Some(15)];
        let lookup = placing::find_home(&hits, 20);
        assert_eq!(lookup, Lookup::Home(2));
        let Placing::Route(found) = r.place("x", &turn(), 0, Some((lookup, &hits)), false) else {
            panic!("not placed");
        };
        assert_eq!(
            (found.index, found.reason, found.moved_from),
            (2, Some(PlaceReason::Found), None)
        );
        assert_eq!(r.session_replica("x"), Some(2));
        let again = route(&r, "x", 20).unwrap();
        assert_eq!(
            (again.index, again.reason, again.turn),
            (2, Some(PlaceReason::Resident), 2)
        );
        let (stats, _) = r.placement_stats();
        assert_eq!((stats.found, stats.new, stats.resident), (1, 0, 1));
        assert!(stats.by_reason().contains(&("found", 1)));
        // Found on a replica that went down meanwhile: placed as new.
        r.get(1).mark_unhealthy("test");
        let hits = [Some(0), Some(15), Some(0)];
        let lookup = placing::find_home(&hits, 20);
        let Placing::Route(new) = r.place("y", &turn(), 0, Some((lookup, &hits)), false) else {
            panic!("not placed");
        };
        assert_eq!(new.reason, Some(PlaceReason::New));
        assert_ne!(new.index, 1);
    }

    #[tokio::test]
    async fn hash_keeps_a_session_on_its_ring_replica_and_counts_reasons() {
        let r = replicas_with(3, "hash");
        assert_eq!(r.policy(), Router::Hash);
        let mut homes = std::collections::HashSet::new();
        for k in 0..30 {
            let id = format!("s{k}");
            let first = route(&r, &id, 0).unwrap();
            let again = route(&r, &id, 0).unwrap();
            assert_eq!(again.index, first.index);
            assert_eq!(again.reason, Some(PlaceReason::Resident));
            homes.insert(first.index);
        }
        assert_eq!(homes.len(), 3, "30 sessions hash onto every replica");
        // Another proxy over the same list computes the same ring.
        let other = replicas_with(3, "hash");
        for k in 0..30 {
            let id = format!("s{k}");
            assert_eq!(
                route(&other, &id, 0).unwrap().index,
                r.session_replica(&id).unwrap()
            );
        }
        let (stats, _) = r.placement_stats();
        assert_eq!((stats.new, stats.resident), (30, 30));
    }

    #[tokio::test]
    async fn sticky_least_loaded_goes_where_this_proxy_has_fewest_requests() {
        let r = replicas_with(2, "sticky-least-loaded");
        // Two requests in flight on replica 0, none on replica 1.
        let busy = [r.get(0).in_flight(), r.get(0).in_flight()];
        assert_eq!((r.get(0).load(), r.get(1).load()), (2, 0));
        assert_eq!(route(&r, "a", 0).unwrap().index, 1);
        // Replica 1 busier now: a stays, a new session goes to 0.
        let more = [
            r.get(1).in_flight(),
            r.get(1).in_flight(),
            r.get(1).in_flight(),
        ];
        assert_eq!(route(&r, "a", 0).unwrap().index, 1);
        assert_eq!(route(&r, "b", 0).unwrap().index, 0);
        drop((busy, more));
        assert_eq!((r.get(0).load(), r.get(1).load()), (0, 0));
        let (stats, _) = r.placement_stats();
        assert_eq!((stats.new, stats.resident), (2, 1));
    }
}
