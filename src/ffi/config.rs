//! `sg_config`: the gate's knobs as a C struct, and their conversion to [`GateConfig`].
use super::status::{Failure, arg, guard, guard_value, out};
use super::sys::{self, sg_config, sg_status};
use crate::error::Error;
use crate::gate::{GateConfig, Pressure};

/// The C struct for a validated-or-not [`GateConfig`]; the inverse of [`to_gate_config`].
pub(crate) fn from_gate_config(c: &GateConfig) -> sg_config {
    sg_config {
        high_watermark: c.high_watermark,
        hit_threshold: c.hit_threshold,
        wait_poll_sec: c.wait_poll_sec,
        idle_grace_sec: c.idle_grace_sec,
        pressure: match c.pressure {
            Pressure::Committed => sys::SG_PRESSURE_COMMITTED,
            Pressure::Engine => sys::SG_PRESSURE_ENGINE,
        },
        has_max_wait: c.max_wait_sec.is_some(),
        max_wait_sec: c.max_wait_sec.unwrap_or(0.0),
        probe_timeout_sec: c.probe_timeout_sec,
        default_max_tokens: c.default_max_tokens,
        idle_engine_turns: c.idle_engine_turns,
    }
}

/// Converts and validates; errors name the knob and the value.
pub(crate) fn to_gate_config(c: &sg_config) -> Result<GateConfig, Error> {
    let pressure = match c.pressure {
        sys::SG_PRESSURE_COMMITTED => Pressure::Committed,
        sys::SG_PRESSURE_ENGINE => Pressure::Engine,
        other => {
            return Err(Error::InvalidKnob {
                knob: "pressure",
                value: other.to_string(),
                why: "expected SG_PRESSURE_COMMITTED (0) or SG_PRESSURE_ENGINE (1)",
            });
        }
    };
    let config = GateConfig {
        high_watermark: c.high_watermark,
        hit_threshold: c.hit_threshold,
        wait_poll_sec: c.wait_poll_sec,
        idle_grace_sec: c.idle_grace_sec,
        pressure,
        max_wait_sec: c.has_max_wait.then_some(c.max_wait_sec),
        probe_timeout_sec: c.probe_timeout_sec,
        default_max_tokens: c.default_max_tokens,
        idle_engine_turns: c.idle_engine_turns,
    };
    config.validate()?;
    Ok(config)
}

/// The defaults of the knob table (`gate::knobs`). See `sg_config_default` in
/// `include/session_gate.h`.
#[unsafe(no_mangle)]
pub extern "C" fn sg_config_default() -> sg_config {
    // A panic here is impossible in practice; if one happened, hand back a config that
    // `sg_gate_create` refuses rather than one that looks valid.
    let poisoned = sg_config {
        high_watermark: f64::NAN,
        ..from_gate_config(&GateConfig::default())
    };
    guard_value("sg_config_default", poisoned, || {
        from_gate_config(&GateConfig::default())
    })
}

/// Defaults overridden by `SESSION_GATE_*`. See `sg_config_from_env` in the header.
///
/// # Safety
/// `out` must be NULL or valid for writes of one `sg_config`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_config_from_env(out_config: *mut sg_config) -> sg_status {
    guard("sg_config_from_env", || {
        let out_config = out(out_config, "out")?;
        let config = GateConfig::from_env()?;
        // SAFETY: non-NULL (checked) and writable by contract.
        unsafe { out_config.write(from_gate_config(&config)) };
        Ok(sys::SG_OK)
    })
}

/// See `sg_config_validate` in the header.
///
/// # Safety
/// `config` must be NULL or point to a valid `sg_config`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_config_validate(config: *const sg_config) -> sg_status {
    guard("sg_config_validate", || {
        // SAFETY: forwarded contract.
        let config = unsafe { arg(config, "config") }?;
        to_gate_config(config).map_err(Failure::from)?;
        Ok(sys::SG_OK)
    })
}
