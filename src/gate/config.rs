//! The gate's knobs: defaults from the seed, validation, and `SESSION_GATE_*` environment overrides.
use crate::error::{Error, Result};

/// What the high watermark is compared with (DESIGN.md, "Pressure").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pressure {
    /// Committed working set: every admission reserves, reservations are kept in age order, and
    /// the youngest are revoked when contexts outgrow the cache. The default.
    #[default]
    Committed,
    /// The seed, literally: vLLM's KV usage only; `open` admissions take no reservation and
    /// nothing is ever revoked.
    Engine,
}

impl Pressure {
    /// Parses `"committed"` or `"engine"` (case-insensitive, surrounding blanks ignored).
    pub fn from_name(name: &str) -> Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "committed" => Ok(Self::Committed),
            "engine" => Ok(Self::Engine),
            _ => Err(Error::InvalidKnob {
                knob: "pressure",
                value: name.to_string(),
                why: "expected \"committed\" or \"engine\"",
            }),
        }
    }

    /// The name [`Pressure::from_name`] accepts.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Committed => "committed",
            Self::Engine => "engine",
        }
    }
}

/// Every knob of the gate. Build with `GateConfig { high_watermark: 0.9, ..Default::default() }`
/// and call [`GateConfig::validate`] (the core does it again on construction).
#[derive(Debug, Clone, PartialEq)]
pub struct GateConfig {
    /// Fraction of KV blocks above which the gate is under pressure. 0..=1, default 0.85.
    pub high_watermark: f64,
    /// Minimum prefix `hit_ratio` for a `resident_prefix` admission. 0..=1, default 0.80.
    pub hit_threshold: f64,
    /// How long a waiter sleeps before looking again when nobody wakes it. > 0 s, default 5.
    pub wait_poll_sec: f64,
    /// How long a released `retain_session` reservation stays as an idle grace window. ≥ 0 s,
    /// default 60. In committed mode a window may yield its room to the head of the queue
    /// after half of it (or 8 of its session's mean turn times, if longer): `gate::core`,
    /// "Yielding idle room".
    pub idle_grace_sec: f64,
    /// What the watermark is compared with. Default [`Pressure::Committed`].
    pub pressure: Pressure,
    /// Past this wait an attempt is admitted with reason `max_wait`. `None` (default) = never.
    pub max_wait_sec: Option<f64>,
    /// A probe that has not answered after this long counts as unavailable. > 0 s, default 2.
    pub probe_timeout_sec: f64,
    /// Output tokens counted in a turn's working set when the caller gives no `max_tokens`
    /// (the seed's `acquire(session_id, prompt_ids)`). Default 256. Passing the turn's real
    /// `max_tokens` makes the working set exact; this is only a guess at it.
    pub default_max_tokens: usize,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            high_watermark: 0.85,
            hit_threshold: 0.80,
            wait_poll_sec: 5.0,
            idle_grace_sec: 60.0,
            pressure: Pressure::Committed,
            max_wait_sec: None,
            probe_timeout_sec: 2.0,
            default_max_tokens: 256,
        }
    }
}

/// Environment variable names, in the order [`GateConfig::with_env_overrides`] reads them.
pub const ENV_VARS: [&str; 8] = [
    "SESSION_GATE_HIGH_WATERMARK",
    "SESSION_GATE_HIT_THRESHOLD",
    "SESSION_GATE_WAIT_POLL_SEC",
    "SESSION_GATE_IDLE_GRACE_SEC",
    "SESSION_GATE_PRESSURE",
    "SESSION_GATE_MAX_WAIT_SEC",
    "SESSION_GATE_PROBE_TIMEOUT_SEC",
    "SESSION_GATE_DEFAULT_MAX_TOKENS",
];

pub(crate) fn fraction(knob: &'static str, v: f64) -> Result<()> {
    // `contains` is false for NaN, so NaN is refused here too.
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(invalid(knob, v, "must be a fraction between 0 and 1"))
    }
}

