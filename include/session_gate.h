/*
 * session_gate.h — C ABI of session-gate, a session-level admission gate for agentic rollouts
 * on vLLM. A C++ wrapper (RAII, exceptions) is in session_gate.hpp beside this file.
 *
 * This header is committed and hand-written. The Rust exports are checked against it at build
 * time: build.rs runs bindgen over this file and src/ffi/ unifies every declaration below with
 * the Rust function of the same name, so a signature that drifts fails `cargo build`.
 *
 * ## Conventions
 *
 * - Every function returns an `sg_status` (except the few that return a constant string or a
 *   struct by value, which cannot fail). `SG_OK` is success; everything else is documented at
 *   the code. After a failure, `sg_last_error()` gives a human-readable message for it.
 * - Every function checks its pointer arguments (`SG_NULL_POINTER`) and catches Rust panics
 *   (`SG_PANIC`): nothing unwinds into the caller.
 * - Strings passed in are UTF-8 with an explicit length (`ptr`, `len`); they need not be
 *   NUL-terminated. A NULL `ptr` is accepted only with `len == 0`. Invalid UTF-8 gives
 *   `SG_INVALID_ARGUMENT`.
 * - Nothing allocated on one side is freed on the other: every handle has its `_destroy`, and
 *   text the library allocates (`sg_gate_prometheus`) is freed with `sg_string_free`. Constant
 *   strings (`sg_version`, `sg_status_name`, `sg_reason_name`) are static and never freed.
 * - Out-parameters are written only on `SG_OK` unless a function says otherwise.
 *
 * ## Threads
 *
 * - An `sg_gate` is thread-safe: any number of threads may call `sg_gate_*` functions on it at
 *   once, except `sg_gate_destroy`, which must be the last call on it. It owns a small tokio
 *   runtime: one worker thread, plus a pool of threads on which the probe callbacks run.
 * - Probe callbacks (`sg_probe`) and wake callbacks (`sg_wake_fn`) are called from the gate's
 *   own threads, possibly several at a time: probe callbacks on a pool of threads that only
 *   run callbacks, so a slow one does not hold up the gate. They must be thread-safe and must
 *   not call a blocking function (`sg_gate_acquire`, `sg_gate_finish_session`,
 *   `sg_gate_destroy` answer `SG_WRONG_THREAD` there). C++ exceptions must not escape a
 *   callback.
 * - An `sg_lease` or `sg_attempt` may be used from any thread, including another thread than the
 *   one that obtained it (releasing from a worker thread is the normal case). Calls on the same
 *   handle are serialized internally, except `_destroy`, which must be the last call on it.
 * - Leases and attempts may outlive their gate: releasing or destroying a lease after
 *   `sg_gate_destroy` is harmless, and a pending attempt then answers `SG_CLOSED`.
 */
#ifndef SESSION_GATE_H
#define SESSION_GATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- version -------------------------------------------------------------------------------- */

/** Version of this header; `sg_version()` gives the loaded library's (they should match). */
#define SG_VERSION_MAJOR 0
#define SG_VERSION_MINOR 1
#define SG_VERSION_PATCH 0
#define SG_VERSION "0.1.0"

/** The loaded library's version, e.g. "0.1.0": static, NUL-terminated, never freed. */
const char *sg_version(void);

/* ---- status codes --------------------------------------------------------------------------- */

/** What every function returns. */
typedef int32_t sg_status;

/** Success. */
#define SG_OK 0
/** `sg_attempt_poll`: not decided yet; poll again after the wake callback fires. */
#define SG_PENDING 1
/** A required pointer argument (or a required callback) was NULL. */
#define SG_NULL_POINTER 2
/** An argument was not acceptable: invalid UTF-8, a negative timeout other than
 * `SG_WAIT_FOREVER`. */
#define SG_INVALID_ARGUMENT 3
/** A knob of `sg_config` (or a `SESSION_GATE_*` variable) was out of its domain: NaN, a fraction
 * outside 0..1, negative seconds, an unknown pressure. The message names the knob and value. */
