//! The gate core for Python: `GateCore` and the actions `GateCore.poll` returns (its knobs,
//! `GateConfig`, are in [`super::knobs`]).
//!
//! This is a thin skin over [`crate::gate::GateCore`]: it converts numbers and strings and holds
//! no state or policy of its own. The asyncio driver (`session_gate/gate.py`) carries out the
//! actions, exactly as the tokio driver does in Rust. Probe answers arrive as plain floats and
//! ints (the driver unpacks the probe's dict), so no per-call dict crosses this boundary.
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use super::guard::no_panic;
use super::knobs::PyGateConfig;
use crate::error::Error;
use crate::gate::metrics::{GateStats, Histogram};
use crate::gate::{
    self, Action, Admission, AttemptId, LeaseId, PrefixReport, ProbeKind, Reason, UsageReport,
};

/// Action: call the probe's `usage()`, then `GateCore.on_usage` (or `on_usage_unavailable`).
#[pyclass(module = "session_gate._native", frozen)]
pub(crate) struct ProbeUsage;

/// Action: call the probe's `prefix(session_id, prompt_ids)`, then `GateCore.on_prefix`.
#[pyclass(module = "session_gate._native", frozen)]
pub(crate) struct ProbePrefix;

/// Action: a newer attempt of the same session took over; this attempt is over.
#[pyclass(module = "session_gate._native", frozen)]
pub(crate) struct Preempted;

/// Action: sleep until `until` (the core's clock) or until `GateCore.epoch` changes.
#[pyclass(module = "session_gate._native", frozen)]
pub(crate) struct Wait {
    #[pyo3(get)]
    until: f64,
}

#[pymethods]
impl Wait {
    fn __repr__(&self) -> String {
        format!("Wait(until={:?})", self.until)
    }
}

/// Action: admitted. The attempt is over and lease `lease` exists until released.
#[pyclass(module = "session_gate._native", frozen)]
pub(crate) struct Admit {
    #[pyo3(get)]
    lease: u64,
    #[pyo3(get)]
    reason: Py<PyString>,
    #[pyo3(get)]
    wait_sec: f64,
    #[pyo3(get)]
    usage: Option<f64>,
    #[pyo3(get)]
    pressure: Option<f64>,
    #[pyo3(get)]
    hit_ratio: Option<f64>,
    #[pyo3(get)]
    retain_session: bool,
    #[pyo3(get)]
    reserved: bool,
    #[pyo3(get)]
    revoked: bool,
    #[pyo3(get)]
    working_set_blocks: Option<u64>,
    #[pyo3(get)]
    num_preempted: u32,
}

#[pymethods]
impl Admit {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Admit(lease={}, reason='{}', wait_sec={:?}, usage={}, pressure={}, \
             hit_ratio={}, retain_session={}, reserved={}, revoked={})",
            self.lease,
            self.reason.bind(py),
            self.wait_sec,
            py_opt(self.usage),
            py_opt(self.pressure),
            py_opt(self.hit_ratio),
            py_bool(self.retain_session),
            py_bool(self.reserved),
            py_bool(self.revoked),
        )
    }
}

/// An optional float as Python prints it.
fn py_opt(v: Option<f64>) -> String {
    v.map_or_else(|| "None".to_string(), |v| format!("{v:?}"))
}

fn py_bool(v: bool) -> &'static str {
    if v { "True" } else { "False" }
}

/// Interned, so admitting allocates no new string per lease.
fn reason_str(py: Python<'_>, reason: Reason) -> Py<PyString> {
    let s = match reason {
        Reason::Open => intern!(py, "open"),
        Reason::ReservedSession => intern!(py, "reserved_session"),
        Reason::PrefixProbeUnavailable => intern!(py, "prefix_probe_unavailable"),
        Reason::ResidentPrefix => intern!(py, "resident_prefix"),
        Reason::MaxWait => intern!(py, "max_wait"),
        Reason::OffloadedPrefix => intern!(py, "offloaded_prefix"),
    };
    s.clone().unbind()
}

