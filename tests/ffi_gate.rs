//! The C ABI's gate, called from Rust exactly as C would call it: `extern "C"` callbacks over a
//! fake engine, raw handles, status codes. Covers every admission reason, waking a waiter from
//! another thread (blocking and try/poll), what destroying an attempt or a gate does, probe
//! timeouts, and calls made from inside callbacks.
use std::ffi::{CStr, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use libc::{c_char, size_t};
use session_gate::ffi::sys::{
    self, sg_attempt, sg_config, sg_gate, sg_lease, sg_lease_info, sg_prefix, sg_probe, sg_request,
    sg_stats, sg_status, sg_usage,
};
use session_gate::ffi::*;

const BLOCKS: u64 = 100;
const BLOCK_SIZE: u64 = 16;

/// What the fake engine answers; tests change it while the gate runs.
struct Answers {
    usage: f64,
    hit_ratio: f64,
    prefix_status: sg_status,
    prefix_delay: Duration,
}

struct Engine {
    answers: Mutex<Answers>,
    prefix_running: AtomicBool,
    prefix_calls: AtomicU32,
    forget_calls: AtomicU32,
    /// Set by a test to make the usage callback call back into this gate.
    reenter: AtomicPtr<sg_gate>,
    reentry_status: AtomicI32,
}

impl Engine {
    fn new() -> Box<Self> {
        Box::new(Self {
            answers: Mutex::new(Answers {
                usage: 0.0,
                hit_ratio: 0.0,
                prefix_status: sys::SG_OK,
                prefix_delay: Duration::ZERO,
            }),
            prefix_running: AtomicBool::new(false),
            prefix_calls: AtomicU32::new(0),
            forget_calls: AtomicU32::new(0),
            reenter: AtomicPtr::new(ptr::null_mut()),
            reentry_status: AtomicI32::new(-1),
        })
    }

    fn set(&self, usage: f64, hit_ratio: f64, prefix_status: sg_status) {
        let mut a = self.answers.lock().unwrap();
        a.usage = usage;
        a.hit_ratio = hit_ratio;
        a.prefix_status = prefix_status;
    }
}

unsafe extern "C" fn on_usage(user_data: *mut c_void, out: *mut sg_usage) -> sg_status {
    // SAFETY: `user_data` is the test's `Engine`, alive until the gate is destroyed.
    let e = unsafe { &*user_data.cast::<Engine>() };
    let gate = e.reenter.swap(ptr::null_mut(), Ordering::SeqCst);
    if !gate.is_null() {
        let r = request("inner", 1, false);
        let mut lease = ptr::null_mut();
        // SAFETY: a live gate and valid pointers; the call must refuse, not block.
        let status = unsafe { sg_gate_acquire(gate, &r.raw, 0, &mut lease) };
        e.reentry_status.store(status, Ordering::SeqCst);
    }
    let a = e.answers.lock().unwrap();
    // SAFETY: the gate passes a valid, zeroed `sg_usage`.
    let out = unsafe { &mut *out };
    out.kv_cache_usage = a.usage;
    out.num_blocks = BLOCKS;
    out.num_free_blocks = ((1.0 - a.usage) * BLOCKS as f64) as u64;
    out.block_size = BLOCK_SIZE;
    sys::SG_OK
}

unsafe extern "C" fn on_prefix(
    user_data: *mut c_void,
    session_id: *const c_char,
    session_id_len: size_t,
    _prompt_ids: *const u32,
    prompt_len: size_t,
    out: *mut sg_prefix,
) -> sg_status {
    // SAFETY: as in `on_usage`; the session id is valid for the call.
    let (e, session) = unsafe {
        (
            &*user_data.cast::<Engine>(),
            std::slice::from_raw_parts(session_id.cast::<u8>(), session_id_len),
        )
    };
    assert!(std::str::from_utf8(session).is_ok());
    e.prefix_calls.fetch_add(1, Ordering::SeqCst);
    let (hit, status, delay) = {
        let a = e.answers.lock().unwrap();
        (a.hit_ratio, a.prefix_status, a.prefix_delay)
    };
    if !delay.is_zero() {
        e.prefix_running.store(true, Ordering::SeqCst);
        thread::sleep(delay);
        e.prefix_running.store(false, Ordering::SeqCst);
    }
    // SAFETY: the gate passes a valid, zeroed `sg_prefix`.
    let out = unsafe { &mut *out };
    out.hit_ratio = hit;
    out.prompt_tokens = prompt_len as u64;
    status
}

unsafe extern "C" fn on_forget(
    user_data: *mut c_void,
    _session_id: *const c_char,
    _session_id_len: size_t,
) -> sg_status {
    // SAFETY: as in `on_usage`.
    let e = unsafe { &*user_data.cast::<Engine>() };
    e.forget_calls.fetch_add(1, Ordering::SeqCst);
    sys::SG_OK
}

fn config() -> sg_config {
    sg_config {
        // Waits end by wake-ups, not by polling.
        wait_poll_sec: 30.0,
        probe_timeout_sec: 10.0,
        ..sg_config_default()
    }
}

/// A gate over an engine, destroyed on drop (before the engine it points to).
struct TestGate {
    raw: *mut sg_gate,
    engine: Box<Engine>,
}

// SAFETY: the gate handle is thread-safe (header), and `Engine` is Sync.
unsafe impl Sync for TestGate {}
// SAFETY: as above.
unsafe impl Send for TestGate {}

impl TestGate {
    fn new(config: sg_config) -> Self {
        let engine = Engine::new();
        let probe = sg_probe {
            usage: Some(on_usage),
            prefix: Some(on_prefix),
            forget: Some(on_forget),
            user_data: (&*engine as *const Engine).cast_mut().cast(),
        };
        let mut raw = ptr::null_mut();
        // SAFETY: valid pointers; `engine` outlives the gate (see Drop).
        assert_eq!(
            unsafe { sg_gate_create(&config, &probe, &mut raw) },
            sys::SG_OK
        );
        Self { raw, engine }
    }

    fn acquire(&self, session: &str, blocks: usize, retain: bool) -> Result<Lease, sg_status> {
        self.acquire_within(session, blocks, retain, 20_000)
    }

    fn acquire_within(
        &self,
        session: &str,
        blocks: usize,
        retain: bool,
        timeout_ms: i64,
    ) -> Result<Lease, sg_status> {
        let r = request(session, blocks, retain);
        let mut lease = ptr::null_mut();
        // SAFETY: valid pointers.
        match unsafe { sg_gate_acquire(self.raw, &r.raw, timeout_ms, &mut lease) } {
            sys::SG_OK => Ok(Lease(lease)),
            status => {
                assert!(lease.is_null());
                Err(status)
            }
        }
    }

    fn try_acquire(&self, session: &str, wake: Option<&Wake>) -> *mut sg_attempt {
        let r = request(session, 10, false);
        let mut attempt = ptr::null_mut();
        let (f, data): (sys::sg_wake_fn, *mut c_void) = match wake {
            Some(w) => (Some(on_wake), (w as *const Wake).cast_mut().cast()),
            None => (None, ptr::null_mut()),
        };
        // SAFETY: valid pointers; the tests keep `wake` alive past the attempt.
        let status = unsafe { sg_gate_try_acquire(self.raw, &r.raw, f, data, &mut attempt) };
        assert_eq!(status, sys::SG_OK);
        attempt
    }

    fn stats(&self) -> sg_stats {
        let mut s = sg_stats::default();
        // SAFETY: valid pointers.
        assert_eq!(unsafe { sg_gate_stats(self.raw, &mut s) }, sys::SG_OK);
        s
    }

    /// Waits until `n` attempts are queued.
    fn until_waiting(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.stats().waiting != n {
            assert!(Instant::now() < deadline, "never reached {n} waiting");
            thread::sleep(Duration::from_millis(2));
        }
    }
}

impl TestGate {
    /// Destroys the handle now; the engine stays for the test to inspect.
    fn destroy(&mut self) {
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: our gate (or NULL, a no-op), not used after this.
        assert_eq!(unsafe { sg_gate_destroy(raw) }, sys::SG_OK);
    }
}

impl Drop for TestGate {
    fn drop(&mut self) {
        self.destroy();
    }
}

/// A request and the session string its pointer refers to.
struct Request {
    raw: sg_request,
    _session: String,
}

static PROMPT: [u32; 64 * BLOCK_SIZE as usize] = [7; 64 * BLOCK_SIZE as usize];

fn request(session: &str, blocks: usize, retain: bool) -> Request {
    let session = session.to_string();
    let raw = sg_request {
        session_id: session.as_ptr().cast(),
        session_id_len: session.len(),
        prompt_ids: PROMPT.as_ptr(),
        prompt_len: blocks * BLOCK_SIZE as usize,
        max_tokens: 16,
        retain_session: retain,
    };
    Request {
        raw,
        _session: session,
    }
}

/// A lease handle, destroyed on drop.
struct Lease(*mut sg_lease);

// SAFETY: a lease may be used from any thread, calls on it are serialized inside (header).
unsafe impl Send for Lease {}
// SAFETY: as above.
unsafe impl Sync for Lease {}

impl Lease {
    fn info(&self) -> sg_lease_info {
        let mut info = sg_lease_info::default();
        // SAFETY: valid pointers.
        assert_eq!(unsafe { sg_lease_get_info(self.0, &mut info) }, sys::SG_OK);
        info
    }

    fn reason(&self) -> &'static str {
        // SAFETY: returns a static C string or NULL.
        let name = unsafe { CStr::from_ptr(sg_reason_name(self.info().reason)) };
        name.to_str().unwrap()
    }

    fn release(&self) -> sg_status {
        // SAFETY: a live lease.
        unsafe { sg_lease_release(self.0) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // SAFETY: our live lease, not used after this.
        assert_eq!(unsafe { sg_lease_destroy(self.0) }, sys::SG_OK);
    }
}

/// A wake callback's target: counts calls, optionally destroys its own attempt from inside.
#[derive(Default)]
struct Wake {
    count: Mutex<u32>,
    cv: Condvar,
    destroy_inside: AtomicPtr<sg_attempt>,
    destroy_status: AtomicI32,
}

unsafe extern "C" fn on_wake(data: *mut c_void) {
    // SAFETY: `data` is the test's `Wake`, alive until the attempt is destroyed.
    let w = unsafe { &*data.cast::<Wake>() };
    let own = w.destroy_inside.swap(ptr::null_mut(), Ordering::SeqCst);
    if !own.is_null() {
        // SAFETY: the attempt this wake belongs to; the test does not touch it again.
        let status = unsafe { sg_attempt_destroy(own) };
        w.destroy_status.store(status, Ordering::SeqCst);
    }
    *w.count.lock().unwrap() += 1;
    w.cv.notify_all();
}

impl Wake {
    fn wait(&self, n: u32) -> bool {
        let count = self.count.lock().unwrap();
        let (count, _) = self
            .cv
            .wait_timeout_while(count, Duration::from_secs(20), |c| *c < n)
            .unwrap();
        *count >= n
    }
}

fn poll(attempt: *mut sg_attempt) -> Result<Option<Lease>, sg_status> {
    let mut lease = ptr::null_mut();
    // SAFETY: a live attempt and a valid out pointer.
    match unsafe { sg_attempt_poll(attempt, &mut lease) } {
        sys::SG_OK => Ok(Some(Lease(lease))),
        sys::SG_PENDING => Ok(None),
        status => Err(status),
    }
}

fn destroy(attempt: *mut sg_attempt) {
    // SAFETY: a live attempt, not used after this.
    assert_eq!(unsafe { sg_attempt_destroy(attempt) }, sys::SG_OK);
}

#[test]
fn every_reason_is_reachable_through_the_c_abi() {
    let gate = TestGate::new(config());
    let first = gate.acquire("s1", 10, true).unwrap();
    assert_eq!(first.reason(), "open");
    assert_eq!(first.release(), sys::SG_OK);

    gate.engine.set(0.9, 0.95, sys::SG_OK);
    let again = gate.acquire("s1", 10, true).unwrap();
    assert_eq!(again.reason(), "reserved_session");
    let resident = gate.acquire("s2", 10, false).unwrap();
    assert_eq!(resident.reason(), "resident_prefix");
    let s = gate.stats();
    assert_eq!(&s.admissions[..4], &[1, 1, 0, 1]);

    // Only engine pressure fails open when the prefix probe cannot answer.
    let engine = TestGate::new(sg_config {
        pressure: sys::SG_PRESSURE_ENGINE,
        ..config()
    });
    engine.engine.set(0.9, 0.0, sys::SG_UNAVAILABLE);
    let blind = engine.acquire("s3", 10, false).unwrap();
    assert_eq!(blind.reason(), "prefix_probe_unavailable");
    let s = engine.stats();
    assert_eq!(
        s.admissions[sys::SG_REASON_PREFIX_PROBE_UNAVAILABLE as usize],
        1
    );
    assert_eq!(s.probe_failures[sys::SG_PROBE_PREFIX], 1);

    let mut bounded = config();
    bounded.has_max_wait = true;
    bounded.max_wait_sec = 0.05;
    let gate = TestGate::new(bounded);
    let _holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 0.0, sys::SG_OK);
    let late = gate.acquire("late", 10, false).unwrap();
    assert_eq!(late.reason(), "max_wait");
    assert!(late.info().wait_sec >= 0.05);
    // Committed pressure: a prefix probe that cannot answer is a miss, so it waits too.
    gate.engine.set(0.9, 0.0, sys::SG_UNAVAILABLE);
    let blind = gate.acquire("blind", 10, false).unwrap();
    assert_eq!(blind.reason(), "max_wait");
}

