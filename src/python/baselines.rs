//! The baseline controllers for Python: `AimdController` and `PauseController`.
//!
//! A thin skin over [`crate::baselines`]: knobs by keyword (an unknown knob is a `ValueError`
//! naming it), a `time_scale` that multiplies the time constants, and plain lists and dicts out.
//! The bench driver (`session_gate.lab.bench.admission`) carries out what they answer; no control logic
//! lives here or in Python.
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::guard::no_panic;
use crate::baselines::{
    AimdConfig, AimdController, AimdSignals, AimdStats, PauseConfig, PauseController, PauseDecision,
};

/// Applies `knobs` (name -> number) to `fields` (name -> field), refusing unknown names.
fn apply_knobs(
    what: &str,
    knobs: Option<&Bound<'_, PyDict>>,
    mut set: impl FnMut(&str, &Bound<'_, PyAny>) -> PyResult<bool>,
) -> PyResult<()> {
    let Some(knobs) = knobs else {
        return Ok(());
    };
    for (k, v) in knobs.iter() {
        let name: String = k.extract()?;
        if !set(&name, &v)? {
            return Err(PyValueError::new_err(format!(
                "{what}: unknown knob `{name}`"
            )));
        }
    }
    Ok(())
}

fn aimd_config(knobs: Option<&Bound<'_, PyDict>>) -> PyResult<AimdConfig> {
    let mut c = AimdConfig::default();
    apply_knobs("AimdController", knobs, |name, v| {
        match name {
            "poll_interval_sec" => c.poll_interval_sec = v.extract()?,
            "initial_inflight" => c.initial_inflight = v.extract()?,
            "min_inflight" => c.min_inflight = v.extract()?,
            "max_inflight" => c.max_inflight = v.extract()?,
            "soft_usage" => c.soft_usage = v.extract()?,
            "cut_usage" => c.cut_usage = v.extract()?,
            "cancel_usage" => c.cancel_usage = v.extract()?,
            "cut_target" => c.cut_target = v.extract()?,
            "preempt_factor" => c.preempt_factor = v.extract()?,
            "queue_factor" => c.queue_factor = v.extract()?,
            "escalated_factor" => c.escalated_factor = v.extract()?,
            "queue_ratio" => c.queue_ratio = v.extract()?,
            "queue_polls" => c.queue_polls = v.extract()?,
            "cooldown_polls" => c.cooldown_polls = v.extract()?,
            "grace_polls" => c.grace_polls = v.extract()?,
            "growth" => c.growth = v.extract()?,
            "binding_fraction" => c.binding_fraction = v.extract()?,
            "grow_valid_sec" => c.grow_valid_sec = v.extract()?,
            "meter_window_sec" => c.meter_window_sec = v.extract()?,
            "meter_min" => c.meter_min = v.extract()?,
            "meter_fraction" => c.meter_fraction = v.extract()?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(c)
}

fn pause_config(knobs: Option<&Bound<'_, PyDict>>) -> PyResult<PauseConfig> {
    let mut c = PauseConfig::default();
    apply_knobs("PauseController", knobs, |name, v| {
        match name {
            "pause_threshold" => c.pause_threshold = v.extract()?,
            "pause_target" => c.pause_target = v.extract()?,
            "resume_hysteresis" => c.resume_hysteresis = v.extract()?,
            "resume_timeout_sec" => c.resume_timeout_sec = v.extract()?,
            "scheduler_interval_sec" => c.scheduler_interval_sec = v.extract()?,
            "acting_token_weight" => c.acting_token_weight = v.extract()?,
            "buffer_per_program" => c.buffer_per_program = v.extract()?,
            "idle_ttl_sec" => c.idle_ttl_sec = v.extract()?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(c)
}

/// prime-rl's adaptive episode concurrency (Rust's `baselines::AimdController`).
#[pyclass(name = "AimdController", module = "session_gate._native")]
pub(crate) struct PyAimd {
    inner: AimdController,
}

#[pymethods]
impl PyAimd {
    /// Published defaults, overridden by keyword; `time_scale` multiplies the time constants.
    #[new]
    #[pyo3(signature = (*, time_scale=1.0, **knobs))]
    fn new(time_scale: f64, knobs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let config = aimd_config(knobs)?;
        no_panic("AimdController()", || {
            Ok(Self {
                inner: AimdController::new(config.scaled(time_scale)?)?,
            })
        })
    }

    /// Queue an episode to start.
    fn submit(&mut self, session_id: &str) -> PyResult<()> {
        no_panic("AimdController.submit", || {
            Ok(self.inner.submit(session_id)?)
        })
    }

    /// The queued episodes to start now.
    fn admit(&mut self, now: f64) -> PyResult<Vec<String>> {
        no_panic("AimdController.admit", || Ok(self.inner.admit(now)))
    }

    /// A natural completion.
    fn on_complete(&mut self, now: f64, session_id: &str) -> PyResult<()> {
        no_panic("AimdController.on_complete", || {
            Ok(self.inner.on_complete(now, session_id)?)
        })
    }

    /// One engine scrape; returns the episodes to cancel, youngest first.
    #[pyo3(signature = (now, *, kv_usage, running, waiting, preemptions_total,
                        kv_capacity_tokens=None, max_model_len=None))]
    #[allow(clippy::too_many_arguments)]
    fn on_poll(
        &mut self,
        now: f64,
        kv_usage: f64,
        running: u64,
        waiting: u64,
        preemptions_total: u64,
        kv_capacity_tokens: Option<u64>,
        max_model_len: Option<u64>,
    ) -> PyResult<Vec<String>> {
        if !(0.0..=1.0).contains(&kv_usage) {
            return Err(PyValueError::new_err(format!(
                "kv_usage must be a fraction between 0 and 1, got {kv_usage}"
            )));
        }
        no_panic("AimdController.on_poll", || {
            Ok(self.inner.on_poll(
                now,
                &AimdSignals {
                    kv_usage,
                    running,
                    waiting,
                    preemptions_total,
                    kv_capacity_tokens,
                    max_model_len,
                },
            ))
        })
    }

    /// The current cap on episodes in flight.
    #[getter]
    fn cap(&self) -> f64 {
        self.inner.cap()
    }

    /// Episodes in flight.
    #[getter]
    fn inflight(&self) -> usize {
        self.inner.inflight()
    }

    /// Episodes waiting to start.
    #[getter]
    fn queued(&self) -> usize {
        self.inner.queued()
    }

    /// Seconds between engine scrapes (after scaling).
    #[getter]
    fn poll_interval_sec(&self) -> f64 {
        self.inner.config().poll_interval_sec
    }

    /// Counters of what the controller did.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = aimd_stats_dict(py, self.inner.stats())?;
        d.set_item("cap", self.inner.cap())?;
        Ok(d)
    }
}

/// An aimd controller's counters as a dict (the bench's controller and the twin's mode).
pub(crate) fn aimd_stats_dict<'py>(py: Python<'py>, s: &AimdStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("polls", s.polls)?;
    d.set_item("admitted", s.admitted)?;
    d.set_item("completed", s.completed)?;
    d.set_item("cancelled", s.cancelled)?;
    d.set_item("hard_cuts", s.hard_cuts)?;
    d.set_item("soft_cuts", s.soft_cuts)?;
    d.set_item("grown", s.grown)?;
    d.set_item("peak_usage", s.peak_usage)?;
    Ok(d)
}

/// ThunderAgent's tool-boundary pausing for one replica (Rust's `baselines::PauseController`).
#[pyclass(name = "PauseController", module = "session_gate._native")]
pub(crate) struct PyPause {
    inner: PauseController,
}

#[pymethods]
impl PyPause {
    /// A scheduler for `capacity_tokens` of KV (block size × blocks): published defaults,
    /// overridden by keyword; `time_scale` multiplies the time constants.
    #[new]
    #[pyo3(signature = (capacity_tokens, *, time_scale=1.0, **knobs))]
    fn new(
        capacity_tokens: u64,
        time_scale: f64,
        knobs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let config = pause_config(knobs)?;
        no_panic("PauseController()", || {
            Ok(Self {
                inner: PauseController::new(config.scaled(time_scale)?, capacity_tokens)?,
            })
        })
    }

    /// A turn is about to be sent: `None` to send it, else the reason it is held.
    fn before_request(
        &mut self,
        now: f64,
        session_id: &str,
        prompt_tokens: u64,
    ) -> PyResult<Option<&'static str>> {
        no_panic("PauseController.before_request", || {
            Ok(
                match self.inner.before_request(now, session_id, prompt_tokens) {
                    PauseDecision::Admit => None,
                    PauseDecision::Hold(reason) => Some(reason),
                },
            )
        })
    }

    /// The turn's response ended; whether the session was paused now (it had been marked).
    fn after_request(&mut self, now: f64, session_id: &str, total_tokens: u64) -> PyResult<bool> {
        no_panic("PauseController.after_request", || {
            Ok(self.inner.after_request(now, session_id, total_tokens)?)
        })
    }

    /// The session ended; whether it was known.
    fn finish(&mut self, session_id: &str) -> PyResult<bool> {
        no_panic("PauseController.finish", || {
            Ok(self.inner.finish(session_id))
        })
    }

    /// One scheduler tick: a dict of lists (`resumed`, `forced`, `paused`, `marked`, `expired`).
    fn tick<'py>(&mut self, py: Python<'py>, now: f64) -> PyResult<Bound<'py, PyDict>> {
        let t = no_panic("PauseController.tick", || Ok(self.inner.tick(now)))?;
        let d = PyDict::new(py);
        d.set_item("resumed", t.resumed)?;
        d.set_item("forced", t.forced)?;
        d.set_item("paused", t.paused)?;
        d.set_item("marked", t.marked)?;
        d.set_item("expired", t.expired)?;
        Ok(d)
    }

    /// Whether the session is paused.
    fn is_paused(&self, session_id: &str) -> bool {
        self.inner.is_paused(session_id)
    }

    /// Counted tokens of active sessions, buffers included.
    #[getter]
    fn used(&self) -> u64 {
        self.inner.used()
    }

    /// Seconds between ticks (after scaling).
    #[getter]
    fn scheduler_interval_sec(&self) -> f64 {
        self.inner.config().scheduler_interval_sec
    }

    /// When the earliest held turn is due a forced resume.
    #[getter]
    fn next_forced_resume(&self) -> Option<f64> {
        self.inner.next_forced_resume()
    }

    /// Counters of what the scheduler did.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("ticks", s.ticks)?;
        d.set_item("pauses", s.pauses)?;
        d.set_item("resumes", s.resumes)?;
        d.set_item("forced_resumes", s.forced_resumes)?;
        d.set_item("marked", s.marked)?;
        d.set_item("admission_held", s.admission_held)?;
        d.set_item("held_turns", s.held_turns)?;
        d.set_item("expired", s.expired)?;
        d.set_item("paused_now", self.inner.paused_count())?;
        Ok(d)
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAimd>()?;
    m.add_class::<PyPause>()?;
    Ok(())
}
