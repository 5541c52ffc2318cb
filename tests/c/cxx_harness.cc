// Scenarios for the C++ wrapper; see cxx_harness.h.
#include "cxx_harness.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "session_gate.hpp"

namespace session_gate {
namespace harness {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kBlocks = 100;
constexpr std::uint64_t kBlockSize = 16;

// A fake engine whose answers the scenario sets: KV usage, prefix hit ratio, or a prefix probe
// that fails (throws, which the wrapper reports as SG_UNAVAILABLE).
class FakeEngine : public Probe {
public:
    void set(double usage, double hit_ratio, bool prefix_ok) {
        std::lock_guard<std::mutex> lock(mu_);
        usage_ = usage;
        hit_ratio_ = hit_ratio;
        prefix_ok_ = prefix_ok;
    }

    Usage usage() override {
        std::lock_guard<std::mutex> lock(mu_);
        Usage u{};
        u.kv_cache_usage = usage_;
        u.num_blocks = kBlocks;
        u.num_free_blocks = kBlocks - static_cast<std::uint64_t>(usage_ * kBlocks);
        u.block_size = kBlockSize;
        return u;
    }

    PrefixReport prefix(std::string_view, const std::uint32_t *, std::size_t prompt_len) override {
        std::lock_guard<std::mutex> lock(mu_);
        if (!prefix_ok_) {
            throw std::runtime_error("engine cannot answer");
        }
        PrefixReport p{};
        p.hit_ratio = hit_ratio_;
        p.prompt_tokens = prompt_len;
        p.hit_tokens = static_cast<std::uint64_t>(hit_ratio_ * static_cast<double>(prompt_len));
        p.hit_blocks = p.hit_tokens / kBlockSize;
        return p;
    }

private:
    std::mutex mu_;
    double usage_ = 0.0;
    double hit_ratio_ = 0.0;
    bool prefix_ok_ = true;
};

// Waits end by wake-ups from releases, not by polling; generous probe timeout for valgrind.
Config test_config() {
    Config c;
    c.wait_poll_sec = 30.0;
    c.probe_timeout_sec = 10.0;
    return c;
}

std::vector<std::uint32_t> prompt(std::size_t blocks) {
    return std::vector<std::uint32_t>(blocks * kBlockSize, 7);
}

void expect(bool ok, const std::string &what) {
    if (!ok) {
        throw std::runtime_error("expectation failed: " + what);
    }
}

void expect_reason(const Lease &lease, sg_reason want) {
    sg_reason got = lease.reason();
    expect(got == want, "reason " + std::string(reason_name(got)) + ", expected " +
                            std::string(reason_name(want)));
}

// Polls `done` every few milliseconds for up to 20 s.
template <class F> void eventually(F done, const std::string &what) {
    auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!done()) {
        expect(std::chrono::steady_clock::now() < deadline, "timed out waiting for " + what);
        std::this_thread::sleep_for(2ms);
    }
}

// Something the gate's thread sets, and a test thread waits for.
class Flag {
public:
    void set() {
        std::lock_guard<std::mutex> lock(mu_);
        set_ = true;
        cv_.notify_all();
    }
    bool wait() {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, 20s, [this] { return set_; });
    }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    bool set_ = false;
};

} // namespace

std::uint32_t admit_every_reason() {
    auto engine = std::make_shared<FakeEngine>();
    Gate gate(engine, test_config());

    // Nothing committed: open. retain_session keeps the reservation as an idle window.
    Lease first = gate.acquire("s1", prompt(10), 16, true);
    expect_reason(first, SG_REASON_OPEN);
    expect(first.session_id() == "s1", "session id of the lease");
    first.release();

    engine->set(0.9, 0.95, true);
    Lease again = gate.acquire("s1", prompt(10), 16, true);
    expect_reason(again, SG_REASON_RESERVED_SESSION);
    Lease resident = gate.acquire("s2", prompt(10), 16);
    expect_reason(resident, SG_REASON_RESIDENT_PREFIX);
    expect(resident.info().has_hit_ratio && resident.info().hit_ratio > 0.9, "hit ratio");

    // The prefix probe cannot answer: committed pressure waits (a miss); engine pressure, the
    // seed's rule, fails open.
    engine->set(0.9, 0.0, false);
    bool waited = false;
    try {
        gate.acquire("s3", prompt(10), 16, false, 50ms);
    } catch (const TimeoutError &) {
        waited = true;
    }
    expect(waited, "an unanswered prefix probe is a miss in committed mode");
    Config seed = test_config();
    seed.pressure = SG_PRESSURE_ENGINE;
    Gate seed_gate(engine, seed);
    Lease blind = seed_gate.acquire("s3", prompt(10), 16);
    expect_reason(blind, SG_REASON_PREFIX_PROBE_UNAVAILABLE);
    again.release();
    resident.release();
    blind.release();

    Stats s = gate.stats();
    expect(s.admissions[SG_REASON_OPEN] == 1 && s.admissions[SG_REASON_RESERVED_SESSION] == 1 &&
               s.admissions[SG_REASON_RESIDENT_PREFIX] == 1 &&
               s.admissions[SG_REASON_PREFIX_PROBE_UNAVAILABLE] == 0 &&
               s.admissions[SG_REASON_OFFLOADED_PREFIX] == 0,
           "admissions by reason in stats");
    expect(seed_gate.stats().admissions[SG_REASON_PREFIX_PROBE_UNAVAILABLE] == 1,
           "engine pressure fails open");
    expect(gate.prometheus().find("session_gate_admissions_total{reason=\"resident_prefix\"} 1") !=
               std::string::npos,
           "prometheus text");
    expect(gate.finish_session("s1"), "s1 had an ownership window");

    // max_wait needs its own knob: a waiter is let in after 50 ms.
    Config patient = test_config();
    patient.has_max_wait = true;
    patient.max_wait_sec = 0.05;
    auto busy = std::make_shared<FakeEngine>();
    Gate bounded(busy, patient);
    Lease holder = bounded.acquire("t1", prompt(10), 16);
    busy->set(0.9, 0.0, true);
    Lease late = bounded.acquire("t2", prompt(10), 16);
    expect_reason(late, SG_REASON_MAX_WAIT);
    expect(late.info().wait_sec >= 0.05, "max_wait waited");
    return 5;
}

