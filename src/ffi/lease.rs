//! `sg_lease`: one admission, releasable from any thread.
use std::sync::{Mutex, MutexGuard};

use libc::{c_char, size_t};

use super::gate_handle::reason_code;
use super::status::{Failure, arg, guard, out};
use super::sys::{self, sg_lease, sg_lease_info, sg_status};
use crate::gate::{Admission, Lease};

/// What an `sg_lease *` points to. The admission and session id are copied out of the lease so
/// reading them needs no lock and the session id's address stays put until destroy.
pub(crate) struct LeaseHandle {
    // A mutex, not `&mut` access: the header lets any thread release, so two threads may race.
    lease: Mutex<Lease>,
    admission: Admission,
    session_id: Box<str>,
}

impl LeaseHandle {
    /// Boxes `lease` for C; `sg_lease_destroy` takes it back.
    pub(crate) fn into_raw(lease: Lease) -> *mut sg_lease {
        let handle = Box::new(Self {
            admission: lease.admission().clone(),
            session_id: lease.session_id().into(),
            lease: Mutex::new(lease),
        });
        Box::into_raw(handle).cast()
    }

    /// # Safety
    /// `ptr` must be NULL or a live lease.
    unsafe fn from_ptr<'a>(ptr: *const sg_lease) -> Result<&'a Self, Failure> {
        // SAFETY: forwarded contract; every `sg_lease *` we hand out is a `LeaseHandle`.
        unsafe { arg(ptr.cast::<LeaseHandle>(), "lease") }
    }

    fn lock(&self) -> MutexGuard<'_, Lease> {
        // Releasing cannot leave the lease half-done, so a poisoned lock is still usable.
        self.lease.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// See `sg_lease_get_info` in `include/session_gate.h`.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_lease_get_info(
    lease: *const sg_lease,
    out_info: *mut sg_lease_info,
) -> sg_status {
    guard("sg_lease_get_info", || {
        // SAFETY: forwarded contract.
        let handle = unsafe { LeaseHandle::from_ptr(lease) }?;
        let out_info = out(out_info, "out")?;
        let a = &handle.admission;
        let info = sg_lease_info {
            lease_id: a.lease.0,
            reason: reason_code(a.reason),
            wait_sec: a.wait_sec,
            has_usage: a.usage.is_some(),
            usage: a.usage.unwrap_or(0.0),
            has_pressure: a.pressure.is_some(),
            pressure: a.pressure.unwrap_or(0.0),
            has_hit_ratio: a.hit_ratio.is_some(),
            hit_ratio: a.hit_ratio.unwrap_or(0.0),
            has_working_set: a.working_set_blocks.is_some(),
            working_set_blocks: a.working_set_blocks.unwrap_or(0),
            retain_session: a.retain_session,
            reserved: a.reserved,
            revoked: a.revoked,
            num_preempted: a.num_preempted,
            released: handle.lock().is_released(),
        };
        // SAFETY: non-NULL (checked) and writable by contract.
        unsafe { out_info.write(info) };
        Ok(sys::SG_OK)
    })
}

/// See `sg_lease_session_id` in the header.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_lease_session_id(
    lease: *const sg_lease,
    out_ptr: *mut *const c_char,
    out_len: *mut size_t,
) -> sg_status {
    guard("sg_lease_session_id", || {
        // SAFETY: forwarded contract.
        let handle = unsafe { LeaseHandle::from_ptr(lease) }?;
        let out_ptr = out(out_ptr, "out_ptr")?;
        let out_len = out(out_len, "out_len")?;
        // SAFETY: both non-NULL (checked) and writable by contract; the boxed str lives as long
        // as the handle.
        unsafe {
            out_ptr.write(handle.session_id.as_ptr().cast());
            out_len.write(handle.session_id.len());
        }
        Ok(sys::SG_OK)
    })
}

/// See `sg_lease_release` in the header.
///
/// # Safety
/// `lease` must be NULL or a live lease.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_lease_release(lease: *mut sg_lease) -> sg_status {
    guard("sg_lease_release", || {
        // SAFETY: forwarded contract.
        let handle = unsafe { LeaseHandle::from_ptr(lease) }?;
        if handle.lock().release() {
            Ok(sys::SG_OK)
        } else {
            Err(Failure::new(
                sys::SG_STALE,
                format!("lease {} was released already", handle.admission.lease.0),
            ))
        }
    })
}

/// See `sg_lease_destroy` in the header.
///
/// # Safety
/// `lease` must be NULL or a live lease; no other call on it may be running or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_lease_destroy(lease: *mut sg_lease) -> sg_status {
    guard("sg_lease_destroy", || {
        if !lease.is_null() {
            // SAFETY: a live lease from this module, given up by the caller. Dropping the
            // `Lease` releases it if nobody did.
            drop(unsafe { Box::from_raw(lease.cast::<LeaseHandle>()) });
        }
        Ok(sys::SG_OK)
    })
}
