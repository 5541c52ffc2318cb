//! `sg_gate`: the tokio [`Gate`] plus the runtime that drives it, and its blocking calls.
//!
//! # Why a multi-thread runtime with one worker
//!
//! The try/poll pair needs attempts to make progress while the caller is not inside the library
//! (an event loop only polls after its wake callback fires), and waiting attempts need timers
//! that fire on their own; so the gate needs a thread of its own, and a current-thread runtime
//! per call would not do. The gate's own work is a few microseconds of bookkeeping under one
//! lock, so one worker is plenty; probe callbacks, which may be slow, run on the runtime's
//! blocking pool (see `probe`). Blocking `sg_gate_acquire` calls `block_on` on the caller's
//! thread, so many callers wait in parallel without occupying the worker.
use std::ffi::CString;
use std::sync::Arc;

use libc::{c_char, size_t};
use tokio::runtime::Runtime;

use super::config::to_gate_config;
use super::lease::LeaseHandle;
use super::probe::CallbackProbe;
use super::status::{
    Failure, arg, guard, not_on_gate_thread, out, slice_arg, str_arg, timeout_arg,
};
use super::sys::{self, sg_config, sg_gate, sg_lease, sg_probe, sg_request, sg_stats, sg_status};
use crate::error::Error;
use crate::gate::{Gate, ProbeKind, Reason};

/// What an `sg_gate *` points to.
pub(crate) struct GateHandle {
    // Dropped first: its shutdown cancels spawned attempts and waits for running callbacks
    // while the gate they use is still alive.
    pub(crate) runtime: Runtime,
    pub(crate) gate: Gate,
}

impl GateHandle {
    /// # Safety
    /// `ptr` must be NULL or a live gate from `sg_gate_create`.
    pub(crate) unsafe fn from_ptr<'a>(ptr: *const sg_gate) -> Result<&'a Self, Failure> {
        // SAFETY: forwarded contract; every `sg_gate *` we hand out is a `GateHandle`.
        unsafe { arg(ptr.cast::<GateHandle>(), "gate") }
    }
}

/// A request's fields, checked.
pub(crate) struct Request<'a> {
    pub(crate) session_id: &'a str,
    pub(crate) prompt_ids: &'a [u32],
    /// `None` for `SG_MAX_TOKENS_DEFAULT`: the gate counts its `default_max_tokens`.
    pub(crate) max_tokens: Option<usize>,
    pub(crate) retain_session: bool,
}

impl<'a> Request<'a> {
    /// # Safety
    /// `ptr` must be NULL or point to an `sg_request` whose pointers are valid as the header
    /// says, for `'a`.
    pub(crate) unsafe fn read(ptr: *const sg_request) -> Result<Self, Failure> {
        // SAFETY: forwarded contract (here and below).
        let r = unsafe { arg(ptr, "request") }?;
        Ok(Self {
            session_id: unsafe { str_arg(r.session_id, r.session_id_len, "request->session_id") }?,
            prompt_ids: unsafe { slice_arg(r.prompt_ids, r.prompt_len, "request->prompt_ids") }?,
            max_tokens: (r.max_tokens != sys::SG_MAX_TOKENS_DEFAULT).then_some(r.max_tokens),
            retain_session: r.retain_session,
        })
    }
}

/// Creates a gate. See `sg_gate_create` in `include/session_gate.h`.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says; the probe's callbacks and
/// `user_data` must stay valid until `sg_gate_destroy` returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_gate_create(
    config: *const sg_config,
    probe: *const sg_probe,
    out_gate: *mut *mut sg_gate,
) -> sg_status {
    guard("sg_gate_create", || {
        // SAFETY: forwarded contract.
        let config = unsafe { arg(config, "config") }?;
        // SAFETY: forwarded contract.
        let probe = unsafe { arg(probe, "probe") }?;
        let out_gate = out(out_gate, "out_gate")?;
        let config = to_gate_config(config)?;
        let probe = CallbackProbe::new(probe)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("session-gate")
            .enable_time()
            .build()
            .map_err(|e| Failure::new(sys::SG_INTERNAL, format!("cannot start runtime: {e}")))?;
        let gate = Gate::new(Arc::new(probe), config)?;
        let handle = Box::new(GateHandle { runtime, gate });
        // SAFETY: non-NULL (checked) and writable by contract.
        unsafe { out_gate.write(Box::into_raw(handle).cast()) };
        Ok(sys::SG_OK)
    })
}

/// Destroys a gate. See `sg_gate_destroy` in the header.
///
/// # Safety
/// `gate` must be NULL or a live gate; no other call on it may be running or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_gate_destroy(gate: *mut sg_gate) -> sg_status {
    guard("sg_gate_destroy", || {
        if gate.is_null() {
            return Ok(sys::SG_OK);
        }
        not_on_gate_thread()?;
        // SAFETY: a live gate from `sg_gate_create`, given up by the caller.
        drop(unsafe { Box::from_raw(gate.cast::<GateHandle>()) });
        Ok(sys::SG_OK)
    })
}

/// Blocks until admitted. See `sg_gate_acquire` in the header.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_gate_acquire(
    gate: *const sg_gate,
    request: *const sg_request,
    timeout_ms: i64,
    out_lease: *mut *mut sg_lease,
) -> sg_status {
    guard("sg_gate_acquire", || {
        // SAFETY: forwarded contract.
        let handle = unsafe { GateHandle::from_ptr(gate) }?;
        // SAFETY: forwarded contract.
        let req = unsafe { Request::read(request) }?;
        let out_lease = out(out_lease, "out_lease")?;
        let timeout = timeout_arg(timeout_ms)?;
        not_on_gate_thread()?;
        let acquire = handle.gate.acquire(
            req.session_id,
            req.prompt_ids,
            req.max_tokens,
            req.retain_session,
        );
        let lease = handle.runtime.block_on(async {
            let Some(limit) = timeout else {
                return acquire.await;
            };
            // Dropping `acquire` on timeout cancels the attempt in the core (cancel safe).
            tokio::time::timeout(limit, acquire)
                .await
                .unwrap_or_else(|_| {
                    Err(Error::Timeout {
                        session_id: req.session_id.to_string(),
                        waited_sec: limit.as_secs_f64(),
                    })
                })
        })?;
        // SAFETY: non-NULL (checked) and writable by contract.
        unsafe { out_lease.write(LeaseHandle::into_raw(lease)) };
        Ok(sys::SG_OK)
    })
}

