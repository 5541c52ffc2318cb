//! The step-time model: how long one engine step takes, from what the step schedules.
//!
//! ```text
//! t = step_sec                                  fixed cost of a step (scheduling, launch, sampling)
//!   + per_seq_sec      · sequences in the step  per-request input prep and output processing
//!   + max(per_token_sec · T, weights_sec)       dense layers: compute-bound for many tokens,
//!                                               weight-read-bound (W / B) for few
//!   + prefill_attn_sec · Σ c·(p + c/2)          attention of a prefill chunk: c new tokens after
//!                                               p cached ones
//!   + decode_ctx_sec   · Σ ctx                  attention of decodes: KV read per context token
//! ```
//! (A roofline form — dense layers bound by compute or by the weight read, attention by its
//! FLOPs or its KV read — plus the fixed and per-request costs a CPU engine shows.)
//!
//! Profiles are TOML data files embedded at build time (`profiles/*.toml`). Each coefficient is
//! `{ value = ..., source = "..." }`; the `[replica]` table gives the engine shape the profile
//! implies; an optional `[engine]` table records the engine a calibration timed (model, dtype,
//! tensor parallelism, ...: [`EngineRecord`]). A bad profile is an [`Error::InvalidProfile`] naming the file, line and field.
use serde::Deserialize;
use toml::Spanned;

use crate::{Error, Result};

/// What one step schedules, summed over its requests (O(1) to evaluate).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct StepWork {
    /// Requests in the step.
    pub num_reqs: u32,
    /// Requests that prefill (a chunk or the whole prompt).
    pub num_prefills: u32,
    /// Requests that decode one token.
    pub num_decodes: u32,
    /// All tokens in the step (T).
    pub total_tokens: u64,
    /// Prefill tokens in the step (Σ c).
    pub prefill_tokens: u64,
    /// Σ c·(p + c/2) over prefill chunks.
    pub prefill_attn: f64,
    /// Σ context length over decodes.
    pub decode_ctx: u64,
}

impl StepWork {
    /// Adds one scheduled request: `n` tokens after `before` computed ones, for a request that
    /// now has `num_tokens` tokens of which `num_output` are outputs. A decode is one token
    /// after the request already has outputs and all but that token; anything else is a prefill
    /// chunk (a first prefill, a chunk of a long one, or the recompute of a preempted request).
    pub fn add(&mut self, n: u32, before: u32, num_tokens: u32, num_output: u32) {
        self.num_reqs += 1;
        self.total_tokens += u64::from(n);
        if n == 1 && num_output > 0 && before + 1 == num_tokens {
            self.num_decodes += 1;
            self.decode_ctx += u64::from(num_tokens);
        } else {
            self.num_prefills += 1;
            self.prefill_tokens += u64::from(n);
            self.prefill_attn += f64::from(n) * (f64::from(before) + f64::from(n) / 2.0);
        }
    }

    /// The regressors of the cost model's linear part, in fitting order: 1 (a step),
    /// sequences, tokens, Σ c·(p + c/2), Σ ctx (the calibration fits these).
    pub fn features(&self) -> [f64; 5] {
        [
            1.0,
            f64::from(self.num_reqs),
            self.total_tokens as f64,
            self.prefill_attn,
            self.decode_ctx as f64,
        ]
    }
}

