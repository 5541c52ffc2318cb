//! `sg_config` through the C ABI: the knob table's defaults, validation naming the knob, and
//! `SESSION_GATE_*` overrides. The only test binary that touches the environment.
use session_gate::ffi::sys::{self, sg_config};
use session_gate::ffi::*;
use session_gate::gate::GateConfig;

fn validate(c: &sg_config) -> sys::sg_status {
    // SAFETY: a valid config pointer.
    unsafe { sg_config_validate(c) }
}

#[test]
fn defaults_are_the_seeds() {
    let c = sg_config_default();
    let d = GateConfig::default();
    assert_eq!(c.high_watermark, d.high_watermark);
    assert_eq!(c.hit_threshold, d.hit_threshold);
    assert_eq!(c.wait_poll_sec, d.wait_poll_sec);
    assert_eq!(c.idle_grace_sec, d.idle_grace_sec);
    assert_eq!(c.probe_timeout_sec, d.probe_timeout_sec);
    assert_eq!(c.pressure, sys::SG_PRESSURE_COMMITTED);
    assert!(!c.has_max_wait);
    assert_eq!(validate(&c), sys::SG_OK);
}

#[test]
fn every_knob_out_of_its_domain_is_refused() {
    let base = sg_config_default();
    let bad = [
        sg_config {
            high_watermark: f64::NAN,
            ..base
        },
        sg_config {
            high_watermark: -0.1,
            ..base
        },
        sg_config {
            hit_threshold: 1.01,
            ..base
        },
        sg_config {
            wait_poll_sec: 0.0,
            ..base
        },
        sg_config {
            idle_grace_sec: f64::INFINITY,
            ..base
        },
        sg_config {
            pressure: 2,
            ..base
        },
        sg_config {
            has_max_wait: true,
            max_wait_sec: f64::NAN,
            ..base
        },
        sg_config {
            probe_timeout_sec: -1.0,
            ..base
        },
    ];
    for c in bad {
        assert_eq!(validate(&c), sys::SG_INVALID_CONFIG, "{c:?}");
    }
    // Off by default, so its value does not matter then.
    let c = sg_config {
        has_max_wait: false,
        max_wait_sec: f64::NAN,
        ..base
    };
    assert_eq!(validate(&c), sys::SG_OK);
    let c = sg_config {
        pressure: sys::SG_PRESSURE_ENGINE,
        idle_grace_sec: 0.0,
        ..base
    };
    assert_eq!(validate(&c), sys::SG_OK);
}

#[test]
fn the_environment_overrides_the_defaults() {
    let mut c = sg_config_default();
    // SAFETY: this is the only test in this binary that reads or writes the environment.
    unsafe {
        std::env::set_var("SESSION_GATE_HIGH_WATERMARK", "0.5");
        std::env::set_var("SESSION_GATE_PRESSURE", "engine");
        std::env::set_var("SESSION_GATE_MAX_WAIT_SEC", "3");
    }
    // SAFETY: a valid out pointer.
    assert_eq!(unsafe { sg_config_from_env(&mut c) }, sys::SG_OK);
    assert_eq!(c.high_watermark, 0.5);
    assert_eq!(c.pressure, sys::SG_PRESSURE_ENGINE);
    assert!(c.has_max_wait && c.max_wait_sec == 3.0);

    // SAFETY: as above.
    unsafe { std::env::set_var("SESSION_GATE_HIT_THRESHOLD", "lots") };
    let before = c;
    // SAFETY: a valid out pointer.
    assert_eq!(
        unsafe { sg_config_from_env(&mut c) },
        sys::SG_INVALID_CONFIG
    );
    assert_eq!(
        c.high_watermark, before.high_watermark,
        "untouched on failure"
    );
    // SAFETY: as above.
    unsafe {
        for v in [
            "HIGH_WATERMARK",
            "PRESSURE",
            "MAX_WAIT_SEC",
            "HIT_THRESHOLD",
        ] {
            std::env::remove_var(format!("SESSION_GATE_{v}"));
        }
    }
}
