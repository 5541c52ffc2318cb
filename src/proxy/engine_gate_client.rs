//! The proxy's client of each replica's engine gate (`session-gate proxy --gate-at engine`):
//! admission is delegated to the gate core inside vLLM's engine core, reached through the
//! endpoint plugin's `/session_gate/v1/{admit,release,cancel,finish,renew}` routes, instead of
//! a gate of the proxy's own. Every client of the replica — other proxies, `HttpGate`s, the
//! `--middleware` — then shares one gate, so several proxies in front of one replica never
//! commit past the line together. [`ReplicaGate`](super::replica_gate::ReplicaGate) chooses
//! this client or the proxy's own gate once, from the configuration.
//!
//! - An admit is the route's long-poll. The proxy's client going away drops the handler, which
//!   drops [`Pending`]: the long-poll's connection closes (the route cancels the attempt) and a
//!   `cancel` of the ticket is sent as well, which also releases a lease won in the race.
//! - Every admit and release names this proxy's client id; a heartbeat ([`heartbeat`]) renews it
//!   on every replica every third of the engine's lease TTL. If the proxy dies, the engines free
//!   its leases one TTL after its last call (`SESSION_GATE_LEASE_TTL_SEC`, 30 s by default).
//! - The gate knobs are the engine's (`SESSION_GATE_*` in `vllm serve`'s environment); the
//!   proxy's own gate flags do not apply in this mode, except `default_max_tokens` (it sizes a
//!   turn that names no `max_tokens`) and `retain_session`.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::StatusCode;
use serde_json::{Value, json};

use super::config::ProxyConfig;
use super::replica_gate::AdmitError;
use super::replicas::{Replica, Replicas};
use super::upstream::{Client, UpstreamError, percent_encode, post_for_json};

const PREFIX: &str = "/session_gate/v1";
/// Heartbeat period until an engine has told us its lease TTL.
const FIRST_RENEW: Duration = Duration::from_secs(1);

/// This proxy process as a client of the replicas' engine gates: its identity, its ticket
/// counter, and how it admits.
#[derive(Debug)]
pub struct EngineGateClient {
    /// The client id every admit, release and renew names (`proxy-<pid>-<nonce>`).
    pub id: String,
    tickets: AtomicU64,
    client: Client,
    authorization: Option<String>,
    /// Sizes a turn that names no `max_tokens`, as the proxy's own gate would.
    default_max_tokens: usize,
    retain_session: bool,
}

impl EngineGateClient {
    /// A client with a fresh id, calling the replicas through `client`.
    pub fn new(config: &ProxyConfig, client: Client) -> Self {
        let nonce = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            id: format!("proxy-{}-{nonce:x}", std::process::id()),
            tickets: AtomicU64::new(0),
            client,
            authorization: config.replica_authorization.clone(),
            default_max_tokens: config.gate.default_max_tokens,
            retain_session: config.retain_session,
        }
    }
}

/// One lease of an engine gate; released (in the background) once, or on drop.
#[derive(Debug)]
pub struct EngineLease {
    target: Target,
    lease: u64,
    /// The DP rank whose gate holds it, on a data-parallel replica (its admit answer's `rank`).
    rank: Option<u64>,
    released: bool,
}

impl EngineLease {
    /// The DP rank whose gate admitted the turn (a data-parallel replica says it): the turn
    /// must run there, and is forwarded without its session id, so it names the rank.
    pub fn dp_rank(&self) -> Option<u64> {
        self.rank
    }

    /// Sends the release (once).
    pub fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        let body = json!({ "lease": self.lease, "client_id": self.target.client_id });
        self.target.spawn_post("release", body);
    }
}

impl Drop for EngineLease {
    fn drop(&mut self) {
        self.release();
    }
}

/// Where an engine call goes: one replica, as this proxy's client.
#[derive(Debug, Clone)]
struct Target {
    client: Client,
    base: String,
    authority: String,
    authorization: Option<String>,
    client_id: String,
}