#[test]
fn a_release_on_another_thread_admits_a_blocked_acquire() {
    let gate = TestGate::new(config());
    let holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 0.0, sys::SG_OK);
    let waiter = thread::scope(|scope| {
        scope.spawn(|| {
            thread::sleep(Duration::from_millis(200));
            gate.engine.set(0.1, 0.0, sys::SG_OK);
            assert_eq!(holder.release(), sys::SG_OK);
        });
        gate.acquire("waiter", 10, false).unwrap()
    });
    assert_eq!(waiter.reason(), "open");
    assert!(waiter.info().wait_sec >= 0.15);
    assert_eq!(holder.release(), sys::SG_STALE);
}

#[test]
fn try_acquire_is_pending_until_woken_then_admitted() {
    let gate = TestGate::new(config());
    let holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 0.0, sys::SG_OK);
    let wake = Wake::default();
    let attempt = gate.try_acquire("waiter", Some(&wake));
    gate.until_waiting(1);
    assert!(poll(attempt).unwrap().is_none());

    thread::scope(|scope| {
        scope.spawn(|| {
            gate.engine.set(0.1, 0.0, sys::SG_OK);
            assert_eq!(holder.release(), sys::SG_OK);
        });
    });
    assert!(wake.wait(1));
    let lease = poll(attempt).unwrap().expect("admitted after the wake");
    assert_eq!(lease.reason(), "open");
    assert_eq!(poll(attempt).err(), Some(sys::SG_STALE));
    destroy(attempt);
}

