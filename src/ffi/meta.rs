//! The exports about the library itself: version, names of codes, and the last error.
use libc::{c_char, size_t};

use super::status::{copy_last_error, guard_value, status_name};
use super::sys::{self, sg_reason, sg_status};

/// The loaded library's version. See `sg_version` in `include/session_gate.h`.
#[unsafe(no_mangle)]
pub extern "C" fn sg_version() -> *const c_char {
    // The header's SG_VERSION is held equal to this at compile time (`abi_check`).
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// See `sg_status_name` in the header.
#[unsafe(no_mangle)]
pub extern "C" fn sg_status_name(status: sg_status) -> *const c_char {
    guard_value("sg_status_name", std::ptr::null(), || {
        status_name(status).map_or(std::ptr::null(), |n| n.as_ptr())
    })
}

/// See `sg_reason_name` in the header.
#[unsafe(no_mangle)]
pub extern "C" fn sg_reason_name(reason: sg_reason) -> *const c_char {
    guard_value("sg_reason_name", std::ptr::null(), || {
        let name = match reason {
            sys::SG_REASON_OPEN => c"open",
            sys::SG_REASON_RESERVED_SESSION => c"reserved_session",
            sys::SG_REASON_PREFIX_PROBE_UNAVAILABLE => c"prefix_probe_unavailable",
            sys::SG_REASON_RESIDENT_PREFIX => c"resident_prefix",
            sys::SG_REASON_MAX_WAIT => c"max_wait",
            sys::SG_REASON_OFFLOADED_PREFIX => c"offloaded_prefix",
            _ => return std::ptr::null(),
        };
        name.as_ptr()
    })
}

/// Copies this thread's last error message. See `sg_last_error` in the header.
///
/// # Safety
/// `buf` must be NULL or writable for `buf_len` bytes; `out_len` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_last_error(
    buf: *mut c_char,
    buf_len: size_t,
    out_len: *mut size_t,
) -> sg_status {
    // Not `guard`: a failure here must not overwrite the message being read.
    guard_value("sg_last_error", sys::SG_PANIC, || {
        copy_last_error(buf, buf_len, out_len)
    })
}
