//! `SchedulerLook`: the scheduler mode's look at a waiting request
//! (`session_gate/engine/gate_scheduler.py`), in native code for the common looks.
//!
//! vLLM asks `Scheduler._handle_blocked_waiting_request(request)` about every waiting request
//! it reaches, on every step: a request the gate holds is looked at once per step until it is
//! admitted, and a request without a session id once per step while it waits. Those looks are
//! answered here without a Python frame: a request held with no answer yet is found by address
//! in a map of its own (vLLM's check is not even called), else vLLM's check runs (only for the
//! statuses where it does something), then the session id, then the Python gate's own
//! `decided` (scheduled) and `held` maps. A first look with a plain session id, a prompt and
//! no other request of its session pending is admitted here too, through the engine gate's book
//! (`EngineGateBook`, no answer dict built): admitted now, it lands in `decided` and in this
//! look's counters; made to wait, the Python gate's `_hold` keeps it. Every other look (an
//! answered hold, a request behind a held one of its session, a bad id, inference) goes to the
//! Python gate's `ready`, which owns those decisions.
//!
//! Installed per scheduler, as a bound method in the scheduler's instance `__dict__` (it shadows
//! the class's function, which stays as it was for schedulers without a gate).
//!
//! Its `free` is the gate's part of vLLM's `_free_request` (the gate's `free`): a scheduled
//! request's lease is released through the book with no Python frame of the gate's; held,
//! queued and inferred requests go to the Python gate's `on_free`.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString};

use super::engine_book::{Admit, MAX_ID_LEN, PyEngineGateBook, plain_int};
use super::guard::no_panic;
use crate::gate::Reason;
use crate::gate::book::Answer;

/// What the native look decided on its own, and the leases of the requests it admitted.
#[derive(Default)]
struct Counts {
    gated: u64,
    admitted: u64,
    max_wait: u64,
    /// Answers other than an admission, by status: preempted, cancelled, expired.
    ungated: [u64; 3],
    /// Leases it granted less those it released (the Python gate counts its own grants and
    /// releases: the sum is what is held). Signed: it may release a lease the Python gate
    /// granted.
    leases: i64,
    by_reason: [u64; Reason::ALL.len()],
}

/// What a look found before deciding anything.
enum Found<'py> {
    /// Answered: scheduled (true) or held (false).
    Known(bool),
    /// A first look: the request's id.
    First(Bound<'py, PyAny>),
    /// The Python gate answers.
    Python,
}

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
    /// The gate's `_held_sessions` (session -> the request whose admit is pending) and
    /// `_queued` (requests behind one of their session's).
    held_sessions: Py<PyDict>,
    queued: Py<PySet>,
    /// The gate's `ready(request)`: every look this one does not answer.
    ready: Py<PyAny>,
    /// The gate's `_hold(request, request_id, session_id, ticket, future)`: a first look's
    /// admit waits.
    hold_held: Py<PyAny>,
    /// The gate's `on_free(request)`: every free [`Self::free`] does not answer.
    on_free: Py<PyAny>,
    /// `infer`: requests without an id are gated too (their session is inferred).
    infer: bool,
    /// The engine gate's book, for first looks (`None`: they go to the Python gate).
    book: Option<Py<PyEngineGateBook>>,
    /// What a first look the book holds is answered through (the gate's `_Held`, made with no
    /// arguments; `None`: the book's `Future`): the gate's `_hold` keeps it.
    sink: Option<Py<PyAny>>,
    /// The book's client the scheduler's admits belong to.
    client_id: String,
    /// Tickets `sched:<n>`, for this look's admits and the Python gate's.
    tickets: AtomicU64,
    counts: Mutex<Counts>,
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

