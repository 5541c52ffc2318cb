//! [`CachedProbe`]: a replica's [`Probe`] with its usage answer cached for `usage_cache_ms` and
//! concurrent usage probes sharing one request (single-flight).
//!
//! The gate starts every admission cycle with a usage probe; over HTTP that is a round trip
//! through vLLM's API server into the engine core, and without a cache every gated request
//! paid it before being forwarded. Committed pressure (the default) is computed by the gate
//! itself and stays exact; only vLLM's own `kv_cache_usage` may be up to `usage_cache_ms` old.
//!
//! Releases. The gate's rule is that a usage reading taken before a release must not decide to
//! wait (the release may have made room). The proxy calls [`CachedProbe::released`] *before*
//! it releases a lease or finishes a session on this replica, which marks the cached reading
//! (and any usage request already in flight) as pre-release. A release only frees KV blocks,
//! so a pre-release reading is an upper bound of the post-release usage, up to what the cache
//! already allows for (growth during `usage_cache_ms`). The gate compares usage with the high
//! watermark and nothing else, so when the pre-release reading is below the watermark, every
//! fresh reading would be too and the decision is the same: it is still served. A pre-release
//! reading at or above the watermark is never served; the next caller asks vLLM again.
//!
//! Failed probes and invalid answers are never cached (callers that shared the failed request all see the failure).
//! A `usage_cache_ms` of 0 turns all of this off: every usage probe goes to vLLM.
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::error::Error;
use crate::gate::{PrefixReport, Probe, ProbeFuture, UsageReport};

/// One usage request to the replica, shared by every caller that joins it.
#[derive(Debug, Default)]
struct Flight {
    /// The answer (`Err` = the message) and when the request was sent.
    answer: OnceCell<(std::result::Result<UsageReport, String>, Instant)>,
}

#[derive(Debug, Clone, Copy)]
struct Cached {
    report: UsageReport,
    /// When the request that got it was sent (its age counts from there).
    asked_at: Instant,
    /// A release happened after it was asked for.
    pre_release: bool,
}

#[derive(Debug, Default)]
struct State {
    /// Bumped by every release: flights of an older generation asked before it.
    generation: u64,
    cached: Option<Cached>,
    /// The flight callers join, and its generation.
    flight: Option<(u64, Arc<Flight>)>,
    /// The last valid usage answer, however old (for routing by headroom).
    last: Option<UsageReport>,
    /// Usage requests actually sent to the replica.
    fetches: u64,
}

/// A [`Probe`] over `inner` that caches usage answers (see the module docs).
pub struct CachedProbe {
    inner: Arc<dyn Probe>,
    ttl: Duration,
    high_watermark: f64,
    state: Mutex<State>,
}

impl std::fmt::Debug for CachedProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedProbe")
            .field("ttl", &self.ttl)
            .field("high_watermark", &self.high_watermark)
            .finish_non_exhaustive()
    }
}

