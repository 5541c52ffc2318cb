//! `sg_attempt`: the non-blocking try/poll pair for event-loop proxies.
//!
//! `sg_gate_try_acquire` spawns [`Gate::acquire`](crate::gate::Gate::acquire) onto the gate's
//! runtime and hands back a handle; the task sends its outcome through a oneshot channel and
//! fires the caller's wake callback, and `sg_attempt_poll` reads the channel without blocking.
//! Driving the tokio gate, rather than a second copy of the driver loop over `GateCore`, keeps
//! one implementation of probes, timeouts and wake-ups; the acquire future is cancel safe, so
//! aborting the task is all that destroying a pending attempt takes.
use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll};

use libc::c_void;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use super::gate_handle::{GateHandle, Request};
use super::lease::LeaseHandle;
use super::status::{Failure, arg, guard, out};
use super::sys::{self, sg_attempt, sg_gate, sg_lease, sg_request, sg_status, sg_wake_fn};
use crate::error::Result;
use crate::gate::Lease;

type WakeFn = unsafe extern "C" fn(*mut c_void);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing here can be left half-updated by a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Wake {
    f: WakeFn,
    data: *mut c_void,
}

// SAFETY: the header makes the caller promise `wake(wake_data)` may be called from a gate thread.
unsafe impl Send for Wake {}

thread_local! {
    /// The slot whose wake callback this thread is running, if any: lets that callback destroy
    /// its own attempt (or another) without deadlocking on the slot or on the task's end.
    static FIRING: Cell<*const Shared> = const { Cell::new(std::ptr::null()) };
}

/// What the attempt's task and its handle share.
struct Shared {
    /// The caller's wake callback until it is called or detached. Called with the lock held, so
    /// that once `detach` has taken the lock no call is running or will start.
    wake: Mutex<Option<Wake>>,
    /// Set when the task's future has been dropped (run to completion, aborted or shut down).
    finished: Mutex<bool>,
    finished_cv: Condvar,
}

impl Shared {
    fn fire(&self) {
        let mut slot = lock(&self.wake);
        if let Some(w) = slot.take() {
            let outer = FIRING.replace(self);
            // SAFETY: the caller's callback and data, valid until it is called or the attempt
            // is destroyed (which detaches under this same lock first).
            unsafe { (w.f)(w.data) };
            FIRING.set(outer);
        }
    }

    fn detach(&self) {
        if std::ptr::eq(FIRING.get(), self) {
            // Called from inside this attempt's own wake: it was taken already, and the lock
            // is ours.
            return;
        }
        lock(&self.wake).take();
    }

