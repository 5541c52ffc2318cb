//! `WakeTimer`: the engine gate's timer (`session_gate/engine/gate_driver.py`). A native thread
//! waits for the book's earliest deadline (a waiter's next poll, `max_wait`, a lease's TTL, the
//! end of a grace window), then calls `fire()`, the driver's wake-up of an idle engine loop.
//!
//! Why native, and why arming it wakes nothing: the book arms the timer from the engine thread
//! on every admit or release that moves a deadline earlier (under pressure, often a few ms
//! ahead: the end of a grace window). A Python timer thread woken there wants the GIL the
//! engine thread holds, and the next arm waits on the lock that thread took: a GIL round trip
//! inside vLLM's step. And waking any thread parked on another CPU costs the waker a futex call
//! and an inter-processor interrupt: 15-20 us per arm, measured inside the engine loop on a
//! 2-core VM. So arming only writes the deadline under an uncontended mutex. While a deadline
//! is armed the thread re-reads it every [`RECHECK`] (it fires at most that late); a busy
//! engine does not wait for it: the engine thread checks the deadline after every step
//! ([`WakeTimer::take_due`]) and ticks itself. The thread is signalled only when it sleeps with
//! nothing armed (the first deadline after a quiet spell), and takes the GIL only to fire.
//!
//! Deadlines are in `time.monotonic()` seconds, read here as `CLOCK_MONOTONIC`, the clock
//! `time.monotonic()` reads on Linux.
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::guard::no_panic;

/// How often the thread re-reads an armed deadline: the most a deadline fires late on an idle
/// engine (a busy one checks it after every step).
const RECHECK: Duration = Duration::from_millis(20);
/// How long the thread sleeps with nothing armed (an arm signals it).
const IDLE: Duration = Duration::from_secs(1);

struct State {
    /// The earliest deadline, monotonic seconds (`INFINITY`: none).
    at: f64,
    /// The thread sleeps with nothing armed: an arm signals it.
    idle: bool,
    /// The thread is to end.
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    cond: Condvar,
}

impl Shared {
    /// The state; no panic can leave it half-updated (plain fields).
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells the thread to end, and wakes it.
    fn stop(&self) {
        self.lock().stop = true;
        self.cond.notify_one();
    }
}

/// `time.monotonic()` now, in seconds.
fn monotonic() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The timer thread: waits for the deadline, takes it, fires; ends on `stop` or when the
/// interpreter can no longer be attached to (it is shutting down).
fn run(shared: Arc<Shared>, fire: Py<PyAny>) {
    loop {
        let mut state = shared.lock();
        loop {
            if state.stop {
                return;
            }
            let delay = state.at - monotonic();
            if delay <= 0.0 {
                break;
            }
            state.idle = !delay.is_finite();
            let wait = if state.idle {
                IDLE
            } else {
                RECHECK.min(Duration::from_secs_f64(delay))
            };
            state = shared
                .cond
                .wait_timeout(state, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.idle = false;
        }
        state.at = f64::INFINITY;
        drop(state);
        let attached = Python::try_attach(|py| {
            if let Err(e) = fire.call0(py) {
                // `fire` logs its own failures; anything it lets through is reported, not lost.
                e.write_unraisable(py, None);
            }
        });
        if attached.is_none() {
            // The interpreter is shutting down: `fire` cannot run, and its reference is left
            // to the process's end (dropping it needs the interpreter too).
            std::mem::forget(fire);
            return;
        }
    }
}

#[pyclass(name = "WakeTimer", module = "session_gate._native", frozen)]
pub(crate) struct WakeTimer {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The process that started the thread (a forked child has no such thread to join).
    pid: u32,
}

#[pymethods]
impl WakeTimer {
    /// A timer that calls `fire()` (no arguments; on its own thread, with the GIL) when the
    /// earliest deadline given to [`Self::arm`] passes, unless [`Self::take_due`] took it
    /// first. Its thread starts here.
    #[new]
    fn new(fire: Py<PyAny>) -> PyResult<Self> {
        no_panic("WakeTimer", || {
            let shared = Arc::new(Shared {
                state: Mutex::new(State {
                    at: f64::INFINITY,
                    idle: false,
                    stop: false,
                }),
                cond: Condvar::new(),
            });
            let theirs = Arc::clone(&shared);
            let thread = std::thread::Builder::new()
                .name("session_gate-timer".into())
                .spawn(move || run(theirs, fire))
                .map_err(|e| PyRuntimeError::new_err(format!("timer thread: {e}")))?;
            Ok(Self {
                shared,
                thread: Mutex::new(Some(thread)),
                pid: std::process::id(),
            })
        })
    }

    /// Fires at monotonic time `at` unless an earlier deadline is armed (NaN is ignored).
    fn arm(&self, at: f64) {
        let mut state = self.shared.lock();
        if at < state.at {
            state.at = at;
            // Only a thread asleep with nothing armed needs a signal (sent after the unlock,
            // so that it does not wake only to wait for the lock); otherwise it re-reads the
            // deadline within RECHECK.
            let wake = state.idle;
            state.idle = false;
            drop(state);
            if wake {
                self.shared.cond.notify_one();
            }
        }
    }

    /// Whether the deadline has passed; if so it is taken (the thread does not fire for it).
    /// The engine thread asks after every step, so a busy engine ticks on time and the thread
    /// never takes its GIL.
    fn take_due(&self) -> bool {
        let mut state = self.shared.lock();
        if state.at <= monotonic() {
            state.at = f64::INFINITY;
            return true;
        }
        false
    }

    /// The armed deadline (None: nothing armed).
    #[getter]
    fn deadline(&self) -> Option<f64> {
        let at = self.shared.lock().at;
        at.is_finite().then_some(at)
    }

    /// Whether the thread is running (False after [`Self::stop`], and in a forked child).
    #[getter]
    fn alive(&self) -> bool {
        self.pid == std::process::id()
            && self
                .thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .is_some_and(|t| !t.is_finished())
    }

    /// Ends the thread and waits for it (idempotent). A fire under way finishes first.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        no_panic("WakeTimer.stop", || {
            self.shared.stop();
            let thread = self
                .thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            match thread {
                // Detached: a fire under way needs the GIL to finish.
                Some(thread) if self.pid == std::process::id() => {
                    let _ = py.detach(|| thread.join());
                }
                // A forked child: the thread lives (or lived) in the parent only.
                Some(thread) => std::mem::forget(thread),
                None => {}
            }
            Ok(())
        })
    }
}

impl Drop for WakeTimer {
    fn drop(&mut self) {
        // Not joined here (a drop may run with the GIL held while the thread waits for it to
        // fire): told to end, it does at its next wake-up.
        self.shared.stop();
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<WakeTimer>()
}
