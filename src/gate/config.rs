//! [`GateConfig`], the gate's knobs as a struct. Their defaults, validation and
//! `SESSION_GATE_*` environment overrides are read off the one table, [`super::knobs::KNOBS`].
use super::knobs::{self, Knob, default_of};
use crate::error::{Error, Result};

/// What the high watermark is compared with (the decision tree in [`crate::gate::core`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pressure {
    /// Committed working set: every admission reserves, reservations are kept in age order, and
    /// the youngest are revoked when contexts outgrow the cache. The default.
    #[default]
    Committed,
    /// The original design's rule, literally: vLLM's KV usage only; `open` admissions take no
    /// reservation and nothing is ever revoked.
    Engine,
}

impl Pressure {
    /// Parses `"committed"` or `"engine"` (case-insensitive, surrounding blanks ignored), by
    /// the `pressure` row of [`knobs::KNOBS`].
    pub fn from_name(name: &str) -> Result<Self> {
        const PRESSURE: &Knob = knobs::row("pressure");
        Ok(Self::named(PRESSURE.parse(name)?.name()))
    }

    /// The pressure called `name` at compile time (an unknown name fails the build).
    const fn named(name: &str) -> Self {
        match name.as_bytes() {
            b"committed" => Self::Committed,
            b"engine" => Self::Engine,
            _ => panic!("unknown pressure name"),
        }
    }

    /// The name [`Pressure::from_name`] accepts.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Committed => "committed",
            Self::Engine => "engine",
        }
    }
}

/// Every knob of the gate; each field is a row of [`knobs::KNOBS`], which holds its rule, default and
/// environment variable. Build with `GateConfig { high_watermark: 0.9, ..Default::default() }`
/// and call [`GateConfig::validate`] (the core does it again on construction).
#[derive(Debug, Clone, PartialEq)]
pub struct GateConfig {
    /// Fraction of KV blocks above which the gate is under pressure.
    pub high_watermark: f64,
    /// Minimum prefix `hit_ratio` for a `resident_prefix` admission.
    pub hit_threshold: f64,
    /// How long a waiter sleeps before looking again when nobody wakes it.
    pub wait_poll_sec: f64,
    /// How long a released `retain_session` reservation stays as an idle grace window. In
    /// committed mode a window may yield its room to the head of the queue after half of it
    /// (or 8 of its session's mean turn times, if longer): `gate::core`, "Yielding idle room".
    pub idle_grace_sec: f64,
    /// What the watermark is compared with.
    pub pressure: Pressure,
    /// Past this wait an attempt is admitted with reason `max_wait`; `None` = never.
    pub max_wait_sec: Option<f64>,
    /// A probe that has not answered after this long counts as unavailable: a prefix probe is
    /// then a miss (the turn waits and probes again), or a fail-open with engine pressure.
    pub probe_timeout_sec: f64,
    /// Output tokens counted in a turn's working set when the caller gives no `max_tokens`
    /// (an `acquire(session_id, prompt_ids)` without it). Passing the turn's real
    /// `max_tokens` makes the working set exact; this is only a guess at it.
    pub default_max_tokens: usize,
    /// While the engine reports nothing running or waiting, a session's idle room may yield
    /// to the head of the queue once idle this many of its own mean turn times, with no floor
    /// (`gate::core`, "An idle engine"); 0 turns it off.
    pub idle_engine_turns: usize,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl GateConfig {
    /// Every knob at its default in [`knobs::KNOBS`] (read at compile time: a field without a row, or a
    /// default of the wrong kind, fails the build).
    pub const DEFAULT: Self = Self {
        high_watermark: default_of("high_watermark").number(),
        hit_threshold: default_of("hit_threshold").number(),
        wait_poll_sec: default_of("wait_poll_sec").number(),
        idle_grace_sec: default_of("idle_grace_sec").number(),
        pressure: Pressure::named(default_of("pressure").name()),
        max_wait_sec: default_of("max_wait_sec").number_or_off(),
        probe_timeout_sec: default_of("probe_timeout_sec").number(),
        default_max_tokens: default_of("default_max_tokens").count(),
        idle_engine_turns: default_of("idle_engine_turns").count(),
    };
}

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

impl GateConfig {
    /// Refuses NaN, fractions outside 0..=1 and negative or infinite seconds (each knob by its
    /// rule in [`knobs::KNOBS`]), naming the knob and the value. A zero poll interval or probe timeout
    /// is refused too: it would spin.
    pub fn validate(&self) -> Result<()> {
        for knob in knobs::gate_knobs() {
            if let Some(value) = knob.get(self) {
                knob.check(value)?;
            }
        }
        Ok(())
    }

    /// Defaults overridden by the process environment (`SESSION_GATE_*`), validated.
    pub fn from_env() -> Result<Self> {
        Self::default().with_env_overrides(|name| std::env::var(name).ok())
    }

    /// `self` with every knob that `lookup` knows replaced, validated. `lookup` maps an
    /// environment variable name (a row's [`knobs::Knob::env`]) to its value; taking a closure
    /// keeps this testable without touching the process environment. Blank values are ignored;
    /// `SESSION_GATE_MAX_WAIT_SEC` accepts `none`/`off` to turn the limit off.
    pub fn with_env_overrides(mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        for knob in knobs::gate_knobs() {
            if let Some(value) = knob.lookup(&lookup)? {
                knob.set(&mut self, value)?;
            }
        }
        self.validate()?;
        Ok(self)
    }
}
