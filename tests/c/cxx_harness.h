// Scenarios that drive the C++ wrapper (include/session_gate.hpp) against a fake engine.
//
// Shared by two callers: tests/ffi_cxx.rs calls them through a cxx bridge (so `cargo test` sees
// the wrapper's exceptions as Rust errors), and tests/c/test_gate.cc calls them from a plain
// C++ program linked against the shared library. Only primitive types cross, so this header
// needs neither cxx nor Rust. Each scenario throws std::runtime_error on a wrong result; the
// wrapper's own exceptions (session_gate::Error and subclasses) pass through unchanged.
#ifndef SESSION_GATE_CXX_HARNESS_H
#define SESSION_GATE_CXX_HARNESS_H

#include <cstdint>

namespace session_gate {
namespace harness {

// Drives one gate through open, reserved_session, resident_prefix and a miss on an unanswered
// prefix probe, prefix_probe_unavailable on an engine-pressure gate, then max_wait on another
// gate; returns the number of admissions checked.
std::uint32_t admit_every_reason();

// A turn waits under pressure until another thread releases a lease; returns its wait_sec.
double release_from_another_thread();

// The try/poll pair: pending, a wake from the gate's thread, then admitted; returns the polls.
std::uint32_t poll_until_admitted();

// A newer try_acquire of the same session preempts the pending one; returns 1 when the older
// attempt's poll threw PreemptedError.
std::uint32_t preempted_attempt_throws();

// Creates a gate whose high_watermark is the argument (throws ConfigError when invalid).
void create_gate(double high_watermark);

// Calls acquire on a moved-from gate (throws Error with SG_NULL_POINTER).
void acquire_on_moved_from_gate();

// Acquires under pressure with this timeout (throws TimeoutError).
void acquire_under_pressure(std::int64_t timeout_ms);

// Releases a lease twice; returns the status carried by the second release's exception.
std::int32_t second_release_status();

} // namespace harness
} // namespace session_gate

#endif // SESSION_GATE_CXX_HARNESS_H