pub(crate) fn seconds(knob: &'static str, v: f64, allow_zero: bool) -> Result<()> {
    let ok = v.is_finite() && if allow_zero { v >= 0.0 } else { v > 0.0 };
    if ok {
        Ok(())
    } else if allow_zero {
        Err(invalid(knob, v, "must be a finite number of seconds >= 0"))
    } else {
        Err(invalid(knob, v, "must be a finite number of seconds > 0"))
    }
}

pub(crate) fn invalid(knob: &'static str, v: f64, why: &'static str) -> Error {
    Error::InvalidKnob {
        knob,
        value: v.to_string(),
        why,
    }
}

fn parse_f64(knob: &'static str, text: &str) -> Result<f64> {
    text.trim().parse::<f64>().map_err(|_| Error::InvalidKnob {
        knob,
        value: text.to_string(),
        why: "not a number",
    })
}

impl GateConfig {
    /// Refuses NaN, fractions outside 0..=1 and negative or infinite seconds, naming the knob and
    /// the value. A zero poll interval or probe timeout is refused too: it would spin.
    pub fn validate(&self) -> Result<()> {
        fraction("high_watermark", self.high_watermark)?;
        fraction("hit_threshold", self.hit_threshold)?;
        seconds("wait_poll_sec", self.wait_poll_sec, false)?;
        seconds("idle_grace_sec", self.idle_grace_sec, true)?;
        if let Some(v) = self.max_wait_sec {
            seconds("max_wait_sec", v, true)?;
        }
        seconds("probe_timeout_sec", self.probe_timeout_sec, false)?;
        Ok(())
    }

    /// Defaults overridden by the process environment (`SESSION_GATE_*`), validated.
    pub fn from_env() -> Result<Self> {
        Self::default().with_env_overrides(|name| std::env::var(name).ok())
    }

    /// `self` with every knob that `lookup` knows replaced, validated. `lookup` maps an
    /// environment variable name (see [`ENV_VARS`]) to its value; taking a closure keeps this
    /// testable without touching the process environment. Blank values are ignored;
    /// `SESSION_GATE_MAX_WAIT_SEC` accepts `none`/`off` to turn the limit off.
    pub fn with_env_overrides(mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        if let Some(v) = get("SESSION_GATE_HIGH_WATERMARK") {
            self.high_watermark = parse_f64("high_watermark", &v)?;
        }
        if let Some(v) = get("SESSION_GATE_HIT_THRESHOLD") {
            self.hit_threshold = parse_f64("hit_threshold", &v)?;
        }
        if let Some(v) = get("SESSION_GATE_WAIT_POLL_SEC") {
            self.wait_poll_sec = parse_f64("wait_poll_sec", &v)?;
        }
        if let Some(v) = get("SESSION_GATE_IDLE_GRACE_SEC") {
            self.idle_grace_sec = parse_f64("idle_grace_sec", &v)?;
        }
        if let Some(v) = get("SESSION_GATE_PRESSURE") {
            self.pressure = Pressure::from_name(&v)?;
        }
        if let Some(v) = get("SESSION_GATE_MAX_WAIT_SEC") {
            self.max_wait_sec = match v.trim().to_ascii_lowercase().as_str() {
                "none" | "off" => None,
                _ => Some(parse_f64("max_wait_sec", &v)?),
            };
        }
        if let Some(v) = get("SESSION_GATE_PROBE_TIMEOUT_SEC") {
            self.probe_timeout_sec = parse_f64("probe_timeout_sec", &v)?;
        }
        if let Some(v) = get("SESSION_GATE_DEFAULT_MAX_TOKENS") {
            self.default_max_tokens = v.trim().parse().map_err(|_| Error::InvalidKnob {
                knob: "default_max_tokens",
                value: v.clone(),
                why: "not a whole number of tokens >= 0",
            })?;
        }
        self.validate()?;
        Ok(self)
    }
}
