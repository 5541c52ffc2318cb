"""The benchmark's workloads are reproducible and its trace format round-trips and names errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from session_gate import workloads
from session_gate.modes import Mode

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "example_trace.jsonl"


def test_builtin_workloads_are_seeded_and_match_their_description():
    a, b = workloads.default_workload(3), workloads.default_workload(3)
    assert a == b and a != workloads.default_workload(4)
    assert len(a.sessions) == 16 and all(len(s.turns) == 10 for s in a.sessions)
    appended = [t.append for s in a.sessions for t in s.turns[1:]]
    assert min(appended) >= 200 and max(appended) <= 600
    assert all(s.turns[0].append == 0 for s in a.sessions)
    mixed = workloads.mixed_workload(0)
    assert {len(s.turns) for s in mixed.sessions} == {3, 12}


def test_the_default_workload_doubled_keeps_its_own_sessions_first():
    one, two = workloads.default_workload(2), workloads.default_workload(2, sessions=32)
    assert two.name == "default-x2" and len(two.sessions) == 32
    assert two.sessions[:16] == one.sessions
    assert len({s.session_id for s in two.sessions}) == 32
    assert two.engine == one.engine
    with pytest.raises(ValueError, match="sessions 0"):
        workloads.default_workload(0, sessions=0)


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


def _trace(tmp_path, *rows):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


GOOD = (
    '{"session_id": "a", "system_tokens": 8, "task_tokens": 16, "arrival": 2.5, '
    '"turns": [{"append": 0, "output": 4, "tool_latency": 0.5}]}'
)


def test_a_trace_may_give_arrivals(tmp_path):
    second = GOOD.replace(', "arrival": 2.5', "").replace('"a"', '"b"')
    trace = workloads.load_trace(_trace(tmp_path, GOOD, second))
    assert [s.arrival for s in trace.sessions] == [2.5, 0.0]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('"arrival": 2.5', '"arrival": -1', r"t.jsonl:2: session 'a': field 'arrival': -1"),
        ('"arrival": 2.5', '"arrival": "soon"', r"t.jsonl:2: session 'a': field 'arrival'"),
        ('"output": 4', '"output": 0', r"t.jsonl:2: session 'a': turns\[0\]: field 'output'"),
        ('"append": 0', '"append": 3', r"turns\[0\]: field 'append': 3: the first turn"),
        ('"task_tokens": 16, ', "", r"t.jsonl:2: session 'a': missing field 'task_tokens'"),
        ('"tool_latency": 0.5', '"tool_latency": true', r"field 'tool_latency': expected"),
        ('"session_id": "a"', '"session_id": 7', r"t.jsonl:2: field 'session_id': expected str"),
        ("{", "[", r"t.jsonl:2: not JSON"),
    ],
)
def test_bad_trace_fields_are_named_with_file_and_line(tmp_path, old, new, message):
    path = _trace(tmp_path, GOOD, GOOD.replace(old, new, 1))
    with pytest.raises(ValueError, match=message):
        workloads.load_trace(path)


def test_a_trace_with_a_session_id_twice_is_refused_with_both_lines(tmp_path):
    path = _trace(tmp_path, GOOD, GOOD.replace('"a"', '"b"'), GOOD)
    with pytest.raises(
        ValueError, match=r"t.jsonl:3: session 'a': duplicate session_id \(first on line 1\)"
    ):
        workloads.load_trace(path)


def test_a_session_that_can_never_fit_the_cache_is_named():
    fits = workloads.SessionSpec("small", 8, 16, (workloads.Turn(0, 8, 0.0),))
    big = workloads.SessionSpec("big", 0, 40_000, (workloads.Turn(0, 1, 0.0),))
    w = workloads.Workload("w", (fits, big))
    with pytest.raises(ValueError, match=r"w: session 'big' needs 40,001 tokens.*32,736 tokens"):
        w.engine_max_model_len  # noqa: B018 (the property refuses before any engine starts)
    workloads.Workload("ok", (fits,)).check_fits(2, 32)  # 32 tokens: exactly one usable block


def test_scale_workloads_are_agentic_rollouts_for_the_twin():
    w = workloads.SCALE_WORKLOADS["rl-rollout"](0)
    assert w.profile_shape and len(w.sessions) == 256
    assert {len(s.turns) for s in w.sessions} <= set(range(20, 51))
    final = sorted(
        s.system_tokens + s.task_tokens + sum(t.append + t.output for t in s.turns)
        for s in w.sessions
    )
    assert final[len(final) // 2] > 32_768
    latencies = sorted(t.tool_latency for s in w.sessions for t in s.turns)
    assert 1.0 < latencies[len(latencies) // 2] < 5.0 and latencies[-1] > 10.0
    arrivals = [s.arrival for s in workloads.SCALE_WORKLOADS["rl-async"](0).sessions]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 300
