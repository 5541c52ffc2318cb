//! `EngineGateBook`: the engine gate's core and bookkeeping for its driver in vLLM's engine
//! core (`session_gate/engine/gate_driver.py`), one native call per utility call.
//!
//! A skin over [`crate::gate::book::EngineBook`]: it checks the arguments (the messages the
//! HTTP routes answer 400 with), reads the block pool's usage itself (one attribute of its
//! free-block queue, no Python frame), calls the engine's prefix probe (Python, with its own native walk) only when
//! the core asks for it, and answers deferred admits by resolving their
//! `concurrent.futures.Future` (which vLLM sends back when it is done). Engine thread only.
//!
//! `admit` and `release` are what vLLM calls for `session_gate_admit` / `…_release` (no Python
//! frame between: `gate_methods` binds them): they take the utility call's own arguments, read
//! the clock themselves, raise every bad input as one `ValueError` starting with
//! [`BAD_INPUT`], and time themselves (`engine_us`, the `*_loop_*` stats).
use std::time::Instant;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyString, PyTuple};

use super::gate_core::stats_dict;
use super::guard::no_panic;
use super::knobs::PyGateConfig;
use super::tokens::{TokenLimits, read_prompt};
use crate::error::Error;
use crate::gate::book::{Answer, BookProbes, EngineBook, Resolved};
use crate::gate::{Admission, GateCore, PrefixReport, Reason, UsageReport};

/// A client id, ticket or session id longer than this is refused (they are map keys).
pub(crate) const MAX_ID_LEN: usize = 256;

/// How every bad-input error of the engine gate starts (`gate_driver.BAD_GATE_INPUT`; the HTTP
/// routes answer it with 400).
const BAD_INPUT: &str = "invalid engine gate input";

/// `TypeError`/`ValueError` (bad arguments) become one `ValueError` starting with [`BAD_INPUT`].
fn bad_input(py: Python<'_>, e: PyErr) -> PyErr {
    if e.is_instance_of::<PyTypeError>(py) || e.is_instance_of::<PyValueError>(py) {
        PyValueError::new_err(format!("{BAD_INPUT}: {}", e.value(py)))
    } else {
        e
    }
}

/// Engine-loop time of the calls answered in the call (admits that wait are not counted).
#[derive(Default, Clone, Copy)]
struct LoopTime {
    calls: u64,
    total_us: f64,
    last_us: f64,
}

impl LoopTime {
    fn record(&mut self, us: f64) {
        self.calls += 1;
        self.total_us += us;
        self.last_us = us;
    }
}

/// Nanoseconds of the last admit or release by part, kept only while `time_parts` is on
/// (the lab's `gate_splits`): argument checks, the usage read, the prefix walk, the book and core, and
/// the answer dict. The book's part is what the others leave of the whole call.
#[derive(Default, Clone, Copy)]
struct Parts {
    args_ns: u64,
    usage_ns: u64,
    prefix_ns: u64,
    answer_ns: u64,
    total_ns: u64,
}

/// What the book keeps per pending admit: its prompt (for the prefix probe) and, once the
/// admit waits, the future vLLM answers the caller with.
struct Payload {
    token_ids: Py<PyAny>,
    future: Option<Py<PyAny>>,
}

/// The probes of one call, read in-process: usage from the block pool (once per call: the
/// pool cannot change during one engine-thread call), prefix through the engine's probe.
struct Probes<'a, 'py> {
    py: Python<'py>,
    /// The pool's `free_block_queue`.
    free_queue: &'a Bound<'py, PyAny>,
    prefix: &'a Bound<'py, PyAny>,
    /// `tier_usage() -> (num_blocks, used_blocks) | None`: the host KV tier, when the engine
    /// has a readable one.
    tier_usage: Option<&'a Bound<'py, PyAny>>,
    /// The engine's queues, when the book was given its scheduler.
    queues: Option<&'a Queues>,
    /// This call decides on a request that sits in vLLM's waiting queue (scheduler mode): it
    /// is not counted waiting either.
    deciding_queued: bool,
    block_size: u64,
    /// `block_pool.num_gpu_blocks` (fixed for the pool's life), null block included.
    num_gpu_blocks: u64,
    usage: Option<UsageReport>,
    /// Whether to time the reads (`time_parts`), and their nanoseconds.
    timed: bool,
    usage_ns: u64,
    prefix_ns: u64,
}

/// vLLM's scheduler, for the usage report's request counts, and the containers of the
/// requests the scheduler mode holds in its waiting queue (taken off the waiting count).
struct Queues {
    scheduler: Py<PyAny>,
    held: Vec<Py<PyAny>>,
    /// vLLM's `RequestStatus.RUNNING`, to tell a listed request that has finished (`None`:
    /// every listed request counts).
    running_status: Option<Py<PyAny>>,
}

