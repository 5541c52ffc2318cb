"""The twin (``python -m session_gate.sim``) and the lab's real bench (``python -m
session_gate.lab.bench``) take the same flags for the same things: ``--trace`` alone runs only the
trace, and every ``--help`` lists every registered workload and mode. No engine is started."""

from __future__ import annotations

from pathlib import Path

import pytest
from session_gate.lab.bench import __main__ as bench
from session_gate.lab.bench import clients
from session_gate.modes import SCHED_KINDS, Mode, mode_names
from session_gate.sim import __main__ as sim
from session_gate.workloads import SCALE_WORKLOADS, WORKLOADS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "example_trace.jsonl"
TRACE = "trace:example_trace.jsonl"
#: The flags both commands share, spelled the same.
SHARED = ("--workload", "--trace", "--modes", "--seed", "--out", "--plot", "--records")


@pytest.mark.parametrize("parse", [bench.parse_args, sim.parse_args], ids=["bench", "sim"])
def test_a_trace_alone_runs_only_the_trace(parse):
    assert [w.name for w in parse(["--trace", str(EXAMPLE)]).workloads] == [TRACE]
    assert [w.name for w in parse([]).workloads] == ["default", "mixed"]
    both = parse(["--workload", "mixed", "--trace", str(EXAMPLE)]).workloads
    assert [w.name for w in both] == ["mixed", TRACE]


def _help(parse, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: a name is never split over two lines
    with pytest.raises(SystemExit) as exit_:
        parse(["--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_help_lists_every_registered_workload_and_mode(capsys, monkeypatch):
    bench_help = _help(bench.parse_args, capsys, monkeypatch)
    sim_help = _help(sim.parse_args, capsys, monkeypatch)
    for name in WORKLOADS:
        assert name in bench_help and name in sim_help, name
    for name in SCALE_WORKLOADS:
        assert name in sim_help, name
    for name in mode_names():
        assert name in bench_help, name
    # The twin runs the baselines with their literal time constants only.
    for name in mode_names(scaled=False):
        assert name in sim_help, name
    assert "-scaled" not in sim_help
    # The scheduler modes: the twin models them, the real bench starts their engine.
    for name in SCHED_KINDS:
        assert name in sim_help, name
        assert name in bench_help, name
    for flag in SHARED:
        assert flag in bench_help and flag in sim_help, flag
    clients_help = _help(clients.main, capsys, monkeypatch)
    for name in (*clients.MODES, *WORKLOADS):
        assert name in clients_help, name


def test_every_listed_mode_parses_and_the_twin_refuses_scaled_baselines():
    for name in mode_names():
        mode = Mode.parse(name.replace("capN", "cap3"))
        assert mode.kind in name
    with pytest.raises(SystemExit):
        sim.parse_args(["--modes", "none,aimd-scaled"])
    assert [m.name for m in bench.parse_args(["--modes", "aimd-scaled"]).mode_list] == [
        "aimd-scaled"
    ]
    for name in mode_names(sched=True):
        assert Mode.parse(name.replace("capN", "cap3")).kind in name
    assert [m.kind for m in sim.parse_args(["--modes", "sched,sched-infer"]).mode_list] == [
        "sched",
        "sched-infer",
    ]
    assert [m.kind for m in bench.parse_args(["--modes", "sched"]).mode_list] == ["sched"]
