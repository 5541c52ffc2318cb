//! The replica twin for Python: `simulate_rl_steps(...)` runs one mode of a workload on a
//! profile over consecutive RL steps through one mode object (the gate core lives across
//! steps) and returns each step's per-turn records and counters. One call is the whole
//! simulation; the GIL is released while it runs.
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::gate_core::stats_dict;
use super::guard::no_panic;
use super::knobs::PyGateConfig;
use crate::error::Error;
use crate::sim::driver::limit::limit_config;
use crate::sim::driver::{
    InferStats, ModeSpec, SessionSpec, SimOutput, TurnRecord, TurnSpec, simulate_steps,
};
use crate::sim::offload::OffloadConfig;
use crate::sim::{CostModel, EngineRecord, Replica, ReplicaConfig, ReplicaStats};

/// A session as Python passes it: `(session_id, system_tokens, task_tokens, arrival, turns)`,
/// each turn `(append, output, tool_latency)`.
type SessionTuple = (String, u32, u32, f64, Vec<(u32, u32, f64)>);

/// Each item of the Python iterable `items` through `read`; an error names the item the way
/// the caller calls it (`what`, e.g. `sessions[2]: ...`).
fn read_each<T>(
    items: &Bound<'_, PyAny>,
    what: &str,
    read: impl Fn(&Bound<'_, PyAny>) -> Result<T, String>,
) -> Result<Vec<T>, Error> {
    let iter = items
        .try_iter()
        .map_err(|e| Error::InvalidInput(format!("{what}: not iterable: {e}")))?;
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        let item = item.map_err(|e| e.to_string()).and_then(|item| read(&item));
        out.push(item.map_err(|e| Error::InvalidInput(format!("{what}[{i}]: {e}")))?);
    }
    Ok(out)
}

pub(super) fn read_sessions(sessions: &Bound<'_, PyAny>) -> Result<Vec<SessionSpec>, Error> {
    read_each(sessions, "sessions", |item| {
        let (session_id, system_tokens, task_tokens, arrival, turns) =
            item.extract::<SessionTuple>().map_err(|e| {
                format!(
                    "expected (session_id, system_tokens, task_tokens, arrival, \
                     [(append, output, tool_latency), ...]): {e}"
                )
            })?;
        Ok(SessionSpec {
            session_id,
            system_tokens,
            task_tokens,
            arrival,
            turns: turns
                .into_iter()
                .map(|(append, output, tool_latency)| TurnSpec {
                    append,
                    output,
                    tool_latency,
                })
                .collect(),
        })
    })
}

