//! Where a replica's session gate runs, decided once when the proxy is built (`--gate-at`):
//! in this proxy ([`ReplicaGate::Local`], each replica's own [`Gate`](crate::gate::Gate)) or
//! in the replica's engine ([`ReplicaGate::Engine`], through the [`EngineGateClient`]).
//!
//! The request handling ([`forward`](super::forward)) only asks this gate — admit a turn,
//! release its lease, finish a session, keep the proxy's leases alive — and never which of
//! the two it is talking to.
use std::sync::Arc;

use hyper::StatusCode;

use super::config::{GateAt, ProxyConfig};
use super::engine_gate_client::{self, EngineGateClient, EngineLease};
use super::replicas::{Replica, Replicas};
use super::upstream::Client;
use super::usage_cache::CachedProbe;
use crate::error::Error;
use crate::gate::Lease;

/// The gate every replica's gated turns go through, wherever it runs.
#[derive(Debug)]
pub enum ReplicaGate {
    /// The gate runs in this proxy: one per replica (`--gate-at proxy`, the default).
    Local {
        /// Whether an admitted session keeps its cache reserved between turns.
        retain_session: bool,
    },
    /// The gate runs in each replica's engine and this proxy is one of its clients
    /// (`--gate-at engine`).
    Engine(Arc<EngineGateClient>),
}

/// Why a turn got no lease.
#[derive(Debug)]
pub enum AdmitError {
    /// A newer attempt of the session (from any client of the gate) took over (HTTP 409).
    Preempted {
        /// How many attempts of the session were preempted so far (0 when the gate does not
        /// say).
        num_preempted: u64,
    },
    /// The gate ended the attempt (`cancelled`, `expired`) or answered something else.
    Failed {
        /// The status to answer the client with.
        status: StatusCode,
        /// What happened, naming the replica.
        message: String,
    },
    /// The admit could not be sent: the connection to the replica failed (it may go elsewhere).
    NotSent(String),
}

impl ReplicaGate {
    /// The gate `config.gate_at` names; `client` is the proxy's pooled client to the replicas.
    pub fn new(config: &ProxyConfig, client: &Client) -> Self {
        match config.gate_at {
            GateAt::Proxy => Self::Local {
                retain_session: config.retain_session,
            },
            GateAt::Engine => Self::Engine(Arc::new(EngineGateClient::new(config, client.clone()))),
        }
    }

    /// Waits until `replica`'s gate admits this turn of `session` (`max_tokens` None: the
    /// gate's `default_max_tokens` knob sizes its working set).
    pub async fn admit(
        &self,
        replica: &Replica,
        session: &str,
        prompt_ids: &[u32],
        max_tokens: Option<usize>,
    ) -> Result<ReplicaLease, AdmitError> {
        let held = match self {
            Self::Local { retain_session } => replica
                .gate
                .acquire(session, prompt_ids, max_tokens, *retain_session)
                .await
                .map(Held::Local)
                .map_err(|e| match e {
                    Error::Preempted { .. } => AdmitError::Preempted { num_preempted: 0 },
                    e => AdmitError::Failed {
                        status: StatusCode::INTERNAL_SERVER_ERROR,
                        message: e.to_string(),
                    },
                })?,
            Self::Engine(client) => Held::Engine(
                client
                    .admit(replica, session, prompt_ids, max_tokens)
                    .await?,
            ),
        };
        Ok(ReplicaLease {
            probe: replica.probe.clone(),
            held,
        })
    }

    /// Ends `session`'s ownership window on `replica`'s gate; whether it had one (`Err`: the
    /// engine's gate could not be asked).
    pub async fn finish_session(&self, replica: &Replica, session: &str) -> Result<bool, String> {
        replica.probe.released();
        match self {
            Self::Local { .. } => Ok(replica.gate.finish_session(session).await),
            Self::Engine(client) => client.finish(replica, session).await,
        }
    }

    /// Starts renewing this proxy's leases on the replicas' engine gates (call once, inside a
    /// tokio runtime). `None` for the proxy's own gates: their leases live in this process and
    /// need no renewal.
    pub fn spawn_heartbeat(&self, replicas: &Arc<Replicas>) -> Option<tokio::task::JoinHandle<()>> {
        match self {
            Self::Local { .. } => None,
            Self::Engine(client) => Some(tokio::spawn(engine_gate_client::heartbeat(
                client.clone(),
                replicas.clone(),
            ))),
        }
    }
}

/// A turn's lease on its replica's gate; released by [`ReplicaLease::release`], or when
/// dropped.
#[derive(Debug)]
pub struct ReplicaLease {
    /// The replica's probe, told before the release (readings taken until then are
    /// pre-release).
    probe: Arc<CachedProbe>,
    held: Held,
}

/// The lease of the gate that admitted the turn.
#[derive(Debug)]
enum Held {
    Local(Lease),
    Engine(EngineLease),
}

impl ReplicaLease {
    /// Releases the lease.
    pub fn release(mut self) {
        // Before the release wakes any waiter: readings taken until now are pre-release.
        self.probe.released();
        match &mut self.held {
            Held::Local(lease) => {
                lease.release();
            }
            Held::Engine(lease) => lease.release(),
        }
    }

    /// Whether the forwarded request keeps the session header. Not after the replica's engine
    /// gate admitted the turn: without the header, the replica's gating middleware (if it runs
    /// one) does not admit the same turn a second time.
    pub fn forwards_session_header(&self) -> bool {
        matches!(self.held, Held::Local(_))
    }

    /// The DP rank the turn must run on (`X-data-parallel-rank`): the rank whose engine gate
    /// admitted it, on a data-parallel replica; `None` otherwise.
    pub fn dp_rank(&self) -> Option<u64> {
        match &self.held {
            Held::Local(_) => None,
            Held::Engine(lease) => lease.dp_rank(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::config::ProxyArgs;

    fn built(gate_at: &str) -> (ReplicaGate, Arc<Replicas>) {
        let args = ProxyArgs {
            replicas: vec!["http://127.0.0.1:9".into()],
            gate_at: Some(gate_at.into()),
            retain_session: Some(false),
            ..Default::default()
        };
        let config = ProxyConfig::from_toml(&args, "").unwrap();
        let client = super::super::upstream::client(std::time::Duration::from_secs(1));
        let replicas = Arc::new(Replicas::new(&config, &client).unwrap());
        (ReplicaGate::new(&config, &client), replicas)
    }

    #[tokio::test]
    async fn the_gate_is_chosen_from_gate_at_and_only_the_engines_needs_a_heartbeat() {
        let (local, replicas) = built("proxy");
        assert!(matches!(
            local,
            ReplicaGate::Local {
                retain_session: false
            }
        ));
        assert!(local.spawn_heartbeat(&replicas).is_none());

        let (engine, replicas) = built("engine");
        let ReplicaGate::Engine(client) = &engine else {
            panic!("--gate-at engine built {engine:?}");
        };
        assert!(client.id.starts_with("proxy-"), "{}", client.id);
        let heartbeat = engine.spawn_heartbeat(&replicas).expect("a heartbeat");
        heartbeat.abort();
    }
}
