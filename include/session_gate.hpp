// session_gate.hpp — C++17 wrapper over the C ABI in session_gate.h.
//
// Header-only: link against the same library as C callers (libsession_gate.so). RAII handles
// (`Gate`, `Lease`, `Attempt`) destroy themselves; every status other than SG_OK (and SG_PENDING
// where polling) is thrown as `session_gate::Error` or one of its subclasses, carrying the
// status code and the library's message. Thread rules are the header's: a `Gate` may be shared
// between threads, a `Lease` may be released from any thread, and `Probe` methods are called
// from the gate's own threads, possibly concurrently.
#ifndef SESSION_GATE_HPP
#define SESSION_GATE_HPP

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "session_gate.h"

namespace session_gate {

// ---- errors ---------------------------------------------------------------------------------

/// A failed call: `status()` is the C status code, `what()` its name and the library's message.
class Error : public std::runtime_error {
public:
    Error(sg_status status, const std::string &what) : std::runtime_error(what), status_(status) {}
    sg_status status() const noexcept { return status_; }

private:
    sg_status status_;
};

/// SG_INVALID_CONFIG: a knob out of its domain (the message names it).
class ConfigError : public Error {
public:
    using Error::Error;
};

/// SG_TIMEOUT: a blocking acquire gave up; its attempt was cancelled.
class TimeoutError : public Error {
public:
    using Error::Error;
};

/// SG_PREEMPTED: a newer acquire of the same session took over.
class PreemptedError : public Error {
public:
    using Error::Error;
};

namespace detail {

/// This thread's last error message (see sg_last_error).
inline std::string last_error() {
    std::size_t len = 0;
    sg_last_error(nullptr, 0, &len);
    std::string text(len + 1, '\0');
    if (sg_last_error(text.data(), text.size(), &len) != SG_OK) {
        return {};
    }
    text.resize(len);
    return text;
}

[[noreturn]] inline void throw_status(sg_status status) {
    const char *name = sg_status_name(status);
    std::string what = std::string(name ? name : "SG_UNKNOWN") + ": " + last_error();
    switch (status) {
    case SG_INVALID_CONFIG:
        throw ConfigError(status, what);
    case SG_TIMEOUT:
        throw TimeoutError(status, what);
    case SG_PREEMPTED:
        throw PreemptedError(status, what);
    default:
        throw Error(status, what);
    }
}

inline void check(sg_status status) {
    if (status != SG_OK) {
        throw_status(status);
    }
}

inline sg_request request(std::string_view session_id, const std::uint32_t *prompt_ids,
                          std::size_t prompt_len, std::size_t max_tokens, bool retain_session) {
    sg_request r{};
    r.session_id = session_id.data();
    r.session_id_len = session_id.size();
    r.prompt_ids = prompt_ids;
    r.prompt_len = prompt_len;
    r.max_tokens = max_tokens;
    r.retain_session = retain_session;
    return r;
}

} // namespace detail

// ---- plain values ---------------------------------------------------------------------------

using Usage = sg_usage;
using PrefixReport = sg_prefix;
using Stats = sg_stats;
using LeaseInfo = sg_lease_info;

/// The name of a reason, e.g. "resident_prefix".
inline std::string_view reason_name(sg_reason reason) {
    const char *name = sg_reason_name(reason);
    return name ? std::string_view(name) : std::string_view("unknown");
}

/// The knobs, starting from their defaults; set fields directly.
struct Config : sg_config {
    Config() : sg_config(sg_config_default()) {}

    /// Defaults overridden by SESSION_GATE_* variables; throws ConfigError.
    static Config from_env() {
        Config c;
        detail::check(sg_config_from_env(&c));
        return c;
    }

