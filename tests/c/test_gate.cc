// The C++ wrapper as a C++ proxy would use it: a plain program linked against the shared
// library, running the scenarios of cxx_harness.cc (which tests/ffi_cxx.rs also runs via cxx)
// and checking which exceptions come out.
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <string>

#include "cxx_harness.h"
#include "session_gate.hpp"

namespace h = session_gate::harness;

static int passed = 0;
static int failed = 0;

static void check(const char *name, const std::function<bool()> &body) {
    bool ok = false;
    try {
        ok = body();
    } catch (const std::exception &e) {
        std::fprintf(stderr, "  %s threw: %s\n", name, e.what());
    }
    std::printf("%s - %s\n", ok ? "ok" : "FAIL", name);
    (ok ? passed : failed)++;
}

// True when `body` throws an E whose status is `status`.
template <class E> static bool throws(sg_status status, const std::function<void()> &body) {
    try {
        body();
    } catch (const E &e) {
        return e.status() == status;
    }
    return false;
}

int main() {
    check("every reason", [] { return h::admit_every_reason() == 5; });
    check("release from another thread", [] { return h::release_from_another_thread() >= 0.15; });
    check("try/poll with wake", [] { return h::poll_until_admitted() == 2; });
    check("preempted attempt", [] { return h::preempted_attempt_throws() == 1; });
    check("valid config", [] {
        h::create_gate(0.85);
        return true;
    });
    check("NaN watermark -> ConfigError", [] {
        return throws<session_gate::ConfigError>(
            SG_INVALID_CONFIG, [] { h::create_gate(std::numeric_limits<double>::quiet_NaN()); });
    });
    check("null gate -> Error(SG_NULL_POINTER)", [] {
        return throws<session_gate::Error>(SG_NULL_POINTER,
                                           [] { h::acquire_on_moved_from_gate(); });
    });
    check("timeout -> TimeoutError", [] {
        return throws<session_gate::TimeoutError>(SG_TIMEOUT,
                                                  [] { h::acquire_under_pressure(50); });
    });
    check("second release -> SG_STALE", [] { return h::second_release_status() == SG_STALE; });
    check("config validate", [] {
        session_gate::Config c;
        c.pressure = 7;
        return throws<session_gate::ConfigError>(SG_INVALID_CONFIG, [&] { c.validate(); });
    });
    std::printf("cpp: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
