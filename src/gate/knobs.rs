//! The one table of knobs: every `SESSION_GATE_*` setting of the product, with its name, rule,
//! default, environment variable and a one-line doc.
//!
//! [`GateConfig`]'s defaults, validation and environment overrides are read off [`KNOBS`], and
//! so are Python's `GateConfig(**knobs)`, `to_dict`, `repr` and `_native.knobs()` /
//! `_native.knob_from_env(name)` (through which the engine half reads its own two knobs). The
//! surfaces that cannot be generated (the C header's `sg_config`, `_native.pyi`, the proxy's
//! flags) are checked against this table by `tests/knobs.rs`, which also checks that every
//! `SESSION_GATE_*` variable the product reads is a row here.
//!
//! Adding a knob: a row here, plus its use (a [`GateConfig`] field and its line in
//! [`GateConfig::DEFAULT`], or the reader of an engine knob), plus the surfaces the test names.
use std::fmt;

use super::config::{GateConfig, Pressure, fraction, seconds};
use crate::const_eq::bytes_eq;
use crate::error::{Error, Result};

/// Where a knob's value lives.
#[derive(Clone, Copy)]
pub enum Home {
    /// A field of [`GateConfig`] (the accessor lends it out): every gate surface has it — a
    /// Python keyword, a field of the C `sg_config`, a flag of `session-gate proxy`.
    GateConfig(fn(&mut GateConfig) -> Slot<'_>),
    /// Read only inside vLLM's engine core process, by the plugin (`session_gate.engine`),
    /// through `_native.knob_from_env`.
    EngineCore,
}

/// What a knob accepts. Every rule refuses NaN.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// A fraction in 0..=1.
    Fraction,
    /// Finite seconds >= 0.
    Seconds,
    /// Finite seconds > 0 (zero would make a loop spin).
    PositiveSeconds,
    /// Finite seconds >= 0, or off (`none` / `off` in the environment, `None` in Python).
    SecondsOrOff,
    /// A whole number >= 0.
    Count,
    /// One of `names` (case-insensitive, surrounding blanks ignored); `why` lists them.
    OneOf {
        /// The accepted names, canonical spelling.
        names: &'static [&'static str],
        /// The refusal's explanation, e.g. `expected "committed" or "engine"`.
        why: &'static str,
    },
}

impl Rule {
    /// The rule in a few words, e.g. for `_native.knobs()`.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Fraction => "a fraction in 0..=1",
            Self::Seconds => "finite seconds >= 0",
            Self::PositiveSeconds => "finite seconds > 0",
            Self::SecondsOrOff => "finite seconds >= 0, or none/off",
            Self::Count => "a whole number >= 0",
            Self::OneOf { why, .. } => why,
        }
    }
}

/// A knob's value, whatever its rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// Fractions and seconds.
    Number(f64),
    /// Whole numbers.
    Count(usize),
    /// A name from [`Rule::OneOf`].
    Name(&'static str),
    /// [`Rule::SecondsOrOff`] turned off.
    Off,
}

impl Value {
    /// The number; a compile error when a default of the wrong kind is read in a `const`.
    pub const fn number(self) -> f64 {
        match self {
            Self::Number(v) => v,
            _ => panic!("knob value is not a number"),
        }
    }

    /// The whole number (see [`Value::number`]).
    pub const fn count(self) -> usize {
        match self {
            Self::Count(v) => v,
            _ => panic!("knob value is not a whole number"),
        }
    }

    /// The number, or `None` when off (see [`Value::number`]).
    pub const fn number_or_off(self) -> Option<f64> {
        match self {
            Self::Number(v) => Some(v),
            Self::Off => None,
            _ => panic!("knob value is neither a number nor off"),
        }
    }

    /// The name (see [`Value::number`]).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Name(v) => v,
            _ => panic!("knob value is not a name"),
        }
    }
}

/// How docs show a value: `0.85`, `256`, `committed`, and `never` for off.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Number(v) => write!(f, "{v}"),
            Self::Count(v) => write!(f, "{v}"),
            Self::Name(v) => f.write_str(v),
            Self::Off => f.write_str("never"),
        }
    }
}

