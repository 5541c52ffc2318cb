//! The tokio driver: runs [`GateCore`]'s actions against a [`Probe`], sleeps on its waits, and
//! hands out [`Lease`]s that release on drop. All state and every decision stay in the core.
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::{Duration, Instant};

use super::config::GateConfig;
use super::core::GateCore;
use super::metrics::GateStats;
use super::types::{
    Action, Admission, AttemptId, LeaseId, PrefixReport, ProbeKind, Reason, UsageReport,
};
use crate::error::{Error, Result};

/// The future a [`Probe`] method returns: boxed, so `Arc<dyn Probe>` works.
pub type ProbeFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// Where the gate's two residency probes go: the engine half (in-process or over HTTP), a C
/// callback, or a fake. An `Err` or an answer slower than `probe_timeout_sec` counts as
/// unavailable; the gate never hangs on a probe.
///
/// Methods return boxed futures so that `Arc<dyn Probe>` works:
///
/// ```
/// use session_gate::gate::{PrefixReport, Probe, ProbeFuture, UsageReport};
///
/// struct Idle;
///
/// impl Probe for Idle {
///     fn usage(&self) -> ProbeFuture<'_, UsageReport> {
///         Box::pin(async {
///             Ok(UsageReport { kv_cache_usage: 0.0, num_blocks: 1024, block_size: 16, ..Default::default() })
///         })
///     }
///     fn prefix<'a>(&'a self, _session: &'a str, prompt: &'a [u32]) -> ProbeFuture<'a, PrefixReport> {
///         let prompt_tokens = prompt.len() as u64;
///         Box::pin(async move { Ok(PrefixReport { prompt_tokens, ..Default::default() }) })
///     }
/// }
/// ```
pub trait Probe: Send + Sync {
    /// `session_gate_usage`: KV usage and the counts behind it.
    fn usage(&self) -> ProbeFuture<'_, UsageReport>;

    /// `session_gate_probe`: how much of this prompt's prefix is resident.
    fn prefix<'a>(
        &'a self,
        session_id: &'a str,
        prompt_ids: &'a [u32],
    ) -> ProbeFuture<'a, PrefixReport>;

    /// Lets the engine half drop what it keeps for a finished session. Optional.
    fn forget<'a>(&'a self, session_id: &'a str) -> ProbeFuture<'a, ()> {
        let _ = session_id;
        Box::pin(std::future::ready(Ok(())))
    }
}

struct Shared {
    core: Mutex<GateCore>,
    probe: Arc<dyn Probe>,
    notify: Notify,
    /// Time zero of the core's clock (tokio's clock, so paused-time tests work).
    origin: Instant,
    probe_timeout: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, GateCore> {
        // A panic elsewhere while holding the lock leaves the core consistent enough to keep
        // serving: every core method finishes its bookkeeping before it can panic.
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the core with the current time, then wakes every waiter if the epoch moved.
    fn with_core<R>(&self, f: impl FnOnce(&mut GateCore, f64) -> R) -> R {
        let mut core = self.lock();
        let before = core.epoch();
        let now = self.origin.elapsed().as_secs_f64();
        let out = f(&mut core, now);
        let moved = core.epoch() != before;
        drop(core);
        if moved {
            self.notify.notify_waiters();
        }
        out
    }

    fn instant_at(&self, t: f64) -> Instant {
        let far = Duration::from_secs(365 * 24 * 3600);
        let d = Duration::try_from_secs_f64(t.max(0.0)).unwrap_or(far);
        self.origin
            .checked_add(d)
            .unwrap_or_else(|| Instant::now() + far)
    }
}

/// A session-level admission gate driven by tokio. Cheap to clone; clones share one gate.
#[derive(Clone)]
pub struct Gate {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").finish_non_exhaustive()
    }
}

/// Cancels the attempt in the core unless disarmed: what makes `acquire` cancel safe.
struct AttemptGuard<'a> {
    shared: &'a Shared,
    id: AttemptId,
    armed: bool,
}

impl Drop for AttemptGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.with_core(|c, now| c.cancel(self.id, now));
        }
    }
}

impl Gate {
    /// A gate over `probe` with `config` (validated).
    pub fn new(probe: Arc<dyn Probe>, config: GateConfig) -> Result<Self> {
        let probe_timeout = Duration::from_secs_f64(config.probe_timeout_sec);
        let core = GateCore::new(config)?;
        Ok(Self {
            shared: Arc::new(Shared {
                core: Mutex::new(core),
                probe,
                notify: Notify::new(),
                origin: Instant::now(),
                probe_timeout,
            }),
        })
    }

