"""A tiny ``make bench-fleet`` end to end: two real CPU ``vllm serve`` replicas (tiny dummy model),
4 sessions x 3 turns, one round of ``gate`` placement through the proxy and of no gate (each
session hashed straight to a replica). The JSON line has its shape and sane figures: every turn
sent is counted on exactly one replica, the proxy decided every turn once by a reason when it
arrived (a move while it waits counts again), the hashed split is the one the session ids give,
and the sessions' ends reached the replicas' engines (their blocks evicted first).
Whether the targets are met is the benchmark's to say, not a test's (no timed assertions).

Runs in a subprocess, as ``make bench-fleet`` does; about a minute, most of it the replicas'
start."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from session_gate.lab.bench.fleet import replica_of
from session_gate.workloads import default_workload

SESSIONS, TURNS = 4, 3


def test_bench_fleet_smoke():
    args = ["--modes", "gate,none", "--reps", "1", "--sessions", str(SESSIONS),
            "--turns", str(TURNS), "--out", ""]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "session_gate.lab.bench.fleet", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("replicas stopped in") for line in lines), proc.stdout[-4000:]
    out = json.loads(lines[-1])

    sent = SESSIONS * TURNS
    assert out["sessions"] == SESSIONS and out["turns"] == sent
    assert out["replicas"] == 2 and out["reps"] == 1 and len(out["cpu_binding"]) == 2
    assert set(out["figures"]) == {"gate", "none"}
    for mode, f in out["figures"].items():
        assert math.isfinite(f["makespan_sec"]) and f["makespan_sec"] > 0, (mode, f)
        assert f["turns"] == sent and sum(f["turns_by_replica"]) == sent, (mode, f)
        assert 0 <= f["hit_rate"] <= f["ideal_hit_rate"] + 1e-9 <= 1 + 1e-9, (mode, f)
        assert f["ideal_hit_rate"] > 0 and len(f["rounds"]) == 1, (mode, f)
        assert math.isfinite(f["replica_cpu_sec"]) and f["replica_cpu_sec"] > 0, (mode, f)

    gate = out["figures"]["gate"]
    decided = {k: v for k, v in gate["placements"].items() if k != "held"}
    assert decided.get("new") == SESSIONS, gate
    # Each turn is decided once when it arrives; a turn moved while it waits for its replica's
    # gate counts once more: `new_move` always, `cold_move` when the move came while it waited
    # (a cold_move at arrival is the arrival's decision).
    at_arrival = sum(decided.values()) - decided.get("new_move", 0)
    assert at_arrival - decided.get("cold_move", 0) <= sent <= at_arrival, gate
    # Each session's end reached its replica's engine (the proxy's gate forgets it there) and
    # its blocks past the first prompt went to the front of the free queue; with no gate
    # nobody ends a session.
    assert gate["finished_blocks_evicted_first"] > 0, gate
    none = out["figures"]["none"]
    assert none["placements"] == {} and none["moves"] == 0
    assert none["finished_blocks_evicted_first"] == 0, none
    expected = [0, 0]
    for s in default_workload(0, sessions=SESSIONS).sessions:
        expected[replica_of(s.session_id, 2)] += TURNS
    assert none["turns_by_replica"] == expected

    t = out["targets"]
    assert t["gate_makespan_over_best_of_sticky_hash"] is None and t["gate_no_slower"] is None
    assert 0 < t["gate_hit_vs_ideal"] <= 1 + 1e-9
    assert t["gate_hit_at_least_0_95_ideal"] == (t["gate_hit_vs_ideal"] >= 0.95)