/// A [`GateConfig`] field, lent out by [`Home::GateConfig`]'s accessor.
pub enum Slot<'a> {
    /// An `f64` field.
    Number(&'a mut f64),
    /// An `Option<f64>` field (`None` = off).
    NumberOrOff(&'a mut Option<f64>),
    /// A `usize` field.
    Count(&'a mut usize),
    /// The [`Pressure`] field.
    Pressure(&'a mut Pressure),
}

impl Slot<'_> {
    fn get(&self) -> Value {
        match self {
            Self::Number(v) => Value::Number(**v),
            Self::NumberOrOff(v) => v.map_or(Value::Off, Value::Number),
            Self::Count(v) => Value::Count(**v),
            Self::Pressure(v) => Value::Name(v.as_str()),
        }
    }

    fn set(self, knob: &'static str, value: Value) -> Result<()> {
        match (self, value) {
            (Self::Number(v), Value::Number(x)) => *v = x,
            (Self::NumberOrOff(v), Value::Number(x)) => *v = Some(x),
            (Self::NumberOrOff(v), Value::Off) => *v = None,
            (Self::Count(v), Value::Count(x)) => *v = x,
            (Self::Pressure(v), Value::Name(x)) => *v = Pressure::from_name(x)?,
            (_, value) => {
                return Err(Error::InvalidKnob {
                    knob,
                    value: value.to_string(),
                    why: "not a value of this knob's kind",
                });
            }
        }
        Ok(())
    }
}

/// One knob: a row of [`KNOBS`].
#[derive(Clone, Copy)]
pub struct Knob {
    /// The name on every surface: `GateConfig` field, Python keyword, C field, TOML key (the
    /// proxy flag is the same with `-` for `_`).
    pub name: &'static str,
    /// The environment variable that overrides the default.
    pub env: &'static str,
    /// What it accepts.
    pub rule: Rule,
    /// Its default.
    pub default: Value,
    /// One line on what it does.
    pub doc: &'static str,
    /// Where its value lives.
    pub home: Home,
}

/// Every knob. [`GateConfig`]'s rows come first, in its field order (the C struct's and the
/// Python keywords' order too).
pub const KNOBS: &[Knob] = &[
    Knob {
        name: "high_watermark",
        env: "SESSION_GATE_HIGH_WATERMARK",
        rule: Rule::Fraction,
        default: Value::Number(0.85),
        doc: "Fraction of KV blocks above which the gate is under pressure.",
        home: Home::GateConfig(|c| Slot::Number(&mut c.high_watermark)),
    },
    Knob {
        name: "hit_threshold",
        env: "SESSION_GATE_HIT_THRESHOLD",
        rule: Rule::Fraction,
        default: Value::Number(0.8),
        doc: "Minimum prefix hit ratio for a `resident_prefix` admission.",
        home: Home::GateConfig(|c| Slot::Number(&mut c.hit_threshold)),
    },
    Knob {
        name: "wait_poll_sec",
        env: "SESSION_GATE_WAIT_POLL_SEC",
        rule: Rule::PositiveSeconds,
        default: Value::Number(5.0),
        doc: "How long a waiter sleeps before looking again when nobody wakes it.",
        home: Home::GateConfig(|c| Slot::Number(&mut c.wait_poll_sec)),
    },
    Knob {
        name: "idle_grace_sec",
        env: "SESSION_GATE_IDLE_GRACE_SEC",
        rule: Rule::Seconds,
        default: Value::Number(60.0),
        doc: "How long a released `retain_session` reservation stays as an idle grace window.",
        home: Home::GateConfig(|c| Slot::Number(&mut c.idle_grace_sec)),
    },
    Knob {
        name: "pressure",
        env: "SESSION_GATE_PRESSURE",
        rule: Rule::OneOf {
            names: &["committed", "engine"],
            why: "expected \"committed\" or \"engine\"",
        },
        default: Value::Name("committed"),
        doc: "What the high watermark is compared with: committed working sets or vLLM's usage.",
        home: Home::GateConfig(|c| Slot::Pressure(&mut c.pressure)),
    },
    Knob {
        name: "max_wait_sec",
        env: "SESSION_GATE_MAX_WAIT_SEC",
        rule: Rule::SecondsOrOff,
        default: Value::Off,
        doc: "Past this wait an attempt is admitted with reason `max_wait`.",
        home: Home::GateConfig(|c| Slot::NumberOrOff(&mut c.max_wait_sec)),
    },
    Knob {
        name: "probe_timeout_sec",
        env: "SESSION_GATE_PROBE_TIMEOUT_SEC",
        rule: Rule::PositiveSeconds,
        default: Value::Number(2.0),
        doc: "A probe that has not answered after this long counts as unavailable (a prefix probe: a miss, the turn waits; fails open with engine pressure).",
        home: Home::GateConfig(|c| Slot::Number(&mut c.probe_timeout_sec)),
    },
    Knob {
        name: "default_max_tokens",
        env: "SESSION_GATE_DEFAULT_MAX_TOKENS",
        rule: Rule::Count,
        default: Value::Count(256),
        doc: "Output tokens a turn's working set counts when the caller gives no `max_tokens`.",
        home: Home::GateConfig(|c| Slot::Count(&mut c.default_max_tokens)),
    },
    Knob {
        name: "idle_engine_turns",
        env: "SESSION_GATE_IDLE_ENGINE_TURNS",
        rule: Rule::Count,
        default: Value::Count(4),
        doc: "While the engine has nothing running or waiting, a session's idle room may yield to the queue's head after this many of its own mean turn times (0: never early).",
        home: Home::GateConfig(|c| Slot::Count(&mut c.idle_engine_turns)),
    },
    Knob {
        name: "lease_ttl_sec",
        env: "SESSION_GATE_LEASE_TTL_SEC",
        rule: Rule::PositiveSeconds,
        default: Value::Number(30.0),
        doc: "Engine gate: how long a silent client's leases and pending admits survive.",
        home: Home::EngineCore,
    },
    Knob {
        name: "chain_cache_bytes",
        env: "SESSION_GATE_CHAIN_CACHE_BYTES",
        rule: Rule::Count,
        default: Value::Count(256 * 1024 * 1024),
        doc: "Engine probes: byte budget of the per-session hash-chain cache.",
        home: Home::EngineCore,
    },
    Knob {
        name: "finished_blocks",
        env: "SESSION_GATE_FINISHED_BLOCKS",
        rule: Rule::OneOf {
            names: &["first", "lru"],
            why: "expected \"first\" or \"lru\"",
        },
        default: Value::Name("first"),
        doc: "Engine gate: where a finished session's own blocks go in vLLM's free queue: first (evicted before any idle session's) or lru (vLLM's order).",
        home: Home::EngineCore,
    },
    Knob {
        name: "scheduler",
        env: "SESSION_GATE_SCHEDULER",
        rule: Rule::OneOf {
            names: &["off", "session-id", "infer"],
            why: "expected \"off\", \"session-id\" or \"infer\"",
        },
        default: Value::Name("off"),
        doc: "Engine gate: gate waiting requests in vLLM's scheduler, by their session id (session-id) or also by the session inferred from their blocks (infer).",
        home: Home::EngineCore,
    },
];

/// `max_wait_sec` in the engine gate's scheduler mode (and the twin's `sched` modes) when the
/// config sets none: every hold is bounded, so a turn never starves. Two hours, because the
/// gate's own order legitimately holds turns that long on large models: on the twin's
/// `rl-rollout` @ `h200-qwen2.5-32b` (a 4-hour step) 120 s made `sched` 2.4x slower than
/// `gate` and 600 s 1.44x, where 7,200 s costs 2.4% (docs/results.md).
pub const SCHEDULER_MAX_WAIT_SEC: f64 = 7200.0;

/// The row named `name`, if any.
pub fn knob(name: &str) -> Option<&'static Knob> {
    KNOBS.iter().find(|k| k.name == name)
}

/// The rows that are [`GateConfig`] fields, in field order.
pub fn gate_knobs() -> impl Iterator<Item = &'static Knob> {
    KNOBS
        .iter()
        .filter(|k| matches!(k.home, Home::GateConfig(_)))
}

