"""A short ``make soak``: two real CPU ``vllm serve`` replicas, the proxy, a few dozen openai
sessions, one replica killed and restarted, dropped streams, abandoned sessions, a retry storm
and bad input to every route; every target of the full run must hold."""

from __future__ import annotations

import asyncio
import json

import pytest
from session_gate.lab.soak.cluster import Engines
from session_gate.lab.soak.run import SoakConfig, run
from session_gate.lab.soak.sessions import Workload


def test_soak_smoke():
    cfg = SoakConfig(
        workload=Workload(sessions=24, turns=8, storm_size=4, ramp_sec=2, think_sec=1.5),
        engines=Engines(num_blocks=64),
        idle_grace_sec=4,
        kill_at=0.4,
        down_sec=2,
        release=False,
        traffic_timeout_sec=600,
    )
    report = asyncio.run(run(cfg))
    if not report["ok"]:
        pytest.fail(json.dumps(report, indent=1))
    # Every turn was counted once, and the faults really happened.
    assert report["turns_sent"] == (
        report["completed"]
        + sum(report["failed_cleanly"].values())
        + report["broken_streams"]
        + report["client_disconnects"]
        + report["lost"]
    )
    assert report["completed"] > 0.5 * report["turns_sent"]
    assert report["sessions_abandoned"] >= 1 and report["client_disconnects"] >= 1
    assert report["bad_input"]["during_traffic"]["requests"] > 300
    assert sum(report["fresh_sessions_after_restart"]["served_by_replica"]) == 6