fn admit(py: Python<'_>, a: Admission) -> Admit {
    Admit {
        lease: a.lease.0,
        reason: reason_str(py, a.reason),
        wait_sec: a.wait_sec,
        usage: a.usage,
        pressure: a.pressure,
        hit_ratio: a.hit_ratio,
        retain_session: a.retain_session,
        reserved: a.reserved,
        revoked: a.revoked,
        working_set_blocks: a.working_set_blocks,
        num_preempted: a.num_preempted,
    }
}

/// A NaN or infinite `now` would corrupt the core's deadlines; refuse it at the boundary.
fn clock(now: f64) -> PyResult<f64> {
    if now.is_finite() {
        Ok(now)
    } else {
        Err(Error::InvalidInput(format!("now must be a finite time in seconds, got {now}")).into())
    }
}

fn probe_kind(kind: &str) -> PyResult<ProbeKind> {
    ProbeKind::ALL
        .into_iter()
        .find(|k| k.as_str() == kind)
        .ok_or_else(|| {
            Error::InvalidInput(format!(
                "probe kind must be \"usage\", \"prefix\" or \"forget\", got {kind:?}"
            ))
            .into()
        })
}

/// The sans-IO admission state machine (Rust's `GateCore`). Single-threaded use: the asyncio
/// driver calls it from its event loop only.
#[pyclass(name = "GateCore", module = "session_gate._native")]
pub(crate) struct PyGateCore {
    core: gate::GateCore,
    // The argument-free actions are shared instances: polling allocates nothing for them.
    probe_usage: Py<ProbeUsage>,
    probe_prefix: Py<ProbePrefix>,
    preempted: Py<Preempted>,
}

#[pymethods]
impl PyGateCore {
    /// A core with `config` (default knobs when omitted).
    #[new]
    #[pyo3(signature = (config=None))]
    fn new(py: Python<'_>, config: Option<PyRef<'_, PyGateConfig>>) -> PyResult<Self> {
        let cfg = config.map(|c| c.inner().clone()).unwrap_or_default();
        no_panic("GateCore()", || {
            Ok(Self {
                core: gate::GateCore::new(cfg)?,
                probe_usage: Py::new(py, ProbeUsage)?,
                probe_prefix: Py::new(py, ProbePrefix)?,
                preempted: Py::new(py, Preempted)?,
            })
        })
    }

    /// The knobs this core runs with.
    #[getter]
    fn config(&self) -> PyGateConfig {
        PyGateConfig::new_inner(self.core.config().clone())
    }

    /// Starts an attempt for one turn; returns its id. Preempts the session's older attempt.
    /// `max_tokens=None` counts the config's `default_max_tokens` in the working set.
    fn begin(
        &mut self,
        session_id: &str,
        prompt_tokens: usize,
        max_tokens: Option<usize>,
        retain_session: bool,
        now: f64,
    ) -> PyResult<u64> {
        no_panic("GateCore.begin", || {
            let now = clock(now)?;
            Ok(self
                .core
                .begin(session_id, prompt_tokens, max_tokens, retain_session, now)
                .0)
        })
    }

    /// What to do next for `attempt`: `ProbeUsage`, `ProbePrefix`, `Wait`, `Admit` or
    /// `Preempted`. `LookupError` if the attempt is over (admitted, preempted, cancelled).
    fn poll(&mut self, py: Python<'_>, attempt: u64, now: f64) -> PyResult<Py<PyAny>> {
        no_panic("GateCore.poll", || {
            let now = clock(now)?;
            Ok(match self.core.poll(AttemptId(attempt), now)? {
                Action::ProbeUsage => self.probe_usage.clone_ref(py).into_any(),
                Action::ProbePrefix => self.probe_prefix.clone_ref(py).into_any(),
                Action::Preempted => self.preempted.clone_ref(py).into_any(),
                Action::Wait { until } => Py::new(py, Wait { until })?.into_any(),
                Action::Admit(a) => Py::new(py, admit(py, a))?.into_any(),
            })
        })
    }

