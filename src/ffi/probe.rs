//! `sg_probe`: the caller's C callbacks as a [`Probe`].
//!
//! Each call runs on tokio's blocking pool, not on the gate's worker: a C callback is
//! synchronous and may take as long as the engine does, and running it there keeps the worker
//! free and lets `probe_timeout_sec` cut a slow call off (its late answer is dropped). The
//! runtime's shutdown waits for the blocking pool, which is what lets the header promise that no
//! callback runs after `sg_gate_destroy` returns.
use libc::{c_char, c_void, size_t};

use super::status::Failure;
use super::sys::{self, sg_prefix, sg_probe, sg_status, sg_usage};
use crate::error::{Error, Result};
use crate::gate::{PrefixReport, Probe, ProbeFuture, UsageReport};

type UsageFn = unsafe extern "C" fn(*mut c_void, *mut sg_usage) -> sg_status;
type PrefixFn = unsafe extern "C" fn(
    *mut c_void,
    *const c_char,
    size_t,
    *const u32,
    size_t,
    *mut sg_prefix,
) -> sg_status;
type ForgetFn = unsafe extern "C" fn(*mut c_void, *const c_char, size_t) -> sg_status;

/// The caller's `user_data`. The header makes the caller promise it may be used from the gate's
/// threads, concurrently, until `sg_gate_destroy` returns.
#[derive(Clone, Copy)]
struct UserData(*mut c_void);

// SAFETY: see the type's docs; the pointer is only ever handed back to the caller's callbacks.
unsafe impl Send for UserData {}
// SAFETY: as above.
unsafe impl Sync for UserData {}

impl UserData {
    /// A method, not a field access, so closures capture the `Send` wrapper and not the pointer.
    fn get(self) -> *mut c_void {
        self.0
    }
}

/// A [`Probe`] over C callbacks.
pub(crate) struct CallbackProbe {
    usage: UsageFn,
    prefix: PrefixFn,
    forget: Option<ForgetFn>,
    user_data: UserData,
}

impl CallbackProbe {
    /// Checks the required callbacks are there.
    pub(crate) fn new(p: &sg_probe) -> Result<Self, Failure> {
        Ok(Self {
            usage: p.usage.ok_or_else(|| Failure::null("probe->usage"))?,
            prefix: p.prefix.ok_or_else(|| Failure::null("probe->prefix"))?,
            forget: p.forget,
            user_data: UserData(p.user_data),
        })
    }
}

/// Runs one callback on the blocking pool.
async fn call<R: Send + 'static>(
    name: &'static str,
    f: impl FnOnce() -> (sg_status, R) + Send + 'static,
) -> Result<R> {
    let (status, value) = tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::ProbeUnavailable(format!("{name} callback did not complete: {e}")))?;
    if status == sys::SG_OK {
        Ok(value)
    } else {
        let code = super::status::status_name(status)
            .map_or_else(|| status.to_string(), |n| n.to_string_lossy().into_owned());
        Err(Error::ProbeUnavailable(format!(
            "{name} callback returned {code}"
        )))
    }
}

impl Probe for CallbackProbe {
    fn usage(&self) -> ProbeFuture<'_, UsageReport> {
        let (f, data) = (self.usage, self.user_data);
        Box::pin(async move {
            let u = call("usage", move || {
                let mut u = sg_usage::default();
                // SAFETY: `f` and `data` are valid and thread-safe until sg_gate_destroy
                // returns (the caller's promise), and destroy waits for this call. `u` is ours.
                let status = unsafe { f(data.get(), &mut u) };
                (status, u)
            })
            .await?;
            Ok(UsageReport {
                kv_cache_usage: u.kv_cache_usage,
                num_blocks: u.num_blocks,
                num_free_blocks: u.num_free_blocks,
                num_cached_free_blocks: u
                    .has_num_cached_free_blocks
                    .then_some(u.num_cached_free_blocks),
                block_size: u.block_size,
                offload_num_blocks: u.has_offload_blocks.then_some(u.offload_num_blocks),
                offload_used_blocks: u.has_offload_blocks.then_some(u.offload_used_blocks),
                num_running_reqs: u.has_num_reqs.then_some(u.num_running_reqs),
                num_waiting_reqs: u.has_num_reqs.then_some(u.num_waiting_reqs),
            })
        })
    }

    fn prefix<'a>(
        &'a self,
        session_id: &'a str,
        prompt_ids: &'a [u32],
    ) -> ProbeFuture<'a, PrefixReport> {
        let (f, data) = (self.prefix, self.user_data);
        // Copied: the blocking call may outlive this future when it times out.
        let session = session_id.to_owned();
        let prompt = prompt_ids.to_vec();
        Box::pin(async move {
            let p = call("prefix", move || {
                let mut p = sg_prefix::default();
                // SAFETY: as in `usage`; `session` and `prompt` live until the call returns.
                let status = unsafe {
                    f(
                        data.get(),
                        session.as_ptr().cast(),
                        session.len(),
                        prompt.as_ptr(),
                        prompt.len(),
                        &mut p,
                    )
                };
                (status, p)
            })
            .await?;
            Ok(PrefixReport {
                hit_ratio: p.hit_ratio,
                hit_blocks: p.hit_blocks,
                hit_tokens: p.hit_tokens,
                prompt_tokens: p.prompt_tokens,
                offloaded_tokens: p.has_offloaded_tokens.then_some(p.offloaded_tokens),
            })
        })
    }

    fn forget<'a>(&'a self, session_id: &'a str) -> ProbeFuture<'a, ()> {
        let Some(f) = self.forget else {
            return Box::pin(std::future::ready(Ok(())));
        };
        let data = self.user_data;
        let session = session_id.to_owned();
        Box::pin(call("forget", move || {
            // SAFETY: as in `usage`.
            let status = unsafe { f(data.get(), session.as_ptr().cast(), session.len()) };
            (status, ())
        }))
    }
}
