"""The ``aimd`` and ``pause`` bench modes: the Rust controllers through the binding, and whole
runs against a real CPU vLLM engine, driven by vLLM's own Prometheus metrics.

The engine runs a small workload (6 sessions x 4 turns on 128 blocks of 32 tokens). Knobs are
set so each controller is sure to act within a few seconds (the published defaults react in
minutes): cancelled episodes must re-run to completion with their lost work counted, and paused
sessions must be resumed and finish.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio
from session_gate._native import AimdController, PauseController
from session_gate.lab.bench.admission import time_scale
from session_gate.lab.bench.matrix import build, median_rounds, parse_args, targets, worst_regret
from session_gate.lab.bench.runner import run_mode
from session_gate.lab.engine.launch import make_async_llm
from session_gate.lab.engine.metrics import kv_capacity, scrape
from session_gate.modes import Mode
from session_gate.workloads import EngineShape, SessionSpec, Turn, Workload

BLOCK = 32
NUM_BLOCKS = 128


def small_workload(seed: int = 0) -> Workload:
    rng = random.Random(seed)
    sessions = tuple(
        SessionSpec(
            f"s{i}",
            256,
            600,
            tuple(
                Turn(0 if t == 0 else rng.randint(150, 300), 16, round(rng.uniform(0.2, 0.5), 3))
                for t in range(4)
            ),
        )
        for i in range(6)
    )
    return Workload("small", sessions, EngineShape(num_blocks=NUM_BLOCKS, block_size=BLOCK))


# --------------------------------------------------------------------------- binding, no engine


def test_unknown_and_invalid_knobs_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown knob `bogus`"):
        AimdController(bogus=1)
    with pytest.raises(ValueError, match="cut_usage"):
        AimdController(cut_usage=1.5)
    with pytest.raises(ValueError, match="pause_target"):
        PauseController(1000, pause_target=0.99)
    with pytest.raises(ValueError, match="time_scale"):
        PauseController(1000, time_scale=0.0)
    with pytest.raises(ValueError, match="kv_usage"):
        AimdController().on_poll(0.0, kv_usage=2.0, running=0, waiting=0, preemptions_total=0)


def test_time_scale_runs_the_controllers_faster():
    assert AimdController().poll_interval_sec == 5.0
    assert AimdController(time_scale=0.1).poll_interval_sec == pytest.approx(0.5)
    assert PauseController(1000, time_scale=0.09).scheduler_interval_sec == pytest.approx(0.45)
    # The default workload: median tool latency ~0.9 s over the 10 s reference.
    from session_gate.workloads import default_workload

    assert 0.05 < time_scale(default_workload()) < 0.15


def test_modes_parse_the_baselines_and_their_scaled_variants():
    assert Mode.parse("aimd") == Mode("aimd", "aimd")
    assert Mode.parse("pause-scaled") == Mode("pause-scaled", "pause", scaled=True)
    with pytest.raises(ValueError, match="unknown mode"):
        Mode.parse("aimd-fast")


def test_the_matrix_computes_regret_against_the_best_mode_and_judges_targets():
    def summary(mode, makespan, engine="vllm-cpu"):
        return {
            "mode": mode,
            "engine": engine,
            "makespan_sec": makespan,
            "hit_rate": 0.8,
            "ideal_hit_rate": 0.82,
            "recompute_ratio": 1.1,
            "lost_tokens": 0,
            "cancellations": 0,
            "late_turn_p90_sec": 1.0,
        }

    m = build(
        {
            "a": [summary("none", 30.0), summary("gate", 20.0), summary("aimd", 25.0)],
            "b": [summary("none", 10.0), summary("gate", 10.5), summary("aimd", 12.0)],
        }
    )
    assert m["a"]["gate"]["regret"] == 1.0 and m["a"]["none"]["regret"] == 1.5
    assert worst_regret(m) == {"gate": 1.05, "aimd": 1.25, "none": 1.5}
    m["b"].pop("aimd")
    assert worst_regret(m) == {"gate": 1.05, "none": 1.5}
    assert worst_regret(m, complete=False) == {"aimd": 1.25}
    t = targets(m)
    assert t["gate_worst_regret"]["met"] and t["gate_lowest_worst_regret"]["met"]
    assert not t["gate_over_none_makespan"]["met"], "5% slower than no gate on b"


def test_repeated_real_runs_are_judged_on_each_figures_median():
    def run(mode, makespan, recompute):
        return {"mode": mode, "engine": "vllm-cpu", "makespan_sec": makespan, "hit_rate": 0.8,
                "ideal_hit_rate": 0.85, "recompute_ratio": recompute, "lost_tokens": 0,
                "cancellations": 0, "late_turn_p90_sec": 1.0, "gate": {"at": makespan}}  # fmt: skip

    rounds = [
        {"default": [run("gate", 40.0, 1.3), run("cap8", 30.0, 1.1)]},
        {"default": [run("cap8", 36.0, 1.2), run("gate", 31.0, 1.2)]},
        {"default": [run("gate", 33.0, 1.25), run("cap8", 33.0, 1.3)]},
    ]
    merged = median_rounds(rounds)["default"]
    gate, cap8 = merged
    assert gate["mode"] == "gate" and cap8["mode"] == "cap8", "the first round's order"
    assert gate["makespan_sec"] == 33.0 and gate["recompute_ratio"] == 1.25
    assert cap8["makespan_sec"] == 33.0 and cap8["recompute_ratio"] == 1.2
    assert [r["makespan_sec"] for r in gate["repeats"]] == [40.0, 31.0, 33.0]
    assert gate["gate"] == {"at": 40.0}, "figures without a median are the first round's"
    m = build({"default": merged})
    assert m["default"]["gate"]["regret"] == 1.0 and m["default"]["gate"]["runs"] == 3
    # A single gate run at 40 s would have been 1.33x cap8's 30 s in the same round.
    assert median_rounds(rounds[:1]) is rounds[0]
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])


def test_the_matrix_rebuilds_from_saved_runs_merging_modes_of_a_workload(tmp_path, capsys):
    import json

    from session_gate.lab.bench import matrix

    def row(mode, makespan):
        return {"mode": mode, "engine": "twin:cpu-tiny", "makespan_sec": makespan,
                "hit_rate": 0.5, "ideal_hit_rate": 0.9, "recompute_ratio": 2.0,
                "lost_tokens": 0, "cancellations": 0, "late_turn_p90_sec": 1.0}  # fmt: skip

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"workloads": {"w": [row("none", 10.0), row("gate", 9.0)]}}))
    b.write_text(json.dumps({"workloads": {"w": [row("gate", 8.0), row("pause", 12.0)]}}))
    out = tmp_path / "m.json"
    matrix.main(["--load", str(a), str(b), "--out", str(out), "--plot", str(tmp_path / "m.png")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["worst_regret"] == {"gate": 1.0, "none": 1.25, "pause": 1.5}
    assert (tmp_path / "m.png").stat().st_size > 0


def test_the_twin_runs_the_baselines_with_literal_constants_only():
    from session_gate.sim.twin import run_twin

    w = small_workload()
    for name in ("aimd", "pause"):
        result = run_twin(w, Mode.parse(name), "cpu-tiny")
        assert_every_turn_ran_once(result, w)
        s = result.summary()
        assert s["engine"] == "twin:cpu-tiny" and s["lost_tokens"] >= 0
        # aimd's own view of the engine comes with its row (the twin's as the bench's).
        if name == "aimd":
            assert s["aimd"]["polls"] > 0 and 0.0 <= s["aimd"]["peak_usage"] <= 1.0, s["aimd"]
        else:
            assert "aimd" not in s
    with pytest.raises(ValueError, match="literal time constants"):
        run_twin(w, Mode.parse("pause-scaled"), "cpu-tiny")


# --------------------------------------------------------------------------- the real engine

pytestmark_engine = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    w = small_workload()
    llm = make_async_llm(
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        max_model_len=w.max_prompt_tokens + 64,
        max_num_seqs=16,
    )
    try:
        yield llm
    finally:
        llm.shutdown()


def assert_every_turn_ran_once(result, workload):
    keys = [(r.session_id, r.turn) for r in result.records]
    assert len(keys) == len(set(keys))
    assert len(keys) == sum(len(s.turns) for s in workload.sessions)


@pytestmark_engine
async def test_vllm_metrics_are_readable_in_process(engine):
    from session_gate.lab.engine.launch import agenerate

    await agenerate(engine, list(range(3, 300)), 8, "metrics-probe")
    load = scrape()
    assert 0.0 <= load.kv_usage <= 1.0
    assert load.running >= 0 and load.waiting >= 0 and load.preemptions_total >= 0
    assert kv_capacity(engine) == (NUM_BLOCKS * BLOCK, engine.model_config.max_model_len)


@pytestmark_engine
async def test_aimd_cancels_youngest_episodes_and_reruns_them_with_lost_work_counted(engine):
    w = small_workload()
    # A hair-trigger hard cap (any usage over 1% cancels down to one episode, every poll) and a
    # huge growth factor (one clear completion lets everyone back in): episodes keep being
    # cancelled, and the oldest always survives, so the run ends. Polls 1.5 s apart leave the
    # episodes time to finish turns (~0.3 s each here) before the cut, so work is lost.
    knobs = dict(
        initial_inflight=6.0,
        cut_usage=0.01,
        cancel_usage=0.02,
        cut_target=0.001,
        cooldown_polls=0,
        poll_interval_sec=1.5,
        growth=100.0,
    )
    result = await asyncio.wait_for(run_mode(engine, w, Mode.parse("aimd"), None, knobs=knobs), 300)
    assert_every_turn_ran_once(result, w)
    s = result.summary()
    st = result.gate_stats
    assert s["cancellations"] > 0 and st["cancelled"] == s["cancellations"], (s, st)
    assert s["lost_turns"] > 0 and s["lost_tokens"] > 0, (s, st)
    assert st["polls"] > 0 and st["scrape_errors"] == 0, st
    # peak_usage is the highest usage a poll saw: a usage-triggered (soft) cut saw more than the
    # 1% line, but cancels also come from hard cuts (a preemption, or the queue outgrowing the
    # running set), which need no usage at all (CI, 4 Dec: 2 cancels, every poll at usage 0.0).
    a = s["aimd"]
    assert a["cancelled"] == s["cancellations"] and a["soft_cuts"] + a["hard_cuts"] > 0, s
    assert a["soft_cuts"] == 0 or a["peak_usage"] > 0.01, a


@pytestmark_engine
async def test_pause_holds_sessions_at_tool_boundaries_and_resumes_them(engine):
    w = small_workload()
    # Counted tokens pass 30% of the 4,096-token cache quickly: pauses are certain.
    knobs = dict(
        pause_threshold=0.3,
        pause_target=0.1,
        resume_hysteresis=0.05,
        scheduler_interval_sec=0.2,
        # A lone late session outgrows the resume line here: the forced resume lets it finish.
        resume_timeout_sec=3.0,
    )
    result = await asyncio.wait_for(
        run_mode(engine, w, Mode.parse("pause"), None, knobs=knobs), 300
    )
    assert_every_turn_ran_once(result, w)
    st = result.gate_stats
    assert st["pauses"] > 0 and st["resumes"] > 0 and st["paused_now"] == 0
    reasons = result.summary()["admissions_by_reason"]
    assert reasons.get("active", 0) > 0
    assert sum(v for k, v in reasons.items() if k != "active") == st["held_turns"] > 0