    /// The usage probe answered (the keys of `session_gate_usage`). The host tier's figures
    /// are `None` when the engine has no readable tier (or predates them); the scheduler's
    /// request counts are `None` when the engine does not report them.
    #[pyo3(signature = (attempt, kv_cache_usage, num_blocks, num_free_blocks, num_cached_free_blocks, block_size, now, offload_num_blocks=None, offload_used_blocks=None, num_running_reqs=None, num_waiting_reqs=None))]
    #[allow(clippy::too_many_arguments)]
    fn on_usage(
        &mut self,
        attempt: u64,
        kv_cache_usage: f64,
        num_blocks: u64,
        num_free_blocks: u64,
        num_cached_free_blocks: Option<u64>,
        block_size: u64,
        now: f64,
        offload_num_blocks: Option<u64>,
        offload_used_blocks: Option<u64>,
        num_running_reqs: Option<u64>,
        num_waiting_reqs: Option<u64>,
    ) -> PyResult<()> {
        no_panic("GateCore.on_usage", || {
            let report = UsageReport {
                kv_cache_usage,
                num_blocks,
                num_free_blocks,
                num_cached_free_blocks,
                block_size,
                offload_num_blocks,
                offload_used_blocks,
                num_running_reqs,
                num_waiting_reqs,
            };
            Ok(self
                .core
                .on_usage(AttemptId(attempt), Ok(report), clock(now)?)?)
        })
    }

    /// The usage probe failed, timed out or answered something unusable.
    fn on_usage_unavailable(&mut self, attempt: u64, reason: String, now: f64) -> PyResult<()> {
        no_panic("GateCore.on_usage_unavailable", || {
            Ok(self
                .core
                .on_usage(AttemptId(attempt), Err(reason), clock(now)?)?)
        })
    }

    /// The prefix probe answered (the keys of `session_gate_probe`). `offloaded_tokens` is
    /// `None` when the engine has no readable host tier (or predates it).
    #[pyo3(signature = (attempt, hit_ratio, hit_blocks, hit_tokens, prompt_tokens, now, offloaded_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn on_prefix(
        &mut self,
        attempt: u64,
        hit_ratio: f64,
        hit_blocks: u64,
        hit_tokens: u64,
        prompt_tokens: u64,
        now: f64,
        offloaded_tokens: Option<u64>,
    ) -> PyResult<()> {
        no_panic("GateCore.on_prefix", || {
            let report = PrefixReport {
                hit_ratio,
                hit_blocks,
                hit_tokens,
                prompt_tokens,
                offloaded_tokens,
            };
            Ok(self
                .core
                .on_prefix(AttemptId(attempt), Ok(report), clock(now)?)?)
        })
    }

    /// The prefix probe failed, timed out, or said `available: False`.
    fn on_prefix_unavailable(&mut self, attempt: u64, reason: String, now: f64) -> PyResult<()> {
        no_panic("GateCore.on_prefix_unavailable", || {
            Ok(self
                .core
                .on_prefix(AttemptId(attempt), Err(reason), clock(now)?)?)
        })
    }

    /// Records one probe call's latency; `kind` is "usage", "prefix" or "forget".
    fn record_probe(&mut self, kind: &str, secs: f64, ok: bool) -> PyResult<()> {
        no_panic("GateCore.record_probe", || {
            self.core.record_probe(probe_kind(kind)?, secs, ok);
            Ok(())
        })
    }

    /// Forgets a pending attempt whose caller went away; false if it was unknown.
    fn cancel(&mut self, attempt: u64, now: f64) -> PyResult<bool> {
        no_panic("GateCore.cancel", || {
            Ok(self.core.cancel(AttemptId(attempt), clock(now)?))
        })
    }

    /// Releases a lease; false (a no-op) if it was released already.
    fn release(&mut self, lease: u64, now: f64) -> PyResult<bool> {
        no_panic("GateCore.release", || {
            Ok(self.core.release(LeaseId(lease), clock(now)?))
        })
    }

    /// Releases a lease its holder dropped unreleased (counted apart).
    fn release_dropped(&mut self, lease: u64, now: f64) -> PyResult<bool> {
        no_panic("GateCore.release_dropped", || {
            Ok(self.core.release_dropped(LeaseId(lease), clock(now)?))
        })
    }

    /// Ends the session's ownership window at once; whether there was one.
    fn finish_session(&mut self, session_id: &str, now: f64) -> PyResult<bool> {
        no_panic("GateCore.finish_session", || {
            Ok(self.core.finish_session(session_id, clock(now)?))
        })
    }

    /// Purges idle grace windows that ended by `now`; returns how many.
    fn expire(&mut self, now: f64) -> PyResult<usize> {
        no_panic("GateCore.expire", || Ok(self.core.expire(clock(now)?)))
    }

    /// Increases whenever waiters should poll again.
    #[getter]
    fn epoch(&self) -> u64 {
        self.core.epoch()
    }

    /// When the earliest idle grace window ends, if any.
    fn next_deadline(&self) -> Option<f64> {
        self.core.next_deadline()
    }

    /// Attempts of this session preempted so far.
    fn num_preempted(&self, session_id: &str) -> u32 {
        self.core.num_preempted(session_id)
    }

    /// Whether the session holds a reservation (in flight or idle).
    fn has_reservation(&self, session_id: &str) -> bool {
        self.core.has_reservation(session_id)
    }

    /// Approximate heap bytes of the core's tables.
    fn approx_bytes(&self) -> usize {
        self.core.approx_bytes()
    }

    /// Raises `RuntimeError` describing the first internal inconsistency (tests, debugging).
    fn check_invariants(&self) -> PyResult<()> {
        no_panic("GateCore.check_invariants", || {
            self.core.check_invariants().map_err(|why| {
                pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "session_gate: core invariant broken: {why}"
                ))
            })
        })
    }

    /// A snapshot of every counter and gauge as a dict (see `_native.pyi` for the keys).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        no_panic("GateCore.stats", || stats_dict(py, &self.core.stats()))
    }

    /// Prometheus text exposition.
    fn prometheus(&self) -> PyResult<String> {
        no_panic("GateCore.prometheus", || Ok(self.core.prometheus()))
    }
}