    fn wait_finished(&self) {
        let mut done = lock(&self.finished);
        while !*done {
            done = self
                .finished_cv
                .wait(done)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The task's end of the attempt: sends the outcome, and on drop — whether the acquire
/// completed, was aborted, or the runtime shut down — fires the wake and marks it finished.
struct Outcome {
    tx: Option<oneshot::Sender<Result<Lease>>>,
    shared: Arc<Shared>,
}

impl Drop for Outcome {
    fn drop(&mut self) {
        // Dropping an unused sender is what tells the poller `SG_CLOSED`.
        self.tx.take();
        self.shared.fire();
        *lock(&self.shared.finished) = true;
        self.shared.finished_cv.notify_all();
    }
}

/// The spawned task. Field order is drop order: the acquire future (whose drop cancels the
/// attempt in the core) goes before the outcome (which reports the end), so when the handle
/// sees "finished" the attempt is already out of the queue.
struct AttemptTask {
    acquire: Pin<Box<dyn Future<Output = Result<Lease>> + Send>>,
    outcome: Outcome,
}

impl Future for AttemptTask {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        match this.acquire.as_mut().poll(cx) {
            Poll::Ready(r) => {
                if let Some(tx) = this.outcome.tx.take() {
                    // A receiver gone (attempt destroyed) hands the lease back; dropping it
                    // releases it.
                    let _ = tx.send(r);
                }
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

enum State {
    Pending(oneshot::Receiver<Result<Lease>>),
    Done,
}

/// What an `sg_attempt *` points to.
struct AttemptHandle {
    state: Mutex<State>,
    shared: Arc<Shared>,
    task: AbortHandle,
}

/// Starts an attempt in the background. See `sg_gate_try_acquire` in
/// `include/session_gate.h`.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says; `wake(wake_data)` must be callable
/// from another thread until it is called or the attempt is destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_gate_try_acquire(
    gate: *const sg_gate,
    request: *const sg_request,
    wake: sg_wake_fn,
    wake_data: *mut c_void,
    out_attempt: *mut *mut sg_attempt,
) -> sg_status {
    guard("sg_gate_try_acquire", || {
        // SAFETY: forwarded contract.
        let handle = unsafe { GateHandle::from_ptr(gate) }?;
        // SAFETY: forwarded contract.
        let req = unsafe { Request::read(request) }?;
        let out_attempt = out(out_attempt, "out_attempt")?;
        let shared = Arc::new(Shared {
            wake: Mutex::new(wake.map(|f: WakeFn| Wake { f, data: wake_data })),
            finished: Mutex::new(false),
            finished_cv: Condvar::new(),
        });
        let (tx, rx) = oneshot::channel();
        // Owned copies: the task outlives this call.
        let gate = handle.gate.clone();
        let session = req.session_id.to_owned();
        let prompt = req.prompt_ids.to_vec();
        let (max_tokens, retain) = (req.max_tokens, req.retain_session);
        let task = AttemptTask {
            acquire: Box::pin(
                async move { gate.acquire(&session, &prompt, max_tokens, retain).await },
            ),
            outcome: Outcome {
                tx: Some(tx),
                shared: Arc::clone(&shared),
            },
        };
        let task = handle.runtime.spawn(task).abort_handle();
        let attempt = Box::new(AttemptHandle {
            state: Mutex::new(State::Pending(rx)),
            shared,
            task,
        });
        // SAFETY: non-NULL (checked) and writable by contract.
        unsafe { out_attempt.write(Box::into_raw(attempt).cast()) };
        Ok(sys::SG_OK)
    })
}

/// Checks an attempt without blocking. See `sg_attempt_poll` in the header.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_attempt_poll(
    attempt: *mut sg_attempt,
    out_lease: *mut *mut sg_lease,
) -> sg_status {
    guard("sg_attempt_poll", || {
        // SAFETY: forwarded contract; every `sg_attempt *` we hand out is an `AttemptHandle`.
        let attempt = unsafe { arg(attempt.cast_const().cast::<AttemptHandle>(), "attempt") }?;
        let out_lease = out(out_lease, "out_lease")?;
        let mut state = lock(&attempt.state);
        let State::Pending(rx) = &mut *state else {
            return Err(Failure::new(sys::SG_STALE, "the attempt has ended already"));
        };
        let outcome = match rx.try_recv() {
            Err(oneshot::error::TryRecvError::Empty) => return Ok(sys::SG_PENDING),
            Err(oneshot::error::TryRecvError::Closed) => Err(Failure::new(
                sys::SG_CLOSED,
                "the gate was destroyed while the attempt was pending",
            )),
            Ok(r) => r.map_err(Failure::from),
        };
        *state = State::Done;
        let lease = outcome?;
        // SAFETY: non-NULL (checked) and writable by contract.
        unsafe { out_lease.write(LeaseHandle::into_raw(lease)) };
        Ok(sys::SG_OK)
    })
}

/// Destroys an attempt, cancelling it if pending. See `sg_attempt_destroy` in the header.
///
/// # Safety
/// `attempt` must be NULL or a live attempt; no other call on it may be running or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_attempt_destroy(attempt: *mut sg_attempt) -> sg_status {
    guard("sg_attempt_destroy", || {
        if attempt.is_null() {
            return Ok(sys::SG_OK);
        }
        // SAFETY: a live attempt from `sg_gate_try_acquire`, given up by the caller.
        let attempt = unsafe { Box::from_raw(attempt.cast::<AttemptHandle>()) };
        attempt.shared.detach();
        attempt.task.abort();
        // Wait until the task's future is gone, so the attempt has left the queue when this
        // returns. Not from a gate thread or a wake callback: the task is dropped by one of
        // those, possibly this very thread, after we return.
        let in_callback = !FIRING.get().is_null();
        if !in_callback && tokio::runtime::Handle::try_current().is_err() {
            attempt.shared.wait_finished();
        }
        // Dropping the receiver drops a lease that was won but never polled, releasing it.
        drop(attempt);
        Ok(sys::SG_OK)
    })
}
