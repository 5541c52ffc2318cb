//! `session-gate proxy`: an OpenAI-compatible HTTP proxy in front of one or more `vllm serve`
//! replicas, with one session gate per replica.
//!
//! - Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, the same
//!   under `/sess/{session_id}/v1/...`, `POST /sess/{session_id}/finish` (and vllm-router's
//!   `POST /finish_session?session_id=`, which prime-rl and SkyRL send), `GET /metrics`,
//!   `GET /health`. The session id comes from the path or the session header (default
//!   `x-session-id`); requests without one pass through ungated.
//! - Placement per turn ([`replicas`], [`placing`]): the policy `--placement` names
//!   ([`crate::gate::routers`]: the gate's [`crate::gate::placement`], `sticky-least-loaded`
//!   or `hash`, the code the twin's fleet drives), over what the proxy knows of each replica;
//!   a new session may be held until a replica would take it (late binding). A replica failing
//!   health checks takes nothing new and its sessions move. A session this proxy has not seen
//!   is looked for on the replicas' prefix probes (another proxy may have placed it).
//! - Replicas from flags, and from a file and DNS names re-read while running ([`discovery`]:
//!   [`replicas_file`], [`replicas_dns`]).
//! - Each gated request acquires its replica's gate before it is forwarded and releases when
//!   the answer has been passed on, failed, or the client went away ([`forward`]). A retry
//!   while the older attempt still waits preempts it: the older one gets HTTP 409.
//! - That gate runs in the proxy (one per replica) or, with `--gate-at engine`, in the
//!   replica's engine ([`engine_gate_client`]); [`replica_gate`] chooses once which.
//! - The replicas run `vllm serve` with `VLLM_PLUGINS=session_gate`: the probes are the
//!   `/session_gate/v1/*` routes ([`http_probe`]); text prompts and chat messages are tokenized
//!   by the replica's own `/tokenize`. Usage answers are cached for `usage_cache_ms` and
//!   shared between concurrent requests ([`usage_cache`]).
pub mod config;
pub mod discovery;
pub mod engine_gate_client;
pub mod forward;
pub mod http_probe;
pub mod metrics;
pub mod placing;
pub mod replica_gate;
pub mod replicas;
pub mod replicas_dns;
pub mod replicas_file;
pub mod upstream;
pub mod usage_cache;
mod waiting;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{any, get, post};
use axum::serve::ListenerExt;

pub use self::config::{ConfigError, ProxyArgs, ProxyConfig};
pub use self::http_probe::HttpProbe;
use self::metrics::ProxyMetrics;
use self::replica_gate::ReplicaGate;
use self::replicas::Replicas;
use self::upstream::Client;

/// The proxy's shared state.
#[derive(Debug)]
pub struct Proxy {
    /// Resolved configuration.
    pub config: ProxyConfig,
    /// Pooled client to the replicas.
    pub client: Client,
    /// Replicas, gates and sticky routing.
    pub replicas: Arc<Replicas>,
    /// The proxy's own metrics.
    pub metrics: ProxyMetrics,
    /// Where the replicas' gates run (in the proxy, or in the replicas' engines).
    pub replica_gate: ReplicaGate,
}

impl Proxy {
    /// Builds the proxy's state (gates included) from a resolved configuration.
    pub fn new(config: ProxyConfig) -> crate::Result<Arc<Self>> {
        let client = upstream::client(Duration::from_secs_f64(config.connect_timeout_sec));
        let replicas = Arc::new(Replicas::new(&config, &client)?);
        let metrics = ProxyMetrics::new(config.max_session_labels);
        let replica_gate = ReplicaGate::new(&config, &client);
        Ok(Arc::new(Self {
            config,
            client,
            replicas,
            metrics,
            replica_gate,
        }))
    }

    /// The axum router over this state.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/v1/{*rest}", any(forward::v1))
            .route("/sess/{session_id}/v1/{*rest}", any(forward::sess_v1))
            .route("/sess/{session_id}/finish", post(forward::finish))
            .route("/finish_session", post(forward::finish_session))
            .route("/metrics", get(forward::metrics))
            .route("/health", get(forward::health))
            .layer(DefaultBodyLimit::max(self.config.max_body_bytes))
            .with_state(self.clone())
    }

    /// Starts the replicas' health checks (call once, inside a tokio runtime).
    pub fn spawn_health_checks(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let interval = Duration::from_secs_f64(self.config.health_interval_sec);
        tokio::spawn(replicas::health_loop(
            self.replicas.clone(),
            self.client.clone(),
            interval,
        ))
    }
}

/// Binds `config.listen`, starts health checks and serves until `shutdown` resolves.
pub async fn serve(
    config: ProxyConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let proxy = Proxy::new(config).map_err(std::io::Error::other)?;
    let listener = tokio::net::TcpListener::bind(proxy.config.listen).await?;
    let local = listener.local_addr()?;
    // TCP_NODELAY on client connections: hyper writes a response's head and body separately,
    // and Nagle's algorithm would hold the body until the client's delayed ACK (~40 ms).
    let listener = listener.tap_io(|stream| {
        let _ = stream.set_nodelay(true);
    });
    let list = proxy.replicas.snapshot();
    eprintln!(
        "session-gate proxy: listening on http://{} for {} replica(s): {}{}",
        local,
        list.len(),
        list.iter()
            .map(|r| r.url.base.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        discovery_note(&proxy.config.discovery)
    );
    let health = proxy.spawn_health_checks();
    let sources = &proxy.config.discovery;
    let watch = (!sources.is_empty())
        .then(|| tokio::spawn(discovery::watch(proxy.replicas.clone(), sources.clone())));
    let heartbeat = proxy.replica_gate.spawn_heartbeat(&proxy.replicas);
    let result = axum::serve(listener, proxy.router())
        .with_graceful_shutdown(shutdown)
        .await;
    health.abort();
    if let Some(w) = watch {
        w.abort();
    }
    if let Some(h) = heartbeat {
        h.abort();
    }
    result
}

/// What the startup line says about the sources polled while running.
fn discovery_note(sources: &discovery::Sources) -> String {
    let mut polled: Vec<String> = sources
        .file
        .iter()
        .map(|(path, _, _)| path.display().to_string())
        .collect();
    polled.extend(sources.dns.iter().map(|(name, _, _)| name.target()));
    if polled.is_empty() {
        String::new()
    } else {
        format!(" (re-reading {})", polled.join(", "))
    }
}
