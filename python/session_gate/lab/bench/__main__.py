"""``python -m session_gate.lab.bench``: run the thrash benchmark (see ``--help``).

One CPU vLLM engine per engine shape; the prefix cache is reset between modes instead of
restarting the engine. Prints a table per workload, writes the JSON results and a PNG plot, and
prints, last, one JSON line with the per-mode figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from typing import Any

from session_gate import report, run_flags
from session_gate.lab.bench.runner import run_mode
from session_gate.modes import DEFAULT_MODES
from session_gate.workloads import WORKLOADS, Workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m session_gate.lab.bench", description=__doc__)
    run_flags.add_run_flags(
        p,
        workloads=WORKLOADS,
        modes=DEFAULT_MODES,
        results=("bench-results.json", "bench-results.png"),
    )
    args = p.parse_args(argv)
    args.mode_list = run_flags.modes_of(p, args.modes)
    try:
        args.workloads = run_flags.workloads_of(args, WORKLOADS)
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    return args


def _engine_for(workload: Workload) -> Any:
    from session_gate.lab.engine.launch import make_async_llm

    e = workload.engine
    max_len = workload.max_prompt_tokens + 64
    return make_async_llm(
        num_blocks=e.num_blocks,
        block_size=e.block_size,
        max_model_len=min(max_len, (e.num_blocks - 1) * e.block_size),
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
    )


async def run(args: argparse.Namespace, results: list[Any] | None = None) -> dict[str, Any]:
    """Every workload of ``args.workloads`` in every mode of ``args.mode_list``; each mode's
    ``ModeResult`` is appended to ``results``."""
    from tqdm import tqdm

    from session_gate import EngineProbe

    workloads = args.workloads
    by_workload: dict[str, list[dict[str, Any]]] = {}
    llm, shape = None, None
    try:
        for workload in workloads:
            print(workload.describe(), flush=True)
            if llm is None or shape != workload.engine or _too_short(llm, workload):
                if llm is not None:
                    llm.shutdown()
                started = time.perf_counter()
                llm, shape = _engine_for(workload), workload.engine
                print(f"engine up in {time.perf_counter() - started:.0f} s", flush=True)
            probe = EngineProbe(llm)
            total = sum(len(s.turns) for s in workload.sessions) * len(args.mode_list)
            summaries = []
            with tqdm(total=total, desc=workload.name, unit="turn") as bar:
                for mode in args.mode_list:
                    bar.set_postfix_str(mode.name)
                    result = await run_mode(llm, workload, mode, probe, bar)
                    summaries.append(result.summary())
                    if results is not None:
                        results.append(result)
            by_workload[workload.name] = summaries
            print("\n" + report.table(summaries))
            print("\n" + report.turn_latency_table(summaries) + "\n", flush=True)
    finally:
        if llm is not None:
            llm.shutdown()
    return by_workload


def _too_short(llm: Any, workload: Workload) -> bool:
    return llm.model_config.max_model_len < workload.max_prompt_tokens + 64


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: list[Any] = []
    by_workload = asyncio.run(run(args, results))
    if args.records:
        report.write_records(args.records, results)
    targets = report.targets(by_workload)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU vLLM (tiny dummy Llama)"
    results = {"machine": machine, "seed": args.seed, "workloads": by_workload, "targets": targets}
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