impl Target {
    fn new(gate: &EngineGateClient, replica: &Replica) -> Self {
        Self {
            client: gate.client.clone(),
            base: replica.url.base.clone(),
            authority: replica.url.authority.clone(),
            authorization: gate.authorization.clone(),
            client_id: gate.id.clone(),
        }
    }

    async fn post(
        &self,
        path_and_query: &str,
        content_type: &str,
        body: Bytes,
    ) -> Result<(StatusCode, Value), UpstreamError> {
        let path = format!("{PREFIX}/{path_and_query}");
        post_for_json(
            &self.client,
            &self.base,
            &self.authority,
            self.authorization.as_deref(),
            &path,
            content_type,
            body,
        )
        .await
    }

    async fn post_json(&self, route: &str, body: &Value) -> Result<Value, String> {
        let bytes = Bytes::from(serde_json::to_vec(body).unwrap_or_default());
        match self.post(route, "application/json", bytes).await? {
            (StatusCode::OK, value) => Ok(value),
            (status, value) => Err(format!(
                "{}{PREFIX}/{route} answered {status}: {}",
                self.base,
                error_message(&value)
            )),
        }
    }

    /// Fire and forget (releases and cancels must not wait for, or fail, the answer).
    fn spawn_post(&self, route: &'static str, body: Value) {
        let target = self.clone();
        // Outside a runtime (a drop during shutdown) nothing can be sent: the TTL frees it.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = target.post_json(route, &body).await {
                    eprintln!("session-gate proxy: engine gate {route} failed: {e}");
                }
            });
        }
    }
}

fn error_message(value: &Value) -> &str {
    value
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("no message")
}

/// An admit in flight: dropped before it is answered (the client went away), it cancels the
/// ticket, which withdraws the attempt or releases the lease it won in the race.
struct Pending {
    target: Target,
    ticket: String,
    answered: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.answered {
            let body = json!({ "ticket": self.ticket, "client_id": self.target.client_id });
            self.target.spawn_post("cancel", body);
        }
    }
}

impl EngineGateClient {
    /// Waits until `replica`'s engine gate admits this turn (`max_tokens` None: the proxy's
    /// `default_max_tokens` knob sizes the working set).
    pub async fn admit(
        &self,
        replica: &Replica,
        session: &str,
        prompt_ids: &[u32],
        max_tokens: Option<usize>,
    ) -> Result<EngineLease, AdmitError> {
        let target = Target::new(self, replica);
        let n = self.tickets.fetch_add(1, Ordering::Relaxed);
        let ticket = format!("{}:{n}", target.client_id);
        let max_tokens = max_tokens.unwrap_or(self.default_max_tokens);
        let query = format!(
            "admit?session_id={}&max_tokens={max_tokens}&retain_session={}\
             &client_id={}&ticket={}",
            percent_encode(session),
            self.retain_session,
            percent_encode(&target.client_id),
            percent_encode(&ticket),
        );
        let packed: Vec<u8> = prompt_ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut pending = Pending {
            target: target.clone(),
            ticket,
            answered: false,
        };
        let answer = target
            .post(&query, "application/octet-stream", Bytes::from(packed))
            .await;
        let failed = |status, message: String| AdmitError::Failed {
            status,
            message: format!("engine gate of {}: {message}", target.base),
        };
        let (status, value) = match answer {
            Ok(answer) => answer,
            // The exchange broke (a dead or dying replica): an admit only reserves cache, so the
            // turn may go elsewhere. If it reached the engine at all, the pending guard's cancel
            // ends the attempt there (a grant whose answer was lost expires with its lease TTL).
            Err(e) if e.broke => {
                pending.answered = e.not_sent;
                return Err(AdmitError::NotSent(e.message));
            }
            Err(e) => return Err(failed(StatusCode::BAD_GATEWAY, e.message)),
        };
        pending.answered = true;
        match (status, value.get("status").and_then(Value::as_str)) {
            (StatusCode::OK, Some("admitted")) => {
                match value.get("lease").and_then(Value::as_u64) {
                    Some(lease) => Ok(EngineLease {
                        target,
                        lease,
                        rank: value.get("rank").and_then(Value::as_u64),
                        released: false,
                    }),
                    None => Err(failed(
                        StatusCode::BAD_GATEWAY,
                        format!("admitted without a lease id: {value}"),
                    )),
                }
            }
            (_, Some("preempted")) => Err(AdmitError::Preempted {
                num_preempted: value
                    .get("num_preempted")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
            }),
            (_, Some(other)) => Err(failed(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the engine ended this request's wait ({other})"),
            )),
            // 400 (bad input, e.g. a token id past the vocabulary) goes back as it is; anything
            // else (503: the plugin is not loaded) is the replica's failure.
            (StatusCode::BAD_REQUEST, None) => Err(failed(
                StatusCode::BAD_REQUEST,
                error_message(&value).into(),
            )),
            (status, None) => Err(failed(
                StatusCode::BAD_GATEWAY,
                format!("admit answered {status}: {}", error_message(&value)),
            )),
        }
    }

