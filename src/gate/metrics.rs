//! Gate statistics and their Prometheus text exposition; every metric name is described here once.
use std::fmt::Write as _;

use super::types::{ProbeKind, Reason};

/// Bucket upper bounds (seconds) of the admission wait histogram.
pub const WAIT_BUCKETS: [f64; 12] = [
    0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Bucket upper bounds (seconds) of the probe latency histograms.
pub const PROBE_BUCKETS: [f64; 12] = [
    0.000_05, 0.000_1, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0,
];

/// A fixed-bucket histogram: per-bucket counts (the last one is `+Inf`), sum and count.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram<const N: usize> {
    /// Upper bounds of the first `N` buckets.
    pub bounds: &'static [f64; N],
    /// Observations per bucket (not cumulative); index `N` is the `+Inf` bucket.
    pub counts: Vec<u64>,
    /// Sum of all observations.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

impl<const N: usize> Histogram<N> {
    pub(crate) fn new(bounds: &'static [f64; N]) -> Self {
        Self {
            bounds,
            counts: vec![0; N + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub(crate) fn observe(&mut self, v: f64) {
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        let i = self.bounds.iter().position(|b| v <= *b).unwrap_or(N);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// Latency and failures of one kind of probe, as reported by drivers.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeStats {
    /// Latency of every call, answered or not.
    pub latency: Histogram<12>,
    /// Calls that errored or timed out.
    pub failures: u64,
}

/// A snapshot of the gate's counters and gauges.
///
/// Identities that always hold (the stress test checks them):
/// `attempts == admissions_total() + preemptions + cancellations + pending`, and
/// `admissions_total() == leases_released + leases_dropped_unreleased + leases_active`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct GateStats {
    /// Admissions per reason, indexed by [`Reason::index`].
    pub admissions: [u64; Reason::ALL.len()],
    /// Attempts begun.
    pub attempts: u64,
    /// Reservations revoked by age order (reason `revoked`), and idle ones that yielded.
    pub revocations: u64,
    /// Idle reservations that yielded early because the engine had nothing running or waiting
    /// (also counted in `revocations`; core module docs, "An idle engine").
    pub idle_engine_yields: u64,
    /// Attempts preempted by a newer attempt of the same session.
    pub preemptions: u64,
    /// Attempts cancelled while pending.
    pub cancellations: u64,
    /// Leases released explicitly.
    pub leases_released: u64,
    /// Leases dropped without an explicit release (released by their drop).
    pub leases_dropped_unreleased: u64,
    /// Idle grace windows that ran out.
    pub grace_expired: u64,
    /// Windows ended by `finish_session`.
    pub sessions_finished: u64,
    /// Leases not yet released (gauge).
    pub leases_active: u64,
    /// Reservations held, in flight or idle (gauge).
    pub reservations_held: u64,
    /// Reservations in their idle grace window (gauge).
    pub reservations_idle: u64,
    /// Sum of the working sets of reserved sessions, in blocks (gauge).
    pub committed_blocks: u64,
    /// Attempts not yet admitted, preempted or cancelled (gauge).
    pub pending: u64,
    /// Attempts that have been told to wait and are still in the FIFO queue (gauge).
    pub waiting: u64,
    /// Sessions the core keeps state for (gauge).
    pub sessions: u64,
    /// Seconds from `begin` to admission.
    pub wait: Histogram<12>,
    /// Per probe kind, indexed by [`ProbeKind::index`].
    pub probes: [ProbeStats; 3],
}

impl GateStats {
    pub(crate) fn new() -> Self {
        let probe = || ProbeStats {
            latency: Histogram::new(&PROBE_BUCKETS),
            failures: 0,
        };
        Self {
            admissions: [0; Reason::ALL.len()],
            attempts: 0,
            revocations: 0,
            idle_engine_yields: 0,
            preemptions: 0,
            cancellations: 0,
            leases_released: 0,
            leases_dropped_unreleased: 0,
            grace_expired: 0,
            sessions_finished: 0,
            leases_active: 0,
            reservations_held: 0,
            reservations_idle: 0,
            committed_blocks: 0,
            pending: 0,
            waiting: 0,
            sessions: 0,
            wait: Histogram::new(&WAIT_BUCKETS),
            probes: [probe(), probe(), probe()],
        }
    }

    /// Admissions with this reason.
    pub fn admitted(&self, reason: Reason) -> u64 {
        self.admissions[reason.index()]
    }

    /// Admissions of every reason; equals the number of leases issued.
    pub fn admissions_total(&self) -> u64 {
        self.admissions.iter().sum()
    }

    /// Stats of one probe kind.
    pub fn probe(&self, kind: ProbeKind) -> &ProbeStats {
        &self.probes[kind.index()]
    }

    /// Prometheus text exposition (format 0.0.4) of this snapshot.
    pub fn prometheus(&self) -> String {
        let mut out = String::with_capacity(4096);
        for m in METRICS {
            let _ = writeln!(out, "# HELP {} {}", m.name, m.help);
            let _ = writeln!(out, "# TYPE {} {}", m.name, m.kind);
            self.samples(m.name, &mut out);
        }
        out
    }

    fn samples(&self, name: &str, out: &mut String) {
        let mut one = |v: u64| {
            let _ = writeln!(out, "{name} {v}");
        };
        match name {
            "session_gate_attempts_total" => one(self.attempts),
            "session_gate_revocations_total" => one(self.revocations),
            "session_gate_idle_engine_yields_total" => one(self.idle_engine_yields),
            "session_gate_preemptions_total" => one(self.preemptions),
            "session_gate_cancellations_total" => one(self.cancellations),
            "session_gate_leases_released_total" => one(self.leases_released),
            "session_gate_leases_dropped_unreleased_total" => one(self.leases_dropped_unreleased),
            "session_gate_grace_expired_total" => one(self.grace_expired),
            "session_gate_sessions_finished_total" => one(self.sessions_finished),
            "session_gate_leases_active" => one(self.leases_active),
            "session_gate_reservations_held" => one(self.reservations_held),
            "session_gate_reservations_idle" => one(self.reservations_idle),
            "session_gate_committed_blocks" => one(self.committed_blocks),
            "session_gate_sessions_pending" => one(self.pending),
            "session_gate_sessions_waiting" => one(self.waiting),
            "session_gate_sessions_tracked" => one(self.sessions),
            "session_gate_admissions_total" => {
                for r in Reason::ALL {
                    let v = self.admitted(r);
                    let _ = writeln!(out, "{name}{{reason=\"{}\"}} {v}", r.as_str());
                }
            }
            "session_gate_wait_seconds" => histogram(out, name, "", &self.wait),
            "session_gate_probe_seconds" => {
                for k in ProbeKind::ALL {
                    let label = format!("probe=\"{}\"", k.as_str());
                    histogram(out, name, &label, &self.probe(k).latency);
                }
            }
            "session_gate_probe_failures_total" => {
                for k in ProbeKind::ALL {
                    let v = self.probe(k).failures;
                    let _ = writeln!(out, "{name}{{probe=\"{}\"}} {v}", k.as_str());
                }
            }
            _ => {}
        }
    }
}

fn histogram<const N: usize>(out: &mut String, name: &str, label: &str, h: &Histogram<N>) {
    let sep = if label.is_empty() { "" } else { "," };
    let mut cumulative = 0;
    for (i, c) in h.counts.iter().enumerate() {
        cumulative += c;
        let le = h
            .bounds
            .get(i)
            .map_or("+Inf".to_string(), |b| b.to_string());
        let _ = writeln!(out, "{name}_bucket{{{label}{sep}le=\"{le}\"}} {cumulative}");
    }
    let braces = if label.is_empty() {
        String::new()
    } else {
        format!("{{{label}}}")
    };
    let _ = writeln!(out, "{name}_sum{braces} {}", h.sum);
    let _ = writeln!(out, "{name}_count{braces} {}", h.count);
}

/// One metric's name, Prometheus type and help text.
#[derive(Debug, Clone, Copy)]
pub struct MetricDesc {
    /// Full name, always starting with `session_gate_`.
    pub name: &'static str,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    /// One line of help.
    pub help: &'static str,
}

const fn m(name: &'static str, kind: &'static str, help: &'static str) -> MetricDesc {
    MetricDesc { name, kind, help }
}

/// Every metric the gate exposes, described once.
pub const METRICS: &[MetricDesc] = &[
    m(
        "session_gate_admissions_total",
        "counter",
        "Admissions by reason (open, reserved_session, prefix_probe_unavailable, resident_prefix, max_wait, offloaded_prefix).",
    ),
    m(
        "session_gate_attempts_total",
        "counter",
        "Admission attempts begun.",
    ),
    m(
        "session_gate_revocations_total",
        "counter",
        "Reservations revoked because the session's working set plus those of older reservations exceeded the watermark.",
    ),
    m(
        "session_gate_idle_engine_yields_total",
        "counter",
        "Idle reservations that gave their room to a waiter early because the engine had nothing running or waiting (also in revocations).",
    ),
    m(
        "session_gate_preemptions_total",
        "counter",
        "Pending attempts preempted by a newer attempt of the same session.",
    ),
    m(
        "session_gate_cancellations_total",
        "counter",
        "Pending attempts cancelled by their caller.",
    ),
    m(
        "session_gate_leases_released_total",
        "counter",
        "Leases released explicitly.",
    ),
    m(
        "session_gate_leases_dropped_unreleased_total",
        "counter",
        "Leases dropped without an explicit release.",
    ),
    m(
        "session_gate_grace_expired_total",
        "counter",
        "Idle grace windows that expired.",
    ),
    m(
        "session_gate_sessions_finished_total",
        "counter",
        "Ownership windows ended by finish_session.",
    ),
    m("session_gate_leases_active", "gauge", "Leases in flight."),
    m(
        "session_gate_reservations_held",
        "gauge",
        "Sessions holding a reservation, in flight or idle.",
    ),
    m(
        "session_gate_reservations_idle",
        "gauge",
        "Reservations in their idle grace window.",
    ),
    m(
        "session_gate_committed_blocks",
        "gauge",
        "Sum of the working sets (prompt + max_tokens, in KV blocks) of reserved sessions.",
    ),
    m(
        "session_gate_sessions_pending",
        "gauge",
        "Attempts not yet admitted.",
    ),
    m(
        "session_gate_sessions_waiting",
        "gauge",
        "Attempts told to wait and still queued.",
    ),
    m(
        "session_gate_sessions_tracked",
        "gauge",
        "Sessions the gate keeps state for.",
    ),
    m(
        "session_gate_wait_seconds",
        "histogram",
        "Seconds from the start of an attempt to its admission.",
    ),
    m(
        "session_gate_probe_seconds",
        "histogram",
        "Probe latency, answered or not.",
    ),
    m(
        "session_gate_probe_failures_total",
        "counter",
        "Probe calls that errored or timed out (counted as unavailable).",
    ),
];
