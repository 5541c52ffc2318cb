//! Replicas, their health, and sticky session routing.
//!
//! Each replica owns one [`Gate`] over its own [`HttpProbe`]. A session sticks to the replica
//! it first went to (its prefix is cached there) until that replica fails health checks; a new
//! (or re-routed) session goes to the healthy replica with the most headroom: the lowest of
//! max(last vLLM usage, committed blocks ÷ total blocks), fewest active leases on ties.
//!
//! Unhealthy has two grades. A replica that could not be connected to (by a request or a health
//! check) is *unreachable*: never routed to until a health check passes. One that only missed a
//! health check (a busy CPU engine can take longer than the check's two seconds to answer
//! `/health`) is still used when no replica is healthy: refusing every request with 503 because
//! the one replica was slow to say it is alive would stop serving for nothing.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request};

use super::config::{ProxyConfig, ReplicaUrl};
use super::http_probe::HttpProbe;
use super::upstream::Client;
use super::usage_cache::CachedProbe;
use crate::gate::Gate;

/// Which replicas may take a request, best first: the healthy ones, else the reachable ones
/// (module docs).
const USABLE: [fn(&Replica) -> bool; 2] = [Replica::is_healthy, Replica::is_reachable];

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
}

impl Replica {
    /// Whether the last health check passed (true until the first one fails).
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Marks the replica unhealthy and unreachable at once (a connection to it just failed);
    /// the next health check that passes marks it healthy again.
    pub fn mark_unhealthy(&self, why: &str) {
        self.reachable.store(false, Ordering::Relaxed);
        self.set_healthy(false, why);
    }

    /// Whether it may take requests when no replica is healthy: it failed no connection since
    /// its last passing health check (see the module docs).
    fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
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

    /// Committed pressure: what a new session's placement compares.
    pub fn pressure(&self) -> f64 {
        let stats = self.gate.stats();
        match self.probe.last_usage() {
            Some(u) if u.num_blocks > 0 => u
                .kv_cache_usage
                .max(stats.committed_blocks as f64 / u.num_blocks as f64),
            _ => stats.committed_blocks as f64,
        }
    }
}

#[derive(Debug)]
struct Sticky {
    replica: usize,
    turns: u64,
    last_seen: Instant,
}

/// The replicas and the session → replica map.
#[derive(Debug)]
pub struct Replicas {
    /// In configuration order.
    pub list: Vec<Arc<Replica>>,
    sessions: Mutex<HashMap<String, Sticky>>,
    next_ungated: std::sync::atomic::AtomicUsize,
}

/// Where a request goes.
#[derive(Debug, Clone)]
pub struct Route {
    /// Index into [`Replicas::list`].
    pub index: usize,
    /// 1-based turn index of this request within its session (0 when ungated).
    pub turn: u64,
    /// The replica the session was pinned to before this request re-pinned it (that replica
    /// is unhealthy), if it moved.
    pub moved_from: Option<usize>,
}

impl Replicas {
    /// One replica (gate and probe) per configured URL.
    pub fn new(config: &ProxyConfig, client: &Client) -> crate::Result<Self> {
        let mut list = Vec::with_capacity(config.replicas.len());
        for url in &config.replicas {
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
            list.push(Arc::new(Replica {
                url: url.clone(),
                gate,
                probe,
                healthy: AtomicBool::new(true),
                reachable: AtomicBool::new(true),
            }));
        }
        Ok(Self {
            list,
            sessions: Mutex::new(HashMap::new()),
            next_ungated: Default::default(),
        })
    }

    /// Of the replicas `usable` accepts, the one with the least pressure; on a tie, the one
    /// with the fewest sessions pinned to it. Pins, not leases: a burst of new sessions is
    /// placed before any of them is admitted (pressure and leases are still equal), and must
    /// not all land on the first one.
    fn best(
        &self,
        sessions: &HashMap<String, Sticky>,
        usable: fn(&Replica) -> bool,
    ) -> Option<usize> {
        let mut pinned = vec![0usize; self.list.len()];
        for s in sessions.values() {
            pinned[s.replica] += 1;
        }
        let mut best: Option<(usize, f64, usize)> = None;
        for (i, r) in self.list.iter().enumerate() {
            if !usable(r) {
                continue;
            }
            let p = r.pressure();
            if best.is_none_or(|(_, bp, bn)| p < bp || (p == bp && pinned[i] < bn)) {
                best = Some((i, p, pinned[i]));
            }
        }
        best.map(|(i, ..)| i)
    }

    /// The replica for this session's next turn (sticky), or `None` when none is healthy or
    /// reachable (a pinned replica that only missed a health check keeps its session while no
    /// other is healthy: its prefix is cached there).
    pub fn route_session(&self, session_id: &str) -> Option<Route> {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let pinned = sessions.get(session_id).map(|s| s.replica);
        let home = USABLE.into_iter().find_map(|usable| match pinned {
            Some(r) if usable(&self.list[r]) => Some(r),
            _ => self.best(&sessions, usable),
        })?;
        let sticky = sessions.entry(session_id.to_string()).or_insert(Sticky {
            replica: home,
            turns: 0,
            last_seen: now,
        });
        sticky.replica = home;
        sticky.turns += 1;
        sticky.last_seen = now;
        Some(Route {
            index: home,
            turn: sticky.turns,
            moved_from: pinned.filter(|&r| r != home),
        })
    }