/// Built-in profiles, in the order `profile_names()` lists them.
const PROFILES: &[(&str, &str)] = &[
    ("cpu-tiny", include_str!("profiles/cpu-tiny.toml")),
    (
        "h200-qwen2.5-7b",
        include_str!("profiles/h200-qwen2.5-7b.toml"),
    ),
    (
        "h200-qwen2.5-32b",
        include_str!("profiles/h200-qwen2.5-32b.toml"),
    ),
    (
        "h100-llama3.1-8b",
        include_str!("profiles/h100-llama3.1-8b.toml"),
    ),
];
const PROFILE_NAMES: &[&str] = &[
    "cpu-tiny",
    "h200-qwen2.5-7b",
    "h200-qwen2.5-32b",
    "h100-llama3.1-8b",
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Coef {
    value: Spanned<f64>,
    source: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CostTable {
    step_sec: Coef,
    per_seq_sec: Coef,
    per_token_sec: Coef,
    weights_sec: Coef,
    prefill_attn_sec: Coef,
    decode_ctx_sec: Coef,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplicaTable {
    num_blocks: Spanned<i64>,
    block_size: Spanned<i64>,
    max_num_seqs: Spanned<i64>,
    max_num_batched_tokens: Spanned<i64>,
    kv_bytes_per_token: Spanned<i64>,
    /// vLLM's `async_scheduling`; absent means vLLM's default on a GPU (on).
    #[serde(default)]
    async_scheduling: Option<bool>,
    source: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    name: String,
    description: String,
    replica: ReplicaTable,
    cost: CostTable,
    #[serde(default)]
    engine: EngineRecord,
    #[serde(default)]
    machine: Option<MachineRecord>,
    offload: Option<OffloadTable>,
}

/// The machine a calibration ran on (`[machine]`, optional; written by `python -m
/// session_gate.lab.sim.calibrate`). Informational for the twin; the lab compares it with the
/// machine at hand before it compares the twin with a real engine there (a profile fitted on
/// other hardware predicts that hardware's step times). `known = false` says the profile does
/// not know where it was fitted, which counts as other hardware.
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineRecord {
    /// Whether the fields below describe the machine the profile was fitted on.
    pub known: bool,
    /// `platform.machine()`, e.g. `x86_64`.
    pub arch: Option<String>,
    /// The CPU's model name (`/proc/cpuinfo`).
    pub cpu_model: Option<String>,
    /// CPUs the calibrating process could run on.
    pub cpus: Option<u32>,
    /// The CPU's instruction-set extensions that vLLM's CPU kernels choose by (AVX-512, AMX, ...).
    pub cpu_flags: Option<Vec<String>>,
    /// The vLLM version the steps were timed with.
    pub vllm_version: Option<String>,
    /// When the profile was fitted (UTC date).
    pub fitted: Option<String>,
    /// Free text: what is known when `known` is false.
    pub note: Option<String>,
}

/// `[offload]`: the host KV tier's transfer speeds (optional; `sim --offload-gb` needs it).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OffloadTable {
    load_gb_per_sec: Coef,
    store_gb_per_sec: Coef,
}

/// A profile's host-tier transfer speeds (`[offload]`), with their sources.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadProfile {
    /// Host-to-device bytes per second.
    pub load_bytes_per_sec: f64,
    /// Device-to-host bytes per second.
    pub store_bytes_per_sec: f64,
    /// The two figures' sources, `load; store`.
    pub source: String,
}

/// The engine a calibration timed (`[engine]`, optional; written by `python -m
/// session_gate.lab.sim.calibrate`): what the replica shape alone does not say. Informational: the
/// twin models `[replica]` and `[cost]`; this says which model and engine they came from.
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineRecord {
    /// The model (path or Hugging Face id).
    pub model: Option<String>,
    /// How its weights were loaded (`auto`, or `dummy` for random weights of the right shape).
    pub load_format: Option<String>,
    /// The model's dtype.
    pub dtype: Option<String>,
    /// Tensor-parallel GPUs.
    pub tensor_parallel_size: Option<u32>,
    /// `max_model_len`.
    pub max_model_len: Option<u32>,
    /// `gpu_memory_utilization` (how `num_blocks` was sized, unless overridden).
    pub gpu_memory_utilization: Option<f64>,
    /// `num_gpu_blocks_override`, when the block count was set rather than sized.
    pub num_gpu_blocks_override: Option<u32>,
    /// CUDA graphs off (`enforce_eager`).
    pub enforce_eager: Option<bool>,
    /// The device the steps ran on.
    pub device: Option<String>,
    /// The vLLM version.
    pub vllm_version: Option<String>,
    /// The command that wrote the profile.
    pub command: Option<String>,
}

/// The engine shape a profile implies (vLLM's KV geometry and scheduler limits).
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileShape {
    /// KV blocks including the null block (`num_gpu_blocks`).
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// `max_num_seqs`.
    pub max_num_seqs: u32,
    /// `max_num_batched_tokens`.
    pub max_num_batched_tokens: u32,
    /// KV-cache bytes per token (from the model's config).
    pub kv_bytes_per_token: u64,
    /// vLLM's `async_scheduling` (on by default on GPUs; vLLM's CPU platform turns it off). It
    /// decides when the engine core serves a utility call (the gate's probes): with it, between
    /// steps with the next step already scheduled; without it, before the next step is
    /// scheduled (`EngineCore.step` schedules, runs and updates in one call).
    pub async_scheduling: bool,
    /// Where these numbers come from.
    pub source: String,
}

/// One coefficient and where it comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct Coefficient {
    /// The coefficient's name in the profile, e.g. `step_sec`.
    pub name: &'static str,
    /// Its value (seconds per unit).
    pub value: f64,
    /// Its source (a publication, a measurement, or "estimate: ...").
    pub source: String,
}