#define SG_INVALID_CONFIG 4
/** `sg_gate_acquire` gave up after its timeout; the attempt was cancelled (it left the queue). */
#define SG_TIMEOUT 5
/** A newer acquire of the same session took over this pending attempt; it is over. */
#define SG_PREEMPTED 6
/** The handle was used up already: a lease released twice, an attempt polled after it ended. */
#define SG_STALE 7
/** `sg_last_error`: the buffer cannot hold the message and its NUL; see `*out_len`. */
#define SG_BUFFER_TOO_SMALL 8
/** A blocking function was called from one of the gate's own threads (inside a callback),
 * where it would deadlock. Nothing was done. */
#define SG_WRONG_THREAD 9
/** The gate was destroyed while this attempt was pending. */
#define SG_CLOSED 10
/** For probe callbacks to return: the engine could not answer. A failed prefix probe is a
 * miss in committed mode (the attempt waits and probes again) and fails open in engine mode
 * (`prefix_probe_unavailable`); a failed usage probe leaves the decision to the committed set. */
#define SG_UNAVAILABLE 11
/** A bug: Rust code panicked. The panic was caught; the message says where. */
#define SG_PANIC 12
/** The library could not do what was asked for a reason outside the caller's control (e.g. the
 * runtime's threads could not be started). */
#define SG_INTERNAL 13

/** The name of a status code, e.g. "SG_TIMEOUT": static, NUL-terminated; NULL if unknown. */
const char *sg_status_name(sg_status status);

/**
 * The message of the most recent failing call (one that returned neither `SG_OK` nor
 * `SG_PENDING`) made on this thread; empty if there was none. Successful calls do not clear it.
 *
 * `*out_len` is always set to the message length in bytes, without a terminating NUL. If
 * `buf_len > *out_len` the message and a NUL are copied into `buf` and `SG_OK` is returned;
 * otherwise nothing is copied and `SG_BUFFER_TOO_SMALL` is returned (call again with a buffer of
 * `*out_len + 1` bytes). `buf` may be NULL when `buf_len` is 0. This call never replaces the
 * stored message. Returns `SG_NULL_POINTER` if `out_len` is NULL, or `buf` is NULL with
 * `buf_len > 0`.
 */
sg_status sg_last_error(char *buf, size_t buf_len, size_t *out_len);

/* ---- reasons, pressure, probe kinds --------------------------------------------------------- */

/** Why an attempt was admitted (the gate's decision tree, plus `max_wait`). */
typedef int32_t sg_reason;
/** No pressure, or nothing committed. */
#define SG_REASON_OPEN 0
/** Under pressure, but the session owns a reservation. */
#define SG_REASON_RESERVED_SESSION 1
/** Engine pressure only: under pressure and the prefix probe could not answer, fail open
 * (committed pressure counts that as a miss and waits). */
#define SG_REASON_PREFIX_PROBE_UNAVAILABLE 2
/** Under pressure and the session's prefix is resident (hit_ratio >= hit_threshold). */
#define SG_REASON_RESIDENT_PREFIX 3
/** The attempt waited `max_wait_sec`. */
#define SG_REASON_MAX_WAIT 4
/** Under pressure; the GPU-resident plus host-tier prefix tokens (`sg_prefix.offloaded_tokens`)
 * reach hit_threshold (it reloads instead of being recomputed), and its working set fits the
 * whole cache. */
#define SG_REASON_OFFLOADED_PREFIX 5
/** Number of reasons; `sg_stats.admissions` is indexed by `sg_reason`. */
#define SG_REASON_COUNT 6

/** The label of a reason, e.g. "resident_prefix": static, NUL-terminated; NULL if unknown. */
const char *sg_reason_name(sg_reason reason);

/** What the high watermark is compared with. */
typedef int32_t sg_pressure;
/** Committed working sets of reserved sessions, with age order and revocation (default). */
#define SG_PRESSURE_COMMITTED 0
/** The original design's rule, literally: vLLM's KV usage only. */
#define SG_PRESSURE_ENGINE 1

/** Index of a probe kind in `sg_stats.probe_calls` / `probe_failures`. */
#define SG_PROBE_USAGE 0
#define SG_PROBE_PREFIX 1
#define SG_PROBE_FORGET 2
#define SG_PROBE_KIND_COUNT 3

/* ---- configuration -------------------------------------------------------------------------- */

