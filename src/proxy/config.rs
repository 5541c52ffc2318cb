//! Configuration of `session-gate proxy`: command-line flags over an optional TOML file over
//! defaults. Every error names the field (flag and TOML key share one name, `-` vs `_`).
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use serde::Deserialize;

use super::discovery::Sources;
use super::replicas_dns::{self, DnsName};
use crate::gate::routers::Router;
use crate::gate::{GateConfig, Pressure};

/// Default listen address: loopback only, so nothing is exposed unless asked for.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8100";

/// Default `usage_cache_ms`.
pub const DEFAULT_USAGE_CACHE_MS: u64 = 100;

/// Largest accepted `usage_cache_ms`.
pub const MAX_USAGE_CACHE_MS: u64 = 10_000;

/// `session-gate proxy`: an OpenAI-compatible proxy with one session gate per vLLM replica.
///
/// Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, the same under
/// /sess/{session_id}/v1/..., POST /sess/{session_id}/finish, GET /metrics, GET /health.
/// The session id comes from the path or the session header; requests without one pass
/// through ungated. Every flag can also be set in the TOML file given with --config (same
/// name with `_` for `-`); flags win over the file.
#[derive(Debug, Clone, Default, Parser)]
#[command(name = "session-gate proxy", version)]
pub struct ProxyArgs {
    /// TOML file with any of the settings below (keys as flag names with `_`).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Address to listen on [default: 127.0.0.1:8100]. Binds loopback unless told otherwise.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,

    /// Base URL of a `vllm serve` replica run with VLLM_PLUGINS=session_gate
    /// (repeat the flag or separate with commas), e.g. http://127.0.0.1:8000.
    #[arg(long = "replica", value_name = "URL", value_delimiter = ',')]
    pub replicas: Vec<String>,

    /// File listing more replicas, one URL a line (`#` comments), re-read while the proxy runs
    /// (polled every 2 s): a replica added takes new sessions, a removed one takes none and its
    /// sessions move at their next turn.
    #[arg(long, value_name = "PATH")]
    pub replicas_file: Option<PathBuf>,

    /// DNS name whose addresses are replicas, as NAME:PORT (repeat or separate with commas),
    /// e.g. a Kubernetes headless service `vllm.rollout.svc.cluster.local:8000`; resolved
    /// again every 2 s (a name that fails to resolve keeps the replicas it had).
    #[arg(long, value_name = "NAME:PORT", value_delimiter = ',')]
    pub replicas_dns: Vec<String>,

    /// Header carrying the session id when the path has none [default: x-session-id].
    #[arg(long, value_name = "NAME")]
    pub session_header: Option<String>,

    /// Fraction of KV blocks above which a replica's gate is under pressure [default: 0.85].
    #[arg(long, value_name = "FRACTION")]
    pub high_watermark: Option<f64>,

    /// Minimum prefix hit ratio for a `resident_prefix` admission [default: 0.8].
    #[arg(long, value_name = "FRACTION")]
    pub hit_threshold: Option<f64>,

    /// Seconds a waiter sleeps before looking again when nothing wakes it [default: 5].
    #[arg(long, value_name = "SEC")]
    pub wait_poll_sec: Option<f64>,

    /// Seconds a finished turn keeps its session's reservation (idle grace) [default: 60].
    #[arg(long, value_name = "SEC")]
    pub idle_grace_sec: Option<f64>,

    /// What the watermark is compared with: `committed` or `engine` [default: committed].
    #[arg(long, value_name = "MODE")]
    pub pressure: Option<String>,

    /// Admit with reason `max_wait` after waiting this long [default: never].
    #[arg(long, value_name = "SEC")]
    pub max_wait_sec: Option<f64>,

    /// A probe slower than this counts as unavailable [default: 2].
    #[arg(long, value_name = "SEC")]
    pub probe_timeout_sec: Option<f64>,

    /// Milliseconds a replica's usage answer (vLLM's KV usage) is reused by later requests;
    /// concurrent requests share one usage probe. A lease released on the replica makes
    /// the answer stale: it is then reused only while below high_watermark. Committed
    /// pressure is exact regardless. 0 probes vLLM for every request [default: 100].
    #[arg(long, value_name = "MS")]
    pub usage_cache_ms: Option<u64>,

    /// Seconds between health checks (GET /health) of each replica [default: 2].
    #[arg(long, value_name = "SEC")]
    pub health_interval_sec: Option<f64>,