impl Queues {
    /// `(running, waiting)`: `len(scheduler.running)` (0 when no request in it is still
    /// running), and `len(scheduler.waiting)` less the held requests and `deciding` (the
    /// request being decided, when it sits in that queue). Read each time (vLLM could rebind
    /// either attribute); `None` if anything cannot be read, so a vLLM that changed its
    /// scheduler only loses the counts.
    ///
    /// Why "still running": vLLM frees a finished request (where a bound lease is released
    /// and the waiters look again) before it takes it off `running`, at the end of
    /// `update_from_output`. Counted as listed, the step that empties the engine would read
    /// busy at the one moment the waiters look, and they would learn it is idle only at their
    /// next poll. The scan stops at the first request whose `status` is `running_status`, so a
    /// busy engine costs one attribute read per usage read; a step that finishes only some of
    /// its requests still counts them all, which changes nothing the gate reads (only whether
    /// both counts are 0).
    fn counts(&self, py: Python<'_>, deciding: usize) -> Option<(u64, u64)> {
        let s = self.scheduler.bind(py);
        let listed = s.getattr(intern!(py, "running")).ok()?;
        let running = match &self.running_status {
            Some(status) => {
                let status = status.bind(py);
                let mut any = false;
                for request in listed.try_iter().ok()? {
                    let request = request.ok()?;
                    if request.getattr(intern!(py, "status")).ok()?.is(status) {
                        any = true;
                        break;
                    }
                }
                if any { listed.len().ok()? } else { 0 }
            }
            None => listed.len().ok()?,
        };
        let waiting = s.getattr(intern!(py, "waiting")).ok()?.len().ok()?;
        let mut held = deciding;
        for h in &self.held {
            held += h.bind(py).len().ok()?;
        }
        Some((running as u64, waiting.saturating_sub(held) as u64))
    }
}

impl Probes<'_, '_> {
    fn read_usage(&self) -> PyResult<UsageReport> {
        let py = self.py;
        // vLLM's `BlockPool.get_num_free_blocks()` and `get_usage()` without their two Python
        // frames: the same attribute, the same float (the null block never counts).
        let num_free_blocks: u64 = self
            .free_queue
            .getattr(intern!(py, "num_free_blocks"))?
            .extract()?;
        let num_blocks = self.num_gpu_blocks.saturating_sub(1);
        let kv_cache_usage = if num_blocks == 0 {
            0.0
        } else {
            1.0 - num_free_blocks as f64 / num_blocks as f64
        };
        let (offload_num_blocks, offload_used_blocks) = match self.tier_usage {
            Some(tier) => tier
                .call0()?
                .extract::<Option<(u64, u64)>>()?
                .map_or((None, None), |(num, used)| (Some(num), Some(used))),
            None => (None, None),
        };
        let deciding = usize::from(self.deciding_queued);
        let counts = self.queues.and_then(|q| q.counts(self.py, deciding));
        Ok(UsageReport {
            kv_cache_usage,
            num_blocks,
            num_free_blocks,
            num_cached_free_blocks: None,
            block_size: self.block_size,
            offload_num_blocks,
            offload_used_blocks,
            num_running_reqs: counts.map(|c| c.0),
            num_waiting_reqs: counts.map(|c| c.1),
        })
    }

    fn read_prefix(&self, session_id: &str, token_ids: &Py<PyAny>) -> PyResult<PrefixReport> {
        let py = self.py;
        let p = self.prefix.call1((session_id, token_ids.bind(py)))?;
        let p = p.cast::<PyDict>()?;
        // `available: False` (and only a real False) means the engine cannot say.
        let unavailable = p
            .get_item(intern!(py, "available"))?
            .is_some_and(|a| a.cast::<PyBool>().is_ok_and(|b| !b.is_true()));
        if unavailable {
            let reason = p
                .get_item(intern!(py, "reason"))?
                .filter(|r| !r.is_none())
                .map(|r| r.str().map(|s| s.to_string()))
                .transpose()?
                .filter(|r| !r.is_empty())
                .unwrap_or_else(|| "prefix probe unavailable".into());
            return Err(PyValueError::new_err(reason));
        }
        Ok(PrefixReport {
            hit_ratio: field(p, intern!(py, "hit_ratio"))?.extract()?,
            hit_blocks: field(p, intern!(py, "hit_blocks"))?.extract()?,
            hit_tokens: field(p, intern!(py, "hit_tokens"))?.extract()?,
            prompt_tokens: field(p, intern!(py, "prompt_tokens"))?.extract()?,
            offloaded_tokens: tier_tokens(p, intern!(py, "offloaded_tokens"))?,
        })
    }
}

/// `offloaded_tokens`: an int, or `None` for `"unavailable"`, `None` or no key (no readable
/// host tier).
fn tier_tokens<'py>(d: &Bound<'py, PyDict>, key: &Bound<'py, PyString>) -> PyResult<Option<u64>> {
    match d.get_item(key)? {
        Some(v) if v.is_instance_of::<PyString>() || v.is_none() => Ok(None),
        Some(v) => Ok(Some(v.extract()?)),
        None => Ok(None),
    }
}

fn field<'py>(d: &Bound<'py, PyDict>, key: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("the prefix probe's answer has no {key}")))
}

impl BookProbes<Payload> for Probes<'_, '_> {
    fn usage(&mut self) -> Result<UsageReport, String> {
        if let Some(u) = self.usage {
            return Ok(u);
        }
        let started = self.timed.then(Instant::now);
        let u = self.read_usage();
        if let Some(t) = started {
            self.usage_ns += t.elapsed().as_nanos() as u64;
        }
        let u = u.map_err(|e| format!("usage probe raised {e}"))?;
        self.usage = Some(u);
        Ok(u)
    }

    fn prefix(
        &mut self,
        session_id: &str,
        payload: &Payload,
    ) -> (Result<PrefixReport, String>, f64) {
        let started = Instant::now();
        let report = self
            .read_prefix(session_id, &payload.token_ids)
            .map_err(|e| {
                if e.is_instance_of::<PyValueError>(self.py) {
                    e.value(self.py).to_string()
                } else {
                    format!("prefix probe raised {e}")
                }
            });
        let elapsed = started.elapsed();
        if self.timed {
            self.prefix_ns += elapsed.as_nanos() as u64;
        }
        (report, elapsed.as_secs_f64())
    }
}