/** Every knob of the gate. Start from `sg_config_default()` and change what you need. Each field
 * is a row of the knob table in src/gate/knobs.rs (tests/knobs.rs holds this struct to it). */
typedef struct sg_config {
    /** Fraction of KV blocks above which the gate is under pressure. 0..1, default 0.85. */
    double high_watermark;
    /** Minimum prefix hit ratio for a `resident_prefix` admission. 0..1, default 0.8. */
    double hit_threshold;
    /** How long a waiter sleeps before looking again when nobody wakes it. > 0 s, default 5. */
    double wait_poll_sec;
    /** How long a released `retain_session` reservation stays as an idle grace window.
     * >= 0 s, default 60. With committed pressure, after half of it (or 8 of the session's
     * mean turn times, if longer) the window may yield its room to the head of the queue. */
    double idle_grace_sec;
    /** `SG_PRESSURE_COMMITTED` (default committed) or `SG_PRESSURE_ENGINE`. */
    sg_pressure pressure;
    /** Whether `max_wait_sec` applies; false by default. */
    bool has_max_wait;
    /** Past this wait an attempt is admitted with reason `max_wait`. >= 0 s, default never
     * (`has_max_wait` false). */
    double max_wait_sec;
    /** A probe callback that has not answered after this long counts as unavailable (a
     * prefix probe is then a miss, or `prefix_probe_unavailable` with engine pressure).
     * > 0 s, default 2. */
    double probe_timeout_sec;
    /** Output tokens a turn's working set counts when its request says
     * `SG_MAX_TOKENS_DEFAULT` (an acquire without `max_tokens`). Default 256. */
    size_t default_max_tokens;
    /** While the engine reports nothing running or waiting (`sg_usage.has_num_reqs`), a
     * session's idle room may yield to the queue's head after this many of its own mean turn
     * times; 0 = never early. Default 4. */
    size_t idle_engine_turns;
} sg_config;

/** Every knob at its default. */
sg_config sg_config_default(void);

/** The defaults overridden by the process environment: `SESSION_GATE_HIGH_WATERMARK`,
 * `SESSION_GATE_HIT_THRESHOLD`, `SESSION_GATE_WAIT_POLL_SEC`, `SESSION_GATE_IDLE_GRACE_SEC`,
 * `SESSION_GATE_PRESSURE` (committed | engine), `SESSION_GATE_MAX_WAIT_SEC` (seconds, or
 * none | off), `SESSION_GATE_PROBE_TIMEOUT_SEC`, `SESSION_GATE_DEFAULT_MAX_TOKENS`,
 * `SESSION_GATE_IDLE_ENGINE_TURNS`; blank ones are ignored.
 * `SG_INVALID_CONFIG` (and `*out` untouched) if a variable is malformed or out of range. */
sg_status sg_config_from_env(sg_config *out);

/** `SG_OK` if every knob is in its domain, else `SG_INVALID_CONFIG` (message: which knob, which
 * value). `sg_gate_create` checks the same. */
sg_status sg_config_validate(const sg_config *config);

/* ---- probes (caller-supplied callbacks) ----------------------------------------------------- */

/** The engine's answer to `session_gate_usage` (same fields). */
typedef struct sg_usage {
    /** vLLM's `BlockPool.get_usage()`: used fraction, free-but-cached blocks counted as free. */
    double kv_cache_usage;
    /** Total KV blocks (must be > 0). */
    uint64_t num_blocks;
    /** Free blocks, cached or not. */
    uint64_t num_free_blocks;
    /** Free blocks that still hold a cached prefix, when `has_num_cached_free_blocks`. The
     * engine counts them only when asked (`session_gate_usage(count_cached_free=True)`), since
     * that visits every block; the gate never decides on them, so leave the flag false. */
    bool has_num_cached_free_blocks;
    uint64_t num_cached_free_blocks;
    /** Tokens per block (must be > 0). */
    uint64_t block_size;
    /** Whether the engine has a host KV tier it can read (vLLM's offloading connector); when
     * false (no tier, or one in another process) the two figures below are ignored. */
    bool has_offload_blocks;
    /** The host tier's capacity, in GPU blocks. */
    uint64_t offload_num_blocks;
    /** GPU blocks' worth of KV the host tier holds now. */
    uint64_t offload_used_blocks;
    /** Whether the two counts below are reported; when false the gate never sees the engine
     * as idle (idle rooms then yield on the usual schedule, see `sg_stats.idle_engine_yields`). */
    bool has_num_reqs;
    /** Requests the engine's scheduler is running now. */
    uint64_t num_running_reqs;
    /** Requests waiting to be scheduled (not counting any the engine gate holds back). */
    uint64_t num_waiting_reqs;
} sg_usage;

