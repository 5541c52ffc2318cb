//! `EngineGateBook`: the engine gate's core and bookkeeping for its driver in vLLM's engine
//! core (`session_gate/engine/gate_driver.py`), one native call per utility call.
//!
//! A skin over [`crate::gate::book::EngineBook`]: it checks the arguments (the messages the
//! HTTP routes answer 400 with), reads the block pool's usage itself (two attribute reads, no
//! Python frame), calls the engine's prefix probe (Python, with its own native walk) only when
//! the core asks for it, and answers deferred admits by resolving their
//! `concurrent.futures.Future` (which vLLM sends back when it is done). Engine thread only.
use std::time::Instant;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};

use super::gate::{PyGateConfig, stats_dict};
use super::guard::no_panic;
use super::tokens::{TokenLimits, read_prompt};
use crate::error::Error;
use crate::gate::book::{Answer, BookProbes, EngineBook, Resolved};
use crate::gate::{Admission, GateCore, PrefixReport, UsageReport};

/// A client id, ticket or session id longer than this is refused (they are map keys).
const MAX_ID_LEN: usize = 256;

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
    pool: &'a Bound<'py, PyAny>,
    prefix: &'a Bound<'py, PyAny>,
    block_size: u64,
    usage: Option<UsageReport>,
}

impl Probes<'_, '_> {
    fn read_usage(&self) -> PyResult<UsageReport> {
        let py = self.py;
        let pool = self.pool;
        // As `EngineState.usage()` reads it: vLLM's usage, and the null block never counts.
        let kv_cache_usage: f64 = pool.call_method0(intern!(py, "get_usage"))?.extract()?;
        let num_gpu_blocks: u64 = pool.getattr(intern!(py, "num_gpu_blocks"))?.extract()?;
        let num_free_blocks: u64 = pool
            .call_method0(intern!(py, "get_num_free_blocks"))?
            .extract()?;
        Ok(UsageReport {
            kv_cache_usage,
            num_blocks: num_gpu_blocks.saturating_sub(1),
            num_free_blocks,
            num_cached_free_blocks: None,
            block_size: self.block_size,
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
        })
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
        let u = self
            .read_usage()
            .map_err(|e| format!("usage probe raised {e}"))?;
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
        (report, started.elapsed().as_secs_f64())
    }
}

/// The engine gate (core + who holds what) for the driver in vLLM's engine core.
#[pyclass(name = "EngineGateBook", module = "session_gate._native")]
pub(crate) struct PyEngineGateBook {
    book: EngineBook<Payload>,
    /// vLLM's `BlockPool` (usage is read from it).
    pool: Py<PyAny>,
    /// `prefix(session_id, token_ids) -> dict`: the engine's prefix probe (`session_gate_probe`).
    prefix: Py<PyAny>,
    /// `arm(at)`: asks the timer thread to wake the engine at `at` (the core's clock).
    arm: Py<PyAny>,
    /// `concurrent.futures.Future`.
    future_cls: Py<PyAny>,
    block_size: u64,
    limits: TokenLimits,
}