#[test]
fn destroying_a_pending_attempt_cancels_it_before_returning() {
    let gate = TestGate::new(config());
    let _holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 0.0, sys::SG_OK);
    let wake = Wake::default();
    let attempt = gate.try_acquire("waiter", Some(&wake));
    gate.until_waiting(1);
    destroy(attempt);
    let s = gate.stats();
    assert_eq!((s.waiting, s.pending, s.cancellations), (0, 0, 1));
    // The wake was detached by the destroy, so it never fires.
    assert_eq!(*wake.count.lock().unwrap(), 0);
}

#[test]
fn a_lease_won_but_never_polled_is_released_when_its_attempt_is_destroyed() {
    let gate = TestGate::new(config());
    let wake = Wake::default();
    let attempt = gate.try_acquire("s", Some(&wake));
    assert!(wake.wait(1));
    destroy(attempt);
    let s = gate.stats();
    assert_eq!(s.admissions[sys::SG_REASON_OPEN as usize], 1);
    assert_eq!((s.leases_active, s.leases_dropped_unreleased), (0, 1));
}

#[test]
fn a_newer_attempt_preempts_the_pending_one() {
    let gate = TestGate::new(config());
    let _holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 0.0, sys::SG_OK);
    let wake = Wake::default();
    let older = gate.try_acquire("s", Some(&wake));
    gate.until_waiting(1);
    // A blocking acquire of the same session takes over, then times out itself.
    assert_eq!(
        gate.acquire_within("s", 10, false, 100).err(),
        Some(sys::SG_TIMEOUT)
    );
    assert!(wake.wait(1));
    assert_eq!(poll(older).err(), Some(sys::SG_PREEMPTED));
    destroy(older);
    let s = gate.stats();
    assert_eq!((s.preemptions, s.cancellations, s.pending), (1, 1, 0));
}

