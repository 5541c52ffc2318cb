//! `session-gate proxy` configuration: flags over TOML over defaults; errors name the field.
#![cfg(feature = "proxy")]
use session_gate::proxy::{ProxyArgs, ProxyConfig};

fn args(replicas: &[&str]) -> ProxyArgs {
    ProxyArgs {
        replicas: replicas.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn field_of(r: Result<ProxyConfig, session_gate::proxy::ConfigError>) -> String {
    r.expect_err("configuration should be refused").field
}

#[test]
fn defaults_bind_loopback() {
    let c = ProxyConfig::from_toml(&args(&["http://127.0.0.1:8000"]), "").unwrap();
    assert!(c.listen.ip().is_loopback());
    assert_eq!(c.session_header, "x-session-id");
    assert_eq!(c.replicas[0].authority, "127.0.0.1:8000");
    assert!(c.retain_session);
}

#[test]
fn flags_win_over_the_file() {
    let mut a = args(&[]);
    a.high_watermark = Some(0.5);
    let toml =
        "replicas = [\"http://a:1\", \"http://b\"]\nhigh_watermark = 0.7\nhit_threshold = 0.6\n";
    let c = ProxyConfig::from_toml(&a, toml).unwrap();
    assert_eq!(c.gate.high_watermark, 0.5);
    assert_eq!(c.gate.hit_threshold, 0.6);
    assert_eq!(c.replicas[1].authority, "b:80");
}

#[test]
fn default_max_tokens_is_the_gates_knob() {
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "").unwrap();
    assert_eq!(c.gate.default_max_tokens, 256);
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "default_max_tokens = 64").unwrap();
    assert_eq!(c.gate.default_max_tokens, 64);
    let mut a = args(&["http://a:1"]);
    a.default_max_tokens = Some(4096);
    let c = ProxyConfig::from_toml(&a, "default_max_tokens = 64").unwrap();
    assert_eq!(c.gate.default_max_tokens, 4096);
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "default_max_tokens = -1");
    assert_eq!(field_of(r), "default_max_tokens");
}

#[test]
fn bad_values_name_their_field() {
    assert_eq!(field_of(ProxyConfig::from_toml(&args(&[]), "")), "replicas");
    assert_eq!(
        field_of(ProxyConfig::from_toml(&args(&["https://a:1"]), "")),
        "replicas[0]"
    );
    assert_eq!(
        field_of(ProxyConfig::from_toml(&args(&["http://a:x"]), "")),
        "replicas[0]"
    );
    assert_eq!(
        field_of(ProxyConfig::from_toml(
            &args(&["http://a:1", "http://a:1"]),
            ""
        )),
        "replicas[1]"
    );
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "listen = \"nowhere\"");
    assert_eq!(field_of(r), "listen");
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "hit_threshold = 1.5");
    assert_eq!(field_of(r), "hit_threshold");
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "pressure = \"vibes\"");
    assert_eq!(field_of(r), "pressure");
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "health_interval_sec = 0");
    assert_eq!(field_of(r), "health_interval_sec");
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "high_watermrk = 0.5");
    assert_eq!(field_of(r), "high_watermrk");
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "wait_poll_sec = \"x\"");
    assert_eq!(field_of(r), "wait_poll_sec");
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "replicas = [");
    assert_eq!(field_of(r), "replicas");
}

#[test]
fn usage_cache_ms_from_flag_file_and_default() {
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "").unwrap();
    assert_eq!(c.usage_cache_ms, 100);
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "usage_cache_ms = 0").unwrap();
    assert_eq!(c.usage_cache_ms, 0);
    let mut a = args(&["http://a:1"]);
    a.usage_cache_ms = Some(10);
    let c = ProxyConfig::from_toml(&a, "usage_cache_ms = 30").unwrap();
    assert_eq!(c.usage_cache_ms, 10);
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "usage_cache_ms = 600000");
    assert_eq!(field_of(r), "usage_cache_ms");
    let r = ProxyConfig::from_toml(&args(&["http://a:1"]), "usage_cache_ms = -1");
    assert_eq!(field_of(r), "usage_cache_ms");
}

#[test]
fn gate_at_chooses_the_proxys_gate_or_the_engines() {
    use session_gate::proxy::config::GateAt;
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "").unwrap();
    assert_eq!(c.gate_at, GateAt::Proxy);
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "gate_at = \"engine\"").unwrap();
    assert_eq!(c.gate_at, GateAt::Engine);
    let mut a = args(&["http://a:1"]);
    a.gate_at = Some("proxy".into());
    let c = ProxyConfig::from_toml(&a, "gate_at = \"engine\"").unwrap();
    assert_eq!(c.gate_at, GateAt::Proxy);
    a.gate_at = Some("replica".into());
    let e = ProxyConfig::from_toml(&a, "").expect_err("an unknown place is refused");
    assert_eq!(e.field, "gate_at");
    assert!(e.message.contains("\"replica\""), "{}", e.message);
}

