"""``lab.bench.matrix``'s targets for the scheduler modes (pure logic over hand-made rows)."""

from __future__ import annotations

from session_gate.lab.bench.matrix import sched_targets, targets


def row(makespan: float, hit: float, engine: str = "vllm-cpu") -> dict:
    return {
        "makespan_sec": makespan,
        "hit_rate": hit,
        "ideal_hit_rate": 0.8,
        "engine": engine,
        "regret": 1.0,
        "recompute_ratio": 1.2,
    }


def test_sched_is_judged_against_gate_and_none_and_infer_on_its_hit():
    matrix = {
        "default": {
            "none": row(60.0, 0.3),
            "gate": row(40.0, 0.78),
            "sched": row(40.8, 0.77),  # 2% over gate, hit 0.9625 x ideal, 1.47x none
            "sched-infer": row(41.0, 0.75),  # hit 0.9375 x ideal
        },
        "mixed": {
            "none": row(50.0, 0.3),
            "gate": row(40.0, 0.78),
            "sched": row(42.0, 0.78),  # 5% over gate: missed
            "sched-infer": row(52.0, 0.78),  # slower than none by 4%: missed everywhere
        },
    }
    out = sched_targets(matrix)
    assert out["real:default:sched"]["met"] is True
    assert out["real:default:sched-infer"]["met"] is True
    assert out["real:mixed:sched"]["met"] is False
    assert abs(out["real:mixed:sched"]["over_gate"] - 1.05) < 1e-9
    assert out["sched_over_none_makespan"]["met"] is True
    assert out["sched-infer_over_none_makespan"]["met"] is False


def test_the_scheduler_modes_are_not_the_gates_rivals_for_lowest_regret():
    matrix = {
        "default": {
            "none": {**row(60.0, 0.3), "regret": 1.5},
            "gate": {**row(40.4, 0.78), "regret": 1.01},
            "sched": {**row(40.0, 0.78), "regret": 1.0},
        }
    }
    assert targets(matrix)["gate_lowest_worst_regret"]["met"] is True
