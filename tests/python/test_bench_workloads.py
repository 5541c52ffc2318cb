"""The benchmark's workloads are reproducible and its trace format round-trips and names errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from session_gate.bench import workloads
from session_gate.bench.modes import Mode

EXAMPLE = Path(workloads.__file__).with_name("example_trace.jsonl")


def test_builtin_workloads_are_seeded_and_match_their_description():
    a, b = workloads.default_workload(3), workloads.default_workload(3)
    assert a == b and a != workloads.default_workload(4)
    assert len(a.sessions) == 16 and all(len(s.turns) == 10 for s in a.sessions)
    appended = [t.append for s in a.sessions for t in s.turns[1:]]
    assert min(appended) >= 200 and max(appended) <= 600
    assert all(s.turns[0].append == 0 for s in a.sessions)
    mixed = workloads.mixed_workload(0)
    assert {len(s.turns) for s in mixed.sessions} == {3, 12}


def test_trace_round_trips(tmp_path):
    original = workloads.mixed_workload(1)
    path = tmp_path / "t.jsonl"
    workloads.dump_trace(original, path)
    loaded = workloads.load_trace(path, seed=1)
    assert loaded.sessions == original.sessions


def test_the_example_trace_loads():
    trace = workloads.load_trace(EXAMPLE)
    assert len(trace.sessions) == 8


def test_a_bad_trace_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(EXAMPLE.read_text().splitlines()[0] + "\n" + '{"session_id": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        workloads.load_trace(path)


def test_modes_parse_and_refuse_unknown_names():
    assert Mode.parse("cap6") == Mode("cap6", "cap", 6)
    assert Mode.parse("gate").kind == "gate"
    for bad in ("cap0", "capx", "fast"):
        with pytest.raises(ValueError, match="unknown mode"):
            Mode.parse(bad)