#[test]
fn destroying_the_gate_closes_pending_attempts_and_leases_outlive_it() {
    let mut gate = TestGate::new(config());
    let holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 0.0, sys::SG_OK);
    let wake = Wake::default();
    let attempt = gate.try_acquire("orphan", Some(&wake));
    gate.until_waiting(1);
    gate.destroy();
    assert_eq!(
        *wake.count.lock().unwrap(),
        1,
        "woken before destroy returned"
    );
    assert_eq!(poll(attempt).err(), Some(sys::SG_CLOSED));
    destroy(attempt);
    assert_eq!(holder.release(), sys::SG_OK);
}

#[test]
fn a_slow_prefix_callback_counts_as_unavailable_and_destroy_waits_for_it() {
    let mut gate = TestGate::new(sg_config {
        probe_timeout_sec: 0.1,
        // Fails open on the timeout, so the acquire returns while the callback still sleeps.
        pressure: sys::SG_PRESSURE_ENGINE,
        ..config()
    });
    let _holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 1.0, sys::SG_OK);
    gate.engine.answers.lock().unwrap().prefix_delay = Duration::from_millis(600);
    let started = Instant::now();
    let slow = gate.acquire("slow", 10, false).unwrap();
    assert_eq!(slow.reason(), "prefix_probe_unavailable");
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(gate.stats().probe_failures[sys::SG_PROBE_PREFIX], 1);
    // The callback is still sleeping; destroy returns only once it is done.
    assert!(gate.engine.prefix_running.load(Ordering::SeqCst));
    gate.destroy();
    assert!(!gate.engine.prefix_running.load(Ordering::SeqCst));
}

