//! `SessionInference` for Python: the scheduler mode's `infer` setting
//! (`session_gate/engine/gate_scheduler.py`) asks it which session a request without an id
//! continues. A thin skin over [`crate::gate::infer`]: it takes vLLM's `request.block_hashes`
//! as they are (a list of `bytes`, each folded to one `u64`) and answers `(session, kind)`.
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::guard::no_panic;
use crate::gate::infer::{ChainHash, DEFAULT_MAX_IDLE, SessionInference};

/// One hash: `bytes` → its 8-byte words mixed into one (every byte counts, so hashes that
/// are not digests still fold apart); anything else (an int in a test, another hash type) →
/// Python's own `hash()` of it.
fn fold(h: &Bound<'_, PyAny>) -> PyResult<ChainHash> {
    if let Ok(b) = h.cast::<PyBytes>() {
        let mut acc = 0x9e37_79b9_7f4a_7c15u64;
        for chunk in b.as_bytes().chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            acc = (acc ^ u64::from_le_bytes(word))
                .wrapping_mul(0xff51_afd7_ed55_8ccd)
                .rotate_left(29);
        }
        return Ok(acc);
    }
    Ok(h.hash()? as u64)
}

/// The hashes of `seq` (a list of block hashes) in order.
fn hashes(seq: &Bound<'_, PyAny>) -> PyResult<Vec<ChainHash>> {
    if let Ok(list) = seq.cast::<PyList>() {
        return list.iter().map(|h| fold(&h)).collect();
    }
    seq.try_iter()?.map(|h| fold(&h?)).collect()
}

/// Which session a request without a session id continues (see `gate::infer`).
#[pyclass(name = "SessionInference", module = "session_gate._native", unsendable)]
pub(crate) struct PySessionInference {
    inner: SessionInference,
}

#[pymethods]
impl PySessionInference {
    #[new]
    #[pyo3(signature = (max_idle = DEFAULT_MAX_IDLE))]
    fn new(max_idle: usize) -> PyResult<Self> {
        no_panic("SessionInference()", || {
            Ok(Self {
                inner: SessionInference::new(max_idle),
            })
        })
    }

    /// A request arrives with its prompt's block hashes: `(session, kind)`, kind one of
    /// `"continued"`, `"ambiguous"`, `"new"`.
    fn arrive(&mut self, prompt_hashes: &Bound<'_, PyAny>) -> PyResult<(u64, &'static str)> {
        no_panic("SessionInference.arrive", || {
            let inferred = self.inner.arrive(&hashes(prompt_hashes)?);
            Ok((inferred.session(), inferred.kind()))
        })
    }

    /// The request of `session` is done: all its block hashes (prompt and answer) and how
    /// many of them the prompt alone filled.
    fn finish(
        &mut self,
        session: u64,
        block_hashes: &Bound<'_, PyAny>,
        prompt_blocks: usize,
    ) -> PyResult<()> {
        no_panic("SessionInference.finish", || {
            let chain = hashes(block_hashes)?;
            self.inner.finish(session, &chain, prompt_blocks);
            Ok(())
        })
    }

    /// Counts: `continued`, `ambiguous`, `new`, `no_own_block`, `forgotten`, `idle`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        no_panic("SessionInference.stats", || {
            let c = self.inner.counts();
            let d = PyDict::new(py);
            d.set_item("continued", c.continued)?;
            d.set_item("ambiguous", c.ambiguous)?;
            d.set_item("new", c.new)?;
            d.set_item("no_own_block", c.no_own_block)?;
            d.set_item("forgotten", c.forgotten)?;
            d.set_item("idle", self.inner.idle_sessions())?;
            Ok(d)
        })
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySessionInference>()
}