    /// Ends `session`'s ownership window in `replica`'s engine gate; whether it had one.
    pub async fn finish(&self, replica: &Replica, session: &str) -> Result<bool, String> {
        let target = Target::new(self, replica);
        let body = json!({ "session_id": session, "client_id": target.client_id });
        let answer = target.post_json("finish", &body).await?;
        Ok(answer
            .get("finished")
            .and_then(Value::as_bool)
            .unwrap_or(false))
    }
}

/// How long a renewal may take before it is given up while no engine has told its TTL yet
/// (the engines' default `SESSION_GATE_LEASE_TTL_SEC`).
const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// Renews this proxy's client id on every replica every third of the engine's lease TTL, so
/// the leases of requests still streaming outlive the TTL. Runs until aborted.
///
/// Every replica, healthy or not: a replica busy enough to miss a health check (a CPU engine
/// saturated by long streams) is still streaming this proxy's admitted turns, and skipping it
/// would let their leases expire mid-stream. Each renewal runs as its own task, bounded by the
/// whole TTL rather than the period: a renewal an overloaded API server answers late still
/// counts on the engine (giving it up at the period, as this once did, could let three slow
/// ones in a row expire the client while it was alive), and the next round starts on time
/// whatever the last one's replicas do.
pub async fn heartbeat(gate: Arc<EngineGateClient>, replicas: Arc<Replicas>) {
    // A third of the shortest TTL the engines told, in microseconds (`u64::MAX` until told).
    let period_us = Arc::new(AtomicU64::new(u64::MAX));
    loop {
        let started = tokio::time::Instant::now();
        let (every, give_up) = match period_us.load(Ordering::Relaxed) {
            u64::MAX => (FIRST_RENEW, DEFAULT_TTL),
            us => (Duration::from_micros(us), Duration::from_micros(us) * 3),
        };
        for replica in replicas.snapshot().iter() {
            let target = Target::new(&gate, replica);
            let healthy = replica.is_healthy();
            let period_us = period_us.clone();
            tokio::spawn(async move {
                let body = json!({ "client_id": target.client_id });
                let answer =
                    match tokio::time::timeout(give_up, target.post_json("renew", &body)).await {
                        Ok(answer) => answer,
                        Err(_) => Err(format!(
                            "{}{PREFIX}/renew did not answer within {give_up:?}",
                            target.base
                        )),
                    };
                match answer {
                    Ok(answer) => {
                        if let Some(ttl) = answer.get("lease_ttl_sec").and_then(Value::as_f64) {
                            let third = Duration::from_secs_f64((ttl / 3.0).clamp(0.05, 60.0));
                            period_us.fetch_min(third.as_micros() as u64, Ordering::Relaxed);
                        }
                    }
                    // An unhealthy replica's failures are the health check's to report.
                    Err(e) if healthy => {
                        eprintln!("session-gate proxy: engine gate heartbeat: {e}")
                    }
                    Err(_) => {}
                }
            });
        }
        tokio::time::sleep_until(started + every).await;
    }
}
