//! The error boundary every export runs inside: status codes, the thread-local last error,
//! panic catching, and the checks that turn C arguments (pointers, ptr + len strings) into Rust.
use std::any::Any;
use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use libc::{c_char, size_t};

use super::sys::{self, sg_status};
use crate::error::Error;

/// Why an export failed: the code it returns and the message `sg_last_error` gives.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: sg_status,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(status: sg_status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn null(what: &str) -> Self {
        Self::new(sys::SG_NULL_POINTER, format!("`{what}` is NULL"))
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        // Exhaustive on purpose: a new error variant must be given a code here.
        let status = match &e {
            Error::InvalidKnob { .. } | Error::InvalidProfile { .. } => sys::SG_INVALID_CONFIG,
            Error::InvalidInput(_) | Error::UnsupportedHashAlgo(_) => sys::SG_INVALID_ARGUMENT,
            Error::ProbeUnavailable(_) => sys::SG_UNAVAILABLE,
            Error::Preempted { .. } => sys::SG_PREEMPTED,
            Error::Timeout { .. } => sys::SG_TIMEOUT,
            Error::StaleHandle(_) => sys::SG_STALE,
        };
        Self::new(status, e.to_string())
    }
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_last_error(message: String) {
    // `try_with`: a call made while this thread's locals are being torn down still returns its
    // code; only the message is lost.
    let _ = LAST_ERROR.try_with(|m| *m.borrow_mut() = message);
}

/// Runs an export's body: a failure becomes its code plus this thread's last error, and a panic
/// becomes `SG_PANIC` instead of unwinding into C (which would abort the caller's process).
pub(crate) fn guard(func: &str, body: impl FnOnce() -> Result<sg_status, Failure>) -> sg_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(status)) => status,
        Ok(Err(f)) => {
            set_last_error(format!("{func}: {}", f.message));
            f.status
        }
        Err(payload) => {
            set_last_error(format!("{func}: panicked: {}", panic_message(&*payload)));
            sys::SG_PANIC
        }
    }
}

/// Like [`guard`] for the few exports that return a value instead of a status: `fallback` on
/// panic.
pub(crate) fn guard_value<T>(func: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(payload) => {
            set_last_error(format!("{func}: panicked: {}", panic_message(&*payload)));
            fallback
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Refuses blocking calls from the gate's own threads (callbacks run there): `block_on` or
/// dropping the runtime from inside it would panic or deadlock.
pub(crate) fn not_on_gate_thread() -> Result<(), Failure> {
    if tokio::runtime::Handle::try_current().is_ok() {
        Err(Failure::new(
            sys::SG_WRONG_THREAD,
            "blocking call from inside a callback (a gate thread); call it from your own thread",
        ))
    } else {
        Ok(())
    }
}

/// A required `T *` argument.
///
/// # Safety
/// `ptr` must be NULL or valid for reads for the returned lifetime.
pub(crate) unsafe fn arg<'a, T>(ptr: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: the caller's contract, NULL checked here.
    unsafe { ptr.as_ref() }.ok_or_else(|| Failure::null(what))
}

/// A required out-parameter; the caller writes through it with `ptr::write` (it may point to
/// uninitialized memory, so no reference is made).
pub(crate) fn out<T>(ptr: *mut T, what: &str) -> Result<*mut T, Failure> {
    if ptr.is_null() {
        Err(Failure::null(what))
    } else {
        Ok(ptr)
    }
}

/// `len` items at `ptr`; NULL is accepted only for an empty slice.
///
/// # Safety
/// `ptr` must be NULL or valid for reads of `len` items for the returned lifetime.
pub(crate) unsafe fn slice_arg<'a, T>(
    ptr: *const T,
    len: size_t,
    what: &str,
) -> Result<&'a [T], Failure> {
    if ptr.is_null() {
        if len == 0 {
            return Ok(&[]);
        }
        return Err(Failure::null(what));
    }
    // SAFETY: the caller's contract; non-NULL checked above.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// A UTF-8 string given as ptr + len.
///
/// # Safety
/// As [`slice_arg`].
pub(crate) unsafe fn str_arg<'a>(
    ptr: *const c_char,
    len: size_t,
    what: &str,
) -> Result<&'a str, Failure> {
    // SAFETY: forwarded contract; `c_char` and `u8` have the same layout.
    let bytes = unsafe { slice_arg(ptr.cast::<u8>(), len, what) }?;
    std::str::from_utf8(bytes).map_err(|e| {
        Failure::new(
            sys::SG_INVALID_ARGUMENT,
            format!("`{what}` is not valid UTF-8: {e}"),
        )
    })
}

/// `timeout_ms` as a deadline: `None` for `SG_WAIT_FOREVER`.
pub(crate) fn timeout_arg(timeout_ms: i64) -> Result<Option<Duration>, Failure> {
    match timeout_ms {
        sys::SG_WAIT_FOREVER => Ok(None),
        ms if ms >= 0 => Ok(Some(Duration::from_millis(ms as u64))),
        ms => Err(Failure::new(
            sys::SG_INVALID_ARGUMENT,
            format!("timeout_ms is {ms}: expected >= 0 or SG_WAIT_FOREVER (-1)"),
        )),
    }
}

/// See `sg_status_name` in the header.
pub(crate) fn status_name(status: sg_status) -> Option<&'static std::ffi::CStr> {
    Some(match status {
        sys::SG_OK => c"SG_OK",
        sys::SG_PENDING => c"SG_PENDING",
        sys::SG_NULL_POINTER => c"SG_NULL_POINTER",
        sys::SG_INVALID_ARGUMENT => c"SG_INVALID_ARGUMENT",
        sys::SG_INVALID_CONFIG => c"SG_INVALID_CONFIG",
        sys::SG_TIMEOUT => c"SG_TIMEOUT",
        sys::SG_PREEMPTED => c"SG_PREEMPTED",
        sys::SG_STALE => c"SG_STALE",
        sys::SG_BUFFER_TOO_SMALL => c"SG_BUFFER_TOO_SMALL",
        sys::SG_WRONG_THREAD => c"SG_WRONG_THREAD",
        sys::SG_CLOSED => c"SG_CLOSED",
        sys::SG_UNAVAILABLE => c"SG_UNAVAILABLE",
        sys::SG_PANIC => c"SG_PANIC",
        sys::SG_INTERNAL => c"SG_INTERNAL",
        _ => return None,
    })
}

/// See `sg_last_error` in the header.
pub(crate) fn copy_last_error(
    buf: *mut c_char,
    buf_len: size_t,
    out_len: *mut size_t,
) -> sg_status {
    if out_len.is_null() || (buf.is_null() && buf_len > 0) {
        // Deliberately not recorded: this call must never replace the message it reports.
        return sys::SG_NULL_POINTER;
    }
    LAST_ERROR
        .try_with(|m| {
            let m = m.borrow();
            let bytes = m.as_bytes();
            // SAFETY: `out_len` is non-NULL (checked) and, by contract, writable.
            unsafe { out_len.write(bytes.len()) };
            if buf_len <= bytes.len() {
                return sys::SG_BUFFER_TOO_SMALL;
            }
            // SAFETY: `buf` holds `buf_len > bytes.len()` bytes by contract; the regions cannot
            // overlap (one is ours).
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
                buf.add(bytes.len()).write(0);
            }
            sys::SG_OK
        })
        .unwrap_or(sys::SG_INTERNAL)
}
