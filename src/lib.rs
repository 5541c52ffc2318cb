//! session-gate: a session-level admission gate for agentic rollouts on vLLM.
//!
//! The rooms of the crate:
//! - the **gate** ([`gate`]): a sans-IO admission state machine (`gate::core`), its one table of
//!   knobs (`gate::knobs`), and the drivers that carry out its probes and waits (tokio's
//!   `gate::driver`; the engine gate's book, `gate::book`);
//! - **hashing and prefix probes** ([`hashing`], [`prefix`]): vLLM-exact block hashing and the
//!   per-session hash-chain cache behind the residency probes;
//! - the **C ABI** ([`ffi`]): every `extern "C"`, declared in `include/session_gate.h`;
//! - the **Python extension** (`python`, behind the `python` feature): `session_gate._native`;
//! - the **proxy** (`proxy` and `cli`, behind the `proxy` feature): `session-gate proxy`;
//! - the **twin** ([`sim`]): a sans-IO model of a vLLM replica that runs the gate in virtual time;
//! - the **baselines** ([`baselines`]): the controllers people deploy today (prime-rl's AIMD
//!   concurrency, ThunderAgent's pausing), sans-IO too, for the benchmark and the twin.
//!
//! The **engine half** is the part that runs inside vLLM's engine core process: the plugin's
//! probes and engine gate (`session_gate.engine` in Python), built on [`hashing`], [`prefix`]
//! and the engine gate's book. Nothing outside `python` and `ffi` knows about Python or C.
#![warn(missing_docs, unreachable_pub)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod baselines;
#[cfg(feature = "proxy")]
pub mod cli;
mod const_eq;
pub mod error;
pub mod ffi;
pub mod gate;
pub mod hashing;
pub mod prefix;
#[cfg(feature = "proxy")]
pub mod proxy;
pub mod sim;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