#[test]
fn blocking_calls_from_a_callback_are_refused_not_deadlocked() {
    let gate = TestGate::new(config());
    gate.engine.reenter.store(gate.raw, Ordering::SeqCst);
    let lease = gate.acquire("outer", 10, false).unwrap();
    assert_eq!(lease.reason(), "open");
    assert_eq!(
        gate.engine.reentry_status.load(Ordering::SeqCst),
        sys::SG_WRONG_THREAD
    );
}

#[test]
fn a_wake_callback_may_destroy_its_own_attempt() {
    let gate = TestGate::new(config());
    let wake = Wake::default();
    let _holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 0.0, sys::SG_OK);
    let attempt = gate.try_acquire("s", Some(&wake));
    wake.destroy_inside.store(attempt, Ordering::SeqCst);
    gate.until_waiting(1);
    gate.engine.set(0.1, 0.0, sys::SG_OK);
    drop(_holder);
    assert!(wake.wait(1));
    assert_eq!(wake.destroy_status.load(Ordering::SeqCst), sys::SG_OK);
    // The lease it won was never polled: released by the destroy.
    let deadline = Instant::now() + Duration::from_secs(20);
    while gate.stats().leases_active != 0 {
        assert!(Instant::now() < deadline);
        thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn finish_session_ends_the_window_and_calls_forget() {
    let gate = TestGate::new(config());
    let lease = gate.acquire("s", 10, true).unwrap();
    assert_eq!(lease.release(), sys::SG_OK);
    let mut ended = false;
    // SAFETY: valid pointers.
    let status = unsafe { sg_gate_finish_session(gate.raw, c"s".as_ptr(), 1, &mut ended) };
    assert_eq!((status, ended), (sys::SG_OK, true));
    // SAFETY: valid pointers; `out_ended` may be NULL.
    let status = unsafe { sg_gate_finish_session(gate.raw, c"s".as_ptr(), 1, ptr::null_mut()) };
    assert_eq!(status, sys::SG_OK);
    assert_eq!(gate.engine.forget_calls.load(Ordering::SeqCst), 2);
    assert_eq!(gate.stats().sessions_finished, 1);
}

#[test]
fn a_timeout_cancels_the_attempt_and_bad_timeouts_are_refused() {
    let gate = TestGate::new(config());
    let _holder = gate.acquire("holder", 10, false).unwrap();
    gate.engine.set(0.9, 0.0, sys::SG_OK);
    assert_eq!(
        gate.acquire_within("w", 10, false, 30).err(),
        Some(sys::SG_TIMEOUT)
    );
    assert_eq!(
        gate.acquire_within("w", 10, false, -2).err(),
        Some(sys::SG_INVALID_ARGUMENT)
    );
    let s = gate.stats();
    assert_eq!((s.cancellations, s.pending, s.waiting), (1, 0, 0));
}

#[test]
fn prometheus_text_is_allocated_by_the_library_and_freed_by_it() {
    let gate = TestGate::new(config());
    let _lease = gate.acquire("s", 1, false).unwrap();
    let mut text: *mut c_char = ptr::null_mut();
    let mut len = 0;
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { sg_gate_prometheus(gate.raw, &mut text, &mut len) },
        sys::SG_OK
    );
    // SAFETY: a NUL-terminated string of `len` bytes from the library.
    let s = unsafe { CStr::from_ptr(text) }.to_str().unwrap().to_owned();
    assert_eq!(s.len(), len);
    assert!(s.contains("session_gate_admissions_total{reason=\"open\"} 1\n"));
    assert!(s.contains("session_gate_leases_active 1\n"));
    // SAFETY: the string from `sg_gate_prometheus`, freed once.
    assert_eq!(unsafe { sg_string_free(text) }, sys::SG_OK);
}