pub(super) fn stats_dict<'py>(py: Python<'py>, s: &GateStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let admissions = PyDict::new(py);
    for r in Reason::ALL {
        admissions.set_item(r.as_str(), s.admitted(r))?;
    }
    d.set_item("admissions", admissions)?;
    d.set_item("admissions_total", s.admissions_total())?;
    for (key, v) in [
        ("attempts", s.attempts),
        ("revocations", s.revocations),
        ("idle_engine_yields", s.idle_engine_yields),
        ("preemptions", s.preemptions),
        ("cancellations", s.cancellations),
        ("leases_released", s.leases_released),
        ("leases_dropped_unreleased", s.leases_dropped_unreleased),
        ("grace_expired", s.grace_expired),
        ("sessions_finished", s.sessions_finished),
        ("leases_active", s.leases_active),
        ("reservations_held", s.reservations_held),
        ("reservations_idle", s.reservations_idle),
        ("committed_blocks", s.committed_blocks),
        ("pending", s.pending),
        ("waiting", s.waiting),
        ("sessions", s.sessions),
    ] {
        d.set_item(key, v)?;
    }
    d.set_item("wait_sec", histogram_dict(py, &s.wait)?)?;
    let probes = PyDict::new(py);
    for k in ProbeKind::ALL {
        let p = s.probe(k);
        let h = histogram_dict(py, &p.latency)?;
        h.set_item("failures", p.failures)?;
        probes.set_item(k.as_str(), h)?;
    }
    d.set_item("probes", probes)?;
    Ok(d)
}

/// `{"count", "sum", "buckets": [(upper_bound, cumulative_count), ..., (inf, count)]}`, the
/// same cumulative buckets the Prometheus exposition shows.
fn histogram_dict<'py, const N: usize>(
    py: Python<'py>,
    h: &Histogram<N>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", h.count)?;
    d.set_item("sum", h.sum)?;
    let buckets = PyList::empty(py);
    let mut cumulative = 0u64;
    for (i, c) in h.counts.iter().enumerate() {
        cumulative += c;
        let le = h.bounds.get(i).copied().unwrap_or(f64::INFINITY);
        buckets.append((le, cumulative))?;
    }
    d.set_item("buckets", buckets)?;
    Ok(d)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGateCore>()?;
    m.add_class::<ProbeUsage>()?;
    m.add_class::<ProbePrefix>()?;
    m.add_class::<Wait>()?;
    m.add_class::<Admit>()?;
    m.add_class::<Preempted>()?;
    Ok(())
}
