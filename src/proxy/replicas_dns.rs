//! `--replicas-dns NAME:PORT`: the replicas behind a DNS name that may change while the proxy
//! runs (a Kubernetes headless service lists one A/AAAA record per ready pod; Consul and Slurm
//! setups publish names the same way). Each address the name resolves to is one replica,
//! `http://ADDRESS:PORT`.
//!
//! Resolved once at startup and then every [`POLL`](super::discovery::POLL) by the
//! discovery loop ([`super::discovery`]). A name that does not resolve keeps the replicas it
//! last resolved to: a DNS blip, or a service with no ready pod for a moment, must not empty the
//! fleet. At startup it is reported and counts as no replica yet: vLLM pods take minutes to
//! become ready, and the proxy serves (or answers 503 "no replica") meanwhile instead of
//! refusing to start.
use std::net::SocketAddr;
use std::time::Duration;

use super::config::{ReplicaUrl, parse_replica};

/// How long one resolution may take before it counts as failed.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// A DNS name and the port its replicas serve on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsName {
    /// The host name, as given.
    pub host: String,
    /// The port of every replica behind it.
    pub port: u16,
}

impl DnsName {
    /// Parses `NAME:PORT`; the error says what is wrong (the caller names the field).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (host, port) = text.rsplit_once(':').ok_or_else(|| {
            format!("{text:?} must be NAME:PORT (the port the replicas serve on)")
        })?;
        if host.is_empty() || host.contains('/') || host.contains('[') {
            return Err(format!(
                "{text:?} must be NAME:PORT with a host name (no scheme, no path)"
            ));
        }
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("{text:?} has an invalid port {port:?}"))?;
        Ok(Self {
            host: host.to_string(),
            port,
        })
    }

    /// The name as `NAME:PORT` (what resolution and the logs use).
    pub fn target(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// The replicas `addrs` stand for, deduplicated and sorted (the order a resolver answers in
/// rotates; the list must not look changed because of it).
pub fn replicas_of(addrs: impl IntoIterator<Item = SocketAddr>) -> Vec<ReplicaUrl> {
    let mut addrs: Vec<SocketAddr> = addrs.into_iter().collect();
    addrs.sort_unstable();
    addrs.dedup();
    addrs
        .into_iter()
        .filter_map(|a| parse_replica("replicas_dns", &format!("http://{a}")).ok())
        .collect()
}

/// Resolves `name` now, blocking (startup, before the runtime serves).
pub fn resolve_blocking(name: &DnsName) -> Result<Vec<ReplicaUrl>, String> {
    use std::net::ToSocketAddrs;
    let addrs = name
        .target()
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {}: {e}", name.target()))?;
    non_empty(name, replicas_of(addrs))
}

/// Resolves `name` (at most [`RESOLVE_TIMEOUT`]).
pub async fn resolve(name: &DnsName) -> Result<Vec<ReplicaUrl>, String> {
    let target = name.target();
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(target.as_str())).await {
        Ok(Ok(addrs)) => non_empty(name, replicas_of(addrs)),
        Ok(Err(e)) => Err(format!("cannot resolve {target}: {e}")),
        Err(_) => Err(format!(
            "cannot resolve {target}: no answer within {} s",
            RESOLVE_TIMEOUT.as_secs()
        )),
    }
}

fn non_empty(name: &DnsName, urls: Vec<ReplicaUrl>) -> Result<Vec<ReplicaUrl>, String> {
    if urls.is_empty() {
        Err(format!("{} resolved to no address", name.target()))
    } else {
        Ok(urls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_needs_a_port_and_no_scheme() {
        assert_eq!(
            DnsName::parse(" vllm.rollout.svc:8000 ").unwrap(),
            DnsName {
                host: "vllm.rollout.svc".into(),
                port: 8000
            }
        );
        for (bad, why) in [
            ("vllm.svc", "NAME:PORT"),
            ("http://vllm.svc:8000", "no scheme"),
            ("vllm.svc:http", "invalid port"),
            ("vllm.svc:0", "invalid port"),
            (":8000", "host name"),
        ] {
            let e = DnsName::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn addresses_become_sorted_unique_replicas_v4_and_v6() {
        let addrs: Vec<SocketAddr> = ["10.0.0.2:8000", "[fd00::1]:8000", "10.0.0.1:8000"]
            .iter()
            .chain(&["10.0.0.2:8000"])
            .map(|a| a.parse().unwrap())
            .collect();
        let bases: Vec<String> = replicas_of(addrs).into_iter().map(|u| u.base).collect();
        assert_eq!(
            bases,
            [
                "http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "http://[fd00::1]:8000"
            ]
        );
    }

    #[tokio::test]
    async fn localhost_resolves_to_loopback_and_a_bad_name_says_so() {
        let name = DnsName::parse("localhost:8123").unwrap();
        let urls = resolve(&name).await.unwrap();
        assert!(
            urls.iter()
                .any(|u| u.base == "http://127.0.0.1:8123" || u.base == "http://[::1]:8123"),
            "{urls:?}"
        );
        assert_eq!(resolve_blocking(&name).unwrap(), urls);
        // `.invalid` never resolves (RFC 6761).
        let e = resolve(&DnsName::parse("no-such-host.invalid:80").unwrap())
            .await
            .unwrap_err();
        assert!(e.contains("cannot resolve no-such-host.invalid:80"), "{e}");
    }
}
