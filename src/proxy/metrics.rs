//! The proxy's Prometheus exposition: each replica's gate metrics (label `replica`), and the
//! proxy's own, described once here (prefix `session_gate_proxy_`).
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use super::replicas::{Replica, Replicas};

/// Latency buckets (seconds) of `session_gate_proxy_request_duration_seconds`.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Turn indices above this share the label `turn="{MAX_TURN_LABEL}+"`.
pub const MAX_TURN_LABEL: u64 = 32;

/// Sessions tracked for `num_preempted` beyond this are summed into `_other` at once.
const MAX_TRACKED_SESSIONS: usize = 100_000;

#[derive(Debug, Clone)]
struct Hist {
    counts: [u64; LATENCY_BUCKETS.len() + 1],
    sum: f64,
    count: u64,
}

impl Hist {
    fn new() -> Self {
        Self {
            counts: [0; LATENCY_BUCKETS.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// How a proxied request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// The upstream answer was passed on completely.
    Completed,
    /// The client went away before the answer was complete; the upstream request was aborted.
    ClientDisconnected,
    /// The upstream failed (connection error or a broken stream).
    UpstreamFailed,
    /// The gate preempted the attempt (HTTP 409).
    Preempted,
    /// The replica could not be reached (connection failed before anything was sent); the
    /// request went to another replica.
    Rerouted,
    /// Rejected before forwarding (bad request, no healthy replica).
    Rejected,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::ClientDisconnected => "client_disconnected",
            Outcome::UpstreamFailed => "upstream_failed",
            Outcome::Preempted => "preempted",
            Outcome::Rerouted => "rerouted",
            Outcome::Rejected => "rejected",
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    requests: BTreeMap<(String, &'static str, u16, Outcome), u64>,
    by_turn: BTreeMap<u64, Hist>,
    preempted: HashMap<String, u64>,
    preempted_untracked: u64,
}

/// The proxy's own counters.
#[derive(Debug)]
pub struct ProxyMetrics {
    inner: Mutex<Inner>,
    max_session_labels: usize,
}

fn turn_label(turn: u64) -> String {
    if turn > MAX_TURN_LABEL {
        format!("{MAX_TURN_LABEL}+")
    } else {
        turn.to_string()
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl ProxyMetrics {
    /// Empty metrics; at most `max_session_labels` sessions get their own label.
    pub fn new(max_session_labels: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            max_session_labels,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts one proxied request; `turn` (1-based, 0 = ungated) gets its latency observed.
    pub fn request(
        &self,
        replica: &str,
        route: &'static str,
        status: u16,
        outcome: Outcome,
        turn: u64,
        secs: f64,
    ) {
        let mut inner = self.lock();
        *inner
            .requests
            .entry((replica.to_string(), route, status, outcome))
            .or_default() += 1;
        if turn > 0 && outcome == Outcome::Completed {
            inner
                .by_turn
                .entry(turn.min(MAX_TURN_LABEL + 1))
                .or_insert_with(Hist::new)
                .observe(secs);
        }
    }

    /// Counts a preempted attempt of `session_id`.
    pub fn preempted(&self, session_id: &str) {
        let mut inner = self.lock();
        if let Some(n) = inner.preempted.get_mut(session_id) {
            *n += 1;
        } else if inner.preempted.len() < MAX_TRACKED_SESSIONS {
            inner.preempted.insert(session_id.to_string(), 1);
        } else {
            inner.preempted_untracked += 1;
        }
    }

    /// Forgets a finished session's per-session counters.
    pub fn finish_session(&self, session_id: &str) {
        let mut inner = self.lock();
        if let Some(n) = inner.preempted.remove(session_id) {
            inner.preempted_untracked += n;
        }
    }

    /// The whole exposition: gate metrics per replica, then the proxy's.
    pub fn render(&self, replicas: &Replicas) -> String {
        let list = replicas.snapshot();
        let mut out = merge_gate_metrics(
            list.iter()
                .map(|r| (r.url.base.as_str(), r.gate.prometheus())),
        );
        replica_gauge(
            &mut out,
            "session_gate_proxy_replica_healthy",
            "Whether the replica passed its last health check.",
            &list,
            Replica::is_healthy,
        );
        replica_gauge(
            &mut out,
            "session_gate_proxy_replica_listed",
            "Whether the replica is listed (flags, the replicas file or a DNS name); an unlisted one takes no new turns.",
            &list,
            Replica::is_listed,
        );
        let name = "session_gate_proxy_replica_list_changes_total";
        let _ = writeln!(
            out,
            "# HELP {name} Changes of the replica list read from the replicas file while running."
        );
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name} {}", replicas.list_changes());
        let name = "session_gate_proxy_placement_info";
        let _ = writeln!(
            out,
            "# HELP {name} The placement policy this proxy runs (--placement): gate, sticky-least-loaded or hash."
        );
        let _ = writeln!(out, "# TYPE {name} gauge");
        let policy = replicas.policy().as_str();
        let _ = writeln!(out, "{name}{{policy=\"{policy}\"}} 1");
        let (placements, hold_timeouts) = replicas.placement_stats();
        let name = "session_gate_proxy_placements_total";
        let _ = writeln!(
            out,
            "# HELP {name} Placement decisions by reason: new, held (a new session no replica would take yet; each ask counts), new_move (a new session moved while its first turn waited), resident, cold_stay, cold_move, slow_move, down_move, found (a session this proxy had not seen, found resident on one replica). A turn moved while it waits counts once at arrival and once for the move."
        );
        let _ = writeln!(out, "# TYPE {name} counter");
        for (reason, n) in placements.by_reason() {
            let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {n}");
        }
        let name = "session_gate_proxy_placement_moves_total";
        let _ = writeln!(
            out,
            "# HELP {name} Sessions moved to another replica (cold_move + slow_move + down_move)."
        );
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name} {}", placements.moves());
        let name = "session_gate_proxy_placement_hold_timeouts_total";
        let _ = writeln!(
            out,
            "# HELP {name} New sessions held max_wait_sec and then placed past the replicas' backlogs."
        );
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name} {hold_timeouts}");
        let _ = writeln!(
            out,
            "# HELP session_gate_proxy_sessions Sessions placed on a replica."
        );
        let _ = writeln!(out, "# TYPE session_gate_proxy_sessions gauge");
        let _ = writeln!(
            out,
            "session_gate_proxy_sessions {}",
            replicas.num_sessions()
        );

        let inner = self.lock();
        let _ = writeln!(
            out,
            "# HELP session_gate_proxy_requests_total Proxied requests by replica, route, HTTP status and outcome."
        );
        let _ = writeln!(out, "# TYPE session_gate_proxy_requests_total counter");
        for ((replica, route, status, outcome), n) in &inner.requests {
            let _ = writeln!(
                out,
                "session_gate_proxy_requests_total{{replica=\"{}\",route=\"{route}\",status=\"{status}\",outcome=\"{}\"}} {n}",
                escape(replica),
                outcome.as_str()
            );
        }
        let name = "session_gate_proxy_request_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Latency of completed gated requests (admission wait included) by the session's turn index."
        );
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (turn, h) in &inner.by_turn {
            let t = turn_label(*turn);
            let mut cumulative = 0;
            for (i, c) in h.counts.iter().enumerate() {
                cumulative += c;
                let le = LATENCY_BUCKETS
                    .get(i)
                    .map_or("+Inf".to_string(), |b| b.to_string());
                let _ = writeln!(
                    out,
                    "{name}_bucket{{turn=\"{t}\",le=\"{le}\"}} {cumulative}"
                );
            }
            let _ = writeln!(out, "{name}_sum{{turn=\"{t}\"}} {}", h.sum);
            let _ = writeln!(out, "{name}_count{{turn=\"{t}\"}} {}", h.count);
        }
        let name = "session_gate_proxy_session_preempted";
        let _ = writeln!(
            out,
            "# HELP {name} Attempts preempted per session (the most preempted sessions; the rest summed under session=\"_other\")."
        );
        let _ = writeln!(out, "# TYPE {name} gauge");
        let mut top: Vec<(&String, &u64)> = inner.preempted.iter().collect();
        top.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        let mut other = inner.preempted_untracked;
        for (i, (session, n)) in top.iter().enumerate() {
            if i < self.max_session_labels {
                let _ = writeln!(out, "{name}{{session=\"{}\"}} {n}", escape(session));
            } else {
                other += **n;
            }
        }
        let _ = writeln!(out, "{name}{{session=\"_other\"}} {other}");
        out
    }
}

/// Merges several gates' expositions into one, each sample labelled with its replica and
/// each family kept together (the text format requires it).
pub fn merge_gate_metrics<'a>(gates: impl Iterator<Item = (&'a str, String)>) -> String {
    // family name → (HELP/TYPE lines, samples), in first-seen order.
    let mut order: Vec<String> = Vec::new();
    let mut families: HashMap<String, (Vec<String>, Vec<String>)> = HashMap::new();
    for (replica, text) in gates {
        let label = format!("replica=\"{}\"", escape(replica));
        let mut current = String::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# ") {
                let mut parts = rest.splitn(3, ' ');
                let (_, name) = (parts.next(), parts.next().unwrap_or_default());
                current = name.to_string();
                let entry = families.entry(current.clone()).or_insert_with(|| {
                    order.push(current.clone());
                    Default::default()
                });
                if !entry.0.iter().any(|l| l == line) {
                    entry.0.push(line.to_string());
                }
            } else if !line.is_empty() {
                let sample = match line.find('{') {
                    Some(i) if line[..i].find(' ').is_none() => {
                        format!("{}{{{label},{}", &line[..i], &line[i + 1..])
                    }
                    _ => match line.split_once(' ') {
                        Some((name, value)) => format!("{name}{{{label}}} {value}"),
                        None => continue,
                    },
                };
                families
                    .entry(current.clone())
                    .or_insert_with(|| {
                        order.push(current.clone());
                        Default::default()
                    })
                    .1
                    .push(sample);
            }
        }
    }
    let mut out = String::with_capacity(8192);
    for name in &order {
        let (headers, samples) = &families[name];
        for l in headers.iter().chain(samples) {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// A 0/1 gauge with one sample per replica, labelled by its URL.
fn replica_gauge(
    out: &mut String,
    name: &str,
    help: &str,
    list: &[Arc<Replica>],
    value: impl Fn(&Replica) -> bool,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    for r in list {
        let _ = writeln!(
            out,
            "{name}{{replica=\"{}\"}} {}",
            escape(&r.url.base),
            u8::from(value(r))
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_families_stay_together_and_carry_the_replica() {
        let a = "# HELP x_total X.\n# TYPE x_total counter\nx_total 1\n# HELP y Y.\n# TYPE y counter\ny{reason=\"open\"} 2\n";
        let out = merge_gate_metrics([("a", a.to_string()), ("b", a.to_string())].into_iter());
        assert_eq!(
            out,
            "# HELP x_total X.\n# TYPE x_total counter\nx_total{replica=\"a\"} 1\nx_total{replica=\"b\"} 1\n\
             # HELP y Y.\n# TYPE y counter\ny{replica=\"a\",reason=\"open\"} 2\ny{replica=\"b\",reason=\"open\"} 2\n"
        );
    }

    #[tokio::test]
    async fn the_policy_is_named_and_every_reason_is_listed() {
        use crate::proxy::config::{ProxyArgs, ProxyConfig};
        let args = ProxyArgs {
            replicas: vec!["http://127.0.0.1:9".into()],
            placement: Some("sticky-least-loaded".into()),
            ..Default::default()
        };
        let config = ProxyConfig::from_toml(&args, "").unwrap();
        let client = super::super::upstream::client(std::time::Duration::from_secs(1));
        let replicas = Replicas::new(&config, &client).unwrap();
        let out = ProxyMetrics::new(8).render(&replicas);
        assert!(
            out.contains("session_gate_proxy_placement_info{policy=\"sticky-least-loaded\"} 1\n"),
            "{out}"
        );
        for reason in ["new", "held", "resident", "cold_move", "down_move", "found"] {
            let line = format!("session_gate_proxy_placements_total{{reason=\"{reason}\"}} 0\n");
            assert!(out.contains(&line), "{line} missing");
        }
    }
}