    /// Output tokens a turn's working set counts when the request sets neither max_tokens nor
    /// max_completion_tokens (the gate's default_max_tokens knob) [default: 256].
    #[arg(long, value_name = "TOKENS")]
    pub default_max_tokens: Option<usize>,

    /// While a replica has nothing running or waiting, an idle session's room may yield after
    /// this many of its own turn times; 0 = never early (the gate's idle_engine_turns knob)
    /// [default: 4].
    #[arg(long, value_name = "TURNS")]
    pub idle_engine_turns: Option<usize>,

    /// Keep a session's reservation for idle_grace_sec after each turn [default: true].
    #[arg(long, value_name = "BOOL")]
    pub retain_session: Option<bool>,

    /// At most this many sessions get their own label in per-session metrics; the rest are
    /// summed under session="_other" [default: 64].
    #[arg(long, value_name = "N")]
    pub max_session_labels: Option<usize>,

    /// Largest request body accepted, in bytes; a larger one gets HTTP 413 [default: 67108864].
    #[arg(long, value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,

    /// Seconds to open a TCP connection to a replica. A request whose connection fails never
    /// reached vLLM: it goes to another healthy replica [default: 5].
    #[arg(long, value_name = "SEC")]
    pub connect_timeout_sec: Option<f64>,

    /// Seconds a replica may take to send a response's headers (a non-streaming answer's
    /// headers come after the whole generation; a 128K-token prompt's prefill comes first);
    /// then HTTP 504, never replayed [default: 1800].
    #[arg(long, value_name = "SEC")]
    pub response_timeout_sec: Option<f64>,

    /// Seconds a replica's response body may stay silent between two chunks (a stream waiting
    /// in vLLM's queue, a long prefill); then the answer is cut off [default: 600].
    #[arg(long, value_name = "SEC")]
    pub idle_timeout_sec: Option<f64>,

    /// Key the proxy's own routes (`/sess/{id}/finish`, `/metrics`) require as
    /// `Authorization: Bearer KEY` (401 otherwise); `/health` stays open. Forwarded `/v1`
    /// requests are vLLM's to authenticate: their `Authorization` passes through untouched
    /// [default: none, open].
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,

    /// Key the proxy sends as `Authorization: Bearer KEY` on its own calls to the replicas
    /// (the `/session_gate/v1/*` probe and gate routes, `/tokenize`), for replicas started
    /// with `vllm serve --api-key` [default: none].
    #[arg(long, value_name = "KEY")]
    pub replica_api_key: Option<String>,

    /// Where sessions are gated: `proxy` (a gate per replica in this process) or `engine` (the
    /// replica's own engine gate, through its /session_gate/v1/admit routes, shared with every
    /// other client of that replica; the gate knobs are then the engine's SESSION_GATE_*)
    /// [default: proxy]. Two proxies in front of the same replicas need `engine`: with
    /// `proxy` each one commits a replica's blocks alone, and together they can commit it
    /// past its line.
    #[arg(long, value_name = "WHERE")]
    pub gate_at: Option<String>,

    /// Where a session goes: `gate` (where it would be admitted soonest; a returning session
    /// stays while its prefix is resident), `sticky-least-loaded` (the replica with the fewest
    /// requests of this proxy in flight or waiting at its first turn, then for good) or `hash`
    /// (consistent hashing on the session id, as vllm-router's consistent_hash). Under `gate`
    /// and `sticky-least-loaded`, a session this proxy has not seen is looked for on the
    /// replicas (prefix probes), so that two proxies, or one restarted, keep it where its
    /// prefix is [default: gate].
    #[arg(long, value_name = "POLICY")]
    pub placement: Option<String>,
}

/// The TOML file: the same settings as the flags (`deny_unknown_fields`, so typos are named).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    replicas: Option<Vec<String>>,
    replicas_file: Option<PathBuf>,
    replicas_dns: Option<Vec<String>>,
    session_header: Option<String>,
    high_watermark: Option<f64>,
    hit_threshold: Option<f64>,
    wait_poll_sec: Option<f64>,
    idle_grace_sec: Option<f64>,
    pressure: Option<String>,
    max_wait_sec: Option<f64>,
    probe_timeout_sec: Option<f64>,
    usage_cache_ms: Option<u64>,
    health_interval_sec: Option<f64>,
    default_max_tokens: Option<usize>,
    idle_engine_turns: Option<usize>,
    retain_session: Option<bool>,
    max_session_labels: Option<usize>,
    max_body_bytes: Option<usize>,
    connect_timeout_sec: Option<f64>,
    response_timeout_sec: Option<f64>,
    idle_timeout_sec: Option<f64>,
    api_key: Option<String>,
    replica_api_key: Option<String>,
    gate_at: Option<String>,
    placement: Option<String>,
}

