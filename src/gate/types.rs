//! Plain values that cross the core's boundary: ids, reasons, probe reports, actions.
//!
//! Everything here is a number, a flag or a small enum, so the Python (PyO3) and C bindings can
//! copy them across without closures or futures.

/// One admission attempt (one `acquire` call) inside a [`GateCore`](super::GateCore).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttemptId(pub u64);

/// One admission; releasing it is what lets the next waiter through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

/// Why an attempt was admitted: the decision tree's outcomes (see [`crate::gate::core`]), plus
/// `max_wait`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// No pressure (and, in committed mode, the working set fits under the watermark), or
    /// nothing at all is committed.
    Open,
    /// Under pressure, but the session owns a reservation; no prefix probe was made.
    ReservedSession,
    /// Engine pressure only: under pressure and the prefix probe could not answer, fail open
    /// (committed mode counts that as a miss and waits).
    PrefixProbeUnavailable,
    /// Under pressure and the session's prefix is resident (`hit_ratio >= hit_threshold`).
    ResidentPrefix,
    /// The attempt waited `max_wait_sec`.
    MaxWait,
    /// Under pressure; the prefix is not GPU-resident enough, but the GPU-resident tokens plus
    /// the tokens the host KV tier holds for it reach `hit_threshold` (it reloads at PCIe speed
    /// instead of being recomputed), and its working set fits the whole cache.
    OffloadedPrefix,
}

impl Reason {
    /// Every reason, in the order used by [`GateStats::admissions`](super::GateStats::admissions).
    pub const ALL: [Reason; 6] = [
        Reason::Open,
        Reason::ReservedSession,
        Reason::PrefixProbeUnavailable,
        Reason::ResidentPrefix,
        Reason::MaxWait,
        Reason::OffloadedPrefix,
    ];

    /// The label used in leases, stats and metrics, e.g. `"reserved_session"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Open => "open",
            Reason::ReservedSession => "reserved_session",
            Reason::PrefixProbeUnavailable => "prefix_probe_unavailable",
            Reason::ResidentPrefix => "resident_prefix",
            Reason::MaxWait => "max_wait",
            Reason::OffloadedPrefix => "offloaded_prefix",
        }
    }

    /// Position in [`Reason::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Which probe a latency sample belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProbeKind {
    /// `session_gate_usage`.
    Usage,
    /// `session_gate_probe`.
    Prefix,
    /// The optional `forget` call after `finish_session`.
    Forget,
}

impl ProbeKind {
    /// Every kind, in the order used by [`GateStats::probes`](super::GateStats::probes).
    pub const ALL: [ProbeKind; 3] = [ProbeKind::Usage, ProbeKind::Prefix, ProbeKind::Forget];

    /// The metric label, e.g. `"usage"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeKind::Usage => "usage",
            ProbeKind::Prefix => "prefix",
            ProbeKind::Forget => "forget",
        }
    }

    /// Position in [`ProbeKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The engine's answer to `session_gate_usage` (same keys).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct UsageReport {
    /// `BlockPool.get_usage()`: used fraction, counting free-but-cached blocks as free.
    pub kv_cache_usage: f64,
    /// Total KV blocks.
    pub num_blocks: u64,
    /// Free blocks (cached or not).
    pub num_free_blocks: u64,
    /// Free blocks that still hold a cached prefix, when the engine was asked to count them
    /// (`session_gate_usage(count_cached_free=True)`): exact, but a visit of every block, so
    /// the usage probe the gate makes leaves it `None`. The gate never decides on it.
    pub num_cached_free_blocks: Option<u64>,
    /// Tokens per block.
    pub block_size: u64,
    /// The host KV tier's capacity, in GPU blocks; `None` = no readable tier.
    pub offload_num_blocks: Option<u64>,
    /// GPU blocks' worth of KV the host tier holds now; `None` = no readable tier.
    pub offload_used_blocks: Option<u64>,
    /// Requests the engine's scheduler is running now (vLLM's `num_running_reqs`); `None` =
    /// not reported.
    pub num_running_reqs: Option<u64>,
    /// Requests waiting in the engine's scheduler to be scheduled, not counting those the
    /// engine gate holds back in scheduler mode (vLLM's `num_waiting_reqs` minus them); `None`
    /// = not reported.
    pub num_waiting_reqs: Option<u64>,
}