/// A lock on state no panic can leave half-updated (counters, a map of references).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SchedulerLook {
    /// [`Self::free`] of a request the gate scheduled (its lease released and counted by the
    /// book, or none to release: it ran ungated); false when `on_free` must answer (no native
    /// book, inference, not scheduled).
    fn free_scheduled(&self, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Some(book) = &self.book else {
            return Ok(false);
        };
        if self.infer {
            return Ok(false); // the answer's blocks become its session's own: `on_free`'s job
        }
        let py = request.py();
        let rid = request.getattr(intern!(py, "request_id"))?;
        let decided = self.decided.bind(py);
        let Some(lease) = decided.get_item(&rid)? else {
            return Ok(false);
        };
        if lease.is_none() {
            decided.del_item(&rid)?;
            return Ok(true);
        }
        let lease = lease.extract::<u64>()?;
        let Ok(mut book) = book.bind(py).try_borrow_mut() else {
            return Ok(false); // the book is busy (a free from inside one of its calls)
        };
        decided.del_item(&rid)?;
        lock(&self.counts).leases -= 1;
        book.release_of_request(py, lease)?;
        Ok(true)
    }

    fn is_unanswered(&self, request: &Bound<'_, PyAny>) -> bool {
        let map = lock(&self.unanswered);
        !map.is_empty() && map.contains_key(&key(request))
    }

    /// The look after vLLM's check said the request may proceed.
    fn find<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<Found<'py>> {
        let py = request.py();
        if !self.infer && !request.getattr(intern!(py, "session_id"))?.is_truthy()? {
            return Ok(Found::Known(true)); // no id: never gated
        }
        let rid = request.getattr(intern!(py, "request_id"))?;
        if self.decided.bind(py).contains(&rid)? {
            return Ok(Found::Known(true));
        }
        if let Some(held) = self.held.bind(py).get_item(&rid)? {
            return Ok(if held.getattr(intern!(py, "answer"))?.is_none() {
                Found::Known(false)
            } else {
                Found::Python // the answer came: the gate takes it
            });
        }
        if self.queued.bind(py).contains(&rid)? {
            return Ok(Found::Python);
        }
        Ok(Found::First(rid))
    }

    /// A first look admitted here: `None` when the Python gate must decide (no book, no plain
    /// id, no prompt or params, another request of the session pending, an error).
    fn first_look(
        &self,
        request: &Bound<'_, PyAny>,
        rid: &Bound<'_, PyAny>,
    ) -> PyResult<Option<bool>> {
        let Some(book) = &self.book else {
            return Ok(None);
        };
        let py = request.py();
        let sid = request.getattr(intern!(py, "session_id"))?;
        let Ok(sid) = sid.cast::<PyString>() else {
            return Ok(None); // no id (inference) or not a str
        };
        let session_id = sid.to_str()?;
        if session_id.is_empty() || session_id.len() > MAX_ID_LEN {
            return Ok(None);
        }
        let params = request.getattr(intern!(py, "sampling_params"))?;
        let tokens = request.getattr(intern!(py, "prompt_token_ids"))?;
        let prompt_tokens = match tokens.cast::<PyList>() {
            Ok(list) if !params.is_none() && !list.is_empty() => list.len(),
            _ => return Ok(None),
        };
        if self.held_sessions.bind(py).contains(sid)? {
            return Ok(None); // behind its session's pending admit
        }
        let max_tokens = params.getattr(intern!(py, "max_tokens"))?;
        let max_tokens = if max_tokens.is_none() {
            0
        } else {
            match plain_int(&max_tokens).map(|m| m.extract::<usize>()) {
                Some(Ok(n)) => n,
                _ => return Ok(None),
            }
        };
        let ticket = self.ticket();
        let Ok(mut book) = book.bind(py).try_borrow_mut() else {
            return Ok(None);
        };
        let admit = Admit {
            session_id,
            token_ids: &tokens,
            prompt_tokens,
            max_tokens,
            retain_session: true,
            ticket: &ticket,
            client_id: &self.client_id,
        };
        let sink = self.sink.as_ref().map(|s| s.bind(py));
        let answer = match book.admit_native(py, admit, sink) {
            Ok(a) => a,
            Err(_) => return Ok(None), // the Python gate asks again, and counts what it gets
        };
        drop(book);
        match answer {
            Ok(Answer::Admitted(a)) => {
                self.decided.bind(py).set_item(rid, a.lease.0)?;
                let mut c = lock(&self.counts);
                c.gated += 1;
                c.admitted += 1;
                c.leases += 1;
                if a.reason == Reason::MaxWait {
                    c.max_wait += 1;
                }
                c.by_reason[a.reason.index()] += 1;
                Ok(Some(true))
            }
            Ok(other) => {
                // Not admitted in its own call (it cannot be preempted, cancelled or expired
                // there, but if it were): scheduled ungated, as the Python gate does.
                self.decided.bind(py).set_item(rid, py.None())?;
                let mut c = lock(&self.counts);
                c.gated += 1;
                c.ungated[match other {
                    Answer::Preempted { .. } => 0,
                    Answer::Cancelled => 1,
                    _ => 2,
                }] += 1;
                Ok(Some(true))
            }
            Err(future) => {
                lock(&self.counts).gated += 1;
                self.hold_held
                    .bind(py)
                    .call1((request, rid, sid, ticket, future))?;
                Ok(Some(false))
            }
        }
    }
}