/// Runs one mode of a workload over consecutive RL steps on the twin: `steps` is a list of
/// session lists (one per step; a session is `(session_id, system_tokens, task_tokens,
/// arrival, [(append, output, tool_latency), ...])`), each step on a fresh replica, all through
/// ONE mode object, so the gate core (what it learned, its counters) lives across steps; the
/// other modes start afresh each step. One step is a plain run of the workload.
///
/// `mode` is `none`, `limit` (`none` on the same engine with a GPU cache no step can exhaust:
/// `num_blocks` is replaced by a count that never evicts; the run fails if it evicted anyway),
/// `cap` (with `cap` sessions), `seed` or `gate` (with `config`'s knobs;
/// `seed` forces `pressure="engine"`), `aimd` or `pause` (the baselines, published defaults),
/// `sched` or `sched-infer` (the engine gate's scheduler mode, with `config`'s knobs;
/// `max_wait_sec` defaults to 120 s).
/// The cost model is the built-in `profile`, or the TOML `profile_text` read from
/// `profile_path`. The replica has the profile's shape unless a shape field is given;
/// `offload_gb` gives it a host KV tier of that many GiB (vLLM's `--kv-offloading-size`; the
/// profile needs an `[offload]` table). `seed` seeds token identity. Returns one dict per step: `records` (columns: `session`, `turn`,
/// `prompt_tokens`, `cached_tokens`, `latency_sec`, `wait_sec`, `reason`, `ready_at`,
/// `finished_at`, `engine_preemptions`), `makespan_sec`, `gate_stats` (or None, cumulative
/// across steps), `infer_stats` (`sched-infer`: inferred sessions against the true ones,
/// cumulative; else None), `replica_stats`, `lost` (cancelled episodes' `cancellations`, `turns`,
/// `tokens`), `profile` (name, description, shape used) and `wall_sec`.
#[pyfunction]
#[pyo3(signature = (
    steps,
    mode,
    *,
    cap=0,
    config=None,
    profile=None,
    profile_path=None,
    profile_text=None,
    num_blocks=None,
    block_size=None,
    max_num_seqs=None,
    max_num_batched_tokens=None,
    seed=0,
    offload_gb=None,
))]
#[allow(clippy::too_many_arguments)]
fn simulate_rl_steps<'py>(
    py: Python<'py>,
    steps: &Bound<'py, PyAny>,
    mode: &str,
    cap: u32,
    config: Option<PyRef<'py, PyGateConfig>>,
    profile: Option<&str>,
    profile_path: Option<&str>,
    profile_text: Option<&str>,
    num_blocks: Option<u32>,
    block_size: Option<u32>,
    max_num_seqs: Option<u32>,
    max_num_batched_tokens: Option<u32>,
    seed: u64,
    offload_gb: Option<f64>,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    no_panic("simulate_rl_steps", || {
        let specs = read_each(steps, "steps", |item| {
            read_sessions(item).map_err(|e| e.to_string())
        })?;
        if specs.is_empty() {
            return Err(Error::InvalidInput("steps: expected at least one step".into()).into());
        }
        let shape = [num_blocks, block_size, max_num_seqs, max_num_batched_tokens];
        let source = (profile, profile_path, profile_text);
        run(
            py, specs, mode, cap, config, source, shape, seed, offload_gb,
        )
    })
}

/// The body of `simulate_rl_steps`: one dict per step.
#[allow(clippy::too_many_arguments)]
fn run<'py>(
    py: Python<'py>,
    steps: Vec<Vec<SessionSpec>>,
    mode: &str,
    cap: u32,
    config: Option<PyRef<'py, PyGateConfig>>,
    (profile, profile_path, profile_text): (Option<&str>, Option<&str>, Option<&str>),
    [num_blocks, block_size, max_num_seqs, max_num_batched_tokens]: [Option<u32>; 4],
    seed: u64,
    offload_gb: Option<f64>,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let gate_config = config.map(|c| c.inner().clone()).unwrap_or_default();
    let spec = ModeSpec::from_kind(mode, cap, gate_config)?;
    let cost = cost_model(profile, profile_path, profile_text)?;
    let d = ReplicaConfig::from_profile(&cost);
    let mut shape = ReplicaConfig {
        num_blocks: num_blocks.unwrap_or(d.num_blocks),
        block_size: block_size.unwrap_or(d.block_size),
        max_num_seqs: max_num_seqs.unwrap_or(d.max_num_seqs),
        max_num_batched_tokens: max_num_batched_tokens.unwrap_or(d.max_num_batched_tokens),
    };
    if spec == ModeSpec::Limit {
        // The same engine with a cache no step can exhaust (num_blocks is the one field
        // that changes).
        shape = limit_config(shape, &steps)?;
    }
    let offload = offload_gb
        .map(|gib| OffloadConfig::from_profile(&cost, gib, shape.block_size))
        .transpose()?;
    let (name, description) = (cost.name.clone(), cost.description.clone());
    let engine = cost.engine.clone();
    let (out, wall) = py.detach(|| {
        let started = Instant::now();
        let replica = || {
            let r = Replica::new(shape, cost.clone())?;
            Ok(match offload {
                Some(cfg) => r.with_offload(cfg),
                None => r,
            })
        };
        let out = simulate_steps(steps, seed, replica, &spec);
        (out, started.elapsed().as_secs_f64())
    });
    let mut dicts = Vec::new();
    for o in out? {
        let result = output_dict(py, &o)?;
        let p = PyDict::new(py);
        p.set_item("name", &name)?;
        p.set_item("description", &description)?;
        p.set_item("num_blocks", shape.num_blocks)?;
        p.set_item("block_size", shape.block_size)?;
        p.set_item("max_num_seqs", shape.max_num_seqs)?;
        p.set_item("max_num_batched_tokens", shape.max_num_batched_tokens)?;
        p.set_item("offload_num_blocks", offload.map(|o| o.num_chunks))?;
        p.set_item("engine", engine_dict(py, &engine)?)?;
        result.set_item("profile", p)?;
        result.set_item("wall_sec", wall)?;
        dicts.push(result);
    }
    Ok(dicts)
}