/// A configuration error; the message names the field.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    /// The field (flag / TOML key) that was wrong.
    pub field: String,
    /// What was wrong with it.
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid configuration: `{}`: {}",
            self.field, self.message
        )
    }
}

impl std::error::Error for ConfigError {}

fn err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        message: message.into(),
    }
}

/// A replica's base URL, split for the HTTP client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaUrl {
    /// As given, without a trailing `/` (used as the `replica` metrics label).
    pub base: String,
    /// `host:port` (port defaulted to 80).
    pub authority: String,
}

/// The resolved configuration of the proxy.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The replicas at startup, in the order given: the static ones (flags or the TOML file's
    /// `replicas`), then the replicas file's, then the DNS names'.
    pub replicas: Vec<ReplicaUrl>,
    /// The static replicas (flags or TOML `replicas`): always listed, whatever the replicas file
    /// says later.
    pub static_replicas: Vec<ReplicaUrl>,
    /// The sources polled while running (`--replicas-file`, `--replicas-dns`), with what they
    /// answered at startup.
    pub discovery: Sources,
    /// Lower-cased header name carrying the session id.
    pub session_header: String,
    /// Each replica's gate configuration (validated).
    pub gate: GateConfig,
    /// How long a replica's usage answer is reused, in milliseconds (0: never).
    pub usage_cache_ms: u64,
    /// Seconds between health checks.
    pub health_interval_sec: f64,
    /// Whether leases ask for an idle grace window.
    pub retain_session: bool,
    /// Cap on per-session metric labels.
    pub max_session_labels: usize,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Connect timeout towards replicas, in seconds.
    pub connect_timeout_sec: f64,
    /// Time allowed until a replica's response headers, in seconds.
    pub response_timeout_sec: f64,
    /// Longest silence inside a replica's response body, in seconds.
    pub idle_timeout_sec: f64,
    /// Key of the proxy's own routes, if any.
    pub api_key: Option<String>,
    /// `Authorization` value of the proxy's own calls to replicas (`Bearer KEY`), if any.
    pub replica_authorization: Option<String>,
    /// Where sessions are gated.
    pub gate_at: GateAt,
    /// Where sessions go.
    pub placement: Router,
}

/// Where `session-gate proxy` gates sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GateAt {
    /// One gate per replica inside the proxy process.
    #[default]
    Proxy,
    /// The replica's engine gate (`/session_gate/v1/admit`), shared by all its clients.
    Engine,
}

impl GateAt {
    fn from_name(name: &str) -> Result<Self, ConfigError> {
        match name {
            "proxy" => Ok(Self::Proxy),
            "engine" => Ok(Self::Engine),
            _ => Err(err(
                "gate_at",
                format!("{name:?} is not a place to gate: expected \"proxy\" or \"engine\""),
            )),
        }
    }
}

/// Parses `http://host[:port][/]` (plain HTTP only: replicas sit on a trusted network).
pub fn parse_replica(field: &str, url: &str) -> Result<ReplicaUrl, ConfigError> {
    let trimmed = url.trim().trim_end_matches('/');
    let rest = trimmed.strip_prefix("http://").ok_or_else(|| {
        err(
            field,
            format!("{url:?} must start with http:// (https upstreams are not supported)"),
        )
    })?;
    if rest.is_empty() || rest.contains('/') || rest.contains('?') || rest.contains('@') {
        return Err(err(
            field,
            format!("{url:?} must be http://host[:port] with no path"),
        ));
    }
    let authority = if rest.rsplit_once(':').is_some_and(|(_, p)| !p.contains(']')) {
        let (_, port) = rest.rsplit_once(':').unwrap_or_default();
        port.parse::<u16>()
            .map_err(|_| err(field, format!("{url:?} has an invalid port {port:?}")))?;
        rest.to_string()
    } else {
        format!("{rest}:80")
    };
    Ok(ReplicaUrl {
        base: trimmed.to_string(),
        authority,
    })
}

