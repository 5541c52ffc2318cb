//! The PyO3 binding, compiled only with the `python` feature: the `session_gate._native` module.
//!
//! Only this folder imports PyO3. Every function body runs inside [`guard::no_panic`], so a Rust
//! panic reaches Python as an ordinary `RuntimeError` — never as PyO3's `PanicException`, which
//! derives from `BaseException` and would escape vLLM's `except Exception` around utility calls
//! and take the engine core down.
use pyo3::prelude::*;

mod baselines;
mod block_pool;
#[cfg(feature = "proxy")]
mod cli;
mod engine;
mod engine_book;
mod errors;
mod fleet;
mod gate_core;
mod guard;
mod host_tier;
mod inference;
mod knobs;
mod residency;
mod sched_look;
mod sim;
mod sim_pool;
mod sim_tier;
mod tokens;
mod wake_timer;

/// `session_gate._native`: the engine-side probe and the gate core.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    engine::register(m)?;
    knobs::register(m)?;
    gate_core::register(m)?;
    engine_book::register(m)?;
    baselines::register(m)?;
    sim::register(m)?;
    fleet::register(m)?;
    #[cfg(feature = "proxy")]
    cli::register(m)?;
    sim_pool::register(m)?;
    sim_tier::register(m)?;
    inference::register(m)?;
    sched_look::register(m)?;
    wake_timer::register(m)?;
    Ok(())
}