double release_from_another_thread() {
    auto engine = std::make_shared<FakeEngine>();
    Gate gate(engine, test_config());
    Lease holder = gate.acquire("holder", prompt(10), 16);
    engine->set(0.9, 0.0, true);
    std::thread releaser([&] {
        std::this_thread::sleep_for(200ms);
        engine->set(0.1, 0.0, true);
        holder.release();
    });
    Lease waiter;
    try {
        waiter = gate.acquire("waiter", prompt(10), 16, false, 20s);
    } catch (...) {
        releaser.join();
        throw;
    }
    releaser.join();
    expect_reason(waiter, SG_REASON_OPEN);
    double waited = waiter.info().wait_sec;
    expect(waited >= 0.15, "the waiter waited for the release, got " + std::to_string(waited));
    return waited;
}

std::uint32_t poll_until_admitted() {
    auto engine = std::make_shared<FakeEngine>();
    Gate gate(engine, test_config());
    Lease holder = gate.acquire("holder", prompt(10), 16);
    engine->set(0.9, 0.0, true);

    Flag woken;
    Attempt attempt = gate.try_acquire("waiter", prompt(10), 16, false, [&] { woken.set(); });
    eventually([&] { return gate.stats().waiting == 1; }, "the attempt to queue");
    std::uint32_t polls = 1;
    expect(!attempt.poll().has_value(), "pending while the cache is full");

    std::thread releaser([&] {
        engine->set(0.1, 0.0, true);
        holder.release();
    });
    releaser.join();
    expect(woken.wait(), "the wake callback fired");
    std::optional<Lease> lease = attempt.poll();
    ++polls;
    expect(lease.has_value(), "admitted after the wake");
    expect_reason(*lease, SG_REASON_OPEN);
    return polls;
}

std::uint32_t preempted_attempt_throws() {
    auto engine = std::make_shared<FakeEngine>();
    Gate gate(engine, test_config());
    Lease holder = gate.acquire("holder", prompt(10), 16);
    engine->set(0.9, 0.0, true);

    Flag first_woken;
    Attempt first = gate.try_acquire("s", prompt(10), 16, false, [&] { first_woken.set(); });
    eventually([&] { return gate.stats().waiting == 1; }, "the first attempt to queue");
    Attempt second = gate.try_acquire("s", prompt(11), 16);
    expect(first_woken.wait(), "the preempted attempt was woken");
    std::uint32_t preempted = 0;
    try {
        first.poll();
    } catch (const PreemptedError &e) {
        expect(e.status() == SG_PREEMPTED, "PreemptedError carries SG_PREEMPTED");
        preempted = 1;
    }
    eventually([&] { return gate.stats().preemptions == 1; }, "the preemption to count");
    return preempted;
}

void create_gate(double high_watermark) {
    Config c = test_config();
    c.high_watermark = high_watermark;
    Gate gate(std::make_shared<FakeEngine>(), c);
}

void acquire_on_moved_from_gate() {
    Gate gate(std::make_shared<FakeEngine>(), test_config());
    Gate moved = std::move(gate);
    gate.acquire("s", prompt(1), 16);
}

void acquire_under_pressure(std::int64_t timeout_ms) {
    auto engine = std::make_shared<FakeEngine>();
    Gate gate(engine, test_config());
    Lease holder = gate.acquire("holder", prompt(10), 16);
    engine->set(0.9, 0.0, true);
    gate.acquire("waiter", prompt(10), 16, false, std::chrono::milliseconds(timeout_ms));
}

std::int32_t second_release_status() {
    Gate gate(std::make_shared<FakeEngine>(), test_config());
    Lease lease = gate.acquire("s", prompt(1), 16);
    lease.release();
    try {
        lease.release();
    } catch (const Error &e) {
        return e.status();
    }
    return SG_OK;
}

} // namespace harness
} // namespace session_gate