/// The turn records as columns (one list per field).
pub(super) fn records_dict<'py>(py: Python<'py>, r: &[TurnRecord]) -> PyResult<Bound<'py, PyDict>> {
    let columns = PyDict::new(py);
    macro_rules! column {
        ($name:literal, $field:ident) => {
            columns.set_item($name, PyList::new(py, r.iter().map(|x| x.$field))?)?;
        };
    }
    column!("session", session);
    column!("turn", turn);
    column!("prompt_tokens", prompt_tokens);
    column!("cached_tokens", cached_tokens);
    column!("latency_sec", latency_sec);
    column!("wait_sec", wait_sec);
    column!("reason", reason);
    column!("ready_at", ready_at);
    column!("finished_at", finished_at);
    column!("engine_preemptions", engine_preemptions);
    Ok(columns)
}

fn output_dict<'py>(py: Python<'py>, out: &SimOutput) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("records", records_dict(py, &out.records)?)?;
    d.set_item("makespan_sec", out.makespan_sec)?;
    match &out.gate_stats {
        Some(s) => d.set_item("gate_stats", stats_dict(py, s)?)?,
        None => d.set_item("gate_stats", py.None())?,
    }
    match &out.aimd_stats {
        Some(s) => d.set_item("aimd_stats", super::baselines::aimd_stats_dict(py, s)?)?,
        None => d.set_item("aimd_stats", py.None())?,
    }
    match &out.infer_stats {
        Some(s) => d.set_item("infer_stats", infer_dict(py, s)?)?,
        None => d.set_item("infer_stats", py.None())?,
    }
    d.set_item("replica_stats", replica_dict(py, &out.replica_stats)?)?;
    let lost = PyDict::new(py);
    lost.set_item("cancellations", out.lost.cancellations)?;
    lost.set_item("turns", out.lost.turns)?;
    lost.set_item("tokens", out.lost.tokens)?;
    d.set_item("lost", lost)?;
    Ok(d)
}

/// The cost model: the built-in `profile`, or the TOML `profile_text` read from `profile_path`.
pub(super) fn cost_model(
    profile: Option<&str>,
    profile_path: Option<&str>,
    profile_text: Option<&str>,
) -> Result<CostModel, Error> {
    match (profile, profile_text) {
        (Some(name), None) => CostModel::profile(name),
        (None, Some(text)) => CostModel::from_toml(profile_path.unwrap_or("<profile>"), text),
        _ => Err(Error::InvalidInput(
            "give exactly one of profile= (a built-in name) or profile_text=".into(),
        )),
    }
}

