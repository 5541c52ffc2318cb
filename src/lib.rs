//! session-gate: a session-level admission gate for agentic rollouts on vLLM.
//!
//! The crate has two halves that share nothing but names:
//! - the **engine half** ([`hashing`], [`prefix`]): vLLM-exact block hashing and the per-session
//!   hash-chain cache behind the residency probes that run inside vLLM's engine core;
//! - the **gate** ([`gate`]): a sans-IO admission state machine plus its tokio driver;
//! - the **twin** ([`sim`]): a sans-IO model of a vLLM replica that runs the gate in virtual time.
//!
//! Beside the gate, [`baselines`] holds the controllers people deploy today (prime-rl's AIMD
//! concurrency, ThunderAgent's pausing), sans-IO too, for the benchmark and the twin.
//!
//! Bindings live in their own folders: `python` (PyO3, behind the `python` feature) and `ffi`
//! (every `extern "C"`). Nothing outside those folders knows about Python or C.
#![warn(missing_docs, unreachable_pub)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod baselines;
#[cfg(feature = "proxy")]
pub mod cli;
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
