"""``python -m session_gate.lab.bench``: run the thrash benchmark (see ``--help``).

One CPU vLLM engine per engine shape; the prefix cache is reset between modes instead of
restarting the engine. Prints a table per workload, writes the JSON results and a PNG plot, and
prints, last, one JSON line with the per-mode figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import time
from typing import Any

from session_gate import report, run_flags
from session_gate.lab.bench import infer_audit
from session_gate.lab.bench.runner import run_mode
from session_gate.lab.engine import launch
from session_gate.lab.sim.machine import this_machine
from session_gate.modes import DEFAULT_MODES
from session_gate.workloads import WORKLOADS, Workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m session_gate.lab.bench", description=__doc__)
    run_flags.add_run_flags(
        p,
        workloads=WORKLOADS,
        modes=DEFAULT_MODES,
        results=("bench-results.json", "bench-results.png"),
        sched_modes=True,
    )
    args = p.parse_args(argv)
    args.mode_list = run_flags.modes_of(p, args.modes, sched=True)
    try:
        args.workloads = run_flags.workloads_of(args, WORKLOADS)
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    return args


def _engine_for(workload: Workload) -> Any:
    from session_gate.lab.engine.launch import make_async_llm

    e = workload.engine
    return make_async_llm(
        num_blocks=e.num_blocks,
        block_size=e.block_size,
        max_model_len=workload.engine_max_model_len,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
    )


async def run(args: argparse.Namespace, results: list[Any] | None = None) -> dict[str, Any]:
    """Every workload of ``args.workloads`` in every mode of ``args.mode_list``; each mode's
    ``ModeResult`` is appended to ``results``. The scheduler modes run on an engine of their
    own, started with their ``SESSION_GATE_SCHEDULER`` setting (:data:`SCHEDULER_SETTINGS`);
    the others share one."""
    from tqdm import tqdm

    from session_gate import EngineProbe

    workloads = args.workloads
    by_workload: dict[str, list[dict[str, Any]]] = {}
    #: setting (None: off) -> (engine, its shape)
    engines: dict[str | None, tuple[Any, Any]] = {}

    def engine(setting: str | None, workload: Workload) -> Any:
        llm, shape = engines.get(setting, (None, None))
        if llm is None or not engine_fits(shape, llm.model_config.max_model_len, workload):
            if llm is not None:
                llm.shutdown()
            started = time.perf_counter()
            with _scheduler_env(setting):
                llm = _engine_for(workload)
            engines[setting] = (llm, workload.engine)
            what = f"SESSION_GATE_SCHEDULER={setting} " if setting else ""
            print(f"{what}engine up in {time.perf_counter() - started:.0f} s", flush=True)
        return llm

    try:
        for workload in workloads:
            print(workload.describe(), flush=True)
            total = sum(len(s.turns) for s in workload.sessions) * len(args.mode_list)
            summaries = []
            with tqdm(total=total, desc=workload.name, unit="turn") as bar:
                for mode in args.mode_list:
                    setting = SCHEDULER_SETTINGS.get(mode.kind)
                    llm = engine(setting, workload)
                    bar.set_postfix_str(mode.name)
                    before = await _scheduler_stats(llm) if setting else None
                    result = await run_mode(llm, workload, mode, EngineProbe(llm), bar)
                    if setting:
                        result.gate_stats = await _scheduler_delta(llm, mode.name, before)
                    summaries.append(result.summary())
                    if results is not None:
                        results.append(result)
            by_workload[workload.name] = summaries
            print("\n" + report.table(summaries))
            print("\n" + report.turn_latency_table(summaries) + "\n", flush=True)
    finally:
        for llm, _ in engines.values():
            llm.shutdown()
    return by_workload


def run_rounds(
    workloads: list[Workload], modes: list[Any], seed: int, repeats: int
) -> list[dict[str, Any]]:
    """``repeats`` rounds of :func:`run` (every workload in every mode), one result per round.
    Round ``r`` starts at the ``r``-th mode (the list rotated), so no mode always runs first
    after an engine start or last in a round."""
    rounds = []
    for r in range(repeats):
        shift = r % len(modes)
        rotated = modes[shift:] + modes[:shift]
        ns = argparse.Namespace(workloads=workloads, mode_list=rotated, seed=seed)
        if repeats > 1:
            print(f"real engine: round {r + 1} of {repeats}", flush=True)
        rounds.append(asyncio.run(run(ns)))
    return rounds


#: The engine setting each scheduler mode needs.
SCHEDULER_SETTINGS = {"sched": "session-id", "sched-nofinish": "session-id", "sched-infer": "infer"}


def _scheduler_env(setting: str | None) -> contextlib.AbstractContextManager[None]:
    """``SESSION_GATE_SCHEDULER`` while an engine starts (its engine core process reads it)."""
    return launch.env_while("SESSION_GATE_SCHEDULER", setting or "off")


async def _scheduler_stats(llm: Any) -> dict[str, Any]:
    stats = await llm.engine_core.call_utility_async("session_gate_stats", "json")
    return stats.get("scheduler") or {}


async def _scheduler_delta(llm: Any, mode: str, before: dict[str, Any]) -> dict[str, Any]:
    """What the scheduler's gate did during one run of ``mode`` (and with ``infer``, the
    inference audited against the truth); refuses a run it did not gate (an engine whose
    scheduler mode did not come up would otherwise be measured as if it had)."""
    after = await _scheduler_stats(llm)
    counts = ("gated", "held", "admitted", "max_wait", "ungated")
    delta: dict[str, Any] = {k: after.get(k, 0) - before.get(k, 0) for k in counts}
    if delta["gated"] <= 0:
        raise RuntimeError(f"mode {mode}: the engine's scheduler gated nothing ({after})")
    out: dict[str, Any] = {"scheduler": delta}
    if "inferred" in after:
        was = before.get("inferred", {})
        delta["inferred"] = {
            k: v - was.get(k, 0) for k, v in after["inferred"].items() if k != "idle"
        }
        rows = await llm.engine_core.call_utility_async("session_gate_stats", "inferred")
        out["infer_audit"] = infer_audit.audit(rows, infer_audit.runner_ids(mode))
    return out


def engine_fits(shape: Any, max_model_len: int, workload: Workload) -> bool:
    """Whether an engine of ``shape`` and ``max_model_len`` is the one ``workload`` would start.
    Not merely long enough: ``aimd`` reads the engine's ``max_model_len`` (its first cap is KV
    capacity over it), so a workload run on an engine started for a longer one ran ``aimd`` at a
    smaller cap than its own engine, and than the twin, gives it (issue 29: 1.8x the twin's
    makespan on a 20 x 12 trace after a longer one)."""
    return shape == workload.engine and max_model_len == workload.engine_max_model_len


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: list[Any] = []
    by_workload = asyncio.run(run(args, results))
    if args.records:
        report.write_records(args.records, results)
    targets = report.targets(by_workload)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU vLLM (tiny dummy Llama)"
    results = {
        "machine": machine,
        # What a twin profile compared with these results must have been fitted on.
        "machine_identity": this_machine(),
        "seed": args.seed,
        "workloads": by_workload,
        "targets": targets,
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    report.plot(by_workload, args.plot)
    print(f"targets: {json.dumps(targets, indent=2)}")
    also = f" and {args.records}" if args.records else ""
    print(f"wrote {args.out}, {args.plot}{also} ({machine})")
    figures = report.figures(by_workload)
    print(json.dumps({"figures": figures, "targets": targets}, sort_keys=True))


if __name__ == "__main__":
    main()
