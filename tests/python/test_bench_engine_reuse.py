"""The real bench runs each workload on the engine that workload would start: ``aimd`` sizes its
first cap from the engine's ``max_model_len``, so an engine kept from a longer workload ran it at
a smaller cap than the twin gives it (issue 29). ``unshared`` is that case's shape."""

from __future__ import annotations

import os
import statistics

import pytest
from session_gate.lab.bench.__main__ import engine_fits
from session_gate.lab.sim import fidelity
from session_gate.workloads import EngineShape, mixed_workload, unshared_workload


def test_an_engine_started_for_a_longer_workload_is_not_reused():
    mixed, unshared = mixed_workload(0), unshared_workload(0)
    assert mixed.engine_max_model_len > unshared.engine_max_model_len
    # Long enough for every prompt of unshared, but aimd's first cap would be mixed's.
    assert not engine_fits(mixed.engine, mixed.engine_max_model_len, unshared)
    assert engine_fits(unshared.engine, unshared.engine_max_model_len, unshared)
    other = EngineShape(num_blocks=unshared.engine.num_blocks * 2)
    assert not engine_fits(other, unshared.engine_max_model_len, unshared)


def test_aimd_first_cap_on_the_bench_engine_is_the_workloads_own():
    # The twin's aimd reads capacity / (longest sequence + 64); the bench's engine must agree.
    w = unshared_workload(0)
    longest = max(
        s.system_tokens + s.task_tokens + sum(t.append + t.output for t in s.turns)
        for s in w.sessions
    )
    assert w.engine_max_model_len == longest + 64


def test_unshared_has_the_issue_shape():
    w = unshared_workload(0)
    assert w == unshared_workload(0) and w != unshared_workload(1)
    assert len(w.sessions) == 20 and all(len(s.turns) == 12 for s in w.sessions)
    assert all(s.system_tokens == 0 for s in w.sessions), "no shared prefix"
    tools = [t.tool_latency for s in w.sessions for t in s.turns]
    # Log-normal: a heavy right tail, not the bench's uniform 0.3-1.5 s.
    assert max(tools) > 4 * statistics.median(tools)
    assert statistics.mean(tools) > statistics.median(tools)
    e = w.engine
    assert w.max_prompt_tokens + 64 <= (e.num_blocks - 1) * e.block_size


def test_fidelity_runs_unshared_after_mixed_by_default():
    args = fidelity.parse_args([])
    names = [w.name for w in args.workloads]
    assert names == ["default", "mixed", "unshared"]
    only = fidelity.parse_args(["--workload", "default"])
    assert [w.name for w in only.workloads] == ["default"]


def test_env_while_restores_what_was_there(monkeypatch):
    """The setting an engine start reads is scoped to it: set inside, the old value (or its
    absence) back after, also when the start raises."""
    from session_gate.lab.engine.launch import env_while

    key = "SESSION_GATE_TEST_ENV_WHILE"
    monkeypatch.delenv(key, raising=False)
    with env_while(key, "0"):
        assert os.environ[key] == "0"
    assert key not in os.environ
    monkeypatch.setenv(key, "1")
    with pytest.raises(RuntimeError), env_while(key, "0"):
        raise RuntimeError("vLLM refused the engine")
    assert os.environ[key] == "1"