/// The engine gate (core + who holds what) for the driver in vLLM's engine core.
#[pyclass(name = "EngineGateBook", module = "session_gate._native")]
pub(crate) struct PyEngineGateBook {
    book: EngineBook<Payload>,
    /// Its `free_block_queue`, read once: usage is its `num_free_blocks` (vLLM makes the queue
    /// with the pool and never replaces it; one attribute read less per call, on cold caches).
    free_queue: Py<PyAny>,
    /// `prefix(session_id, token_ids) -> dict`: the engine's prefix probe (`session_gate_probe`).
    prefix: Py<PyAny>,
    /// `tier_usage() -> (num_blocks, used_blocks) | None`, when the engine has a host KV tier.
    tier_usage: Option<Py<PyAny>>,
    /// The engine's queues, for the request counts of every usage read.
    queues: Option<Queues>,
    /// Set while a scheduler-mode admit runs (`admit_trusted`, the native look's
    /// `admit_native`): its request is in vLLM's waiting queue ([`Probes::deciding_queued`]).
    deciding_queued: bool,
    /// `arm(at)`: asks the timer thread to wake the engine at `at` (the core's clock).
    arm: Py<PyAny>,
    /// `concurrent.futures.Future`.
    future_cls: Py<PyAny>,
    block_size: u64,
    num_gpu_blocks: u64,
    limits: TokenLimits,
    /// `Instant` and `time.monotonic()` read together at construction: `now` for `admit` and
    /// `release` without a Python call (both are `CLOCK_MONOTONIC` on Linux).
    clock: (Instant, f64),
    admit_time: LoopTime,
    release_time: LoopTime,
    /// Releases of leases bound to vLLM requests that ended ([`Self::release_bound`]): those
    /// that released one, and those that found it gone (its client released it first).
    bound_released: u64,
    bound_unknown: u64,
    time_parts: bool,
    parts: Parts,
    reasons: ReasonStrs,
}

/// A client id, ticket or session id: a non-empty `str` of at most [`MAX_ID_LEN`] characters
/// (borrowed: the book copies what it keeps).
fn id_str<'a>(name: &str, value: &'a Bound<'_, PyAny>) -> PyResult<&'a str> {
    if let Ok(s) = value.cast::<PyString>() {
        let s = s.to_str()?;
        if !s.is_empty() {
            // At most MAX_ID_LEN bytes is at most MAX_ID_LEN characters: count only beyond.
            let n = if s.len() <= MAX_ID_LEN {
                0
            } else {
                s.chars().count()
            };
            if n > MAX_ID_LEN {
                return Err(PyValueError::new_err(format!(
                    "{name} is {n} characters long, more than {MAX_ID_LEN}"
                )));
            }
            return Ok(s);
        }
    }
    let type_name = value.get_type().name()?;
    let msg = format!(
        "{name} must be a non-empty str, got {type_name} {}",
        value.repr()?
    );
    Err(PyTypeError::new_err(
        msg.chars().take(300).collect::<String>(),
    ))
}

/// An id argument that may be absent from the call (it then reads as `None`, and is refused).
fn required_id<'a>(name: &str, value: Option<&'a Bound<'_, PyAny>>) -> PyResult<&'a str> {
    match value {
        Some(v) => id_str(name, v),
        None => Err(PyTypeError::new_err(format!(
            "{name} must be a non-empty str, got NoneType None"
        ))),
    }
}

fn optional_id<'a>(name: &str, value: Option<&'a Bound<'_, PyAny>>) -> PyResult<Option<&'a str>> {
    value
        .filter(|v| !v.is_none())
        .map(|v| id_str(name, v))
        .transpose()
}

/// A lease id: `None` for a negative or huge int (it names no lease); a `TypeError` for
/// anything but an int.
fn lease_id(lease: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    match plain_int(lease) {
        Some(l) => Ok(l.extract::<u64>().ok()),
        None => Err(PyTypeError::new_err(format!(
            "lease must be an int lease id, got {}",
            lease.get_type().name()?
        ))),
    }
}

/// An int that is not a bool (Python's `bool` is an `int`).
pub(crate) fn plain_int<'a>(value: &'a Bound<'_, PyAny>) -> Option<&'a Bound<'a, PyAny>> {
    (value.cast::<PyInt>().is_ok() && value.cast::<PyBool>().is_err()).then_some(value)
}

/// The keys of an admission's answer (`engine_us` is added to those answered in their call).
const ADMITTED_KEYS: [&str; 14] = [
    "status",
    "lease",
    "ticket",
    "session_id",
    "reason",
    "wait_sec",
    "usage",
    "pressure",
    "hit_ratio",
    "retain_session",
    "reserved",
    "revoked",
    "working_set_blocks",
    "num_preempted",
];

/// What every answer reuses, made once: the reasons' labels as Python strings, and an
/// admission's keys as a template dict (copying it is one allocation of the right size;
/// filling a new dict grows it twice).
struct ReasonStrs {
    reasons: [Py<PyString>; Reason::ALL.len()],
    admitted: Py<PyDict>,
}