impl ProxyConfig {
    /// Resolves flags over the TOML file (if `--config` names one) over defaults.
    pub fn load(args: &ProxyArgs) -> Result<Self, ConfigError> {
        let file = match &args.config {
            None => FileConfig::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| err("config", format!("cannot read {}: {e}", path.display())))?;
                Self::parse_toml(&text)?
            }
        };
        Self::resolve(args, file)
    }

    /// Resolves flags over a TOML document (for tests and embedders).
    pub fn from_toml(args: &ProxyArgs, text: &str) -> Result<Self, ConfigError> {
        Self::resolve(args, Self::parse_toml(text)?)
    }

    fn parse_toml(text: &str) -> Result<FileConfig, ConfigError> {
        toml::from_str::<FileConfig>(text).map_err(|e| {
            // The field is the key on the line the error points at (unknown key, bad value).
            let field = e
                .span()
                .and_then(|span| {
                    let start = text[..span.start.min(text.len())]
                        .rfind('\n')
                        .map_or(0, |i| i + 1);
                    let line = text[start..].lines().next()?;
                    let key = line.split('=').next()?.trim().trim_matches('"');
                    (!key.is_empty() && !key.starts_with('[')).then(|| key.to_string())
                })
                .unwrap_or_else(|| "config".to_string());
            err(
                &field,
                format!("in the TOML file: {}", e.to_string().trim()),
            )
        })
    }

    fn resolve(args: &ProxyArgs, file: FileConfig) -> Result<Self, ConfigError> {
        let listen_text = args
            .listen
            .clone()
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.to_string());
        let listen: SocketAddr = listen_text.parse().map_err(|e| {
            err(
                "listen",
                format!("{listen_text:?} is not an address like 127.0.0.1:8100 ({e})"),
            )
        })?;
        let replica_list = if args.replicas.is_empty() {
            file.replicas.unwrap_or_default()
        } else {
            args.replicas.clone()
        };
        let mut replicas = Vec::with_capacity(replica_list.len());
        for (i, url) in replica_list.iter().enumerate() {
            let r = parse_replica(&format!("replicas[{i}]"), url)?;
            if replicas.iter().any(|o: &ReplicaUrl| o.base == r.base) {
                return Err(err(
                    &format!("replicas[{i}]"),
                    format!("{url:?} is listed twice"),
                ));
            }
            replicas.push(r);
        }
        let static_replicas = replicas.clone();
        let mut discovery = Sources::default();
        if let Some(path) = args.replicas_file.clone().or(file.replicas_file) {
            let (text, urls) =
                super::replicas_file::read(&path).map_err(|e| err("replicas_file", e))?;
            discovery.file = Some((path, text, urls));
        }
        let dns_list = if args.replicas_dns.is_empty() {
            file.replicas_dns.unwrap_or_default()
        } else {
            args.replicas_dns.clone()
        };
        for (i, text) in dns_list.iter().enumerate() {
            let field = format!("replicas_dns[{i}]");
            let name = DnsName::parse(text).map_err(|e| err(&field, e))?;
            // Not resolving yet is no error: the pods behind the name may not be ready.
            let urls = replicas_dns::resolve_blocking(&name).unwrap_or_else(|e| {
                eprintln!("session-gate proxy: {e}; no replica from {field} yet");
                Vec::new()
            });
            discovery.dns.push((name, None, urls));
        }
        for url in discovery.listed() {
            if !replicas.iter().any(|o| o.base == url.base) {
                replicas.push(url);
            }
        }
        if replicas.is_empty() && discovery.dns.is_empty() {
            return Err(err(
                "replicas",
                "at least one replica is needed (--replica http://host:port, a \
                 --replicas-file that lists one, or --replicas-dns NAME:PORT)",
            ));
        }
        let session_header = args
            .session_header
            .clone()
            .or(file.session_header)
            .unwrap_or_else(|| "x-session-id".to_string())
            .to_ascii_lowercase();
        if axum::http::HeaderName::from_bytes(session_header.as_bytes()).is_err() {
            return Err(err(
                "session_header",
                format!("{session_header:?} is not a valid header name"),
            ));
        }
        let mut gate = GateConfig::default();
        macro_rules! knob {
            ($name:ident) => {
                if let Some(v) = args.$name.or(file.$name) {
                    gate.$name = v;
                }
            };
        }
        knob!(high_watermark);
        knob!(hit_threshold);
        knob!(wait_poll_sec);
        knob!(idle_grace_sec);
        knob!(probe_timeout_sec);
        knob!(default_max_tokens);
        knob!(idle_engine_turns);
        if let Some(v) = args.max_wait_sec.or(file.max_wait_sec) {
            gate.max_wait_sec = Some(v);
        }
        if let Some(p) = args.pressure.clone().or(file.pressure) {
            gate.pressure = Pressure::from_name(&p).map_err(|e| err("pressure", e.to_string()))?;
        }
        // The gate's own validation names the knob; the knob is the field.
        gate.validate().map_err(|e| match &e {
            crate::Error::InvalidKnob { knob, .. } => err(knob, e.to_string()),
            _ => err("gate", e.to_string()),
        })?;
        let usage_cache_ms = args
            .usage_cache_ms
            .or(file.usage_cache_ms)
            .unwrap_or(DEFAULT_USAGE_CACHE_MS);
        if usage_cache_ms > MAX_USAGE_CACHE_MS {
            return Err(err(
                "usage_cache_ms",
                format!(
                    "{usage_cache_ms} is too long: at most {MAX_USAGE_CACHE_MS} ms \
                     (a usage answer that old says little about vLLM's cache)"
                ),
            ));
        }
        let health_interval_sec = args
            .health_interval_sec
            .or(file.health_interval_sec)
            .unwrap_or(2.0);
        if !(health_interval_sec.is_finite() && health_interval_sec > 0.0) {
            return Err(err(
                "health_interval_sec",
                format!("{health_interval_sec} must be a positive number of seconds"),
            ));
        }
        let max_session_labels = args
            .max_session_labels
            .or(file.max_session_labels)
            .unwrap_or(64);
        let max_body_bytes = args
            .max_body_bytes
            .or(file.max_body_bytes)
            .unwrap_or(64 << 20);
        if max_body_bytes == 0 {
            return Err(err("max_body_bytes", "must be positive"));
        }
        let seconds = |field: &str, value: Option<f64>, default: f64| {
            let v = value.unwrap_or(default);
            if v.is_finite() && v > 0.0 && v <= 86_400.0 {
                Ok(v)
            } else {
                Err(err(
                    field,
                    format!("{v} must be a number of seconds in (0, 86400]"),
                ))
            }
        };
        let connect_timeout_sec = seconds(
            "connect_timeout_sec",
            args.connect_timeout_sec.or(file.connect_timeout_sec),
            5.0,
        )?;
        let response_timeout_sec = seconds(
            "response_timeout_sec",
            args.response_timeout_sec.or(file.response_timeout_sec),
            1800.0,
        )?;
        let idle_timeout_sec = seconds(
            "idle_timeout_sec",
            args.idle_timeout_sec.or(file.idle_timeout_sec),
            600.0,
        )?;
        let key = |field: &str, value: Option<String>| match value {
            Some(k) if k.is_empty() || !k.bytes().all(|b| b.is_ascii_graphic()) => Err(err(
                field,
                "must be non-empty printable ASCII without spaces",
            )),
            v => Ok(v),
        };
        let api_key = key("api_key", args.api_key.clone().or(file.api_key))?;
        let replica_api_key = key(
            "replica_api_key",
            args.replica_api_key.clone().or(file.replica_api_key),
        )?;
        Ok(Self {
            listen,
            replicas,
            static_replicas,
            discovery,
            session_header,
            gate,
            usage_cache_ms,
            health_interval_sec,
            retain_session: args.retain_session.or(file.retain_session).unwrap_or(true),
            max_session_labels,
            max_body_bytes,
            connect_timeout_sec,
            response_timeout_sec,
            idle_timeout_sec,
            api_key,
            replica_authorization: replica_api_key.map(|k| format!("Bearer {k}")),
            gate_at: match args.gate_at.clone().or(file.gate_at) {
                Some(name) => GateAt::from_name(&name)?,
                None => GateAt::Proxy,
            },
            placement: match args.placement.clone().or(file.placement) {
                Some(name) => Router::from_name(&name).ok_or_else(|| {
                    err(
                        "placement",
                        format!(
                            "{name:?} is not a placement policy: expected one of {}",
                            Router::NAMES.join(", ")
                        ),
                    )
                })?,
                None => Router::Gate,
            },
        })
    }
}
