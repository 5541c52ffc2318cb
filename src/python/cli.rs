//! `session_gate._native.cli(argv)`: the Rust command line (`session-gate proxy …`) inside the
//! Python extension, so the wheel's console script runs the proxy with no separate binary and
//! no Rust toolchain on the target. Compiled with the `proxy` feature (the wheel enables it).
use pyo3::prelude::*;

use super::guard::no_panic;

/// Runs `session-gate` with `argv` (the arguments after the program name) and returns the exit
/// code. The GIL is released while the proxy serves; Ctrl-C / SIGTERM stop it gracefully.
#[pyfunction]
fn cli(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    no_panic("cli", || {
        let args = std::iter::once("session-gate".to_owned()).chain(argv);
        Ok(py.detach(|| crate::cli::run(args)))
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cli, m)?)?;
    Ok(())
}