/// A client id, ticket or session id: a non-empty `str` of at most [`MAX_ID_LEN`] characters.
fn id_str(name: &str, value: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = value.cast::<PyString>() {
        let s = s.to_str()?;
        if !s.is_empty() {
            let n = s.chars().count();
            if n > MAX_ID_LEN {
                return Err(PyValueError::new_err(format!(
                    "{name} is {n} characters long, more than {MAX_ID_LEN}"
                )));
            }
            return Ok(s.to_owned());
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

fn optional_id(name: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    value
        .filter(|v| !v.is_none())
        .map(|v| id_str(name, v))
        .transpose()
}

/// An int that is not a bool (Python's `bool` is an `int`).
fn plain_int<'a>(value: &'a Bound<'_, PyAny>) -> Option<&'a Bound<'a, PyAny>> {
    (value.cast::<PyInt>().is_ok() && value.cast::<PyBool>().is_err()).then_some(value)
}

fn admission_dict<'py>(
    py: Python<'py>,
    ticket: &str,
    session_id: &str,
    a: &Admission,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(intern!(py, "status"), intern!(py, "admitted"))?;
    d.set_item(intern!(py, "lease"), a.lease.0)?;
    d.set_item(intern!(py, "ticket"), ticket)?;
    d.set_item(intern!(py, "session_id"), session_id)?;
    d.set_item(intern!(py, "reason"), a.reason.as_str())?;
    d.set_item(intern!(py, "wait_sec"), a.wait_sec)?;
    d.set_item(intern!(py, "usage"), a.usage)?;
    d.set_item(intern!(py, "pressure"), a.pressure)?;
    d.set_item(intern!(py, "hit_ratio"), a.hit_ratio)?;
    d.set_item(intern!(py, "retain_session"), a.retain_session)?;
    d.set_item(intern!(py, "reserved"), a.reserved)?;
    d.set_item(intern!(py, "revoked"), a.revoked)?;
    d.set_item(intern!(py, "working_set_blocks"), a.working_set_blocks)?;
    d.set_item(intern!(py, "num_preempted"), a.num_preempted)?;
    Ok(d)
}

fn answer_dict<'py>(
    py: Python<'py>,
    ticket: &str,
    session_id: &str,
    answer: &Answer,
) -> PyResult<Bound<'py, PyDict>> {
    match answer {
        Answer::Admitted(a) => admission_dict(py, ticket, session_id, a),
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

impl PyEngineGateBook {
    /// Runs `f` on the book with this call's probes, then hands the timer its new deadline
    /// and answers every deferred admit that ended.
    fn with_book<'py, R>(
        &mut self,
        py: Python<'py>,
        f: impl FnOnce(&mut EngineBook<Payload>, &mut Probes<'_, 'py>) -> PyResult<R>,
    ) -> PyResult<R> {
        let pool = self.pool.bind(py).clone();
        let prefix = self.prefix.bind(py).clone();
        let mut probes = Probes {
            py,
            pool: &pool,
            prefix: &prefix,
            block_size: self.block_size,
            usage: None,
        };
        let out = f(&mut self.book, &mut probes);
        self.after_call(py)?;
        out
    }

    fn after_call(&mut self, py: Python<'_>) -> PyResult<()> {
        if let Some(at) = self.book.take_alarm() {
            self.arm.bind(py).call1((at,))?;
        }
        if self.book.has_resolved() {
            for r in self.book.take_resolved() {
                deliver(py, r)?;
            }
        }
        Ok(())
    }
}

/// Answers a deferred admit (if its caller got a future; an admit answered in its own call
/// never reaches here).
fn deliver(py: Python<'_>, r: Resolved<Payload>) -> PyResult<()> {
    let Some(future) = r.payload.future else {
        return Ok(());
    };
    let future = future.bind(py);
    if future.call_method0(intern!(py, "done"))?.is_truthy()? {
        return Ok(());
    }
    let answer = answer_dict(py, &r.ticket, &r.session_id, &r.answer)?;
    future.call_method1(intern!(py, "set_result"), (answer,))?;
    Ok(())
}

