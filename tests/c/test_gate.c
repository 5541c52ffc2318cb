/*
 * The C ABI as a C proxy would use it: a fake engine behind callback probes, admissions through
 * every reason, a waiter let in by a release on another thread (blocking and try/poll), and the
 * documented codes for NULL handles, bad arguments and bad configuration. `make test-c` runs it
 * plain and under valgrind.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "session_gate.h"

static int passed = 0;
static int failed = 0;

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (cond) {                                                                            \
            passed++;                                                                          \
        } else {                                                                               \
            failed++;                                                                          \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);           \
        }                                                                                      \
    } while (0)

/* A call that must return `want`; prints the last error when it does not. */
#define EXPECT_STATUS(call, want)                                                              \
    do {                                                                                       \
        sg_status got_ = (call);                                                               \
        if (got_ == (want)) {                                                                  \
            passed++;                                                                          \
        } else {                                                                               \
            failed++;                                                                          \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__, __LINE__,   \
                    #call, sg_status_name(got_), sg_status_name(want), last_error());          \
        }                                                                                      \
    } while (0)

static const char *last_error(void) {
    static char buf[1024];
    size_t len = 0;
    if (sg_last_error(buf, sizeof buf, &len) != SG_OK) {
        return "(message too long)";
    }
    return buf;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- a fake engine ------------------------------------------------------------------------ */

enum { BLOCKS = 100, BLOCK_SIZE = 16 };

typedef struct engine {
    pthread_mutex_t mu;
    double usage;
    double hit_ratio;
    sg_status prefix_status;
    int usage_calls, prefix_calls, forget_calls;
} engine;

static void engine_init(engine *e) {
    memset(e, 0, sizeof *e);
    pthread_mutex_init(&e->mu, NULL);
    e->prefix_status = SG_OK;
}

static void engine_set(engine *e, double usage, double hit_ratio, sg_status prefix_status) {
    pthread_mutex_lock(&e->mu);
    e->usage = usage;
    e->hit_ratio = hit_ratio;
    e->prefix_status = prefix_status;
    pthread_mutex_unlock(&e->mu);
}

static sg_status on_usage(void *user_data, sg_usage *out) {
    engine *e = user_data;
    pthread_mutex_lock(&e->mu);
    e->usage_calls++;
    out->kv_cache_usage = e->usage;
    out->num_blocks = BLOCKS;
    out->num_free_blocks = (uint64_t)((1.0 - e->usage) * BLOCKS);
    out->block_size = BLOCK_SIZE;
    /* A host KV tier of a tenth of the GPU cache, full: too small to hold the working sets
     * these tests commit, so the gate never steps aside for it (step 0 of the tree). */
    out->has_offload_blocks = true;
    out->offload_num_blocks = BLOCKS / 10;
    out->offload_used_blocks = BLOCKS / 10;
    pthread_mutex_unlock(&e->mu);
    return SG_OK;
}

static sg_status on_prefix(void *user_data, const char *session_id, size_t session_id_len,
                           const uint32_t *prompt_ids, size_t prompt_len, sg_prefix *out) {
    engine *e = user_data;
    (void)session_id;
    (void)session_id_len;
    (void)prompt_ids;
    pthread_mutex_lock(&e->mu);
    e->prefix_calls++;
    sg_status status = e->prefix_status;
    out->hit_ratio = e->hit_ratio;
    out->prompt_tokens = prompt_len;
    out->hit_tokens = (uint64_t)(e->hit_ratio * (double)prompt_len);
    out->hit_blocks = out->hit_tokens / BLOCK_SIZE;
    /* The tier holds nothing more of these prompts. */
    out->has_offloaded_tokens = true;
    out->offloaded_tokens = 0;
    pthread_mutex_unlock(&e->mu);
    return status;
}

static sg_status on_forget(void *user_data, const char *session_id, size_t session_id_len) {
    engine *e = user_data;
    (void)session_id;
    (void)session_id_len;
    pthread_mutex_lock(&e->mu);
    e->forget_calls++;
    pthread_mutex_unlock(&e->mu);
    return SG_OK;
}

static sg_probe probe_of(engine *e) {
    sg_probe p = {on_usage, on_prefix, on_forget, e};
    return p;
}

/* Waits end by wake-ups from releases, not polling; a generous probe timeout for valgrind. */
static sg_config test_config(void) {
    sg_config c = sg_config_default();
    c.wait_poll_sec = 30.0;
    c.probe_timeout_sec = 10.0;
    return c;
}

static sg_gate *make_gate(engine *e, sg_config c) {
    sg_probe p = probe_of(e);
    sg_gate *gate = NULL;
    EXPECT_STATUS(sg_gate_create(&c, &p, &gate), SG_OK);
    return gate;
}

/* Every request in these tests: `blocks` blocks of prompt plus 16 tokens of output. */
static uint32_t prompt_ids[64 * BLOCK_SIZE];

static sg_request request(const char *session_id, size_t blocks, bool retain) {
    sg_request r;
    memset(&r, 0, sizeof r);
    r.session_id = session_id;
    r.session_id_len = strlen(session_id);
    r.prompt_ids = prompt_ids;
    r.prompt_len = blocks * BLOCK_SIZE;
    r.max_tokens = 16;
    r.retain_session = retain;
    return r;
}

static sg_lease *acquire(sg_gate *gate, const char *session_id, bool retain, sg_reason want) {
    sg_request r = request(session_id, 10, retain);
    sg_lease *lease = NULL;
    EXPECT_STATUS(sg_gate_acquire(gate, &r, 20000, &lease), SG_OK);
    sg_lease_info info;
    EXPECT_STATUS(sg_lease_get_info(lease, &info), SG_OK);
    if (info.reason != want) {
        fprintf(stderr, "%s: admitted as %s, expected %s\n", session_id,
                sg_reason_name(info.reason), sg_reason_name(want));
    }
    CHECK(info.reason == want);
    return lease;
}

static uint64_t stat_waiting(sg_gate *gate) {
    sg_stats s;
    return sg_gate_stats(gate, &s) == SG_OK ? s.waiting : 0;
}

static void wait_until_queued(sg_gate *gate, uint64_t n) {
    for (int i = 0; i < 10000 && stat_waiting(gate) != n; i++) {
        sleep_ms(2);
    }
    CHECK(stat_waiting(gate) == n);
}

/* ---- scenarios ---------------------------------------------------------------------------- */

static void every_reason(void) {
    engine e;
    engine_init(&e);
    sg_gate *gate = make_gate(&e, test_config());

    /* Nothing committed: open; the retained reservation stays as an idle grace window. */
    sg_lease *first = acquire(gate, "s1", true, SG_REASON_OPEN);
    const char *sid = NULL;
    size_t sid_len = 0;
    EXPECT_STATUS(sg_lease_session_id(first, &sid, &sid_len), SG_OK);
    CHECK(sid_len == 2 && memcmp(sid, "s1", 2) == 0);
    EXPECT_STATUS(sg_lease_release(first), SG_OK);
    EXPECT_STATUS(sg_lease_release(first), SG_STALE);
    sg_lease_info info;
    EXPECT_STATUS(sg_lease_get_info(first, &info), SG_OK);
    CHECK(info.released && info.reserved && info.has_working_set && info.working_set_blocks == 11);
    EXPECT_STATUS(sg_lease_destroy(first), SG_OK);

    /* Under pressure: the reserved session goes in without a prefix probe. */
    engine_set(&e, 0.9, 0.95, SG_OK);
    int prefix_calls = e.prefix_calls;
    sg_lease *again = acquire(gate, "s1", true, SG_REASON_RESERVED_SESSION);
    CHECK(e.prefix_calls == prefix_calls);
    /* A cold session whose prefix is resident. */
    sg_lease *resident = acquire(gate, "s2", false, SG_REASON_RESIDENT_PREFIX);
    EXPECT_STATUS(sg_lease_get_info(resident, &info), SG_OK);
    CHECK(info.has_hit_ratio && info.hit_ratio == 0.95 && info.has_usage && info.usage == 0.9);
    /* The prefix probe cannot answer: committed pressure counts blocks itself, so that is a
     * miss and the session waits; a timeout cancels it. */
    engine_set(&e, 0.9, 0.0, SG_UNAVAILABLE);
    sg_request dark = request("s3", 10, false);
    sg_lease *none = NULL;
    EXPECT_STATUS(sg_gate_acquire(gate, &dark, 50, &none), SG_TIMEOUT);
    CHECK(none == NULL);
    /* Engine pressure (the seed's rule) fails open instead. */
    sg_config seed = test_config();
    seed.pressure = SG_PRESSURE_ENGINE;
    sg_gate *seed_gate = make_gate(&e, seed);
    sg_lease *blind = acquire(seed_gate, "s3", false, SG_REASON_PREFIX_PROBE_UNAVAILABLE);

    /* A cold session with nothing resident waits; a timeout cancels it. */
    engine_set(&e, 0.9, 0.0, SG_OK);
    sg_request cold = request("s4", 10, false);
    EXPECT_STATUS(sg_gate_acquire(gate, &cold, 50, &none), SG_TIMEOUT);
    CHECK(none == NULL);

    EXPECT_STATUS(sg_lease_release(again), SG_OK);
    EXPECT_STATUS(sg_lease_release(resident), SG_OK);
    EXPECT_STATUS(sg_lease_destroy(again), SG_OK);
    EXPECT_STATUS(sg_lease_destroy(resident), SG_OK);
    /* Destroyed without a release: released for the caller, counted as such. */
    EXPECT_STATUS(sg_lease_destroy(blind), SG_OK);
    sg_stats seed_stats;
    EXPECT_STATUS(sg_gate_stats(seed_gate, &seed_stats), SG_OK);
    CHECK(seed_stats.admissions[SG_REASON_PREFIX_PROBE_UNAVAILABLE] == 1);
    CHECK(seed_stats.leases_dropped_unreleased == 1);
    EXPECT_STATUS(sg_gate_destroy(seed_gate), SG_OK);

    bool ended = false;
    EXPECT_STATUS(sg_gate_finish_session(gate, "s1", 2, &ended), SG_OK);
    CHECK(ended);
    EXPECT_STATUS(sg_gate_finish_session(gate, "s1", 2, &ended), SG_OK);
    CHECK(!ended);
    CHECK(e.forget_calls == 2);

    sg_stats s;
    EXPECT_STATUS(sg_gate_stats(gate, &s), SG_OK);
    CHECK(s.admissions[SG_REASON_OPEN] == 1);
    CHECK(s.admissions[SG_REASON_RESERVED_SESSION] == 1);
    CHECK(s.admissions[SG_REASON_RESIDENT_PREFIX] == 1);
    CHECK(s.admissions[SG_REASON_PREFIX_PROBE_UNAVAILABLE] == 0);
    CHECK(s.admissions[SG_REASON_MAX_WAIT] == 0);
    CHECK(s.admissions[SG_REASON_OFFLOADED_PREFIX] == 0);
    CHECK(s.attempts == 5 && s.cancellations == 2 && s.leases_active == 0);
    CHECK(s.leases_released == 3 && s.leases_dropped_unreleased == 0);
    CHECK(s.sessions_finished == 1 && s.wait_count == 3);
    CHECK(s.probe_calls[SG_PROBE_FORGET] == 2 && s.probe_failures[SG_PROBE_PREFIX] == 1);

    char *text = NULL;
    size_t len = 0;
    EXPECT_STATUS(sg_gate_prometheus(gate, &text, &len), SG_OK);
    CHECK(text != NULL && strlen(text) == len);
    CHECK(strstr(text, "session_gate_admissions_total{reason=\"resident_prefix\"} 1\n") != NULL);
    CHECK(strstr(text, "session_gate_admissions_total{reason=\"offloaded_prefix\"} 0\n") != NULL);
    CHECK(strstr(text, "session_gate_cancellations_total 2\n") != NULL);
    EXPECT_STATUS(sg_string_free(text), SG_OK);

    EXPECT_STATUS(sg_gate_destroy(gate), SG_OK);
    pthread_mutex_destroy(&e.mu);
}

static void max_wait(void) {
    engine e;
    engine_init(&e);
    sg_config c = test_config();
    c.has_max_wait = true;
    c.max_wait_sec = 0.05;
    sg_gate *gate = make_gate(&e, c);
    sg_lease *holder = acquire(gate, "holder", false, SG_REASON_OPEN);
    engine_set(&e, 0.9, 0.0, SG_OK);
    sg_lease *late = acquire(gate, "late", false, SG_REASON_MAX_WAIT);
    sg_lease_info info;
    EXPECT_STATUS(sg_lease_get_info(late, &info), SG_OK);
    CHECK(info.wait_sec >= 0.05);
    sg_lease_destroy(late);
    sg_lease_destroy(holder);
    EXPECT_STATUS(sg_gate_destroy(gate), SG_OK);
    pthread_mutex_destroy(&e.mu);
}

/* Lets the cache drain, then releases `lease` — from a thread of its own. */
typedef struct releaser {
    engine *e;
    sg_lease *lease;
    long delay_ms;
    sg_status status;
} releaser;

static void *release_later(void *arg) {
    releaser *r = arg;
    sleep_ms(r->delay_ms);
    engine_set(r->e, 0.1, 0.0, SG_OK);
    r->status = sg_lease_release(r->lease);
    return NULL;
}

static void wait_then_admitted_blocking(void) {
    engine e;
    engine_init(&e);
    sg_gate *gate = make_gate(&e, test_config());
    sg_lease *holder = acquire(gate, "holder", false, SG_REASON_OPEN);
    engine_set(&e, 0.9, 0.0, SG_OK);

    releaser r = {&e, holder, 200, -1};
    pthread_t t;
    pthread_create(&t, NULL, release_later, &r);
    /* Waits (pressure, nothing resident) until the release on the other thread. */
    sg_lease *waiter = acquire(gate, "waiter", false, SG_REASON_OPEN);
    pthread_join(t, NULL);
    EXPECT_STATUS(r.status, SG_OK);
    sg_lease_info info;
    EXPECT_STATUS(sg_lease_get_info(waiter, &info), SG_OK);
    CHECK(info.wait_sec >= 0.15);

    sg_lease_destroy(waiter);
    sg_lease_destroy(holder);
    EXPECT_STATUS(sg_gate_destroy(gate), SG_OK);
    pthread_mutex_destroy(&e.mu);
}

/* What an event loop would do on wake: here, signal a condition variable. */
typedef struct wakeup {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int count;
} wakeup;

static void on_wake(void *wake_data) {
    wakeup *w = wake_data;
    pthread_mutex_lock(&w->mu);
    w->count++;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static int wait_wake(wakeup *w, int count) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 20;
    pthread_mutex_lock(&w->mu);
    while (w->count < count) {
        if (pthread_cond_timedwait(&w->cv, &w->mu, &deadline) != 0) {
            break;
        }
    }
    int got = w->count;
    pthread_mutex_unlock(&w->mu);
    return got >= count;
}

static void wakeup_init(wakeup *w) {
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->count = 0;
}

static void wakeup_destroy(wakeup *w) {
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
}

static void wait_then_admitted_try_poll(void) {
    engine e;
    engine_init(&e);
    sg_gate *gate = make_gate(&e, test_config());
    sg_lease *holder = acquire(gate, "holder", false, SG_REASON_OPEN);
    engine_set(&e, 0.9, 0.0, SG_OK);

    wakeup w;
    wakeup_init(&w);
    sg_request r = request("waiter", 10, false);
    sg_attempt *attempt = NULL;
    EXPECT_STATUS(sg_gate_try_acquire(gate, &r, on_wake, &w, &attempt), SG_OK);
    wait_until_queued(gate, 1);
    sg_lease *lease = NULL;
    EXPECT_STATUS(sg_attempt_poll(attempt, &lease), SG_PENDING);
    CHECK(lease == NULL);

    releaser rel = {&e, holder, 0, -1};
    pthread_t t;
    pthread_create(&t, NULL, release_later, &rel);
    pthread_join(t, NULL);
    CHECK(wait_wake(&w, 1));
    EXPECT_STATUS(sg_attempt_poll(attempt, &lease), SG_OK);
    sg_lease_info info;
    EXPECT_STATUS(sg_lease_get_info(lease, &info), SG_OK);
    CHECK(info.reason == SG_REASON_OPEN);
    EXPECT_STATUS(sg_attempt_poll(attempt, &lease), SG_STALE);
    EXPECT_STATUS(sg_attempt_destroy(attempt), SG_OK);

    /* Preemption: a newer attempt of the same session ends the pending one. */
    engine_set(&e, 0.9, 0.0, SG_OK);
    wakeup w1;
    wakeup_init(&w1);
    sg_request s = request("s", 10, false);
    sg_attempt *older = NULL, *newer = NULL;
    EXPECT_STATUS(sg_gate_try_acquire(gate, &s, on_wake, &w1, &older), SG_OK);
    wait_until_queued(gate, 1);
    EXPECT_STATUS(sg_gate_try_acquire(gate, &s, NULL, NULL, &newer), SG_OK);
    CHECK(wait_wake(&w1, 1));
    sg_lease *never = NULL;
    EXPECT_STATUS(sg_attempt_poll(older, &never), SG_PREEMPTED);
    CHECK(never == NULL);
    EXPECT_STATUS(sg_attempt_destroy(older), SG_OK);
    /* Destroying the pending newer one cancels it: it has left the queue on return. */
    EXPECT_STATUS(sg_attempt_destroy(newer), SG_OK);
    sg_stats st;
    EXPECT_STATUS(sg_gate_stats(gate, &st), SG_OK);
    CHECK(st.preemptions == 1 && st.cancellations == 1 && st.waiting == 0 && st.pending == 0);

    /* A gate destroyed under a pending attempt: woken, then SG_CLOSED. */
    wakeup w2;
    wakeup_init(&w2);
    sg_request orphan = request("orphan", 10, false);
    sg_attempt *pending = NULL;
    EXPECT_STATUS(sg_gate_try_acquire(gate, &orphan, on_wake, &w2, &pending), SG_OK);
    wait_until_queued(gate, 1);
    EXPECT_STATUS(sg_gate_destroy(gate), SG_OK);
    CHECK(wait_wake(&w2, 1));
    EXPECT_STATUS(sg_attempt_poll(pending, &never), SG_CLOSED);
    EXPECT_STATUS(sg_attempt_destroy(pending), SG_OK);
    /* Leases may outlive their gate. */
    EXPECT_STATUS(sg_lease_release(lease), SG_OK);
    EXPECT_STATUS(sg_lease_destroy(lease), SG_OK);
    EXPECT_STATUS(sg_lease_destroy(holder), SG_OK);

    wakeup_destroy(&w);
    wakeup_destroy(&w1);
    wakeup_destroy(&w2);
    pthread_mutex_destroy(&e.mu);
}

static void null_handles_and_bad_arguments(void) {
    engine e;
    engine_init(&e);
    sg_config c = test_config();
    sg_probe p = probe_of(&e);
    sg_gate *gate = NULL;

    EXPECT_STATUS(sg_gate_create(NULL, &p, &gate), SG_NULL_POINTER);
    EXPECT_STATUS(sg_gate_create(&c, NULL, &gate), SG_NULL_POINTER);
    EXPECT_STATUS(sg_gate_create(&c, &p, NULL), SG_NULL_POINTER);
    sg_probe no_usage = p;
    no_usage.usage = NULL;
    EXPECT_STATUS(sg_gate_create(&c, &no_usage, &gate), SG_NULL_POINTER);
    CHECK(strstr(last_error(), "probe->usage") != NULL);
    CHECK(gate == NULL);

    sg_request r = request("s", 1, false);
    sg_lease *lease = NULL;
    sg_attempt *attempt = NULL;
    EXPECT_STATUS(sg_gate_acquire(NULL, &r, 0, &lease), SG_NULL_POINTER);
    CHECK(strstr(last_error(), "`gate` is NULL") != NULL);
    EXPECT_STATUS(sg_gate_try_acquire(NULL, &r, NULL, NULL, &attempt), SG_NULL_POINTER);
    EXPECT_STATUS(sg_gate_finish_session(NULL, "s", 1, NULL), SG_NULL_POINTER);
    sg_stats s;
    EXPECT_STATUS(sg_gate_stats(NULL, &s), SG_NULL_POINTER);
    char *text = NULL;
    size_t len = 0;
    EXPECT_STATUS(sg_gate_prometheus(NULL, &text, &len), SG_NULL_POINTER);
    EXPECT_STATUS(sg_lease_release(NULL), SG_NULL_POINTER);
    sg_lease_info info;
    EXPECT_STATUS(sg_lease_get_info(NULL, &info), SG_NULL_POINTER);
    EXPECT_STATUS(sg_attempt_poll(NULL, &lease), SG_NULL_POINTER);
    EXPECT_STATUS(sg_config_validate(NULL), SG_NULL_POINTER);
    EXPECT_STATUS(sg_config_from_env(NULL), SG_NULL_POINTER);
    /* Destroying NULL is a no-op, like free(NULL). */
    EXPECT_STATUS(sg_gate_destroy(NULL), SG_OK);
    EXPECT_STATUS(sg_lease_destroy(NULL), SG_OK);
    EXPECT_STATUS(sg_attempt_destroy(NULL), SG_OK);
    EXPECT_STATUS(sg_string_free(NULL), SG_OK);

    gate = make_gate(&e, c);
    EXPECT_STATUS(sg_gate_acquire(gate, NULL, 0, &lease), SG_NULL_POINTER);
    EXPECT_STATUS(sg_gate_acquire(gate, &r, 0, NULL), SG_NULL_POINTER);
    EXPECT_STATUS(sg_gate_stats(gate, NULL), SG_NULL_POINTER);
    sg_request bad = r;
    bad.session_id = NULL;
    EXPECT_STATUS(sg_gate_acquire(gate, &bad, 0, &lease), SG_NULL_POINTER);
    bad = r;
    bad.prompt_ids = NULL;
    EXPECT_STATUS(sg_gate_acquire(gate, &bad, 0, &lease), SG_NULL_POINTER);
    bad = r;
    bad.session_id = "\xff\xfe";
    bad.session_id_len = 2;
    EXPECT_STATUS(sg_gate_acquire(gate, &bad, 0, &lease), SG_INVALID_ARGUMENT);
    CHECK(strstr(last_error(), "UTF-8") != NULL);
    EXPECT_STATUS(sg_gate_acquire(gate, &r, -5, &lease), SG_INVALID_ARGUMENT);
    EXPECT_STATUS(sg_gate_finish_session(gate, "\xff", 1, NULL), SG_INVALID_ARGUMENT);
    /* An empty prompt may come as NULL + 0. */
    bad = r;
    bad.prompt_ids = NULL;
    bad.prompt_len = 0;
    EXPECT_STATUS(sg_gate_acquire(gate, &bad, SG_WAIT_FOREVER, &lease), SG_OK);
    EXPECT_STATUS(sg_lease_destroy(lease), SG_OK);
    EXPECT_STATUS(sg_gate_destroy(gate), SG_OK);
    pthread_mutex_destroy(&e.mu);
}

static void bad_configuration(void) {
    engine e;
    engine_init(&e);
    sg_probe p = probe_of(&e);
    sg_gate *gate = NULL;

    sg_config c = sg_config_default();
    CHECK(c.high_watermark == 0.85 && c.hit_threshold == 0.80 && c.wait_poll_sec == 5.0);
    CHECK(c.idle_grace_sec == 60.0 && c.pressure == SG_PRESSURE_COMMITTED && !c.has_max_wait);
    EXPECT_STATUS(sg_config_validate(&c), SG_OK);

    c.high_watermark = NAN;
    EXPECT_STATUS(sg_gate_create(&c, &p, &gate), SG_INVALID_CONFIG);
    CHECK(gate == NULL);
    /* The message names the knob and the value; sizing it first, then reading it. */
    size_t need = 0;
    EXPECT_STATUS(sg_last_error(NULL, 0, &need), SG_BUFFER_TOO_SMALL);
    char small[8];
    size_t len = 0;
    EXPECT_STATUS(sg_last_error(small, sizeof small, &len), SG_BUFFER_TOO_SMALL);
    CHECK(len == need && need > sizeof small);
    char *msg = malloc(need + 1);
    EXPECT_STATUS(sg_last_error(msg, need + 1, &len), SG_OK);
    CHECK(len == need && strlen(msg) == need);
    CHECK(strstr(msg, "high_watermark") != NULL && strstr(msg, "NaN") != NULL);
    free(msg);
    EXPECT_STATUS(sg_last_error(small, sizeof small, NULL), SG_NULL_POINTER);

    c = sg_config_default();
    c.pressure = 7;
    EXPECT_STATUS(sg_config_validate(&c), SG_INVALID_CONFIG);
    CHECK(strstr(last_error(), "pressure") != NULL);
    c = sg_config_default();
    c.has_max_wait = true;
    c.max_wait_sec = -1.0;
    EXPECT_STATUS(sg_gate_create(&c, &p, &gate), SG_INVALID_CONFIG);
    CHECK(strstr(last_error(), "max_wait_sec") != NULL);
    c = sg_config_default();
    c.hit_threshold = 1.5;
    EXPECT_STATUS(sg_gate_create(&c, &p, &gate), SG_INVALID_CONFIG);
    c = sg_config_default();
    c.probe_timeout_sec = 0.0;
    EXPECT_STATUS(sg_gate_create(&c, &p, &gate), SG_INVALID_CONFIG);
    c = sg_config_default();
    c.pressure = SG_PRESSURE_ENGINE;
    EXPECT_STATUS(sg_config_validate(&c), SG_OK);
    CHECK(gate == NULL);
    pthread_mutex_destroy(&e.mu);
}

/* A plain acquire(session_id, prompt_ids): no max_tokens, so the working set counts the
 * config's default_max_tokens (256 by default: 16 blocks of 16 tokens). */
static void default_max_tokens(void) {
    CHECK(sg_config_default().default_max_tokens == 256);
    engine e;
    engine_init(&e);
    sg_config c = test_config();
    c.default_max_tokens = 40; /* 3 blocks of output */
    sg_gate *gate = make_gate(&e, c);
    sg_request r = request("seed", 10, false);
    r.max_tokens = SG_MAX_TOKENS_DEFAULT;
    sg_lease *lease = NULL;
    EXPECT_STATUS(sg_gate_acquire(gate, &r, 20000, &lease), SG_OK);
    sg_lease_info info;
    EXPECT_STATUS(sg_lease_get_info(lease, &info), SG_OK);
    CHECK(info.has_working_set && info.working_set_blocks == 13);
    EXPECT_STATUS(sg_lease_release(lease), SG_OK);
    EXPECT_STATUS(sg_lease_destroy(lease), SG_OK);
    EXPECT_STATUS(sg_gate_destroy(gate), SG_OK);
    pthread_mutex_destroy(&e.mu);
}

static void names_and_version(void) {
    CHECK(strcmp(sg_version(), SG_VERSION) == 0);
    CHECK(strcmp(sg_status_name(SG_INVALID_CONFIG), "SG_INVALID_CONFIG") == 0);
    CHECK(sg_status_name(999) == NULL);
    CHECK(strcmp(sg_reason_name(SG_REASON_PREFIX_PROBE_UNAVAILABLE),
                 "prefix_probe_unavailable") == 0);
    CHECK(strcmp(sg_reason_name(SG_REASON_OFFLOADED_PREFIX), "offloaded_prefix") == 0);
    CHECK(SG_REASON_OFFLOADED_PREFIX == SG_REASON_COUNT - 1);
    CHECK(sg_reason_name(SG_REASON_COUNT) == NULL);
}

int main(void) {
    for (size_t i = 0; i < sizeof prompt_ids / sizeof prompt_ids[0]; i++) {
        prompt_ids[i] = (uint32_t)i;
    }
    every_reason();
    max_wait();
    wait_then_admitted_blocking();
    wait_then_admitted_try_poll();
    null_handles_and_bad_arguments();
    bad_configuration();
    default_max_tokens();
    names_and_version();
    printf("c: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