/// The row named `name`, at compile time: use it in a `const` so a missing row fails the build.
pub const fn row(name: &str) -> &'static Knob {
    let mut i = 0;
    while i < KNOBS.len() {
        if bytes_eq(KNOBS[i].name.as_bytes(), name.as_bytes()) {
            return &KNOBS[i];
        }
        i += 1;
    }
    panic!("no such knob")
}

/// The default of the row named `name` (see [`row`]).
pub const fn default_of(name: &str) -> Value {
    row(name).default
}

impl Knob {
    /// `value` if it meets the rule, else an error naming the knob and the value.
    pub fn check(&self, value: Value) -> Result<Value> {
        match (self.rule, value) {
            (Rule::Fraction, Value::Number(v)) => fraction(self.name, v)?,
            (Rule::Seconds | Rule::SecondsOrOff, Value::Number(v)) => seconds(self.name, v, true)?,
            (Rule::PositiveSeconds, Value::Number(v)) => seconds(self.name, v, false)?,
            (Rule::SecondsOrOff, Value::Off) | (Rule::Count, Value::Count(_)) => {}
            (Rule::OneOf { names, why }, Value::Name(v)) if !names.contains(&v) => {
                return Err(self.refuse(v, why));
            }
            (Rule::OneOf { .. }, Value::Name(_)) => {}
            (_, v) => return Err(self.refuse(&v.to_string(), "not a value of this knob's kind")),
        }
        Ok(value)
    }