    /// The replica a session is pinned to, if any.
    pub fn session_replica(&self, session_id: &str) -> Option<usize> {
        let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.get(session_id).map(|s| s.replica)
    }

    /// Forgets the session's pin (after `/sess/{id}/finish`).
    pub fn forget_session(&self, session_id: &str) -> Option<usize> {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.remove(session_id).map(|s| s.replica)
    }

    /// A healthy replica for an ungated request (round robin); with none healthy, a reachable
    /// one.
    pub fn route_ungated(&self) -> Option<Route> {
        let n = self.list.len();
        let start = self.next_ungated.fetch_add(1, Ordering::Relaxed);
        USABLE
            .into_iter()
            .find_map(|usable| {
                (0..n)
                    .map(|k| (start + k) % n)
                    .find(|&i| usable(&self.list[i]))
            })
            .map(|index| Route {
                index,
                turn: 0,
                moved_from: None,
            })
    }

    /// Drops pins of sessions idle for longer than `ttl` (bounded memory for abandoned ones).
    pub fn expire_sessions(&self, ttl: Duration) {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        sessions.retain(|_, s| now.duration_since(s.last_seen) < ttl);
    }

    /// Number of pinned sessions.
    pub fn num_sessions(&self) -> usize {
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }
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

/// Checks every replica every `interval` and expires long-idle session pins, forever.
pub async fn health_loop(replicas: Arc<Replicas>, client: Client, interval: Duration) {
    loop {
        for r in &replicas.list {
            r.checked(check(&client, r).await);
        }
        replicas.expire_sessions(Duration::from_secs(3600));
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::config::{ProxyArgs, ProxyConfig};

    fn replicas(n: usize) -> Replicas {
        let args = ProxyArgs {
            replicas: (0..n)
                .map(|i| format!("http://127.0.0.1:{}", 9 + i))
                .collect(),
            ..Default::default()
        };
        let config = ProxyConfig::from_toml(&args, "").unwrap();
        let client = super::super::upstream::client(Duration::from_secs(1));
        Replicas::new(&config, &client).unwrap()
    }

    #[tokio::test]
    async fn a_burst_of_new_sessions_is_spread_over_idle_replicas() {
        // No usage answers and nothing admitted yet: every replica's pressure is equal.
        let r = replicas(3);
        let mut per_replica = [0; 3];
        for k in 0..12 {
            per_replica[r.route_session(&format!("s{k}")).unwrap().index] += 1;
        }
        assert_eq!(per_replica, [4, 4, 4]);
        // A known session stays where it is pinned.
        let home = r.session_replica("s5").unwrap();
        assert_eq!(r.route_session("s5").unwrap().index, home);
        assert_eq!(r.route_session("s5").unwrap().turn, 3);
    }

    #[tokio::test]
    async fn a_session_on_an_unhealthy_replica_moves_and_says_from_where() {
        let r = replicas(2);
        let first = r.route_session("a").unwrap();
        assert_eq!(first.moved_from, None);
        r.list[first.index].mark_unhealthy("test");
        let next = r.route_session("a").unwrap();
        assert_eq!(next.moved_from, Some(first.index));
        assert_ne!(next.index, first.index);
        assert_eq!(next.turn, 2);
        r.list[next.index].mark_unhealthy("test");
        assert!(r.route_session("a").is_none(), "no reachable replica left");
        assert!(r.route_ungated().is_none());
    }

    #[tokio::test]
    async fn a_replica_that_only_missed_a_health_check_serves_while_none_is_healthy() {
        let r = replicas(2);
        let home = r.route_session("a").unwrap().index;
        let other = 1 - home;
        // Both miss a health check (busy, not gone): the session stays home, new work still
        // goes somewhere.
        r.list[home].checked(Health::Failed);
        r.list[other].checked(Health::Failed);
        let again = r.route_session("a").unwrap();
        assert_eq!((again.index, again.moved_from), (home, None));
        assert!(r.route_session("b").is_some());
        assert!(r.route_ungated().is_some());
        // A healthy replica is still preferred to a merely reachable one.
        r.list[other].checked(Health::Ok);
        let moved = r.route_session("a").unwrap();
        assert_eq!((moved.index, moved.moved_from), (other, Some(home)));
        // A failed connection (or a check that could not connect) rules a replica out.
        r.list[other].mark_unhealthy("test");
        r.list[home].checked(Health::Unreachable);
        assert!(r.route_session("a").is_none());
        assert!(r.route_ungated().is_none());
        // Until a health check passes.
        r.list[home].checked(Health::Ok);
        assert_eq!(r.route_session("a").unwrap().index, home);
    }
}
