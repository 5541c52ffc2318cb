//! The crate's one error type. Every variant names what was wrong, so callers (Python, C, HTTP)
//! can report it without parsing messages.
use thiserror::Error;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in session-gate.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A configuration knob was given a value outside its domain.
    #[error("invalid value for knob `{knob}`: {value} ({why})")]
    InvalidKnob {
        /// The knob's name, e.g. `high_watermark`.
        knob: &'static str,
        /// The rejected value, rendered as text.
        value: String,
        /// What the knob accepts.
        why: &'static str,
    },
    /// A probe argument (prompt, token id, session id) was not acceptable.
    #[error("invalid probe input: {0}")]
    InvalidInput(String),
    /// The prefix-caching hash algorithm is not one vLLM offers.
    #[error(
        "unsupported prefix_caching_hash_algo `{0}` (expected sha256, sha256_cbor, xxhash or xxhash_cbor)"
    )]
    UnsupportedHashAlgo(String),
    /// A probe could not answer (engine side missing, timed out, failed).
    #[error("probe unavailable: {0}")]
    ProbeUnavailable(String),
    /// An admission attempt was superseded by a newer attempt of the same session.
    #[error("admission attempt for session `{session_id}` was preempted by a newer attempt")]
    Preempted {
        /// The session whose older attempt lost.
        session_id: String,
    },
    /// An admission attempt waited longer than the caller allowed.
    #[error("admission for session `{session_id}` timed out after {waited_sec:.3} s")]
    Timeout {
        /// The session that was waiting.
        session_id: String,
        /// How long it waited.
        waited_sec: f64,
    },
    /// A handle (lease, attempt) that is unknown or already used.
    #[error("unknown or stale handle: {0}")]
    StaleHandle(String),
    /// A twin profile (TOML) is malformed or has a value out of range.
    #[error("{file}:{line}: field `{field}`: {why}")]
    InvalidProfile {
        /// The profile's path (or built-in name).
        file: String,
        /// 1-based line of the problem (0 if unknown).
        line: usize,
        /// The field that was wrong, e.g. `cost.step_sec`.
        field: String,
        /// What was wrong with it.
        why: String,
    },
}
