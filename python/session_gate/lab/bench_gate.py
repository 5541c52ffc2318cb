"""Benchmark of the Python gate's open path: ``async with gate.admit(...)`` + release through
``SessionGate`` with an instant fake probe, against the same path driven on the bare Rust core
through the binding (begin → poll → on_usage → poll → release) in the same run, so the cost of
the asyncio driver is visible as a ratio.

Same settings as ``examples/bench_gate.rs``: an idle engine of 10 M blocks of 16 tokens, a
1,024-token prompt, ``max_tokens=256``, one session, no ownership window.

``python -m session_gate.lab.bench_gate``; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time

from session_gate import GateConfig, SessionGate
from session_gate._native import Admit, GateCore, ProbeUsage
from session_gate.lab.testing import ScriptedProbe

NUM_BLOCKS = 10_000_000
BLOCK_SIZE = 16
PROMPT = 1024
MAX_TOKENS = 256
USAGE = 0.1


def quantiles(ns: list[int]) -> tuple[float, float]:
    """(median, p99) in microseconds."""
    ns.sort()
    p99 = ns[int((len(ns) - 1) * 0.99)]
    return statistics.median(ns) / 1000.0, p99 / 1000.0


def core_open_path(iterations: int, warmup: int) -> tuple[float, float]:
    """The baseline: the bare core driven through the binding, no asyncio."""
    core = GateCore(GateConfig())
    clock, perf = time.monotonic, time.perf_counter_ns
    samples = []
    for i in range(warmup + iterations):
        t = perf()
        now = clock()
        attempt = core.begin("bench", PROMPT, MAX_TOKENS, False, now)
        action = core.poll(attempt, now)
        assert type(action) is ProbeUsage
        core.on_usage(attempt, USAGE, NUM_BLOCKS, NUM_BLOCKS, 0, BLOCK_SIZE, now)
        action = core.poll(attempt, now)
        assert type(action) is Admit
        core.release(action.lease, now)
        elapsed = perf() - t
        if i >= warmup:
            samples.append(elapsed)
    return quantiles(samples)


async def gate_open_path(iterations: int, warmup: int) -> tuple[float, float]:
    """``async with gate.admit(...)``: acquire (usage probe, decision, lease) and release."""
    probe = ScriptedProbe(USAGE, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    gate = SessionGate(probe, GateConfig())
    prompt = [1] * PROMPT
    perf = time.perf_counter_ns
    samples = []
    for i in range(warmup + iterations):
        t = perf()
        async with gate.admit("bench", prompt, MAX_TOKENS, retain_session=False) as lease:
            pass
        elapsed = perf() - t
        if i >= warmup:
            samples.append(elapsed)
    assert lease.reason == "open"
    stats = gate.stats()
    assert stats["admissions"]["open"] == warmup + iterations and stats["leases_active"] == 0
    return quantiles(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=50_000)
    parser.add_argument("--warmup", type=int, default=5_000)
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    print(
        f"bench_gate (python): {platform.system()} {platform.machine()}, {cores} cores, "
        f"Python {platform.python_version()} ({sys.implementation.name}), "
        f"{args.iterations} iterations after {args.warmup} warm-up"
    )
    core_med, core_p99 = core_open_path(args.iterations, args.warmup)
    print(f"core via binding (baseline): median {core_med:.3f} us, p99 {core_p99:.3f} us")
    py_med, py_p99 = asyncio.run(gate_open_path(args.iterations, args.warmup))
    print(f"SessionGate admit+release:   median {py_med:.3f} us, p99 {py_p99:.3f} us")
    print(
        json.dumps(
            {
                "open_path_python_us": round(py_med, 3),
                "open_path_python_p99_us": round(py_p99, 3),
                "open_path_core_binding_us": round(core_med, 3),
                "open_path_core_binding_p99_us": round(core_p99, 3),
                "python_over_core_ratio": round(py_med / core_med, 2),
                "iterations": args.iterations,
                "cores": cores,
                "python": platform.python_version(),
                "target_open_path_python_us": 50,
            }
        )
    )


if __name__ == "__main__":
    main()