impl CachedProbe {
    /// Caches `inner`'s usage answers for `ttl` (zero: no caching, no sharing). Pre-release
    /// readings are served only below `high_watermark` (the gate's).
    pub fn new(inner: Arc<dyn Probe>, ttl: Duration, high_watermark: f64) -> Self {
        Self {
            inner,
            ttl,
            high_watermark,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The last valid usage answer, if any arrived (however old).
    pub fn last_usage(&self) -> Option<UsageReport> {
        self.state().last
    }

    /// Usage requests sent to the replica so far (cache misses that were not shared).
    pub fn usage_fetches(&self) -> u64 {
        self.state().fetches
    }

    /// Call before releasing a lease on (or finishing a session of) this replica: readings
    /// asked for until now are pre-release.
    pub fn released(&self) {
        let mut st = self.state();
        st.generation += 1;
        if let Some(c) = &mut st.cached {
            c.pre_release = true;
        }
    }

    /// Drops every reading (cached and last): the replica went away or came back, and what it
    /// said before says nothing about its cache now (a restarted replica starts empty).
    pub fn forget_usage(&self) {
        let mut st = self.state();
        st.generation += 1;
        st.cached = None;
        st.last = None;
    }

    /// A cached reading the gate may use now, if any.
    fn usable(&self, st: &State, now: Instant) -> Option<UsageReport> {
        let c = st.cached?;
        let fresh = now.saturating_duration_since(c.asked_at) < self.ttl;
        let safe = !c.pre_release || c.report.kv_cache_usage < self.high_watermark;
        (fresh && safe).then_some(c.report)
    }

    async fn usage_impl(&self) -> crate::Result<UsageReport> {
        let (generation, flight) = {
            let mut st = self.state();
            if let Some(report) = self.usable(&st, Instant::now()) {
                return Ok(report);
            }
            let generation = st.generation;
            let flight = match &st.flight {
                Some((g, f)) if *g == generation => f.clone(),
                _ => {
                    let f = Arc::new(Flight::default());
                    st.flight = Some((generation, f.clone()));
                    f
                }
            };
            (generation, flight)
        };
        // One caller runs the request; if it is cancelled (its client left, or the gate's probe
        // timeout), a waiting caller takes over, so nobody waits on an abandoned request.
        let (answer, asked_at) = flight
            .answer
            .get_or_init(|| async {
                self.state().fetches += 1;
                let asked_at = Instant::now();
                let r = match self.inner.usage().await {
                    Ok(report) => Ok(report),
                    Err(Error::ProbeUnavailable(message)) => Err(message),
                    Err(e) => Err(e.to_string()),
                };
                (r, asked_at)
            })
            .await
            .clone();
        let mut st = self.state();
        if st
            .flight
            .as_ref()
            .is_some_and(|(_, f)| Arc::ptr_eq(f, &flight))
        {
            st.flight = None;
        }
        if let Some(report) = answer
            .as_ref()
            .ok()
            .filter(|r| r.problem().is_none())
            .copied()
        {
            let newer = st.cached.is_none_or(|c| c.asked_at <= asked_at);
            if newer {
                st.cached = Some(Cached {
                    report,
                    asked_at,
                    pre_release: generation != st.generation,
                });
                st.last = Some(report);
            }
        }
        answer.map_err(Error::ProbeUnavailable)
    }
}

impl Probe for CachedProbe {
    fn usage(&self) -> ProbeFuture<'_, UsageReport> {
        if self.ttl.is_zero() {
            let inner = self.inner.usage();
            return Box::pin(async move {
                let report = inner.await?;
                let mut st = self.state();
                st.fetches += 1;
                st.last = Some(report);
                Ok(report)
            });
        }
        Box::pin(self.usage_impl())
    }

    fn prefix<'a>(
        &'a self,
        session_id: &'a str,
        prompt_ids: &'a [u32],
    ) -> ProbeFuture<'a, PrefixReport> {
        self.inner.prefix(session_id, prompt_ids)
    }

    fn forget<'a>(&'a self, session_id: &'a str) -> ProbeFuture<'a, ()> {
        self.inner.forget(session_id)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use tokio::sync::Semaphore;

    use super::*;
    use crate::gate::testing::usage_report;

    /// Answers the current `usage` after taking a permit from `gate` (none: at once), and
    /// counts the requests it received.
    struct SlowProbe {
        usage: Mutex<f64>,
        gate: Option<Semaphore>,
        calls: AtomicU64,
    }

    impl SlowProbe {
        fn new(usage: f64, held: bool) -> Arc<Self> {
            Arc::new(Self {
                usage: Mutex::new(usage),
                gate: held.then(|| Semaphore::new(0)),
                calls: AtomicU64::new(0),
            })
        }

        fn set(&self, usage: f64) {
            *self.usage.lock().unwrap() = usage;
        }

        fn calls(&self) -> u64 {
            self.calls.load(Ordering::SeqCst)
        }
    }

    impl Probe for SlowProbe {
        fn usage(&self) -> ProbeFuture<'_, UsageReport> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if let Some(g) = &self.gate {
                    g.acquire().await.expect("open").forget();
                }
                Ok(usage_report(*self.usage.lock().unwrap(), 1000, 16))
            })
        }

        fn prefix<'a>(&'a self, _: &'a str, _: &'a [u32]) -> ProbeFuture<'a, PrefixReport> {
            Box::pin(async { Ok(PrefixReport::default()) })
        }
    }

    fn cached(inner: &Arc<SlowProbe>, ttl_ms: u64) -> Arc<CachedProbe> {
        Arc::new(CachedProbe::new(
            inner.clone(),
            Duration::from_millis(ttl_ms),
            0.85,
        ))
    }

    async fn usage(p: &CachedProbe) -> f64 {
        p.usage().await.expect("usage").kv_cache_usage
    }

    #[tokio::test(start_paused = true)]
    async fn answers_are_reused_until_the_ttl_ends() {
        let inner = SlowProbe::new(0.1, false);
        let p = cached(&inner, 50);
        assert_eq!(usage(&p).await, 0.1);
        inner.set(0.2);
        tokio::time::advance(Duration::from_millis(49)).await;
        assert_eq!(usage(&p).await, 0.1, "within the TTL: the cached answer");
        assert_eq!(inner.calls(), 1);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(usage(&p).await, 0.2, "TTL over: asked again");
        assert_eq!(inner.calls(), 2);
        assert_eq!(p.last_usage().map(|u| u.kv_cache_usage), Some(0.2));
    }

    #[tokio::test(start_paused = true)]
    async fn zero_ttl_asks_every_time() {
        let inner = SlowProbe::new(0.1, false);
        let p = cached(&inner, 0);
        for _ in 0..3 {
            usage(&p).await;
        }
        assert_eq!(inner.calls(), 3);
        assert_eq!(p.usage_fetches(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_callers_share_one_request() {
        let inner = SlowProbe::new(0.3, true);
        let p = cached(&inner, 50);
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let p = p.clone();
                tokio::spawn(async move { usage(&p).await })
            })
            .collect();
        tokio::task::yield_now().await;
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        assert_eq!(inner.calls(), 1, "one request in flight for eight callers");
        inner.gate.as_ref().unwrap().add_permits(1);
        for t in tasks {
            assert_eq!(t.await.unwrap(), 0.3);
        }
        assert_eq!(inner.calls(), 1);
        assert_eq!(p.usage_fetches(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_leader_hands_the_request_on() {
        let inner = SlowProbe::new(0.3, true);
        let p = cached(&inner, 50);
        let leader = tokio::spawn({
            let p = p.clone();
            async move { usage(&p).await }
        });
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        let follower = tokio::spawn({
            let p = p.clone();
            async move { usage(&p).await }
        });
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert_eq!(inner.calls(), 1);
        leader.abort();
        let _ = leader.await;
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert_eq!(inner.calls(), 2, "the follower asked itself");
        inner.gate.as_ref().unwrap().add_permits(1);
        assert_eq!(follower.await.unwrap(), 0.3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_makes_readings_at_or_over_the_watermark_stale() {
        let inner = SlowProbe::new(0.9, false);
        let p = cached(&inner, 50);
        assert_eq!(usage(&p).await, 0.9);
        assert_eq!(usage(&p).await, 0.9);
        assert_eq!(inner.calls(), 1, "no release: cached");
        inner.set(0.4);
        p.released();
        assert_eq!(
            usage(&p).await,
            0.4,
            "pre-release reading over the watermark"
        );
        assert_eq!(inner.calls(), 2);
        assert_eq!(usage(&p).await, 0.4, "the post-release reading is cached");
        assert_eq!(inner.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_keeps_readings_under_the_watermark() {
        let inner = SlowProbe::new(0.4, false);
        let p = cached(&inner, 50);
        assert_eq!(usage(&p).await, 0.4);
        inner.set(0.2);
        p.released();
        // 0.4 < 0.85: any post-release reading (≤ 0.4) decides the same.
        assert_eq!(usage(&p).await, 0.4);
        assert_eq!(inner.calls(), 1);
        tokio::time::advance(Duration::from_millis(50)).await;
        assert_eq!(usage(&p).await, 0.2, "the TTL still applies");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_across_a_release_is_not_joined_or_trusted() {
        let inner = SlowProbe::new(0.9, true);
        let p = cached(&inner, 50);
        let before = tokio::spawn({
            let p = p.clone();
            async move { usage(&p).await }
        });
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        p.released();
        let after = tokio::spawn({
            let p = p.clone();
            async move { usage(&p).await }
        });
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert_eq!(inner.calls(), 2, "the post-release caller did not join");
        inner.gate.as_ref().unwrap().add_permits(1);
        assert_eq!(before.await.unwrap(), 0.9);
        // The pre-release answer (0.9 ≥ 0.85) is cached as stale: not served after the release.
        inner.set(0.5);
        inner.gate.as_ref().unwrap().add_permits(1);
        assert_eq!(after.await.unwrap(), 0.5);
        assert_eq!(usage(&p).await, 0.5, "the post-release answer is cached");
        assert_eq!(inner.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_that_went_away_keeps_no_reading() {
        let inner = SlowProbe::new(0.9, false);
        let p = cached(&inner, 50);
        assert_eq!(usage(&p).await, 0.9);
        p.forget_usage();
        assert!(
            p.last_usage().is_none(),
            "a restarted replica's old usage must not steer"
        );
        inner.set(0.0);
        assert_eq!(usage(&p).await, 0.0, "not served from the cache either");
        assert_eq!(inner.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_shared_but_not_cached() {
        struct Failing(AtomicU64);
        impl Probe for Failing {
            fn usage(&self) -> ProbeFuture<'_, UsageReport> {
                self.0.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Err(Error::ProbeUnavailable("down".into())) })
            }
            fn prefix<'a>(&'a self, _: &'a str, _: &'a [u32]) -> ProbeFuture<'a, PrefixReport> {
                Box::pin(async { Ok(PrefixReport::default()) })
            }
        }
        let inner = Arc::new(Failing(AtomicU64::new(0)));
        let p = CachedProbe::new(inner.clone(), Duration::from_millis(50), 0.85);
        let e = p.usage().await.unwrap_err();
        assert_eq!(e.to_string(), "probe unavailable: down");
        assert!(p.usage().await.is_err());
        assert_eq!(inner.0.load(Ordering::SeqCst), 2);
        assert!(p.last_usage().is_none());
    }
}