#[test]
fn timeouts_and_keys_have_defaults_and_are_checked() {
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "").unwrap();
    assert_eq!(c.connect_timeout_sec, 5.0);
    // Long enough for a 128K-token prompt's prefill and a long generation.
    assert!(c.response_timeout_sec >= 600.0);
    assert!(c.idle_timeout_sec >= 300.0);
    assert_eq!(c.max_body_bytes, 64 << 20);
    assert_eq!(c.api_key, None);
    assert_eq!(c.replica_authorization, None);

    let mut a = args(&["http://a:1"]);
    a.api_key = Some("p".into());
    a.replica_api_key = Some("k".into());
    a.idle_timeout_sec = Some(30.0);
    let toml = "connect_timeout_sec = 0.5\nresponse_timeout_sec = 60\n";
    let c = ProxyConfig::from_toml(&a, toml).unwrap();
    assert_eq!(c.api_key.as_deref(), Some("p"));
    assert_eq!(c.replica_authorization.as_deref(), Some("Bearer k"));
    assert_eq!(
        (
            c.connect_timeout_sec,
            c.response_timeout_sec,
            c.idle_timeout_sec
        ),
        (0.5, 60.0, 30.0)
    );

    for (toml, field) in [
        ("connect_timeout_sec = 0", "connect_timeout_sec"),
        ("response_timeout_sec = -1", "response_timeout_sec"),
        ("idle_timeout_sec = 1e9", "idle_timeout_sec"),
        ("api_key = \"\"", "api_key"),
        ("replica_api_key = \"has space\"", "replica_api_key"),
        ("max_body_bytes = 0", "max_body_bytes"),
    ] {
        let e = ProxyConfig::from_toml(&args(&["http://a:1"]), toml).expect_err(toml);
        assert_eq!(e.field, field, "{toml}");
    }
}

/// A replicas file in the system's temp directory, named for the test.
fn replicas_file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("session-gate-{name}-{}.txt", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_replicas_file_adds_to_the_flags_and_a_bad_line_is_named() {
    let path = replicas_file(
        "fleet",
        "# fleet\nhttp://b:2\n\nhttp://a:1  # dup of a flag\n",
    );
    let mut a = args(&["http://a:1"]);
    a.replicas_file = Some(path.clone());
    let c = ProxyConfig::from_toml(&a, "").unwrap();
    let bases: Vec<_> = c.replicas.iter().map(|r| r.base.as_str()).collect();
    assert_eq!(bases, ["http://a:1", "http://b:2"]);
    assert_eq!(c.static_replicas.len(), 1);
    assert_eq!(c.replicas_file.as_ref().unwrap().0, path);

    // The file alone is enough; from TOML too.
    let toml = format!("replicas_file = {:?}\n", path.display().to_string());
    let c = ProxyConfig::from_toml(&args(&[]), &toml).unwrap();
    assert_eq!(c.replicas.len(), 2);
    assert!(c.static_replicas.is_empty());

    std::fs::write(&path, "http://b:2\nftp://c\n").unwrap();
    let mut a = args(&[]);
    a.replicas_file = Some(path.clone());
    let e = ProxyConfig::from_toml(&a, "").unwrap_err();
    assert_eq!(e.field, "replicas_file");
    assert!(
        e.message.contains("line 2") && e.message.contains("ftp://c"),
        "{e}"
    );

    std::fs::write(&path, "# nobody yet\n").unwrap();
    assert_eq!(field_of(ProxyConfig::from_toml(&a, "")), "replicas");
    std::fs::remove_file(&path).unwrap();
    assert_eq!(field_of(ProxyConfig::from_toml(&a, "")), "replicas_file");
}

#[test]
fn placement_is_gate_unless_told_and_an_unknown_one_is_named() {
    use session_gate::gate::routers::Router;
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "").unwrap();
    assert_eq!(c.placement, Router::Gate);
    let c = ProxyConfig::from_toml(&args(&["http://a:1"]), "placement = \"hash\"").unwrap();
    assert_eq!(c.placement, Router::Hash);
    let mut a = args(&["http://a:1"]);
    a.placement = Some("sticky-least-loaded".into());
    let c = ProxyConfig::from_toml(&a, "placement = \"hash\"").unwrap();
    assert_eq!(c.placement, Router::StickyLeastLoaded, "the flag wins");
    a.placement = Some("cache-aware".into());
    let e = ProxyConfig::from_toml(&a, "").unwrap_err();
    assert_eq!(e.field, "placement");
    assert!(e.message.contains("hash, sticky-least-loaded, gate"), "{e}");
    let e = ProxyConfig::from_toml(&args(&["http://a:1"]), "placement = 3").unwrap_err();
    assert_eq!(e.field, "placement");
}
