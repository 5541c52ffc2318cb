"""The fleet CLI's pure parts (``session_gate.sim.fleet``): workloads scaled to the fleet, and
the targets read from a group of runs. The simulation itself is tested in Rust
(``tests/sim_fleet.rs``)."""

from __future__ import annotations

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
