//! The anti-thrash controllers people deploy today, as sans-IO state machines beside the gate core,
//! so the real-engine benchmark and the replica twin run the same code against the gate:
//!
//! - [`aimd`]: prime-rl's adaptive concurrency (orchestrator): a cap on in-flight *episodes*
//!   (sessions) driven by vLLM's KV usage, running/waiting counts and preemption counter, shrunk
//!   multiplicatively, grown geometrically on completions, with youngest-first cancellation;
//! - [`pause`]: ThunderAgent's program-aware scheduler (the NVIDIA Dynamo port's defaults): a
//!   periodic tick that pauses sessions sitting in a tool call when the *counted tokens* of active
//!   sessions pass a threshold, and resumes them with hysteresis.
//!
//! Like [`crate::gate::GateCore`], neither reads a clock or does I/O: the driver tells them the
//! time and what happened and carries out what they answer. Every knob is a public field with the
//! published default in `Default`, validated by `validate` (errors name the knob and the value).
//! Where a rule is an interpretation of the public source, the item's docs say so.
pub mod aimd;
pub mod pause;

pub use self::aimd::{AimdConfig, AimdController, AimdSignals, AimdStats};
pub use self::pause::{PauseConfig, PauseController, PauseDecision, PauseStats, PauseTick};

use crate::error::Result;

/// A knob that must be a finite number > 0 (a factor, a count of tokens).
pub(crate) fn positive(knob: &'static str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(crate::gate::config::invalid(
            knob,
            v,
            "must be a finite number > 0",
        ))
    }
}

/// A knob that must lie in `0 < v <= 1` (a multiplicative decrease).
pub(crate) fn factor(knob: &'static str, v: f64) -> Result<()> {
    if v > 0.0 && v <= 1.0 {
        Ok(())
    } else {
        Err(crate::gate::config::invalid(
            knob,
            v,
            "must be a factor in (0, 1]",
        ))
    }
}

/// Two knobs whose order matters (e.g. a pause target at or below its threshold).
pub(crate) fn ordered(knob: &'static str, v: f64, limit: f64, why: &'static str) -> Result<()> {
    if v <= limit {
        Ok(())
    } else {
        Err(crate::gate::config::invalid(knob, v, why))
    }
}