/// A step-time model built from a profile.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// The profile's name.
    pub name: String,
    /// One line saying what it models.
    pub description: String,
    /// The replica shape the profile implies.
    pub shape: ProfileShape,
    step_sec: f64,
    per_seq_sec: f64,
    per_token_sec: f64,
    weights_sec: f64,
    prefill_attn_sec: f64,
    decode_ctx_sec: f64,
    coefficients: Vec<Coefficient>,
    /// The engine a calibration timed (empty for hand-written profiles).
    pub engine: EngineRecord,
    /// The machine a calibration ran on (None for hand-written profiles).
    pub machine: Option<MachineRecord>,
    /// The host KV tier's speeds, if the profile states them.
    pub offload: Option<OffloadProfile>,
}

impl CostModel {
    /// A built-in profile by name (see [`Self::profile_names`]).
    pub fn profile(name: &str) -> Result<Self> {
        let (file, text) = PROFILES.iter().find(|(n, _)| *n == name).ok_or_else(|| {
            Error::InvalidInput(format!(
                "unknown twin profile `{name}` (expected one of {})",
                PROFILE_NAMES.join(", ")
            ))
        })?;
        Self::from_toml(&format!("src/sim/profiles/{file}.toml"), text)
    }

    /// The built-in profile names.
    pub fn profile_names() -> &'static [&'static str] {
        PROFILE_NAMES
    }

    /// A built-in profile's TOML text, as embedded (None for an unknown name).
    pub fn profile_text(name: &str) -> Option<&'static str> {
        PROFILES.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
    }

    /// Parses a profile; errors name `path_for_errors`, the line and the field.
    pub fn from_toml(path_for_errors: &str, text: &str) -> Result<Self> {
        let file: ProfileFile = toml::from_str(text).map_err(|e| {
            let (line, key) = match e.span() {
                Some(span) => line_and_key(text, span.start),
                None => (0, String::new()),
            };
            let field = field_in_message(e.message()).unwrap_or(key);
            Error::InvalidProfile {
                file: path_for_errors.to_string(),
                line,
                field,
                why: e.message().trim().to_string(),
            }
        })?;
        let bad = |name: &str, span: std::ops::Range<usize>, why: String| Error::InvalidProfile {
            file: path_for_errors.to_string(),
            line: line_and_key(text, span.start).0,
            field: name.to_string(),
            why,
        };
        let r = &file.replica;
        let int = |name: &str, v: &Spanned<i64>, min: i64| -> Result<u32> {
            let x = *v.get_ref();
            if x < min || x > i64::from(u32::MAX) {
                return Err(bad(
                    name,
                    v.span(),
                    format!("{x} is out of range (at least {min})"),
                ));
            }
            Ok(x as u32)
        };
        let num_blocks = int("replica.num_blocks", &r.num_blocks, 2)?;
        let block_size = int("replica.block_size", &r.block_size, 1)?;
        let max_num_seqs = int("replica.max_num_seqs", &r.max_num_seqs, 1)?;
        let max_num_batched_tokens = int(
            "replica.max_num_batched_tokens",
            &r.max_num_batched_tokens,
            1,
        )?;
        let kv_bytes = int("replica.kv_bytes_per_token", &r.kv_bytes_per_token, 1)?;
        let c = &file.cost;
        let mut coefficients = Vec::new();
        let mut coef = |name: &'static str, k: &Coef| -> Result<f64> {
            let v = *k.value.get_ref();
            if !v.is_finite() || v < 0.0 {
                return Err(bad(
                    &format!("cost.{name}"),
                    k.value.span(),
                    format!("{v} is not a finite number >= 0"),
                ));
            }
            if k.source.trim().is_empty() {
                return Err(bad(
                    &format!("cost.{name}"),
                    k.value.span(),
                    "source is empty".into(),
                ));
            }
            coefficients.push(Coefficient {
                name,
                value: v,
                source: k.source.clone(),
            });
            Ok(v)
        };
        let offload = match &file.offload {
            None => None,
            Some(o) => {
                let gbps = |name: &str, k: &Coef| -> Result<f64> {
                    let v = *k.value.get_ref();
                    if !v.is_finite() || v <= 0.0 || k.source.trim().is_empty() {
                        return Err(bad(
                            &format!("offload.{name}"),
                            k.value.span(),
                            format!("{v}: expected a finite number > 0 with a source"),
                        ));
                    }
                    Ok(v * 1e9)
                };
                Some(OffloadProfile {
                    load_bytes_per_sec: gbps("load_gb_per_sec", &o.load_gb_per_sec)?,
                    store_bytes_per_sec: gbps("store_gb_per_sec", &o.store_gb_per_sec)?,
                    source: format!(
                        "{}; {}",
                        o.load_gb_per_sec.source, o.store_gb_per_sec.source
                    ),
                })
            }
        };
        Ok(CostModel {
            offload,
            step_sec: coef("step_sec", &c.step_sec)?,
            per_seq_sec: coef("per_seq_sec", &c.per_seq_sec)?,
            per_token_sec: coef("per_token_sec", &c.per_token_sec)?,
            weights_sec: coef("weights_sec", &c.weights_sec)?,
            prefill_attn_sec: coef("prefill_attn_sec", &c.prefill_attn_sec)?,
            decode_ctx_sec: coef("decode_ctx_sec", &c.decode_ctx_sec)?,
            coefficients,
            engine: file.engine,
            machine: file.machine,
            name: file.name,
            description: file.description,
            shape: ProfileShape {
                num_blocks,
                block_size,
                max_num_seqs,
                max_num_batched_tokens,
                kv_bytes_per_token: u64::from(kv_bytes),
                async_scheduling: r.async_scheduling.unwrap_or(true),
                source: r.source.clone(),
            },
        })
    }

    /// The coefficients with their sources, in the profile's order.
    pub fn coefficients(&self) -> &[Coefficient] {
        &self.coefficients
    }

    /// The fixed cost of a step (`step_sec`): about what a step costs that schedules nothing,
    /// as vLLM's busy loop runs while its waiting requests are all held by a gate.
    pub fn fixed_step_sec(&self) -> f64 {
        self.step_sec
    }

    /// Seconds one step with this work takes (0 for an empty step).
    pub fn step_time(&self, w: &StepWork) -> f64 {
        if w.num_reqs == 0 {
            return 0.0;
        }
        self.step_sec
            + self.per_seq_sec * f64::from(w.num_reqs)
            + (self.per_token_sec * w.total_tokens as f64).max(self.weights_sec)
            + self.prefill_attn_sec * w.prefill_attn
            + self.decode_ctx_sec * w.decode_ctx as f64
    }
}

