//! The C++ wrapper (`include/session_gate.hpp`) driven from Rust through a cxx bridge: the
//! scenarios in `tests/c/cxx_harness.cc` run against the real gate, and the wrapper's C++
//! exceptions arrive here as `cxx::Exception`s, so the status-code-to-exception mapping is
//! checked by `cargo test` (build.rs compiles the C++ side with cxx-build).
use session_gate::ffi::sys;

#[cxx::bridge(namespace = "session_gate::harness")]
mod harness {
    unsafe extern "C++" {
        include!("session-gate/tests/c/cxx_harness.h");

        fn admit_every_reason() -> Result<u32>;
        fn release_from_another_thread() -> Result<f64>;
        fn poll_until_admitted() -> Result<u32>;
        fn preempted_attempt_throws() -> Result<u32>;
        fn create_gate(high_watermark: f64) -> Result<()>;
        fn acquire_on_moved_from_gate() -> Result<()>;
        fn acquire_under_pressure(timeout_ms: i64) -> Result<()>;
        fn second_release_status() -> Result<i32>;
    }
}

/// The C++ exception's `what()`, or a panic if the scenario succeeded.
fn what(r: Result<(), cxx::Exception>) -> String {
    r.expect_err("the wrapper should have thrown")
        .what()
        .to_string()
}

#[test]
fn every_reason_is_reachable_through_the_wrapper() {
    assert_eq!(harness::admit_every_reason().unwrap(), 5);
}

#[test]
fn a_release_on_another_thread_admits_the_waiter() {
    let waited = harness::release_from_another_thread().unwrap();
    assert!(waited >= 0.15, "waited {waited}");
}

#[test]
fn try_acquire_is_pending_until_the_wake_then_admitted() {
    assert_eq!(harness::poll_until_admitted().unwrap(), 2);
}

#[test]
fn a_preempted_attempt_throws_preempted_error() {
    assert_eq!(harness::preempted_attempt_throws().unwrap(), 1);
}

#[test]
fn an_invalid_knob_throws_config_error_naming_it() {
    harness::create_gate(0.85).unwrap();
    let msg = what(harness::create_gate(f64::NAN));
    assert!(msg.starts_with("SG_INVALID_CONFIG: "), "{msg}");
    assert!(
        msg.contains("high_watermark") && msg.contains("NaN"),
        "{msg}"
    );
    let msg = what(harness::create_gate(1.5));
    assert!(
        msg.contains("high_watermark") && msg.contains("1.5"),
        "{msg}"
    );
}

#[test]
fn a_moved_from_gate_throws_null_pointer() {
    let msg = what(harness::acquire_on_moved_from_gate());
    assert!(msg.starts_with("SG_NULL_POINTER: "), "{msg}");
    assert!(msg.contains("`gate` is NULL"), "{msg}");
}

#[test]
fn a_timed_out_acquire_throws_timeout_error() {
    let msg = what(harness::acquire_under_pressure(50));
    assert!(msg.starts_with("SG_TIMEOUT: "), "{msg}");
}

#[test]
fn a_second_release_throws_stale() {
    assert_eq!(harness::second_release_status().unwrap(), sys::SG_STALE);
}
