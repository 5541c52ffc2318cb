//! The C ABI: every `extern "C"` function of the crate, declared in `include/session_gate.h`.
//!
//! The header is the source of truth and is written by hand. build.rs runs bindgen over it into
//! [`sys`]; the exports here take and return those generated types, and [`abi_check`] proves at
//! compile time that each exported function has exactly the signature the header declares.
//!
//! Every export runs inside [`status::guard`]: null pointers and bad arguments become documented
//! status codes with a message for `sg_last_error`, and panics are caught instead of unwinding
//! into C. Handles are boxes handed out as opaque pointers: `sg_gate` owns a [`Gate`] and the
//! tokio runtime that drives it, `sg_lease` a [`Lease`], `sg_attempt` a spawned acquire.
//!
//! Rust code can call the exports directly (`session_gate::ffi::sg_gate_create`), with the
//! types from [`sys`]; the integration tests do.
//!
//! [`Gate`]: crate::gate::Gate
//! [`Lease`]: crate::gate::Lease
mod abi_check;
mod attempt;
mod config;
mod gate_handle;
mod lease;
mod meta;
mod probe;
mod status;
pub mod sys;

pub use self::attempt::{sg_attempt_destroy, sg_attempt_poll, sg_gate_try_acquire};
pub use self::config::{sg_config_default, sg_config_from_env, sg_config_validate};
pub use self::gate_handle::{
    sg_gate_acquire, sg_gate_create, sg_gate_destroy, sg_gate_finish_session, sg_gate_prometheus,
    sg_gate_stats, sg_string_free,
};
pub use self::lease::{sg_lease_destroy, sg_lease_get_info, sg_lease_release, sg_lease_session_id};
pub use self::meta::{sg_last_error, sg_reason_name, sg_status_name, sg_version};

/// Names of the functions the header declares (read off it by build.rs).
pub fn header_functions() -> &'static [&'static str] {
    abi_check::HEADER_FUNCTIONS
}