    /// Waits until this turn of `session_id` may go to the engine, and returns its lease.
    /// Release the lease (or drop it) when the engine's answer is complete.
    ///
    /// `max_tokens` is the turn's output budget, or `None` (a plain `acquire(session_id,
    /// prompt_ids)`): the working set then counts [`GateConfig::default_max_tokens`].
    ///
    /// Fails with [`Error::Preempted`] when a newer `acquire` for the same session takes over;
    /// the older attempt learns it at its next checkpoint: before and after every probe, and
    /// on waking from a wait (the preemption wakes it).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe. Dropping the future before it completes cancels the attempt in the core: it
    /// leaves the queue, and a later waiter moves up. Once the future has completed, the lease
    /// exists and its drop releases it.
    pub async fn acquire(
        &self,
        session_id: &str,
        prompt_ids: &[u32],
        max_tokens: impl Into<Option<usize>>,
        retain_session: bool,
    ) -> Result<Lease> {
        let max_tokens = max_tokens.into();
        let shared = &*self.shared;
        let id = shared.with_core(|c, now| {
            c.begin(
                session_id,
                prompt_ids.len(),
                max_tokens,
                retain_session,
                now,
            )
        });
        let mut guard = AttemptGuard {
            shared,
            id,
            armed: true,
        };
        loop {
            // Created before polling: `notify_waiters` reaches every `Notified` that exists,
            // polled or not, so a release between this poll and the sleep below is not lost.
            let notified = shared.notify.notified();
            tokio::pin!(notified);
            let action = shared.with_core(|c, now| c.poll(id, now))?;
            match action {
                Action::ProbeUsage => {
                    let (r, secs) = self.timed(shared.probe.usage()).await;
                    shared.with_core(|c, now| {
                        c.record_probe(ProbeKind::Usage, secs, r.is_ok());
                        c.on_usage(id, r, now)
                    })?;
                }
                Action::ProbePrefix => {
                    let (r, secs) = self
                        .timed(shared.probe.prefix(session_id, prompt_ids))
                        .await;
                    shared.with_core(|c, now| {
                        c.record_probe(ProbeKind::Prefix, secs, r.is_ok());
                        c.on_prefix(id, r, now)
                    })?;
                }
                Action::Wait { until } => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(shared.instant_at(until)) => {}
                    }
                }
                Action::Admit(admission) => {
                    guard.armed = false;
                    return Ok(Lease {
                        shared: Arc::clone(&self.shared),
                        session_id: session_id.into(),
                        admission,
                        released: false,
                    });
                }
                Action::Preempted => {
                    guard.armed = false;
                    return Err(Error::Preempted {
                        session_id: session_id.to_string(),
                    });
                }
            }
        }
    }

    /// Ends the session's ownership window at once, then asks the probe to `forget` it (best
    /// effort: a failure or timeout is only counted). Returns whether a window was open.
    pub async fn finish_session(&self, session_id: &str) -> bool {
        let ended = self
            .shared
            .with_core(|c, now| c.finish_session(session_id, now));
        let (r, secs) = self.timed(self.shared.probe.forget(session_id)).await;
        self.shared
            .with_core(|c, _| c.record_probe(ProbeKind::Forget, secs, r.is_ok()));
        ended
    }

    /// A snapshot of the counters and gauges.
    pub fn stats(&self) -> GateStats {
        // Grace windows are purged lazily: purge what has ended, so an idle gate does not
        // report reservations whose window already closed.
        self.shared.with_core(|c, now| {
            c.expire(now);
            c.stats()
        })
    }

    /// Prometheus text exposition.
    pub fn prometheus(&self) -> String {
        self.shared.with_core(|c, now| {
            c.expire(now);
            c.prometheus()
        })
    }

    /// How many attempts of this session were preempted (see [`GateCore::num_preempted`]).
    pub fn num_preempted(&self, session_id: &str) -> u32 {
        self.shared.lock().num_preempted(session_id)
    }

    /// Read-only access to the core, e.g. for [`GateCore::check_invariants`] or
    /// [`GateCore::has_reservation`]. Do not block inside `f`: it holds the gate's lock.
    pub fn inspect<R>(&self, f: impl FnOnce(&GateCore) -> R) -> R {
        f(&self.shared.lock())
    }

    /// Runs one probe call under `probe_timeout_sec`; returns the answer (`Err` = unavailable)
    /// and how long it took.
    async fn timed<T>(&self, call: ProbeFuture<'_, T>) -> (std::result::Result<T, String>, f64) {
        let started = Instant::now();
        let timeout = self.shared.probe_timeout;
        let r = match tokio::time::timeout(timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "probe did not answer within {} s",
                timeout.as_secs_f64()
            )),
        };
        (r, started.elapsed().as_secs_f64())
    }
}

/// One admission. Release it (or drop it) when the engine's answer is complete: that is what
/// lets the next waiter through. With `retain_session` the session keeps its reservation as an
/// idle grace window after release.
pub struct Lease {
    shared: Arc<Shared>,
    session_id: Box<str>,
    admission: Admission,
    released: bool,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("session_id", &self.session_id)
            .field("admission", &self.admission)
            .field("released", &self.released)
            .finish()
    }
}

impl Lease {
    /// Releases the lease. Returns false (a no-op) if it was released already.
    pub fn release(&mut self) -> bool {
        if std::mem::replace(&mut self.released, true) {
            return false;
        }
        let lease = self.admission.lease;
        self.shared.with_core(|c, now| c.release(lease, now))
    }

    /// The lease's id in the core.
    pub fn id(&self) -> LeaseId {
        self.admission.lease
    }

    /// The session this lease admitted.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// Everything the core said about this admission.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Why it was admitted.
    pub fn reason(&self) -> Reason {
        self.admission.reason
    }

    /// Seconds it waited.
    pub fn wait_sec(&self) -> f64 {
        self.admission.wait_sec
    }

    /// vLLM's KV usage at the decision, if the usage probe answered.
    pub fn usage(&self) -> Option<f64> {
        self.admission.usage
    }

    /// The prefix hit ratio, if the prefix probe was asked and answered.
    pub fn hit_ratio(&self) -> Option<f64> {
        self.admission.hit_ratio
    }

    /// Whether an ownership window was asked for.
    pub fn retain_session(&self) -> bool {
        self.admission.retain_session
    }

    /// Whether [`Lease::release`] has run.
    pub fn is_released(&self) -> bool {
        self.released
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.released {
            self.released = true;
            let lease = self.admission.lease;
            self.shared
                .with_core(|c, now| c.release_dropped(lease, now));
        }
    }
}
