//! Panic containment at the Python boundary.
use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::PyResult;
use pyo3::exceptions::PyRuntimeError;

/// Runs `f`, turning a panic into a `RuntimeError` that names the operation.
pub(crate) fn no_panic<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    no_panic_then(what, f, || ())
}

/// Like [`no_panic`], and runs `after_panic` when `f` panicked.
///
/// The closure is asserted unwind-safe because callers whose state a panic could leave half
/// updated pass an `after_panic` that discards that state (the probe drops its chain cache).
pub(crate) fn no_panic_then<T>(
    what: &str,
    f: impl FnOnce() -> PyResult<T>,
    after_panic: impl FnOnce(),
) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            after_panic();
            let detail = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(PyRuntimeError::new_err(format!(
                "session_gate: internal error in {what}: {detail}"
            )))
        }
    }
}