#[pymethods]
impl SchedulerLook {
    /// The look of the scheduler whose vLLM check is `vllm_check` (bound), over `gate` (a
    /// `gate_scheduler.SchedulerGate`: its maps and its `ready` and `_hold`), admitting first
    /// looks through `book` (the engine gate's `EngineGateBook`; `None`: the gate does) for
    /// `client_id`; a first look the book holds is answered through a `sink()` (the gate's
    /// `_Held`; `None`: a `Future`).
    #[new]
    #[pyo3(signature = (vllm_check, plain, gate, client_id, book=None, sink=None))]
    fn new(
        vllm_check: Py<PyAny>,
        plain: Vec<Py<PyAny>>,
        gate: &Bound<'_, PyAny>,
        client_id: String,
        book: Option<Py<PyEngineGateBook>>,
        sink: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let py = gate.py();
        let infer = gate.getattr("mode")?.eq("infer")?;
        Ok(Self {
            vllm_check,
            plain,
            decided: gate.getattr("_decided")?.cast_into::<PyDict>()?.unbind(),
            held: gate.getattr("_held")?.cast_into::<PyDict>()?.unbind(),
            held_sessions: gate
                .getattr("_held_sessions")?
                .cast_into::<PyDict>()?
                .unbind(),
            queued: gate.getattr("_queued")?.cast_into::<PySet>()?.unbind(),
            ready: gate.getattr("ready")?.unbind(),
            hold_held: gate.getattr("_hold")?.unbind(),
            on_free: gate.getattr("on_free")?.unbind(),
            infer,
            book: book.map(|b| b.clone_ref(py)),
            sink,
            client_id,
            tickets: AtomicU64::new(0),
            counts: Mutex::new(Counts::default()),
            unanswered: Mutex::new(HashMap::new()),
        })
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
        let decided = no_panic("SchedulerLook.look", || {
            Ok(match self.find(request)? {
                Found::Known(answer) => Some(answer),
                Found::First(rid) => self.first_look(request, &rid)?,
                Found::Python => None,
            })
        });
        match decided {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) | Err(_) => self.ready.bind(py).call1((request,))?.is_truthy(),
        }
    }

    /// vLLM freed `request` (`Scheduler._free_request`, through `gate_binding`). A scheduled
    /// request's lease is released here, through the book's release of a request's lease
    /// (counted there); every other free (a held or queued request, inference, no native
    /// book) goes to the gate's `on_free`. Errors raise, as `on_free`'s do (the caller logs
    /// and counts them: vLLM's free never fails on the gate).
    fn free(&self, request: &Bound<'_, PyAny>) -> PyResult<()> {
        if !no_panic("SchedulerLook.free", || self.free_scheduled(request))? {
            self.on_free.bind(request.py()).call1((request,))?;
        }
        Ok(())
    }

    /// The next ticket, `sched:<n>` (the Python gate's admits take theirs here too).
    fn ticket(&self) -> String {
        format!("sched:{}", self.tickets.fetch_add(1, Ordering::Relaxed))
    }

    /// `request` is held and its admit not answered: later looks answer False at once.
    fn hold(&self, request: &Bound<'_, PyAny>) {
        let old = lock(&self.unanswered).insert(key(request), request.clone().unbind());
        drop(old); // after the lock: dropping a reference may run Python
    }

    /// `request`'s admit was answered, or it was freed: whether it was held.
    fn unhold(&self, request: &Bound<'_, PyAny>) -> bool {
        let old = lock(&self.unanswered).remove(&key(request));
        old.is_some()
    }

    /// How many requests are held with no answer.
    #[getter]
    fn holding(&self) -> usize {
        lock(&self.unanswered).len()
    }

    /// What this look decided on its own: `gated`, `admitted`, `max_wait`,
    /// `ungated_preempted` / `_cancelled` / `_expired`, `leases` (granted here less released
    /// here) and `admitted_by_reason`.
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = lock(&self.counts);
        let d = PyDict::new(py);
        d.set_item("gated", c.gated)?;
        d.set_item("admitted", c.admitted)?;
        d.set_item("max_wait", c.max_wait)?;
        for (status, n) in ["preempted", "cancelled", "expired"].iter().zip(c.ungated) {
            d.set_item(format!("ungated_{status}"), n)?;
        }
        d.set_item("leases", c.leases)?;
        let by = PyDict::new(py);
        for (r, n) in Reason::ALL.iter().zip(c.by_reason) {
            if n > 0 {
                by.set_item(r.as_str(), n)?;
            }
        }
        d.set_item("admitted_by_reason", by)?;
        Ok(d)
    }

    /// Leases granted here less those released here (read on every driver tick).
    #[getter]
    fn leases(&self) -> i64 {
        lock(&self.counts).leases
    }

    /// Gated requests so far (cheap: read around each look by the lab's cost bench).
    #[getter]
    fn gated(&self) -> u64 {
        lock(&self.counts).gated
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SchedulerLook>()
}
