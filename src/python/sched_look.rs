//! `SchedulerLook`: the scheduler mode's look at a waiting request
//! (`session_gate/engine/gate_scheduler.py`), in native code for the looks that decide nothing.
//!
//! vLLM asks `Scheduler._handle_blocked_waiting_request(request)` about every waiting request
//! it reaches, on every step: a request the gate holds is looked at once per step until it is
//! admitted, and a request without a session id once per step while it waits. Those looks
//! change nothing, so they are answered here without a Python frame: a request held with no
//! answer yet is found by address in a map of its own (vLLM's check is not even called), else
//! vLLM's check (only for the statuses where it does something), the session id, then the
//! Python gate's own `decided` (scheduled) and `held` (held, answer not taken yet) maps. The
//! Python gate tells it when it holds a request and when the hold ends. Every other look (a first
//! look, which admits; an answered hold; a request behind a held one of its session; inference)
//! goes to the Python gate's `ready`, which owns every decision and every counter.
//!
//! Installed per scheduler, as a bound method in the scheduler's instance `__dict__` (it shadows
//! the class's function, which stays as it was for schedulers without a gate).
use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::guard::no_panic;

#[pyclass(name = "SchedulerLook", module = "session_gate._native", frozen)]
pub(crate) struct SchedulerLook {
    /// vLLM's own `_handle_blocked_waiting_request`, bound to the scheduler.
    vllm_check: Py<PyAny>,
    /// The statuses for which vLLM's check returns True and does nothing else (`WAITING`,
    /// `PREEMPTED`): compared by identity (enum members), the check is not called for them.
    plain: Vec<Py<PyAny>>,
    /// The gate's `_decided`: request id -> lease or None (scheduled).
    decided: Py<PyDict>,
    /// The gate's `_held`: request id -> its pending admit (`answer` None until the book answers).
    held: Py<PyDict>,
    /// The gate's `ready(request)`: every look this one does not answer.
    ready: Py<PyAny>,
    /// `infer`: requests without an id are gated too (their session is inferred).
    infer: bool,
    /// The requests held now with no answer yet, by address (each kept alive while it is
    /// here, so no other object can take its address): their look is one map lookup, not even
    /// vLLM's check (a held request waits as `WAITING` or `PREEMPTED`, where the check does
    /// nothing; an abort frees it, and the gate takes it out). The gate adds a request when
    /// it holds it ([`Self::hold`]) and takes it out when its answer comes or it is freed
    /// ([`Self::unhold`]). Locked only around the map's own operations: never while Python
    /// runs (a gate call made from a look resolves other holds, which take theirs out).
    unanswered: Mutex<HashMap<usize, Py<PyAny>>>,
}

fn key(request: &Bound<'_, PyAny>) -> usize {
    request.as_ptr() as usize
}

impl SchedulerLook {
    /// The map of held requests, whatever a panic elsewhere left of its lock (it holds no
    /// invariant a panic could break half-way).
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Py<PyAny>>> {
        self.unanswered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn is_unanswered(&self, request: &Bound<'_, PyAny>) -> bool {
        let map = self.map();
        !map.is_empty() && map.contains_key(&key(request))
    }

    /// The look after vLLM's check said the request may proceed: `None` when the Python gate
    /// must answer.
    fn known(&self, request: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
        let py = request.py();
        if !self.infer && !request.getattr(intern!(py, "session_id"))?.is_truthy()? {
            return Ok(Some(true)); // no id: never gated
        }
        let rid = request.getattr(intern!(py, "request_id"))?;
        if self.decided.bind(py).contains(&rid)? {
            return Ok(Some(true));
        }
        if let Some(held) = self.held.bind(py).get_item(&rid)?
            && held.getattr(intern!(py, "answer"))?.is_none()
        {
            return Ok(Some(false));
        }
        Ok(None)
    }
}

#[pymethods]
impl SchedulerLook {
    #[new]
    fn new(
        vllm_check: Py<PyAny>,
        plain: Vec<Py<PyAny>>,
        decided: Py<PyDict>,
        held: Py<PyDict>,
        ready: Py<PyAny>,
        infer: bool,
    ) -> Self {
        Self {
            vllm_check,
            plain,
            decided,
            held,
            ready,
            infer,
            unanswered: Mutex::new(HashMap::new()),
        }
    }

    /// `request` is held and its admit not answered: later looks answer False at once.
    fn hold(&self, request: &Bound<'_, PyAny>) {
        let old = self.map().insert(key(request), request.clone().unbind());
        drop(old); // after the lock: dropping a reference may run Python
    }

    /// `request`'s admit was answered, or it was freed: whether it was held.
    fn unhold(&self, request: &Bound<'_, PyAny>) -> bool {
        let old = self.map().remove(&key(request));
        old.is_some()
    }

    /// How many requests are held with no answer.
    #[getter]
    fn holding(&self) -> usize {
        self.map().len()
    }

    /// Whether `request` may be scheduled in this step (vLLM's check, then the gate's).
    fn look(&self, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        let py = request.py();
        if self.is_unanswered(request) {
            return Ok(false);
        }
        let status = request.getattr(intern!(py, "status"))?;
        if !self.plain.iter().any(|s| status.is(s))
            && !self.vllm_check.bind(py).call1((request,))?.is_truthy()?
        {
            return Ok(false); // vLLM's own reasons (remote KV, grammar, streaming input)
        }
        // A look this part cannot read (an attribute missing, a panic) goes to the Python gate,
        // which owns every decision and how errors are handled: ours never fails a step.
        match no_panic("SchedulerLook.look", || self.known(request)) {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) | Err(_) => self.ready.bind(py).call1((request,))?.is_truthy(),
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SchedulerLook>()
}