/** The engine's answer to `session_gate_probe` (same fields). */
typedef struct sg_prefix {
    /** Tokens vLLM would report as cached for this prompt / prompt tokens. 0..1. */
    double hit_ratio;
    /** Leading blocks of the prompt found in the cache. */
    uint64_t hit_blocks;
    /** hit_blocks * block_size, capped at the prompt length. */
    uint64_t hit_tokens;
    /** Prompt length the engine saw. */
    uint64_t prompt_tokens;
    /** Whether the engine could read its host KV tier; when false `offloaded_tokens` is
     * ignored (the gate then decides on GPU residency alone). */
    bool has_offloaded_tokens;
    /** Tokens after `hit_tokens` that the host KV tier holds for this prompt and would load. */
    uint64_t offloaded_tokens;
} sg_prefix;

/** Fills `*out` (zeroed beforehand) and returns `SG_OK`, or returns anything else (by
 * convention `SG_UNAVAILABLE`) when the engine cannot answer. */
typedef sg_status (*sg_usage_fn)(void *user_data, sg_usage *out);

/** Fills `*out` for this session's prompt. `session_id` (UTF-8, not NUL-terminated) and
 * `prompt_ids` are valid only during the call. */
typedef sg_status (*sg_prefix_fn)(void *user_data, const char *session_id,
                                  size_t session_id_len, const uint32_t *prompt_ids,
                                  size_t prompt_len, sg_prefix *out);

/** Lets the engine side drop what it keeps for a finished session. Best effort: the status
 * is only counted. */
typedef sg_status (*sg_forget_fn)(void *user_data, const char *session_id,
                                  size_t session_id_len);

/**
 * The two residency probes as callbacks. `usage` and `prefix` are required, `forget` may be
 * NULL. `user_data` is passed to each and must stay valid until `sg_gate_destroy` returns;
 * after it returns no callback is running or will run. A callback that takes longer than
 * `probe_timeout_sec` counts as unavailable (its late answer is dropped, but the call is
 * waited for at destroy).
 */
typedef struct sg_probe {
    sg_usage_fn usage;
    sg_prefix_fn prefix;
    sg_forget_fn forget;
    void *user_data;
} sg_probe;

/* ---- the gate ------------------------------------------------------------------------------- */

/** A gate: one per engine replica. Opaque; thread-safe. */
typedef struct sg_gate sg_gate;
/** One admission; release it when the engine's answer is complete. Opaque. */
typedef struct sg_lease sg_lease;
/** A non-blocking admission attempt (`sg_gate_try_acquire`). Opaque. */
typedef struct sg_attempt sg_attempt;

/**
 * Creates a gate over `probe` with `config` (both copied). On `SG_OK` `*out_gate` is the new
 * gate, to be destroyed with `sg_gate_destroy`.
 * Codes: `SG_NULL_POINTER` (an argument, or `probe->usage` / `probe->prefix`),
 * `SG_INVALID_CONFIG`, `SG_INTERNAL` (threads could not be started).
 */
sg_status sg_gate_create(const sg_config *config, const sg_probe *probe, sg_gate **out_gate);

/**
 * Destroys a gate: cancels its pending attempts (their wake callbacks fire before it returns),
 * then waits for probe callbacks still running. NULL is a no-op (`SG_OK`). Its leases may still
 * be released, and must still be destroyed. `SG_WRONG_THREAD` (nothing done) from inside a
 * callback.
 */
sg_status sg_gate_destroy(sg_gate *gate);

/** `sg_request.max_tokens` meaning "not given": count the config's `default_max_tokens`. */
#define SG_MAX_TOKENS_DEFAULT SIZE_MAX

