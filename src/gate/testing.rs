//! A scripted fake [`Probe`] for unit tests and benchmarks: answers what it is told, fails or
//! hangs on demand, and counts its calls. Not for integration tests, which use a real engine.
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::driver::{Probe, ProbeFuture};
use super::types::{PrefixReport, UsageReport};
use crate::error::Error;

/// A usage report with `usage` of `num_blocks` blocks of `block_size` tokens in use.
pub fn usage_report(usage: f64, num_blocks: u64, block_size: u64) -> UsageReport {
    let used = (usage * num_blocks as f64).round() as u64;
    UsageReport {
        kv_cache_usage: usage,
        num_blocks,
        num_free_blocks: num_blocks.saturating_sub(used),
        num_cached_free_blocks: None,
        block_size,
        offload_num_blocks: None,
        offload_used_blocks: None,
        num_running_reqs: None,
        num_waiting_reqs: None,
    }
}

/// What the probe does for one kind of call.
#[derive(Debug, Clone, PartialEq)]
pub enum Behaviour<T> {
    /// Answer this.
    Answer(T),
    /// Fail with `ProbeUnavailable(message)`.
    Fail(String),
    /// Never answer.
    Hang,
}

#[derive(Debug)]
struct Script {
    usage: Behaviour<UsageReport>,
    prefix: Behaviour<f64>,
    hits: HashMap<String, f64>,
    forgotten: Vec<String>,
}

/// The scripted probe. Prefix answers use the per-session hit ratio set with
/// [`ScriptedProbe::set_hit`], else the default behaviour.
#[derive(Debug)]
pub struct ScriptedProbe {
    script: Mutex<Script>,
    usage_calls: AtomicU64,
    prefix_calls: AtomicU64,
}

impl ScriptedProbe {
    /// Answers `usage` to every usage probe and hit ratio 0 to every prefix probe.
    pub fn new(usage: UsageReport) -> Self {
        Self {
            script: Mutex::new(Script {
                usage: Behaviour::Answer(usage),
                prefix: Behaviour::Answer(0.0),
                hits: HashMap::new(),
                forgotten: Vec::new(),
            }),
            usage_calls: AtomicU64::new(0),
            prefix_calls: AtomicU64::new(0),
        }
    }

    fn script(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What usage probes do from now on.
    pub fn set_usage(&self, behaviour: Behaviour<UsageReport>) {
        self.script().usage = behaviour;
    }

    /// What prefix probes do from now on for sessions without their own hit ratio.
    pub fn set_prefix(&self, behaviour: Behaviour<f64>) {
        self.script().prefix = behaviour;
    }

    /// This session's hit ratio from now on (answered even when the default fails or hangs).
    pub fn set_hit(&self, session_id: &str, hit_ratio: f64) {
        self.script().hits.insert(session_id.to_string(), hit_ratio);
    }

    /// Usage probes made so far.
    pub fn usage_calls(&self) -> u64 {
        self.usage_calls.load(Ordering::Relaxed)
    }

    /// Prefix probes made so far.
    pub fn prefix_calls(&self) -> u64 {
        self.prefix_calls.load(Ordering::Relaxed)
    }

    /// Sessions passed to `forget`, in order.
    pub fn forgotten(&self) -> Vec<String> {
        self.script().forgotten.clone()
    }
}

fn play<'a, T: Send + 'a>(b: Behaviour<T>) -> ProbeFuture<'a, T> {
    match b {
        Behaviour::Answer(v) => Box::pin(std::future::ready(Ok(v))),
        Behaviour::Fail(m) => Box::pin(std::future::ready(Err(Error::ProbeUnavailable(m)))),
        Behaviour::Hang => Box::pin(std::future::pending()),
    }
}

impl Probe for ScriptedProbe {
    fn usage(&self) -> ProbeFuture<'_, UsageReport> {
        self.usage_calls.fetch_add(1, Ordering::Relaxed);
        let b = self.script().usage.clone();
        play(b)
    }

    fn prefix<'a>(
        &'a self,
        session_id: &'a str,
        prompt_ids: &'a [u32],
    ) -> ProbeFuture<'a, PrefixReport> {
        self.prefix_calls.fetch_add(1, Ordering::Relaxed);
        let script = self.script();
        let b = match script.hits.get(session_id) {
            Some(h) => Behaviour::Answer(*h),
            None => script.prefix.clone(),
        };
        drop(script);
        let prompt_tokens = prompt_ids.len() as u64;
        play(match b {
            Behaviour::Answer(h) => {
                let hit_tokens = (h * prompt_tokens as f64).round() as u64;
                Behaviour::Answer(PrefixReport {
                    hit_ratio: h,
                    hit_blocks: 0,
                    hit_tokens,
                    prompt_tokens,
                    offloaded_tokens: None,
                })
            }
            Behaviour::Fail(m) => Behaviour::Fail(m),
            Behaviour::Hang => Behaviour::Hang,
        })
    }

    fn forget<'a>(&'a self, session_id: &'a str) -> ProbeFuture<'a, ()> {
        self.script().forgotten.push(session_id.to_string());
        Box::pin(std::future::ready(Ok(())))
    }
}