    /// Parses `text` (an environment variable's value) by the rule, then checks it.
    pub fn parse(&self, text: &str) -> Result<Value> {
        let t = text.trim();
        let value = match self.rule {
            Rule::SecondsOrOff if matches!(t.to_ascii_lowercase().as_str(), "none" | "off") => {
                Value::Off
            }
            Rule::Fraction | Rule::Seconds | Rule::PositiveSeconds | Rule::SecondsOrOff => {
                Value::Number(t.parse().map_err(|_| self.refuse(text, "not a number"))?)
            }
            Rule::Count => Value::Count(
                t.parse()
                    .map_err(|_| self.refuse(text, "not a whole number >= 0"))?,
            ),
            Rule::OneOf { names, why } => Value::Name(
                names
                    .iter()
                    .find(|n| n.eq_ignore_ascii_case(t))
                    .ok_or_else(|| self.refuse(text, why))?,
            ),
        };
        self.check(value)
    }

    /// The value `lookup` gives [`Knob::env`] (parsed and checked), or `None` when it gives
    /// nothing or blanks. `lookup` stands for the process environment in tests.
    pub fn lookup(&self, lookup: impl Fn(&str) -> Option<String>) -> Result<Option<Value>> {
        lookup(self.env)
            .filter(|v| !v.trim().is_empty())
            .map(|v| self.parse(&v))
            .transpose()
    }

    /// The process environment's value, or the default.
    pub fn from_env(&self) -> Result<Value> {
        Ok(self
            .lookup(|name| std::env::var(name).ok())?
            .unwrap_or(self.default))
    }

    /// Reads this knob's field of `config` (`None` for an engine-core knob).
    pub fn get(&self, config: &GateConfig) -> Option<Value> {
        // The accessor lends `&mut`; a copy of eight numbers is the price of one accessor.
        let mut copy = config.clone();
        match self.home {
            Home::GateConfig(slot) => Some(slot(&mut copy).get()),
            Home::EngineCore => None,
        }
    }

    /// Writes `value` (checked) into this knob's field of `config`.
    pub fn set(&self, config: &mut GateConfig, value: Value) -> Result<()> {
        let value = self.check(value)?;
        match self.home {
            Home::GateConfig(slot) => slot(config).set(self.name, value),
            Home::EngineCore => Err(self.refuse(self.name, "not a GateConfig knob")),
        }
    }

    fn refuse(&self, value: &str, why: &'static str) -> Error {
        Error::InvalidKnob {
            knob: self.name,
            value: value.to_string(),
            why,
        }
    }
}
