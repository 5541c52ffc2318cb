"""A tiny ``make bench-sched-cost`` end to end on the real CPU engine: both parts run, the JSON
line has its shape and every figure is a finite number of the right sign. Whether the targets
are met is the benchmark's to say, not a test's (no timed assertions).

Runs in a subprocess: the benchmark starts its engine in scheduler mode in its own process and
wraps vLLM's classes there. The cache (64 blocks, 0.85 x 63 = 53.55 for the gate) is too small
for 4 sessions of 512-token prompts at once, so some turns are held and admits walk prefixes."""

from __future__ import annotations

import json
import math
import subprocess
import sys


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_bench_sched_cost_smoke():
    args = [
        "--rounds", "2", "--requests", "6", "--floor-calls", "2000",
        "--sessions", "4", "--turns", "2", "--prompt", "512", "--append", "64",
        "--max-tokens", "8", "--num-blocks", "64",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "session_gate.lab.engine.bench_sched_cost", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()  # vLLM's log lines among them
    assert any(line.startswith("(a) ") for line in lines), proc.stdout[-4000:]
    assert any(line.startswith("(b) ") for line in lines), proc.stdout[-4000:]
    out = json.loads(lines[-1])

    a = out["a"]
    assert a["rounds"] == 2 and len(a["pair_ratios"]) == 2
    for arm in ("off", "on"):
        for key in ("steps_per_s_median", "tokens_per_s_median", "round_sec_median"):
            assert _finite(a[arm][key]) and a[arm][key] > 0, (arm, key, a[arm])
    for key in ("ratio_median", "ratio_min", "ratio_max"):
        assert _finite(a[key]) and a[key] > 0, (key, a)
    assert _finite(a["cost_median"]) and _finite(a["predicted_cost"]) and a["predicted_cost"] >= 0
    assert len(a["steps_per_round"]) == 1 and a["steps_per_round"][0] > 0  # the same work
    calls = a["calls_per_round"]
    assert calls["adds"] == 6 and calls["frees"] == 6 and calls["looks"] >= 6, calls
    assert all(_finite(v) and v >= 0 for v in a["floor_ns"].values()), a["floor_ns"]

    b = out["b"]
    assert b["gated_requests"] == 8, b  # 4 sessions x 2 turns, every one asked the gate
    assert b["held"] >= 1 and b["prefix_walks"] >= 1, b  # the cache was under pressure
    for key in ("admit_us_per_gated_request", "release_us_per_gated_request"):
        assert _finite(b[key]) and b[key] > 0, (key, b)
    for key in (
        "ready_us_per_gated_request",
        "admit_prefix_walk_us_per_gated_request",
        "release_prefix_walk_us_per_gated_request",
        "tick_us_per_gated_request",
        "typical_us_per_gated_request",
        "timer_us_per_gated_request",
    ):
        assert _finite(b[key]) and b[key] >= 0, (key, b)
    # The net figures take the timers' own clock reads out of the same sums.
    for kind in ("total", "typical"):
        net = b[f"{kind}_net_of_timers_us_per_gated_request"]
        assert math.isclose(
            net, b[f"{kind}_us_per_gated_request"] - b["timer_us_per_gated_request"]
        )
    assert b["ready_us_per_gated_request"] > 0 and b["ready_looks_per_gated_request"] > 0, b
    total = sum(b[f"{k}_us_per_gated_request"] for k in ("admit", "ready", "release"))
    assert math.isclose(b["total_us_per_gated_request"], total)
    assert b["target_us"] == 20.0 and _finite(b["ratio_to_target"])
    assert b["per_call"]["admit_minus_walk"]["n"] == 8
    assert out["engine"]["num_blocks"] == 64