impl UsageReport {
    /// The engine reported nothing running and nothing waiting to be scheduled.
    pub fn engine_idle(&self) -> bool {
        self.num_running_reqs == Some(0) && self.num_waiting_reqs == Some(0)
    }

    /// Why the report cannot be used, if it cannot (the core then treats it as unavailable).
    pub fn problem(&self) -> Option<&'static str> {
        if !(0.0..=1.0).contains(&self.kv_cache_usage) {
            Some("kv_cache_usage outside 0..=1")
        } else if self.num_blocks == 0 {
            Some("num_blocks is 0")
        } else if self.block_size == 0 {
            Some("block_size is 0")
        } else {
            None
        }
    }
}

/// The engine's answer to `session_gate_probe` (same keys). An engine answering
/// `"unavailable"` is reported to the core as `Err`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefixReport {
    /// Tokens vLLM would report as cached for this prompt ÷ prompt tokens.
    pub hit_ratio: f64,
    /// Leading blocks of the prompt found in the cache.
    pub hit_blocks: u64,
    /// `hit_blocks × block_size`, capped at the prompt length.
    pub hit_tokens: u64,
    /// Prompt length the engine saw.
    pub prompt_tokens: u64,
    /// Tokens after `hit_tokens` that the host KV tier holds for this prompt and would load;
    /// `None` when there is no readable tier.
    pub offloaded_tokens: Option<u64>,
}

impl PrefixReport {
    /// Why the report cannot be used, if it cannot.
    pub fn problem(&self) -> Option<&'static str> {
        if (0.0..=1.0).contains(&self.hit_ratio) {
            None
        } else {
            Some("hit_ratio outside 0..=1")
        }
    }
}

/// What an admission granted; the lease's public face.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Admission {
    /// Release this to let the next waiter through.
    pub lease: LeaseId,
    /// Why it was admitted.
    pub reason: Reason,
    /// Seconds from `begin` to admission.
    pub wait_sec: f64,
    /// vLLM's `kv_cache_usage` from the last usage probe, if it answered.
    pub usage: Option<f64>,
    /// The pressure compared with the watermark: `usage` in engine mode, max(usage,
    /// committed ÷ blocks) in committed mode (committed including this session). `None` when
    /// the cache geometry is not known yet.
    pub pressure: Option<f64>,
    /// The prefix probe's hit ratio, if it was asked and answered.
    pub hit_ratio: Option<f64>,
    /// Whether the caller asked for an ownership window.
    pub retain_session: bool,
    /// Whether this lease holds the session's reservation while in flight.
    pub reserved: bool,
    /// Whether the session's reservation was revoked (age order) during this attempt.
    pub revoked: bool,
    /// Working set in blocks (prompt + max_tokens), when the block size is known.
    pub working_set_blocks: Option<u64>,
    /// How many older attempts of this session have been preempted so far.
    pub num_preempted: u32,
}

/// What the driver must do next for an attempt. Drivers loop: poll → do it → report → poll.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Action {
    /// Ask the engine for `session_gate_usage`, then call `on_usage`.
    ProbeUsage,
    /// Ask the engine for `session_gate_probe` on this prompt, then call `on_prefix`.
    ProbePrefix,
    /// Admitted: the attempt is over and a lease exists.
    Admit(Admission),
    /// Sleep until `until` (the core's clock) or until [`GateCore::epoch`](super::GateCore::epoch)
    /// changes, whichever comes first, then poll again.
    Wait {
        /// Absolute time, in the same seconds the caller passes as `now`.
        until: f64,
    },
    /// A newer attempt of the same session took over; this one is over.
    Preempted,
}