fn reason_strs(py: Python<'_>) -> PyResult<ReasonStrs> {
    let admitted = PyDict::new(py);
    for key in ADMITTED_KEYS {
        admitted.set_item(PyString::intern(py, key), py.None())?;
    }
    // The one value every admission's answer shares, and the values most have (an open
    // admit answered in its call): `admission_dict` sets only the others.
    admitted.set_item(intern!(py, "status"), intern!(py, "admitted"))?;
    admitted.set_item(intern!(py, "wait_sec"), 0.0)?;
    admitted.set_item(intern!(py, "retain_session"), true)?;
    admitted.set_item(intern!(py, "reserved"), true)?;
    admitted.set_item(intern!(py, "revoked"), false)?;
    admitted.set_item(intern!(py, "num_preempted"), 0)?;
    Ok(ReasonStrs {
        reasons: Reason::ALL.map(|r| PyString::intern(py, r.as_str()).unbind()),
        admitted: admitted.unbind(),
    })
}

/// `ticket` and `session_id` are the caller's own `str` objects when the admit answers in its
/// call (nothing to copy), the book's copies when it answers later.
fn admission_dict<'py, S: IntoPyObject<'py> + Copy>(
    py: Python<'py>,
    ticket: S,
    session_id: S,
    a: &Admission,
    reasons: &ReasonStrs,
) -> PyResult<Bound<'py, PyDict>> {
    let reason = a.reason.index();
    // Every key is there already, with `status`'s value and the common ones (see
    // `reason_strs`): each item below replaces a value, nothing grows, and a value the
    // template already has is not set again (on the engine thread every item is a few cache
    // lines missed).
    let d = reasons.admitted.bind(py).copy()?;
    d.set_item(intern!(py, "lease"), a.lease.0)?;
    d.set_item(intern!(py, "ticket"), ticket)?;
    d.set_item(intern!(py, "session_id"), session_id)?;
    d.set_item(intern!(py, "reason"), reasons.reasons[reason].bind(py))?;
    // `!=` also sets -0.0 and NaN as they are.
    if a.wait_sec != 0.0 || a.wait_sec.is_sign_negative() {
        d.set_item(intern!(py, "wait_sec"), a.wait_sec)?;
    }
    for (key, value) in [
        (intern!(py, "usage"), a.usage),
        (intern!(py, "pressure"), a.pressure),
        (intern!(py, "hit_ratio"), a.hit_ratio),
    ] {
        if value.is_some() {
            d.set_item(key, value)?;
        }
    }
    if !a.retain_session {
        d.set_item(intern!(py, "retain_session"), false)?;
    }
    if !a.reserved {
        d.set_item(intern!(py, "reserved"), false)?;
    }
    if a.revoked {
        d.set_item(intern!(py, "revoked"), true)?;
    }
    if a.working_set_blocks.is_some() {
        d.set_item(intern!(py, "working_set_blocks"), a.working_set_blocks)?;
    }
    if a.num_preempted != 0 {
        d.set_item(intern!(py, "num_preempted"), a.num_preempted)?;
    }
    Ok(d)
}

fn answer_dict<'py, S: IntoPyObject<'py> + Copy>(
    py: Python<'py>,
    ticket: S,
    session_id: S,
    answer: &Answer,
    reasons: &ReasonStrs,
) -> PyResult<Bound<'py, PyDict>> {
    match answer {
        Answer::Admitted(a) => admission_dict(py, ticket, session_id, a, reasons),
        Answer::Preempted { num_preempted } => {
            let d = PyDict::new(py);
            d.set_item(intern!(py, "status"), intern!(py, "preempted"))?;
            d.set_item(intern!(py, "num_preempted"), *num_preempted)?;
            Ok(d)
        }
        Answer::Cancelled | Answer::Expired => {
            let d = PyDict::new(py);
            let status = if matches!(answer, Answer::Cancelled) {
                "cancelled"
            } else {
                "expired"
            };
            d.set_item(intern!(py, "status"), status)?;
            Ok(d)
        }
    }
}

/// An admit's checked arguments.
pub(crate) struct Admit<'a, 'py> {
    pub session_id: &'a str,
    pub token_ids: &'a Bound<'py, PyAny>,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub retain_session: bool,
    pub ticket: &'a str,
    pub client_id: &'a str,
}

impl PyEngineGateBook {
    /// Starts a call's part timings (when on): its argument checks took until now.
    fn start_parts(&mut self, started: Instant) {
        if self.time_parts {
            self.parts = Parts {
                args_ns: started.elapsed().as_nanos() as u64,
                ..Parts::default()
            };
        }
    }