/** One turn of a session asking to go to the engine. */
typedef struct sg_request {
    /** The session (UTF-8, `session_id_len` bytes). */
    const char *session_id;
    size_t session_id_len;
    /** The turn's prompt token ids; may be NULL when `prompt_len` is 0. Copied. */
    const uint32_t *prompt_ids;
    size_t prompt_len;
    /** The turn's `max_tokens` (part of its working set), or `SG_MAX_TOKENS_DEFAULT`: the working
     * set then counts the config's `default_max_tokens`. Pass the real one when you know it. */
    size_t max_tokens;
    /** Keep the session's reservation as an idle grace window after the lease is released. */
    bool retain_session;
} sg_request;

/** `sg_gate_acquire`'s timeout meaning "no timeout". */
#define SG_WAIT_FOREVER (-1)

/**
 * Blocks until this turn may go to the engine, then sets `*out_lease`.
 * `timeout_ms` >= 0, or `SG_WAIT_FOREVER`. Codes: `SG_TIMEOUT` (the attempt was cancelled),
 * `SG_PREEMPTED` (another acquire of the same session took over), `SG_NULL_POINTER`,
 * `SG_INVALID_ARGUMENT`, `SG_WRONG_THREAD` (called from a callback).
 */
sg_status sg_gate_acquire(const sg_gate *gate, const sg_request *request, int64_t timeout_ms,
                          sg_lease **out_lease);

/** Called once, from a gate thread, when an attempt's outcome is ready to be polled. Keep it
 * short (e.g. write to an eventfd or post to your event loop). It may call `sg_attempt_poll`
 * and `sg_attempt_destroy` (on its own attempt or another), but no blocking function. */
typedef void (*sg_wake_fn)(void *wake_data);

/**
 * Starts an admission attempt without blocking, for event-loop proxies: on `SG_OK`
 * `*out_attempt` is a pending attempt; the gate works on it in the background and calls
 * `wake(wake_data)` once when `sg_attempt_poll` has an answer (also when the gate is destroyed
 * first). `wake` may be NULL (then poll on a timer). `wake_data` must stay valid until the
 * wake call returns or until `sg_attempt_destroy` returns, whichever is first.
 * Codes: `SG_NULL_POINTER`, `SG_INVALID_ARGUMENT`.
 */
sg_status sg_gate_try_acquire(const sg_gate *gate, const sg_request *request, sg_wake_fn wake,
                              void *wake_data, sg_attempt **out_attempt);

/**
 * Checks an attempt without blocking. `SG_OK`: admitted, `*out_lease` set. `SG_PENDING`: not
 * yet. `SG_PREEMPTED`, `SG_CLOSED`: it is over without a lease. After any answer other than
 * `SG_PENDING` the attempt is used up (`SG_STALE`); destroy it.
 */
sg_status sg_attempt_poll(sg_attempt *attempt, sg_lease **out_lease);

/**
 * Destroys an attempt. A pending one is cancelled: called from your own thread, it has left the
 * queue when this returns (from inside a callback, shortly after). A lease it won but nobody
 * polled is released. After it returns, its wake callback will not be called, and is not
 * running unless this was called from inside it. NULL is a no-op (`SG_OK`).
 */
sg_status sg_attempt_destroy(sg_attempt *attempt);

/**
 * Ends the session's ownership window at once (in flight or idle), then calls the probe's
 * `forget` if there is one. Blocks for at most `probe_timeout_sec`. `*out_ended` (may be NULL)
 * tells whether a window was open. Codes: `SG_NULL_POINTER`, `SG_INVALID_ARGUMENT`,
 * `SG_WRONG_THREAD`.
 */
sg_status sg_gate_finish_session(const sg_gate *gate, const char *session_id,
                                 size_t session_id_len, bool *out_ended);

/* ---- leases --------------------------------------------------------------------------------- */