#[pymethods]
impl PyEngineGateBook {
    /// A gate core with `config` over vLLM's `block_pool` (`hash_block_size` tokens per
    /// block), `prefix(session_id, token_ids) -> dict` for the prefix probe, `arm(at)` for the
    /// timer, `future_cls` (`concurrent.futures.Future`) for deferred answers, and the
    /// engine's vocabulary size and context length for checking prompts.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        config: PyRef<'_, PyGateConfig>,
        lease_ttl_sec: f64,
        block_pool: Py<PyAny>,
        block_size: u64,
        vocab_size: u64,
        max_model_len: usize,
        prefix: Py<PyAny>,
        arm: Py<PyAny>,
        future_cls: Py<PyAny>,
    ) -> PyResult<Self> {
        no_panic("EngineGateBook()", || {
            let core = GateCore::new(config.inner().clone())?;
            Ok(Self {
                book: EngineBook::new(core, lease_ttl_sec)?,
                pool: block_pool,
                prefix,
                arm,
                future_cls,
                block_size,
                limits: TokenLimits {
                    vocab_size,
                    max_model_len,
                },
            })
        })
    }

    /// One admit: the answer as a dict if it ends now, else a `Future` of it. Bad arguments
    /// raise `TypeError`/`ValueError` naming the argument.
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        py: Python<'_>,
        session_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        retain_session: &Bound<'_, PyAny>,
        ticket: &Bound<'_, PyAny>,
        client_id: &Bound<'_, PyAny>,
        now: f64,
    ) -> PyResult<Py<PyAny>> {
        no_panic("EngineGateBook.admit", || {
            let session_id = id_str("session_id", session_id)?;
            let ticket = id_str("ticket", ticket)?;
            let client_id = id_str("client_id", client_id)?;
            let max_tokens = plain_int(max_tokens)
                .and_then(|m| m.extract::<usize>().ok())
                .ok_or_else(|| {
                    let shown = max_tokens.repr().map(|r| r.to_string()).unwrap_or_default();
                    PyValueError::new_err(format!(
                        "max_tokens must be a non-negative int, got {shown}"
                    ))
                })?;
            let retain_session = match retain_session.cast::<PyBool>() {
                Ok(b) => b.is_true(),
                Err(_) => {
                    return Err(PyTypeError::new_err(format!(
                        "retain_session must be a bool, got {}",
                        retain_session.get_type().name()?
                    )));
                }
            };
            let prompt_tokens = read_prompt(token_ids, Some(self.limits))
                .map_err(|e| PyValueError::new_err(format!("token_ids: {e}")))?
                .len();
            let payload = Payload {
                token_ids: token_ids.clone().unbind(),
                future: None,
            };
            let answer = self.with_book(py, |book, probes| {
                book.admit(
                    &ticket,
                    &client_id,
                    &session_id,
                    prompt_tokens,
                    max_tokens,
                    retain_session,
                    payload,
                    now,
                    probes,
                )
                .map_err(|e| match e {
                    Error::InvalidInput(m) => PyValueError::new_err(m),
                    e => e.into(),
                })
            })?;
            match answer {
                Some(a) => Ok(answer_dict(py, &ticket, &session_id, &a)?
                    .into_any()
                    .unbind()),
                None => {
                    let future = self.future_cls.bind(py).call0()?.unbind();
                    if let Some(p) = self.book.payload_mut(&ticket) {
                        p.future = Some(future.clone_ref(py));
                    }
                    Ok(future)
                }
            }
        })
    }

    /// Releases a lease (and renews `client_id`); false if it was unknown or released.
    #[pyo3(signature = (lease, client_id, now))]
    fn release(
        &mut self,
        py: Python<'_>,
        lease: &Bound<'_, PyAny>,
        client_id: Option<&Bound<'_, PyAny>>,
        now: f64,
    ) -> PyResult<bool> {
        no_panic("EngineGateBook.release", || {
            let Some(lease) = plain_int(lease).and_then(|l| l.extract::<u64>().ok()) else {
                if plain_int(lease).is_some() {
                    return Ok(false); // a negative or huge int names no lease
                }
                return Err(PyTypeError::new_err(format!(
                    "lease must be an int lease id, got {}",
                    lease.get_type().name()?
                )));
            };
            let client_id = optional_id("client_id", client_id)?;
            self.with_book(py, |book, probes| {
                Ok(book.release(lease, client_id.as_deref(), now, probes))
            })
        })
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
                Ok(book.cancel(&ticket, client_id.as_deref(), now, probes))
            })
        })
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
                Ok(book.finish(&session_id, client_id.as_deref(), now, probes))
            })
        })
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
            self.with_book(py, |book, probes| Ok(book.renew(&client_id, now, probes)))
        })
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
            d.set_item("engine_gate", e)?;
            Ok(d)
        })
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