/// The profile's `[engine]` record: only the fields it has.
fn engine_dict<'py>(py: Python<'py>, e: &EngineRecord) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let texts = [
        ("model", &e.model),
        ("load_format", &e.load_format),
        ("dtype", &e.dtype),
        ("device", &e.device),
        ("vllm_version", &e.vllm_version),
        ("command", &e.command),
    ];
    for (key, v) in texts {
        if let Some(v) = v {
            d.set_item(key, v)?;
        }
    }
    let counts = [
        ("tensor_parallel_size", e.tensor_parallel_size),
        ("max_model_len", e.max_model_len),
        ("num_gpu_blocks_override", e.num_gpu_blocks_override),
    ];
    for (key, v) in counts {
        if let Some(v) = v {
            d.set_item(key, v)?;
        }
    }
    if let Some(v) = e.gpu_memory_utilization {
        d.set_item("gpu_memory_utilization", v)?;
    }
    if let Some(v) = e.enforce_eager {
        d.set_item("enforce_eager", v)?;
    }
    Ok(d)
}

/// `sched-infer`'s comparison of inferred and true sessions, with the inference's own counts.
fn infer_dict<'py>(py: Python<'py>, s: &InferStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("turns", s.turns)?;
    d.set_item("first_new", s.first_new)?;
    d.set_item("first_merged", s.first_merged)?;
    d.set_item("later_turns", s.later_turns())?;
    d.set_item("continued_true", s.continued_true)?;
    d.set_item("continued_other", s.continued_other)?;
    d.set_item("missed", s.missed)?;
    d.set_item("continued_fraction", s.continued_fraction())?;
    let c = &s.counts;
    d.set_item("continued", c.continued)?;
    d.set_item("ambiguous", c.ambiguous)?;
    d.set_item("new", c.new)?;
    d.set_item("no_own_block", c.no_own_block)?;
    d.set_item("forgotten", c.forgotten)?;
    Ok(d)
}

pub(super) fn replica_dict<'py>(py: Python<'py>, s: &ReplicaStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("steps", s.steps)?;
    d.set_item("busy_sec", s.busy_sec)?;
    d.set_item("preemptions", s.preemptions)?;
    d.set_item("scheduled_tokens", s.scheduled_tokens)?;
    d.set_item("prefill_tokens", s.prefill_tokens)?;
    d.set_item("finished", s.finished)?;
    d.set_item("evicted_blocks", s.evicted_blocks)?;
    Ok(d)
}

/// The built-in profile names.
#[pyfunction]
fn sim_profile_names() -> Vec<&'static str> {
    CostModel::profile_names().to_vec()
}

/// A built-in profile's TOML text, as embedded in the extension (its `[machine]` says where it
/// was fitted).
#[pyfunction]
fn sim_profile_text(name: &str) -> PyResult<&'static str> {
    CostModel::profile_text(name).ok_or_else(|| {
        Error::InvalidInput(format!(
            "unknown twin profile `{name}` (expected one of {})",
            CostModel::profile_names().join(", ")
        ))
        .into()
    })
}

/// The replica shape a profile implies (its `[replica]` table): `num_blocks` (vLLM's null block
/// included), `block_size`, `max_num_seqs`, `max_num_batched_tokens`. The same profile arguments
/// as `simulate_rl_steps`.
#[pyfunction]
#[pyo3(signature = (*, profile=None, profile_path=None, profile_text=None))]
fn sim_profile_shape<'py>(
    py: Python<'py>,
    profile: Option<&str>,
    profile_path: Option<&str>,
    profile_text: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    no_panic("sim_profile_shape", || {
        let shape = ReplicaConfig::from_profile(&cost_model(profile, profile_path, profile_text)?);
        let d = PyDict::new(py);
        d.set_item("num_blocks", shape.num_blocks)?;
        d.set_item("block_size", shape.block_size)?;
        d.set_item("max_num_seqs", shape.max_num_seqs)?;
        d.set_item("max_num_batched_tokens", shape.max_num_batched_tokens)?;
        Ok(d)
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate_rl_steps, m)?)?;
    m.add_function(wrap_pyfunction!(sim_profile_shape, m)?)?;
    m.add_function(wrap_pyfunction!(sim_profile_names, m)?)?;
    m.add_function(wrap_pyfunction!(sim_profile_text, m)?)?;
    Ok(())
}