/// 1-based line of byte `offset`, and the key on that line (`key = ...` or `[table]`).
fn line_and_key(text: &str, offset: usize) -> (usize, String) {
    let offset = offset.min(text.len());
    let line = text[..offset].matches('\n').count() + 1;
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    let l = text[start..end].trim();
    let key = if let Some(inner) = l.strip_prefix('[') {
        inner.trim_end_matches(']').trim().to_string()
    } else {
        l.split('=').next().unwrap_or("").trim().to_string()
    };
    (line, key)
}

/// The field serde names in messages such as "missing field `source`".
fn field_in_message(msg: &str) -> Option<String> {
    let i = msg.find("field `")? + "field `".len();
    let j = msg[i..].find('`')? + i;
    Some(msg[i..j].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_parses() {
        for name in CostModel::profile_names() {
            let m = CostModel::profile(name).unwrap();
            assert_eq!(&m.name, name);
            assert_eq!(m.coefficients().len(), 6);
        }
    }

    #[test]
    fn the_machine_record_is_optional_checked_and_the_shipped_cpu_tiny_does_not_know_it() {
        let base = include_str!("profiles/h200-qwen2.5-7b.toml");
        assert_eq!(CostModel::from_toml("x.toml", base).unwrap().machine, None);
        let text = base.replace(
            "[cost]",
            "[machine]\nknown = true\ncpu_model = \"Some CPU\"\ncpus = 8\n\
             cpu_flags = [\"avx2\", \"amx_bf16\"]\nvllm_version = \"0.32.0\"\n\n[cost]",
        );
        let m = CostModel::from_toml("x.toml", &text)
            .unwrap()
            .machine
            .unwrap();
        assert!(m.known);
        assert_eq!(m.cpus, Some(8));
        assert_eq!(m.cpu_flags.unwrap(), ["avx2", "amx_bf16"]);
        let bad = text.replace("cpus = 8", "cpus = 8\nhostname = \"x\"");
        let err = CostModel::from_toml("x.toml", &bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("hostname"), "{err}");
        let tiny = CostModel::profile("cpu-tiny").unwrap().machine.unwrap();
        assert!(
            !tiny.known,
            "cpu-tiny's machine was not recorded: other hardware"
        );
        assert_eq!(
            CostModel::profile_text("cpu-tiny"),
            Some(include_str!("profiles/cpu-tiny.toml"))
        );
    }

    #[test]
    fn the_engine_record_is_optional_and_checked() {
        let base = include_str!("profiles/h200-qwen2.5-7b.toml");
        let m = CostModel::from_toml("x.toml", base).unwrap();
        assert_eq!(m.engine, EngineRecord::default());
        let text = base.replace(
            "[cost]",
            "[engine]\nmodel = \"Qwen/Qwen2.5-7B-Instruct\"\ntensor_parallel_size = 2\n\
             gpu_memory_utilization = 0.9\nenforce_eager = false\n\n[cost]",
        );
        let with = CostModel::from_toml("x.toml", &text).unwrap();
        assert_eq!(
            with.engine.model.as_deref(),
            Some("Qwen/Qwen2.5-7B-Instruct")
        );
        assert_eq!(with.engine.tensor_parallel_size, Some(2));
        assert_eq!(with.engine.gpu_memory_utilization, Some(0.9));
        assert_eq!(with.engine.enforce_eager, Some(false));
        // Informational: the same shape and step times as without it.
        assert_eq!(with.shape, m.shape);
        assert_eq!(with.coefficients(), m.coefficients());
        for (bad, field) in [
            ("tensor_parallel_size = 2", "tensor_parallel_size = \"two\""),
            ("tensor_parallel_size = 2", "tensor_parallel = 2"),
            ("tensor_parallel_size = 2", "tensor_parallel_size = -1"),
        ] {
            let err = CostModel::from_toml("x.toml", &text.replace(bad, field))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("x.toml") && err.contains("tensor_parallel"),
                "{err}"
            );
        }
    }

    #[test]
    fn async_scheduling_is_off_on_cpu_and_defaults_on() {
        // vLLM's CPU platform sets async_scheduling = False; GPU profiles keep vLLM's default.
        assert!(
            !CostModel::profile("cpu-tiny")
                .unwrap()
                .shape
                .async_scheduling
        );
        assert!(
            CostModel::profile("h200-qwen2.5-7b")
                .unwrap()
                .shape
                .async_scheduling
        );
        let text = include_str!("profiles/cpu-tiny.toml").replace("async_scheduling = false", "");
        let m = CostModel::from_toml("x.toml", &text).unwrap();
        assert!(m.shape.async_scheduling);
        let bad = include_str!("profiles/cpu-tiny.toml")
            .replace("async_scheduling = false", "async_scheduling = 3");
        let err = CostModel::from_toml("x.toml", &bad)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("x.toml") && err.contains("async_scheduling"),
            "{err}"
        );
    }
}
