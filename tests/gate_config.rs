//! Gate knobs: the table's defaults, refusal of invalid values naming knob and value, env overrides.
use std::collections::HashMap;

use session_gate::Error;
use session_gate::gate::{GateConfig, GateCore, Pressure};

fn refused(cfg: GateConfig) -> (&'static str, String) {
    match cfg.validate() {
        Err(Error::InvalidKnob { knob, value, .. }) => (knob, value),
        other => panic!("expected InvalidKnob, got {other:?}"),
    }
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| map.get(name).cloned()
}

#[test]
fn defaults_are_the_tables() {
    let c = GateConfig::default();
    assert_eq!(c.high_watermark, 0.85);
    assert_eq!(c.hit_threshold, 0.80);
    assert_eq!(c.wait_poll_sec, 5.0);
    assert_eq!(c.idle_grace_sec, 60.0);
    assert_eq!(c.pressure, Pressure::Committed);
    assert_eq!(c.max_wait_sec, None);
    assert_eq!(c.probe_timeout_sec, 2.0);
    c.validate().unwrap();
}

#[test]
fn invalid_knobs_are_refused_with_their_name_and_value() {
    let d = GateConfig::default;
    let cases = [
        (
            GateConfig {
                high_watermark: f64::NAN,
                ..d()
            },
            "high_watermark",
            "NaN",
        ),
        (
            GateConfig {
                high_watermark: 1.5,
                ..d()
            },
            "high_watermark",
            "1.5",
        ),
        (
            GateConfig {
                hit_threshold: -0.1,
                ..d()
            },
            "hit_threshold",
            "-0.1",
        ),
        (
            GateConfig {
                wait_poll_sec: -1.0,
                ..d()
            },
            "wait_poll_sec",
            "-1",
        ),
        (
            GateConfig {
                wait_poll_sec: 0.0,
                ..d()
            },
            "wait_poll_sec",
            "0",
        ),
        (
            GateConfig {
                idle_grace_sec: f64::INFINITY,
                ..d()
            },
            "idle_grace_sec",
            "inf",
        ),
        (
            GateConfig {
                max_wait_sec: Some(-3.0),
                ..d()
            },
            "max_wait_sec",
            "-3",
        ),
        (
            GateConfig {
                probe_timeout_sec: f64::NAN,
                ..d()
            },
            "probe_timeout_sec",
            "NaN",
        ),
    ];
    for (cfg, knob, value) in cases {
        let err = cfg.validate().unwrap_err();
        let text = err.to_string();
        assert!(text.contains(knob) && text.contains(value), "{text}");
        assert_eq!(refused(cfg.clone()), (knob, value.to_string()));
        assert!(GateCore::new(cfg).is_err(), "the core refuses it too");
    }
}

#[test]
fn edge_values_are_accepted() {
    let cfg = GateConfig {
        high_watermark: 1.0,
        hit_threshold: 0.0,
        idle_grace_sec: 0.0,
        max_wait_sec: Some(0.0),
        ..Default::default()
    };
    cfg.validate().unwrap();
}

#[test]
fn pressure_names_parse_and_unknown_ones_are_refused() {
    assert_eq!(
        Pressure::from_name("committed").unwrap(),
        Pressure::Committed
    );
    assert_eq!(Pressure::from_name(" Engine ").unwrap(), Pressure::Engine);
    assert_eq!(Pressure::Engine.as_str(), "engine");
    match Pressure::from_name("usage") {
        Err(Error::InvalidKnob { knob, value, .. }) => {
            assert_eq!((knob, value.as_str()), ("pressure", "usage"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn env_overrides_replace_every_knob() {
    let cfg = GateConfig::default()
        .with_env_overrides(env(&[
            ("SESSION_GATE_HIGH_WATERMARK", "0.9"),
            ("SESSION_GATE_HIT_THRESHOLD", " 0.5 "),
            ("SESSION_GATE_WAIT_POLL_SEC", "1"),
            ("SESSION_GATE_IDLE_GRACE_SEC", "30"),
            ("SESSION_GATE_PRESSURE", "engine"),
            ("SESSION_GATE_MAX_WAIT_SEC", "120"),
            ("SESSION_GATE_PROBE_TIMEOUT_SEC", "0.5"),
            ("SESSION_GATE_DEFAULT_MAX_TOKENS", "1024"),
            ("SESSION_GATE_IDLE_ENGINE_TURNS", "0"),
        ]))
        .unwrap();
    assert_eq!(
        cfg,
        GateConfig {
            high_watermark: 0.9,
            hit_threshold: 0.5,
            wait_poll_sec: 1.0,
            idle_grace_sec: 30.0,
            pressure: Pressure::Engine,
            max_wait_sec: Some(120.0),
            probe_timeout_sec: 0.5,
            default_max_tokens: 1024,
            idle_engine_turns: 0,
        }
    );
}

#[test]
fn a_malformed_default_max_tokens_is_refused_by_name() {
    for bad in ["-1", "2.5", "lots"] {
        match GateConfig::default()
            .with_env_overrides(env(&[("SESSION_GATE_DEFAULT_MAX_TOKENS", bad)]))
        {
            Err(Error::InvalidKnob { knob, value, .. }) => {
                assert_eq!((knob, value.as_str()), ("default_max_tokens", bad));
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
}

#[test]
fn env_overrides_leave_unset_and_blank_knobs_alone() {
    let base = GateConfig {
        max_wait_sec: Some(10.0),
        ..Default::default()
    };
    let cfg = base
        .clone()
        .with_env_overrides(env(&[("SESSION_GATE_HIGH_WATERMARK", "  ")]))
        .unwrap();
    assert_eq!(cfg, base);
    let off = base
        .with_env_overrides(env(&[("SESSION_GATE_MAX_WAIT_SEC", "off")]))
        .unwrap();
    assert_eq!(off.max_wait_sec, None);
}

#[test]
fn env_values_that_are_not_numbers_or_out_of_range_are_refused_by_name() {
    let err = GateConfig::default()
        .with_env_overrides(env(&[("SESSION_GATE_HIGH_WATERMARK", "high")]))
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidKnob { knob: "high_watermark", ref value, .. } if value == "high"
    ));
    let err = GateConfig::default()
        .with_env_overrides(env(&[("SESSION_GATE_IDLE_GRACE_SEC", "-5")]))
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidKnob {
            knob: "idle_grace_sec",
            ..
        }
    ));
    let err = GateConfig::default()
        .with_env_overrides(env(&[("SESSION_GATE_PRESSURE", "vllm")]))
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidKnob {
            knob: "pressure",
            ..
        }
    ));
}