    /// Runs `f` on the book with this call's probes, then hands the timer its new deadline
    /// and answers every deferred admit that ended.
    fn with_book<'py, R>(
        &mut self,
        py: Python<'py>,
        f: impl FnOnce(&mut EngineBook<Payload>, &mut Probes<'_, 'py>) -> PyResult<R>,
    ) -> PyResult<R> {
        // Borrowed, not cloned: no reference count written on either object.
        let mut probes = Probes {
            py,
            free_queue: self.free_queue.bind(py),
            prefix: self.prefix.bind(py),
            tier_usage: self.tier_usage.as_ref().map(|t| t.bind(py)),
            queues: self.queues.as_ref(),
            deciding_queued: self.deciding_queued,
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            usage: None,
            timed: self.time_parts,
            usage_ns: 0,
            prefix_ns: 0,
        };
        let out = f(&mut self.book, &mut probes);
        if self.time_parts {
            self.parts.usage_ns = probes.usage_ns;
            self.parts.prefix_ns = probes.prefix_ns;
        }
        self.after_call(py)?;
        out
    }

    /// `at` (this call's one clock read, taken on entry) in monotonic seconds on
    /// `time.monotonic()`'s scale: the call reads the clock once more, at its end, for its
    /// own time.
    fn now(&self, at: Instant) -> f64 {
        self.clock.1 + at.saturating_duration_since(self.clock.0).as_secs_f64()
    }

    /// The admit of [`Self::admit`], its arguments unpacked. `trusted_len`: the prompt's
    /// length when its tokens are vLLM's own (already validated), so they are not read.
    #[allow(clippy::too_many_arguments)]
    fn admit_inner<'py>(
        &mut self,
        py: Python<'py>,
        started: Instant,
        session_id: &Bound<'py, PyAny>,
        token_ids: &Bound<'py, PyAny>,
        max_tokens: &Bound<'py, PyAny>,
        retain_session: Option<&Bound<'py, PyAny>>,
        ticket: Option<&Bound<'py, PyAny>>,
        client_id: Option<&Bound<'py, PyAny>>,
        trusted_len: Option<usize>,
    ) -> PyResult<Py<PyAny>> {
        let session_str = session_id;
        let session_id = id_str("session_id", session_id)?;
        let ticket_str = ticket;
        let ticket = required_id("ticket", ticket)?;
        let client_id = required_id("client_id", client_id)?;
        let max_tokens = plain_int(max_tokens)
            .and_then(|m| m.extract::<usize>().ok())
            .ok_or_else(|| {
                let shown = max_tokens.repr().map(|r| r.to_string()).unwrap_or_default();
                PyValueError::new_err(format!(
                    "max_tokens must be a non-negative int, got {shown}"
                ))
            })?;
        let retain_session = match retain_session.map(|r| r.cast::<PyBool>()) {
            None => true,
            Some(Ok(b)) => b.is_true(),
            Some(Err(_)) => {
                let r = retain_session.expect("matched Some");
                return Err(PyTypeError::new_err(format!(
                    "retain_session must be a bool, got {}",
                    r.get_type().name()?
                )));
            }
        };
        let prompt_tokens = match trusted_len {
            Some(n) => n,
            None => read_prompt(token_ids, Some(self.limits))
                .map_err(|e| PyValueError::new_err(format!("token_ids: {e}")))?
                .len(),
        };
        let admit = Admit {
            session_id,
            token_ids,
            prompt_tokens,
            max_tokens,
            retain_session,
            ticket,
            client_id,
        };
        match self.admit_checked(py, started, admit)? {
            Some(a) => {
                let answered = self.time_parts.then(Instant::now);
                let ticket_str = ticket_str.expect("a ticket was read above");
                let d = answer_dict(py, ticket_str, session_str, &a, &self.reasons)?;
                // Set last: the whole call but this one item.
                let us = started.elapsed().as_secs_f64() * 1e6;
                d.set_item(intern!(py, "engine_us"), us)?;
                self.admit_time.record(us);
                if let Some(t) = answered {
                    self.parts.answer_ns = t.elapsed().as_nanos() as u64;
                    self.parts.total_ns = started.elapsed().as_nanos() as u64;
                }
                Ok(d.into_any().unbind())
            }
            None => self.defer(py, ticket, None),
        }
    }

    /// An admit whose arguments are checked: the book's answer if it ends now, else `None`
    /// (the attempt waits: [`Self::defer`] gives its caller a future).
    fn admit_checked<'py>(
        &mut self,
        py: Python<'py>,
        started: Instant,
        a: Admit<'_, 'py>,
    ) -> PyResult<Option<Answer>> {
        let payload = Payload {
            token_ids: a.token_ids.clone().unbind(),
            future: None,
        };
        self.start_parts(started);
        let now = self.now(started);
        self.with_book(py, |book, probes| {
            book.admit(
                a.ticket,
                a.client_id,
                a.session_id,
                a.prompt_tokens,
                a.max_tokens,
                a.retain_session,
                payload,
                now,
                probes,
            )
            .map_err(|e| match e {
                Error::InvalidInput(m) => PyValueError::new_err(m),
                e => e.into(),
            })
        })
    }

    /// The future the waiting attempt `ticket` is answered through: a `future_cls()`, or a
    /// `sink()` (any object with `done()` and `set_result(answer)`, all the book calls).
    fn defer(
        &mut self,
        py: Python<'_>,
        ticket: &str,
        sink: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let make = sink.unwrap_or_else(|| self.future_cls.bind(py));
        let future = make.call0()?.unbind();
        if let Some(p) = self.book.payload_mut(ticket) {
            p.future = Some(future.clone_ref(py));
        }
        Ok(future)
    }

    /// The scheduler's native look's admit (`SchedulerLook`): `admit_trusted` without its
    /// Python objects. The caller has checked `admit`'s ids (non empty, at most
    /// [`MAX_ID_LEN`] bytes); its `token_ids` are vLLM's own prompt of `prompt_tokens`. The
    /// book's answer if it ends now (no dict is built), else the future its answer comes
    /// through (made by `sink()` when given: see [`Self::defer`]).
    pub(crate) fn admit_native(
        &mut self,
        py: Python<'_>,
        admit: Admit<'_, '_>,
        sink: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Result<Answer, Py<PyAny>>> {
        let started = Instant::now();
        let ticket = admit.ticket;
        self.deciding_queued = true;
        let checked = self.admit_checked(py, started, admit);
        self.deciding_queued = false;
        match checked? {
            Some(a) => {
                let us = started.elapsed().as_secs_f64() * 1e6;
                self.admit_time.record(us);
                if self.time_parts {
                    self.parts.total_ns = started.elapsed().as_nanos() as u64;
                }
                Ok(Ok(a))
            }
            None => Ok(Err(self.defer(py, ticket, sink)?)),
        }
    }

    /// [`Self::release_bound`] of a lease id already read (the scheduler's native free,
    /// `SchedulerLook.free`, keeps the book's own answer): released, or counted as a no-op.
    pub(crate) fn release_of_request(&mut self, py: Python<'_>, lease: u64) -> PyResult<bool> {
        let released = self.release_checked(py, Instant::now(), lease, None)?;
        self.count_bound(released);
        Ok(released)
    }

    fn count_bound(&mut self, released: bool) {
        if released {
            self.bound_released += 1;
        } else {
            self.bound_unknown += 1;
        }
    }

    /// A release whose arguments are checked (`started`: the call's entry), timed as one.
    fn release_checked(
        &mut self,
        py: Python<'_>,
        started: Instant,
        lease: u64,
        client_id: Option<&str>,
    ) -> PyResult<bool> {
        self.start_parts(started);
        let now = self.now(started);
        let released = self.with_book(py, |book, probes| {
            Ok(book.release(lease, client_id, now, probes))
        })?;
        let us = started.elapsed().as_secs_f64() * 1e6;
        self.release_time.record(us);
        if self.time_parts {
            self.parts.total_ns = started.elapsed().as_nanos() as u64;
        }
        Ok(released)
    }

    fn after_call(&mut self, py: Python<'_>) -> PyResult<()> {
        if let Some(at) = self.book.take_alarm() {
            self.arm.bind(py).call1((at,))?;
        }
        if self.book.has_resolved() {
            for r in self.book.take_resolved() {
                deliver(py, r, &self.reasons)?;
            }
        }
        Ok(())
    }
}

