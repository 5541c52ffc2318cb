"""The fleet CLI's pure parts (``session_gate.sim.fleet``): workloads scaled to the fleet, and
the targets read from a group of runs, and a smoke run of the CLI on a small fleet. The
simulation itself is tested in Rust (``tests/sim_fleet.rs``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from session_gate.sim import fleet


def test_fleet_workloads_scale_with_the_replicas() -> None:
    rollout = fleet.fleet_workload("rl-rollout", 4, 0)
    assert len(rollout.sessions) == 4 * 256
    assert all(s.arrival == 0.0 for s in rollout.sessions)
    stream = fleet.fleet_workload("rl-async", 4, 0)
    assert len(stream.sessions) == 4 * 512
    # Four arrivals a second: the last of 2,048 comes after about 512 s.
    assert 400 < stream.sessions[-1].arrival < 620
    speed = fleet.fleet_workload("speed", 16, 0)
    assert len(speed.sessions) == 4096
    assert {len(s.turns) for s in speed.sessions} == {30}
    with pytest.raises(ValueError, match="unknown fleet workload"):
        fleet.fleet_workload("default", 2, 0)


def _row(placement: str, mode: str, makespan: float, fault: str = "none") -> dict:
    return {
        "workload": "w",
        "profile": "p",
        "fault": fault,
        "placement": placement,
        "mode": mode,
        "makespan_sec": makespan,
    }


def test_targets_name_the_best_and_the_regret_and_compare_a_fault_with_absence() -> None:
    groups = {
        "none": [_row("gate", "gate", 105.0), _row("hash", "gate", 100.0)],
        "lost": [_row("gate", "gate", 120.0, "lost"), _row("hash", "gate", 150.0, "lost")],
        "absent": [_row("gate", "gate", 110.0, "absent")],
    }
    t = fleet.targets(groups)
    assert t["none"] == {"regret": 1.05, "lowest": False, "best": "hash+gate"}
    assert t["lost"]["lowest"] and t["lost"]["regret"] == 1.0
    assert t["lost"]["over_absent"] == round(120 / 110, 4)
    assert "over_absent" not in t["none"]


def test_sessions_per_replica_scales_a_fleet_workload_down() -> None:
    assert len(fleet.fleet_workload("rl-rollout", 3, 0, per_replica=8).sessions) == 24
    stream = fleet.fleet_workload("rl-async", 2, 0, per_replica=10)
    # Still one arrival a second per replica: 20 sessions over about 10 s.
    assert len(stream.sessions) == 20 and stream.sessions[-1].arrival < 30
    with pytest.raises(ValueError, match="sessions per replica 0"):
        fleet.fleet_workload("speed", 2, 0, per_replica=0)


def test_the_fleet_cli_prints_simulated_tables_and_targets(tmp_path) -> None:
    """A 2-replica fleet of 16 sessions each (about a second of CPU): every placement x mode x
    fault asked is a row, the JSON holds them, and the straggler is kept off by `gate`."""
    out = tmp_path / "fleet.json"
    argv = [sys.executable, "-m", "session_gate.sim", "--replicas", "2"]
    argv += ["--sessions-per-replica", "16", "--profile", "h200-qwen2.5-7b"]
    argv += ["--fleet-workload", "rl-rollout", "--modes", "gate,none"]
    argv += ["--placement", "gate", "hash", "--fault", "none", "straggler", "absent"]
    argv += ["--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.count("2 replicas (SIMULATED)") == 3
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["simulated"] is True
    result = json.loads(out.read_text())
    assert result["engine"] == "twin fleet (SIMULATED)"
    groups = result["groups"]
    assert len(groups) == 3
    for rows in groups.values():
        assert {(r["placement"], r["mode"]) for r in rows} == {
            (p, m) for p in ("gate", "hash") for m in ("gate", "none")
        }
        for r in rows:
            assert r["makespan_sec"] > 0 and 0.0 < r["hit"] <= 1.0
    absent = next(rows for key, rows in groups.items() if key.endswith("fault=absent"))
    assert {r["replicas"] for r in absent} == {1}
    assert {tuple(r["sessions_served"]) for r in absent} == {(32, 32)}
    straggler_key = next(key for key in groups if key.endswith("fault=straggler"))
    straggler = {(r["placement"], r["mode"]): r for r in groups[straggler_key]}
    # hash keeps its share on the half-speed replica; gate moves new sessions off it.
    ours, hashed = straggler[("gate", "gate")], straggler[("hash", "gate")]
    assert ours["makespan_sec"] < hashed["makespan_sec"]
    assert ours["sessions_served"][0] < hashed["sessions_served"][0]
    assert "over_absent" in last["targets"][straggler_key]


def test_the_fleet_cli_refuses_bad_sizes() -> None:
    argv = [sys.executable, "-m", "session_gate.sim", "--replicas", "2"]
    proc = subprocess.run(
        [*argv, "--sessions-per-replica", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "--sessions-per-replica 0: at least 1" in proc.stderr