/// Ends a session's ownership window. See `sg_gate_finish_session` in the header.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_gate_finish_session(
    gate: *const sg_gate,
    session_id: *const c_char,
    session_id_len: size_t,
    out_ended: *mut bool,
) -> sg_status {
    guard("sg_gate_finish_session", || {
        // SAFETY: forwarded contract.
        let handle = unsafe { GateHandle::from_ptr(gate) }?;
        // SAFETY: forwarded contract.
        let session_id = unsafe { str_arg(session_id, session_id_len, "session_id") }?;
        not_on_gate_thread()?;
        let ended = handle
            .runtime
            .block_on(handle.gate.finish_session(session_id));
        if !out_ended.is_null() {
            // SAFETY: non-NULL and writable by contract.
            unsafe { out_ended.write(ended) };
        }
        Ok(sys::SG_OK)
    })
}

/// The C code of a reason.
pub(crate) fn reason_code(r: Reason) -> sys::sg_reason {
    match r {
        Reason::Open => sys::SG_REASON_OPEN,
        Reason::ReservedSession => sys::SG_REASON_RESERVED_SESSION,
        Reason::PrefixProbeUnavailable => sys::SG_REASON_PREFIX_PROBE_UNAVAILABLE,
        Reason::ResidentPrefix => sys::SG_REASON_RESIDENT_PREFIX,
        Reason::MaxWait => sys::SG_REASON_MAX_WAIT,
        Reason::OffloadedPrefix => sys::SG_REASON_OFFLOADED_PREFIX,
    }
}

fn probe_index(k: ProbeKind) -> usize {
    match k {
        ProbeKind::Usage => sys::SG_PROBE_USAGE,
        ProbeKind::Prefix => sys::SG_PROBE_PREFIX,
        ProbeKind::Forget => sys::SG_PROBE_FORGET,
    }
}

/// A statistics snapshot. See `sg_gate_stats` in the header.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_gate_stats(
    gate: *const sg_gate,
    out_stats: *mut sg_stats,
) -> sg_status {
    guard("sg_gate_stats", || {
        // SAFETY: forwarded contract.
        let handle = unsafe { GateHandle::from_ptr(gate) }?;
        let out_stats = out(out_stats, "out")?;
        let s = handle.gate.stats();
        let mut c = sg_stats {
            attempts: s.attempts,
            revocations: s.revocations,
            idle_engine_yields: s.idle_engine_yields,
            preemptions: s.preemptions,
            cancellations: s.cancellations,
            leases_released: s.leases_released,
            leases_dropped_unreleased: s.leases_dropped_unreleased,
            grace_expired: s.grace_expired,
            sessions_finished: s.sessions_finished,
            leases_active: s.leases_active,
            reservations_held: s.reservations_held,
            reservations_idle: s.reservations_idle,
            committed_blocks: s.committed_blocks,
            pending: s.pending,
            waiting: s.waiting,
            sessions: s.sessions,
            wait_count: s.wait.count,
            wait_sum_sec: s.wait.sum,
            ..Default::default()
        };
        for r in Reason::ALL {
            c.admissions[reason_code(r) as usize] = s.admitted(r);
        }
        for k in ProbeKind::ALL {
            let p = s.probe(k);
            c.probe_calls[probe_index(k)] = p.latency.count;
            c.probe_failures[probe_index(k)] = p.failures;
        }
        // SAFETY: non-NULL (checked) and writable by contract.
        unsafe { out_stats.write(c) };
        Ok(sys::SG_OK)
    })
}

/// Prometheus text, allocated here. See `sg_gate_prometheus` in the header.
///
/// # Safety
/// Each pointer must be NULL or valid as the header says.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_gate_prometheus(
    gate: *const sg_gate,
    out_text: *mut *mut c_char,
    out_len: *mut size_t,
) -> sg_status {
    guard("sg_gate_prometheus", || {
        // SAFETY: forwarded contract.
        let handle = unsafe { GateHandle::from_ptr(gate) }?;
        let out_text = out(out_text, "out_text")?;
        let out_len = out(out_len, "out_len")?;
        let text = CString::new(handle.gate.prometheus()).map_err(|e| {
            Failure::new(sys::SG_INTERNAL, format!("metrics text holds a NUL: {e}"))
        })?;
        let len = text.as_bytes().len();
        // SAFETY: both non-NULL (checked) and writable by contract. Ownership of the string
        // goes to the caller until `sg_string_free` takes it back.
        unsafe {
            out_len.write(len);
            out_text.write(text.into_raw());
        }
        Ok(sys::SG_OK)
    })
}

/// Frees text from `sg_gate_prometheus`. See `sg_string_free` in the header.
///
/// # Safety
/// `text` must be NULL or a string from `sg_gate_prometheus` not freed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_string_free(text: *mut c_char) -> sg_status {
    guard("sg_string_free", || {
        if !text.is_null() {
            // SAFETY: made by `CString::into_raw` in `sg_gate_prometheus` (contract).
            drop(unsafe { CString::from_raw(text) });
        }
        Ok(sys::SG_OK)
    })
}