/// Answers a deferred admit (if its caller got a future; an admit answered in its own call
/// never reaches here).
fn deliver(py: Python<'_>, r: Resolved<Payload>, reasons: &ReasonStrs) -> PyResult<()> {
    let Some(future) = r.payload.future else {
        return Ok(());
    };
    let future = future.bind(py);
    if future.call_method0(intern!(py, "done"))?.is_truthy()? {
        return Ok(());
    }
    let answer = answer_dict(
        py,
        r.ticket.as_str(),
        r.session_id.as_str(),
        &r.answer,
        reasons,
    )?;
    future.call_method1(intern!(py, "set_result"), (answer,))?;
    Ok(())
}

#[pymethods]
impl PyEngineGateBook {
    /// A gate core with `config` over vLLM's `block_pool` (`hash_block_size` tokens per
    /// block), `prefix(session_id, token_ids) -> dict` for the prefix probe, `arm(at)` for the
    /// timer, `future_cls` (`concurrent.futures.Future`) for deferred answers, and the
    /// engine's vocabulary size and context length for checking prompts; `tier_usage()` for
    /// the host KV tier's figures and vLLM's `scheduler` for the request counts of every usage
    /// read (the core's idle-engine rule), when there are, with `running_status` (vLLM's
    /// `RequestStatus.RUNNING`) to leave out listed requests that have finished.
    #[new]
    #[pyo3(signature = (config, lease_ttl_sec, block_pool, block_size, vocab_size, max_model_len, prefix, arm, future_cls, tier_usage=None, scheduler=None, running_status=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config: PyRef<'_, PyGateConfig>,
        lease_ttl_sec: f64,
        block_pool: Py<PyAny>,
        block_size: u64,
        vocab_size: u64,
        max_model_len: usize,
        prefix: Py<PyAny>,
        arm: Py<PyAny>,
        future_cls: Py<PyAny>,
        tier_usage: Option<Py<PyAny>>,
        scheduler: Option<Py<PyAny>>,
        running_status: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        no_panic("EngineGateBook()", || {
            let core = GateCore::new(config.inner().clone())?;
            let pool = block_pool.bind(py);
            let num_gpu_blocks: u64 = pool.getattr(intern!(py, "num_gpu_blocks"))?.extract()?;
            let free_queue = pool.getattr(intern!(py, "free_block_queue"))?.unbind();
            let monotonic = py.import("time")?.getattr("monotonic")?;
            let clock = (Instant::now(), monotonic.call0()?.extract::<f64>()?);
            Ok(Self {
                book: EngineBook::new(core, lease_ttl_sec)?,
                free_queue,
                prefix,
                tier_usage,
                queues: scheduler.map(|scheduler| Queues {
                    scheduler,
                    held: Vec::new(),
                    running_status,
                }),
                deciding_queued: false,
                arm,
                future_cls,
                block_size,
                num_gpu_blocks,
                limits: TokenLimits {
                    vocab_size,
                    max_model_len,
                },
                clock,
                admit_time: LoopTime::default(),
                release_time: LoopTime::default(),
                bound_released: 0,
                bound_unknown: 0,
                time_parts: false,
                parts: Parts::default(),
                reasons: reason_strs(py)?,
            })
        })
    }

    /// `session_gate_admit(session_id, token_ids, max_tokens, retain_session=True,
    /// ticket=None, client_id=None)`, called by vLLM with the utility call's own arguments:
    /// the answer as a dict if it ends now (with `engine_us`, this call's time), else a
    /// `Future` of it. Bad arguments raise `ValueError("invalid engine gate input: ...")`
    /// naming the argument.
    #[pyo3(signature = (*args))]
    fn admit(&mut self, py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<Py<PyAny>> {
        let started = Instant::now();
        no_panic("EngineGateBook.admit", || {
            let n = args.len();
            if !(3..=6).contains(&n) {
                return Err(PyTypeError::new_err(format!(
                    "session_gate_admit takes session_id, token_ids, max_tokens and optionally \
                     retain_session, ticket, client_id: got {n} arguments"
                )));
            }
            let arg = |i: usize| (i < n).then(|| args.get_borrowed_item(i)).transpose();
            let (a0, a1, a2) = (arg(0)?, arg(1)?, arg(2)?);
            let (a3, a4, a5) = (arg(3)?, arg(4)?, arg(5)?);
            self.admit_inner(
                py,
                started,
                &a0.expect("n >= 3"),
                &a1.expect("n >= 3"),
                &a2.expect("n >= 3"),
                a3.as_deref(),
                a4.as_deref(),
                a5.as_deref(),
                None,
            )
        })
        .map_err(|e| bad_input(py, e))
    }

    /// The scheduler mode's admit (`gate_scheduler`): `token_ids` is vLLM's own
    /// `request.prompt_token_ids`, which vLLM has validated, so only its length is read (the
    /// list is kept for a prefix walk, if the core asks for one); reading and checking every
    /// token, as `admit` does for a utility call's bytes, costs ~5 us per 1K tokens in the
    /// engine loop. The session is retained; answers as `admit` does.
    fn admit_trusted(
        &mut self,
        py: Python<'_>,
        session_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        ticket: &Bound<'_, PyAny>,
        client_id: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let started = Instant::now();
        no_panic("EngineGateBook.admit_trusted", || {
            let len = token_ids.len()?;
            let retain = PyBool::new(py, true).to_owned().into_any();
            self.deciding_queued = true;
            let answer = self.admit_inner(
                py,
                started,
                session_id,
                token_ids,
                max_tokens,
                Some(&retain),
                Some(ticket),
                Some(client_id),
                Some(len),
            );
            self.deciding_queued = false;
            answer
        })
        .map_err(|e| bad_input(py, e))
    }

    /// `session_gate_release(lease, client_id=None)`, called by vLLM with the utility call's
    /// own arguments: releases a lease (and renews `client_id`); false if it was unknown or
    /// released. Bad arguments raise as `admit`'s do.
    #[pyo3(signature = (*args))]
    fn release(&mut self, py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        let started = Instant::now();
        no_panic("EngineGateBook.release", || {
            let n = args.len();
            if !(1..=2).contains(&n) {
                return Err(PyTypeError::new_err(format!(
                    "session_gate_release takes lease and optionally client_id: got {n} arguments"
                )));
            }
            let lease = args.get_borrowed_item(0)?;
            let client_id = if n == 2 {
                Some(args.get_borrowed_item(1)?)
            } else {
                None
            };
            let Some(lease) = lease_id(&lease)? else {
                return Ok(false);
            };
            let client_id = optional_id("client_id", client_id.as_deref())?;
            self.release_checked(py, started, lease, client_id)
        })
        .map_err(|e| bad_input(py, e))
    }

    /// The engine's own release of a lease bound to a vLLM request that just ended
    /// (`gate_binding`, scheduler mode; engine thread): `release(lease)`, counted under
    /// `engine_gate` in the stats as `leases_released_by_request`, or as
    /// `bound_releases_unknown` when it changed nothing (released twice: its client released
    /// it first). Bad leases raise as `release`'s do.
    fn release_bound(&mut self, py: Python<'_>, lease: &Bound<'_, PyAny>) -> PyResult<bool> {
        let started = Instant::now();
        no_panic("EngineGateBook.release_bound", || {
            let released = match lease_id(lease)? {
                Some(lease) => self.release_checked(py, started, lease, None)?,
                None => false,
            };
            self.count_bound(released);
            Ok(released)
        })
        .map_err(|e| bad_input(py, e))
    }

    /// Bound releases so far, both kinds (cheap: read around each free by the lab's cost
    /// bench).
    #[getter]
    fn bound_releases(&self) -> u64 {
        self.bound_released + self.bound_unknown
    }

    /// Withdraws a pending admit or releases the lease it won in the race.
    #[pyo3(signature = (ticket, client_id, now))]
    fn cancel(
        &mut self,
        py: Python<'_>,
        ticket: &Bound<'_, PyAny>,
        client_id: Option<&Bound<'_, PyAny>>,
        now: f64,
    ) -> PyResult<bool> {
        no_panic("EngineGateBook.cancel", || {
            let ticket = id_str("ticket", ticket)?;
            let client_id = optional_id("client_id", client_id)?;
            self.with_book(py, |book, probes| {
                Ok(book.cancel(ticket, client_id, now, probes))
            })
        })
        .map_err(|e| bad_input(py, e))
    }

    /// Grows the working set the held lease `lease` commits to `ws_tokens` (prompt +
    /// max_tokens of the request it admitted, which took more input since); whether it grew.
    fn grow_lease(&mut self, py: Python<'_>, lease: u64, ws_tokens: u64) -> PyResult<bool> {
        no_panic("EngineGateBook.grow_lease", || {
            self.with_book(py, |book, _| Ok(book.grow_lease(lease, ws_tokens)))
        })
        .map_err(|e| bad_input(py, e))
    }

    /// Ends a session's ownership window; whether it had one.
    #[pyo3(signature = (session_id, client_id, now))]
    fn finish(
        &mut self,
        py: Python<'_>,
        session_id: &Bound<'_, PyAny>,
        client_id: Option<&Bound<'_, PyAny>>,
        now: f64,
    ) -> PyResult<bool> {
        no_panic("EngineGateBook.finish", || {
            let session_id = id_str("session_id", session_id)?;
            let client_id = optional_id("client_id", client_id)?;
            self.with_book(py, |book, probes| {
                Ok(book.finish(session_id, client_id, now, probes))
            })
        })
        .map_err(|e| bad_input(py, e))
    }

    /// A client's heartbeat: `(leases, pending)` it holds.
    fn renew(
        &mut self,
        py: Python<'_>,
        client_id: &Bound<'_, PyAny>,
        now: f64,
    ) -> PyResult<(usize, usize)> {
        no_panic("EngineGateBook.renew", || {
            let client_id = id_str("client_id", client_id)?;
            self.with_book(py, |book, probes| Ok(book.renew(client_id, now, probes)))
        })
        .map_err(|e| bad_input(py, e))
    }

    /// Runs what is due; returns the clients declared dead as
    /// `(client_id, silent_sec, leases_released, attempts_cancelled)`.
    fn tick(&mut self, py: Python<'_>, now: f64) -> PyResult<Vec<(String, f64, usize, usize)>> {
        no_panic("EngineGateBook.tick", || {
            let expired = self.with_book(py, |book, probes| Ok(book.tick(now, probes)))?;
            Ok(expired
                .into_iter()
                .map(|c| (c.client_id, c.silent_sec, c.leases, c.attempts))
                .collect())
        })
    }

    /// Containers (anything with a `len()`) of the requests the scheduler mode holds in
    /// vLLM's waiting queue: the request counts of every usage read take them off the waiting
    /// count, since a held request is not work the engine could do. Replaces earlier ones; a
    /// book made without a `scheduler` has no counts, and this changes nothing.
    fn hold_in_queue(&mut self, held: Vec<Py<PyAny>>) {
        if let Some(q) = &mut self.queues {
            q.held = held;
        }
    }

    /// The seconds a silent client's leases and attempts survive.
    #[getter]
    fn lease_ttl_sec(&self) -> f64 {
        self.book.lease_ttl_sec()
    }

    /// The core's counters (as `GateCore.stats()`) and the bookkeeping's, under `engine_gate`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        no_panic("EngineGateBook.stats", || {
            let d = stats_dict(py, &self.book.stats())?;
            let e = PyDict::new(py);
            let c = self.book.counters();
            e.set_item("clients_expired", c.clients_expired)?;
            e.set_item("leases_expired", c.leases_expired)?;
            e.set_item("attempts_expired", c.attempts_expired)?;
            e.set_item("clients", self.book.num_clients())?;
            e.set_item("lease_ttl_sec", self.book.lease_ttl_sec())?;
            e.set_item("leases_held", self.book.num_held())?;
            e.set_item("attempts_pending", self.book.num_pending())?;
            e.set_item("leases_released_by_request", self.bound_released)?;
            e.set_item("bound_releases_unknown", self.bound_unknown)?;
            // Engine-loop time of admits answered in their call and of releases.
            for (call, t) in [("admit", self.admit_time), ("release", self.release_time)] {
                e.set_item(format!("{call}_loop_calls"), t.calls)?;
                e.set_item(format!("{call}_loop_us_total"), t.total_us)?;
                e.set_item(format!("{call}_loop_us_last"), t.last_us)?;
            }
            d.set_item("engine_gate", e)?;
            Ok(d)
        })
    }

    /// Whether `admit` and `release` time their parts (`gate_splits`; off by default).
    #[getter]
    fn get_time_parts(&self) -> bool {
        self.time_parts
    }

    #[setter]
    fn set_time_parts(&mut self, on: bool) {
        self.time_parts = on;
    }

    /// The last admit's or release's parts in ns while `time_parts` is on: `args` (argument
    /// checks and the prompt read), `usage` (the block pool read), `prefix` (the prefix walk),
    /// `answer` (the answer dict), `book` (the rest: the book and the core) and `total`.
    fn last_parts(&self) -> [(&'static str, u64); 6] {
        let p = self.parts;
        let book = p
            .total_ns
            .saturating_sub(p.args_ns + p.usage_ns + p.prefix_ns + p.answer_ns);
        [
            ("args", p.args_ns),
            ("usage", p.usage_ns),
            ("prefix", p.prefix_ns),
            ("answer", p.answer_ns),
            ("book", book),
            ("total", p.total_ns),
        ]
    }

    /// The core's Prometheus text.
    fn prometheus(&self) -> PyResult<String> {
        no_panic("EngineGateBook.prometheus", || Ok(self.book.prometheus()))
    }

    /// Raises `RuntimeError` describing the core's first internal inconsistency (tests).
    fn check_invariants(&self) -> PyResult<()> {
        no_panic("EngineGateBook.check_invariants", || {
            self.book.core().check_invariants().map_err(|why| {
                pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "session_gate: core invariant broken: {why}"
                ))
            })
        })
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngineGateBook>()
}