    /// Throws ConfigError naming the first knob out of its domain.
    void validate() const { detail::check(sg_config_validate(this)); }
};

// ---- probe ----------------------------------------------------------------------------------

/// The engine's two residency probes. Implementations are called from the gate's threads,
/// possibly concurrently. Throwing from a method means "unavailable".
class Probe {
public:
    virtual ~Probe() = default;
    virtual Usage usage() = 0;
    virtual PrefixReport prefix(std::string_view session_id, const std::uint32_t *prompt_ids,
                                std::size_t prompt_len) = 0;
    virtual void forget(std::string_view session_id) { (void)session_id; }
};

namespace detail {

// Trampolines from the C callbacks to a `Probe`: exceptions must not cross into the library.
inline sg_status probe_usage(void *self, sg_usage *out) {
    try {
        *out = static_cast<Probe *>(self)->usage();
        return SG_OK;
    } catch (...) {
        return SG_UNAVAILABLE;
    }
}

inline sg_status probe_prefix(void *self, const char *session_id, std::size_t session_id_len,
                              const std::uint32_t *prompt_ids, std::size_t prompt_len,
                              sg_prefix *out) {
    try {
        *out = static_cast<Probe *>(self)->prefix(std::string_view(session_id, session_id_len),
                                                  prompt_ids, prompt_len);
        return SG_OK;
    } catch (...) {
        return SG_UNAVAILABLE;
    }
}

inline sg_status probe_forget(void *self, const char *session_id, std::size_t session_id_len) {
    try {
        static_cast<Probe *>(self)->forget(std::string_view(session_id, session_id_len));
        return SG_OK;
    } catch (...) {
        return SG_UNAVAILABLE;
    }
}

inline void call_wake(void *fn) {
    try {
        (*static_cast<std::function<void()> *>(fn))();
    } catch (...) {
        // A wake that throws is the caller's bug; it must not unwind into the library.
    }
}

} // namespace detail

// ---- lease ----------------------------------------------------------------------------------

/// One admission. Release it when the engine's answer is complete; destroying an unreleased
/// lease releases it (counted as dropped unreleased).
class Lease {
public:
    Lease() noexcept = default;
    explicit Lease(sg_lease *handle) noexcept : handle_(handle) {}
    Lease(Lease &&other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
    Lease &operator=(Lease &&other) noexcept {
        if (this != &other) {
            reset();
            handle_ = std::exchange(other.handle_, nullptr);
        }
        return *this;
    }
    Lease(const Lease &) = delete;
    Lease &operator=(const Lease &) = delete;
    ~Lease() { reset(); }

    explicit operator bool() const noexcept { return handle_ != nullptr; }

    /// Lets the next waiter through. Throws Error(SG_STALE) if released already.
    void release() { detail::check(sg_lease_release(handle_)); }

    LeaseInfo info() const {
        LeaseInfo info{};
        detail::check(sg_lease_get_info(handle_, &info));
        return info;
    }

    sg_reason reason() const { return info().reason; }

    std::string_view session_id() const {
        const char *ptr = nullptr;
        std::size_t len = 0;
        detail::check(sg_lease_session_id(handle_, &ptr, &len));
        return std::string_view(ptr, len);
    }

    sg_lease *get() const noexcept { return handle_; }

private:
    void reset() noexcept {
        if (handle_) {
            sg_lease_destroy(handle_);
            handle_ = nullptr;
        }
    }

    sg_lease *handle_ = nullptr;
};

// ---- attempt --------------------------------------------------------------------------------

/// A non-blocking acquire (Gate::try_acquire). Destroying a pending attempt cancels it.
class Attempt {
public:
    Attempt(sg_attempt *handle, std::unique_ptr<std::function<void()>> wake) noexcept
        : handle_(handle), wake_(std::move(wake)) {}
    Attempt(Attempt &&other) noexcept
        : handle_(std::exchange(other.handle_, nullptr)), wake_(std::move(other.wake_)) {}
    Attempt &operator=(Attempt &&other) noexcept {
        if (this != &other) {
            reset();
            handle_ = std::exchange(other.handle_, nullptr);
            wake_ = std::move(other.wake_);
        }
        return *this;
    }
    Attempt(const Attempt &) = delete;
    Attempt &operator=(const Attempt &) = delete;
    ~Attempt() { reset(); }

    /// The lease once admitted, std::nullopt while pending. Throws PreemptedError, or
    /// Error(SG_CLOSED) if the gate was destroyed, or Error(SG_STALE) once used up.
    std::optional<Lease> poll() {
        sg_lease *lease = nullptr;
        sg_status status = sg_attempt_poll(handle_, &lease);
        if (status == SG_PENDING) {
            return std::nullopt;
        }
        detail::check(status);
        return Lease(lease);
    }

private:
    void reset() noexcept {
        // Destroy first: after it returns the wake function is not running and never will be.
        if (handle_) {
            sg_attempt_destroy(handle_);
            handle_ = nullptr;
        }
        wake_.reset();
    }

