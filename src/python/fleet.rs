//! The twin as a fleet for Python: `simulate_fleet(...)` runs one gating mode of a workload on
//! N replicas of a profile with a placement policy, and returns the per-turn records, the
//! placement counters and each replica's counters. The GIL is released while it runs.
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::guard::no_panic;
use super::knobs::PyGateConfig;
use super::sim::{cost_model, read_sessions, records_dict, replica_dict};
use crate::sim::driver::ModeSpec;
use crate::sim::fleet::policy::PlacementKind;
use crate::sim::fleet::{FleetSpec, simulate_fleet as run_fleet};
use crate::sim::{Replica, ReplicaConfig};

/// Runs `sessions` (as `simulate_rl_steps` takes one step's) on `replicas` replicas of the
/// built-in `profile` (or the TOML `profile_text`), each behind its own `mode` (`none`, `seed`,
/// `gate` with `config`'s knobs, `pause`, `aimd`), placed by `placement` (`hash`,
/// `sticky-least-loaded`, `cache-aware`, `thunder`, `gate`). `straggler` is `(replica,
/// slowdown)`; `lose` a replica lost once half the turns have finished. Returns `records`
/// (columns as `simulate_rl_steps`), `makespan_sec`, `placement` (decisions by reason),
/// `replica_stats` (one dict per replica, with `sessions_served`), `lost`, `resent_turns`,
/// `lost_at` and `wall_sec`.
#[pyfunction]
#[pyo3(signature = (
    sessions,
    mode,
    *,
    replicas,
    placement,
    config=None,
    profile=None,
    profile_path=None,
    profile_text=None,
    straggler=None,
    lose=None,
    seed=0,
))]
#[allow(clippy::too_many_arguments)]
fn simulate_fleet<'py>(
    py: Python<'py>,
    sessions: &Bound<'py, PyAny>,
    mode: &str,
    replicas: usize,
    placement: &str,
    config: Option<PyRef<'py, PyGateConfig>>,
    profile: Option<&str>,
    profile_path: Option<&str>,
    profile_text: Option<&str>,
    straggler: Option<(usize, f64)>,
    lose: Option<usize>,
    seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    no_panic("simulate_fleet", || {
        let specs = read_sessions(sessions)?;
        let gate_config = config.map(|c| c.inner().clone()).unwrap_or_default();
        let spec = ModeSpec::from_kind(mode, 0, gate_config)?;
        let fleet = FleetSpec {
            replicas,
            placement: PlacementKind::from_name(placement)?,
            straggler,
            lose,
        };
        let cost = cost_model(profile, profile_path, profile_text)?;
        let shape = ReplicaConfig::from_profile(&cost);
        let (out, wall) = py.detach(|| {
            let started = Instant::now();
            let out = run_fleet(
                specs,
                seed,
                || Replica::new(shape, cost.clone()),
                &spec,
                &fleet,
            );
            (out, started.elapsed().as_secs_f64())
        });
        let out = out?;
        let d = PyDict::new(py);
        d.set_item("records", records_dict(py, &out.records)?)?;
        // The replica that served each record (per-replica tails, spreads).
        d.set_item("served_by", PyList::new(py, &out.served_by)?)?;
        d.set_item("makespan_sec", out.makespan_sec)?;
        let placed = PyDict::new(py);
        for (reason, n) in out.placement.by_reason() {
            placed.set_item(reason, n)?;
        }
        placed.set_item("moves", out.placement.moves())?;
        d.set_item("placement", placed)?;
        let per_replica = PyList::empty(py);
        for (stats, served) in out.replica_stats.iter().zip(&out.sessions_served) {
            let r = replica_dict(py, stats)?;
            r.set_item("sessions_served", served)?;
            per_replica.append(r)?;
        }
        d.set_item("replica_stats", per_replica)?;
        let lost = PyDict::new(py);
        lost.set_item("cancellations", out.lost.cancellations)?;
        lost.set_item("turns", out.lost.turns)?;
        lost.set_item("tokens", out.lost.tokens)?;
        d.set_item("lost", lost)?;
        d.set_item("resent_turns", out.resent_turns)?;
        d.set_item("lost_at", out.lost_at)?;
        d.set_item("block_size", shape.block_size)?;
        d.set_item("wall_sec", wall)?;
        Ok(d)
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate_fleet, m)?)
}