/** Everything the gate said about an admission. */
typedef struct sg_lease_info {
    /** The lease's id inside the gate (unique per gate). */
    uint64_t lease_id;
    /** Why it was admitted. */
    sg_reason reason;
    /** Seconds from the start of the attempt to its admission. */
    double wait_sec;
    /** vLLM's KV usage from the last usage probe, if it answered. */
    bool has_usage;
    double usage;
    /** The pressure compared with the watermark, when the cache geometry was known. */
    bool has_pressure;
    double pressure;
    /** The prefix probe's hit ratio, if it was asked and answered. */
    bool has_hit_ratio;
    double hit_ratio;
    /** Working set in blocks (prompt + max_tokens), when the block size was known. */
    bool has_working_set;
    uint64_t working_set_blocks;
    /** Whether the request asked for an ownership window. */
    bool retain_session;
    /** Whether this lease holds the session's reservation while in flight. */
    bool reserved;
    /** Whether the session's reservation was revoked (age order) during this attempt. */
    bool revoked;
    /** How many older attempts of this session have been preempted so far. */
    uint32_t num_preempted;
    /** Whether `sg_lease_release` has run. */
    bool released;
} sg_lease_info;

/** Fills `*out` with the lease's admission. Works before and after release. */
sg_status sg_lease_get_info(const sg_lease *lease, sg_lease_info *out);

/** The lease's session id: `*out_ptr` (not NUL-terminated) stays valid until the lease is
 * destroyed. */
sg_status sg_lease_session_id(const sg_lease *lease, const char **out_ptr, size_t *out_len);

/** Releases the lease: the next waiter may go. `SG_STALE` if it was released already. Any
 * thread may release it. */
sg_status sg_lease_release(sg_lease *lease);

/** Destroys a lease, releasing it first if needed (counted as dropped unreleased). NULL is a
 * no-op (`SG_OK`). */
sg_status sg_lease_destroy(sg_lease *lease);

/* ---- statistics ----------------------------------------------------------------------------- */

/** A snapshot of the gate's counters and gauges. */
typedef struct sg_stats {
    /** Admissions per reason, indexed by `sg_reason`. */
    uint64_t admissions[SG_REASON_COUNT];
    /** Attempts begun. */
    uint64_t attempts;
    /** Reservations revoked by age order. */
    uint64_t revocations;
    /** Attempts preempted by a newer attempt of the same session. */
    uint64_t preemptions;
    /** Attempts cancelled while pending (timeouts, destroyed attempts). */
    uint64_t cancellations;
    /** Leases released with `sg_lease_release`. */
    uint64_t leases_released;
    /** Leases destroyed without a release. */
    uint64_t leases_dropped_unreleased;
    /** Idle grace windows that ran out. */
    uint64_t grace_expired;
    /** Windows ended by `sg_gate_finish_session`. */
    uint64_t sessions_finished;
    /** Gauges: leases in flight, reservations held (in flight or idle), reservations idle,
     * committed working-set blocks, attempts pending, attempts queued, sessions tracked. */
    uint64_t leases_active;
    uint64_t reservations_held;
    uint64_t reservations_idle;
    uint64_t committed_blocks;
    uint64_t pending;
    uint64_t waiting;
    uint64_t sessions;
    /** Admission wait: number of admissions and the sum of their waits in seconds. */
    uint64_t wait_count;
    double wait_sum_sec;
    /** Probe calls and failures (errors or timeouts), indexed by `SG_PROBE_*`. */
    uint64_t probe_calls[SG_PROBE_KIND_COUNT];
    uint64_t probe_failures[SG_PROBE_KIND_COUNT];
    /** Idle reservations that yielded early because the engine had nothing running or waiting
     * (`sg_usage.num_running_reqs` and `num_waiting_reqs` both 0); also in `revocations`. */
    uint64_t idle_engine_yields;
} sg_stats;

/** Fills `*out` with a snapshot of the gate's statistics. */
sg_status sg_gate_stats(const sg_gate *gate, sg_stats *out);

/**
 * The Prometheus text exposition (format 0.0.4) of the gate's metrics. On `SG_OK` `*out_text`
 * is a NUL-terminated UTF-8 string of `*out_len` bytes (NUL not counted), allocated by the
 * library: free it with `sg_string_free`, never with `free()`.
 */
sg_status sg_gate_prometheus(const sg_gate *gate, char **out_text, size_t *out_len);

/** Frees text returned by `sg_gate_prometheus`. NULL is a no-op (`SG_OK`). */
sg_status sg_string_free(char *text);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SESSION_GATE_H */