    sg_attempt *handle_ = nullptr;
    std::unique_ptr<std::function<void()>> wake_;
};

// ---- gate -----------------------------------------------------------------------------------

/// A gate over a `Probe`. Thread-safe; move-only. The probe is kept alive by the gate.
class Gate {
public:
    explicit Gate(std::shared_ptr<Probe> probe, const Config &config = Config())
        : probe_(std::move(probe)) {
        if (!probe_) {
            throw Error(SG_NULL_POINTER, "SG_NULL_POINTER: probe is null");
        }
        sg_probe p{};
        p.usage = &detail::probe_usage;
        p.prefix = &detail::probe_prefix;
        p.forget = &detail::probe_forget;
        p.user_data = probe_.get();
        detail::check(sg_gate_create(&config, &p, &handle_));
    }
    Gate(Gate &&other) noexcept
        : probe_(std::move(other.probe_)), handle_(std::exchange(other.handle_, nullptr)) {}
    Gate &operator=(Gate &&other) noexcept {
        if (this != &other) {
            reset();
            probe_ = std::move(other.probe_);
            handle_ = std::exchange(other.handle_, nullptr);
        }
        return *this;
    }
    Gate(const Gate &) = delete;
    Gate &operator=(const Gate &) = delete;
    ~Gate() { reset(); }

    /// Blocks until this turn may go to the engine. `timeout` unset = wait forever. Throws
    /// TimeoutError, PreemptedError, or Error (e.g. SG_NULL_POINTER on a moved-from gate).
    /// `max_tokens` defaults to `SG_MAX_TOKENS_DEFAULT` (the config's `default_max_tokens`).
    Lease acquire(std::string_view session_id, const std::vector<std::uint32_t> &prompt_ids,
                  std::size_t max_tokens = SG_MAX_TOKENS_DEFAULT, bool retain_session = false,
                  std::optional<std::chrono::milliseconds> timeout = std::nullopt) const {
        sg_request r = detail::request(session_id, prompt_ids.data(), prompt_ids.size(),
                                       max_tokens, retain_session);
        sg_lease *lease = nullptr;
        std::int64_t ms = timeout ? static_cast<std::int64_t>(timeout->count()) : SG_WAIT_FOREVER;
        detail::check(sg_gate_acquire(handle_, &r, ms, &lease));
        return Lease(lease);
    }

    /// Starts an attempt without blocking; `wake` (optional) is called once from a gate thread
    /// when `Attempt::poll` has an answer.
    Attempt try_acquire(std::string_view session_id, const std::vector<std::uint32_t> &prompt_ids,
                        std::size_t max_tokens = SG_MAX_TOKENS_DEFAULT,
                        bool retain_session = false,
                        std::function<void()> wake = {}) const {
        sg_request r = detail::request(session_id, prompt_ids.data(), prompt_ids.size(),
                                       max_tokens, retain_session);
        std::unique_ptr<std::function<void()>> fn;
        if (wake) {
            fn = std::make_unique<std::function<void()>>(std::move(wake));
        }
        sg_attempt *attempt = nullptr;
        detail::check(sg_gate_try_acquire(handle_, &r, fn ? &detail::call_wake : nullptr,
                                          fn.get(), &attempt));
        return Attempt(attempt, std::move(fn));
    }

    /// Ends the session's ownership window; true if one was open.
    bool finish_session(std::string_view session_id) const {
        bool ended = false;
        detail::check(
            sg_gate_finish_session(handle_, session_id.data(), session_id.size(), &ended));
        return ended;
    }

    Stats stats() const {
        Stats s{};
        detail::check(sg_gate_stats(handle_, &s));
        return s;
    }

    /// Prometheus text exposition.
    std::string prometheus() const {
        char *text = nullptr;
        std::size_t len = 0;
        detail::check(sg_gate_prometheus(handle_, &text, &len));
        std::unique_ptr<char, void (*)(char *)> owned(text, [](char *t) { sg_string_free(t); });
        return std::string(owned.get(), len);
    }

    sg_gate *get() const noexcept { return handle_; }

private:
    void reset() noexcept {
        // Destroy first: it waits for running callbacks, which use the probe.
        if (handle_) {
            sg_gate_destroy(handle_);
            handle_ = nullptr;
        }
        probe_.reset();
    }

    std::shared_ptr<Probe> probe_;
    sg_gate *handle_ = nullptr;
};

} // namespace session_gate

#endif // SESSION_GATE_HPP
