"""``python -m session_gate.lab.bench.stream``: vLLM's own sessions as a baseline of the thrash
benchmark — each session one streaming-input request, no admission at all.

vLLM 0.32's ``AsyncLLM.generate`` takes an async generator of ``StreamingInput``: one resumable
request whose KV blocks (and model-runner slot) stay with it while it waits, in
``WAITING_FOR_STREAMING_REQ``, for the next chunk. Mode ``stream`` runs each session that way: a
chunk per turn carrying only the turn's *new* tokens (the first turn: system prompt and task;
later turns: the tool result) and the turn's ``max_tokens`` in the chunk's ``sampling_params``;
the next chunk is sent when the previous one has finished and the turn's tool latency has
passed, as the runner does. vLLM appends each chunk to the request's context, and the previous
chunk's output with it except the last sampled token (it has no KV yet), so a turn's prompt here
is one token per earlier turn shorter than the plain runner's.

Cached tokens per turn: the first chunk's is vLLM's ``num_cached_tokens`` (a prefix-cache hit,
e.g. the shared system prompt). vLLM reports nothing newer: it takes prefill stats once per
request and repeats the first chunk's figure on every later output. A later chunk resumes from
the request's ``num_computed_tokens``, which is the whole kept context (the previous turn's
sequence less its last sampled token), unless the engine preempted the request while it ran; so
this mode records that figure, and counts vLLM's preemptions (``vllm:num_preemptions``) over the
run to say whether it holds (with preemptions it is an upper bound). Having kept even the
partial last block, a turn can count up to a block more than ``ideal_cached`` allows, so the hit
rate can exceed the ideal one.

Nothing evicts a paused session, so once the live sessions' contexts outgrow the KV cache no
chunk can get blocks and the engine stalls for good. A watchdog declares the run stalled when no
output arrives for ``--stall-sec`` while a chunk is outstanding, aborts the sessions and reports
the turns done. ``stream-capN`` lets at most N sessions live at once (a static session cap in
front of vLLM's sessions).

The CLI runs ``none`` (the runner's plain per-turn requests) and ``stream`` on one engine of the
bench's shape for the workload, prints ``session_gate.report.table`` of both and, last, one JSON
line with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from typing import Any

from session_gate import report, run_flags
from session_gate.lab.bench.runner import SessionTokens, run_mode, system_prompt
from session_gate.lab.engine import streaming
from session_gate.modes import Mode
from session_gate.results import ModeResult, TurnRecord, ideal_cached
from session_gate.workloads import WORKLOADS, SessionSpec, Workload

#: Seconds without any output, while a chunk is outstanding, after which a run is stalled.
STALL_SEC = 60.0


def _preemptions() -> int:
    from session_gate.lab.engine.metrics import scrape

    return scrape().preemptions_total


def _load() -> dict[str, Any]:
    from session_gate.lab.engine.metrics import scrape

    load = scrape()
    return {"kv_usage": load.kv_usage, "running": load.running, "waiting": load.waiting}


def stream_cap(name: str) -> int | None:
    """``stream`` -> 0 (no cap), ``stream-capN`` -> N, anything else -> None."""
    if name == "stream":
        return 0
    rest = name.removeprefix("stream-cap")
    if rest != name and rest.isdigit() and int(rest) > 0:
        return int(rest)
    return None


async def run_stream(
    llm: Any,
    workload: Workload,
    progress: Any = None,
    *,
    max_sessions: int = 0,
    stall_sec: float = STALL_SEC,
) -> ModeResult:
    """Run every session of ``workload`` as one streaming-input request (at most
    ``max_sessions`` at once when non-zero) after resetting the prefix cache; the result has one
    ``TurnRecord`` per completed chunk. A stalled run (see the module docstring) returns the turns
    done, with ``gate_stats["stalled"]`` set."""
    await llm.reset_prefix_cache()
    name = f"stream-cap{max_sessions}" if max_sessions else "stream"
    block = workload.engine.block_size
    system = system_prompt(workload)
    records: list[TurnRecord] = []
    system_seen = [False]
    outstanding = [0]  # chunks sent and not finished
    last_output = [time.perf_counter()]
    cap = asyncio.Semaphore(max_sessions) if max_sessions else None
    preempted_before = _preemptions()

    async def run_session(spec: SessionSpec) -> None:
        if spec.arrival > 0:
            await asyncio.sleep(spec.arrival)
        async with cap if cap is not None else contextlib.nullcontext():
            await session(spec)

    async def session(spec: SessionSpec) -> None:
        # The runner's token contents: the same system prompt, task and tool results.
        tokens = SessionTokens(workload, spec, system)
        first = tokens.first
        finished: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

        async def inputs() -> Any:
            prev_sequence = 0  # the previous turn's prompt and output
            for t, turn in enumerate(spec.turns):
                new = (first if t == 0 else []) + tokens.draw(turn.append)
                kept = max(prev_sequence - 1, 0)  # vLLM drops the last sampled token
                prompt = kept + len(new)
                ideal = ideal_cached(
                    prev_sequence, prompt, block, spec.system_tokens, system_seen[0]
                )
                system_seen[0] = True
                started = time.perf_counter()
                outstanding[0] += 1
                yield streaming.chunk(new, turn.output)
                output, reported = await finished.get()
                outstanding[0] -= 1
                cached = reported if t == 0 else kept
                records.append(
                    TurnRecord(
                        spec.session_id,
                        t,
                        prompt,
                        cached,
                        ideal,
                        time.perf_counter() - started,
                        0.0,
                        "stream",
                    )
                )
                if progress is not None:
                    progress.update(1)
                prev_sequence = prompt + output
                await asyncio.sleep(turn.tool_latency)

        count = 0
        async for out in llm.generate(
            inputs(), streaming.chunk_params(1), request_id=f"stream-{spec.session_id}"
        ):
            last_output[0] = time.perf_counter()
            count += len(out.outputs[0].token_ids)
            if out.outputs[0].finish_reason is not None:
                finished.put_nowait((count, int(out.num_cached_tokens or 0)))
                count = 0

    started = time.perf_counter()
    tasks = [asyncio.ensure_future(run_session(s)) for s in workload.sessions]
    stalled: dict[str, Any] = {}
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=1.0)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            idle = time.perf_counter() - last_output[0]
            if outstanding[0] and idle > stall_sec:
                stalled = {
                    "after_sec": round(time.perf_counter() - started - idle, 1),
                    "turns_done": len(records),
                    "turns_total": sum(len(s.turns) for s in workload.sessions),
                    "chunks_outstanding": outstanding[0],
                    **_load(),
                }
                break
    finally:
        for t in tasks:
            t.cancel()  # aborts a stalled session's request (AsyncLLM.generate's cancel path)
        await asyncio.gather(*tasks, return_exceptions=True)
    makespan = stalled["after_sec"] if stalled else time.perf_counter() - started
    stats: dict[str, Any] = {"preemptions": _preemptions() - preempted_before}
    if stalled:
        stats["stalled"] = stalled
    return ModeResult(name, workload.name, makespan, records, stats)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m session_gate.lab.bench.stream", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    run_flags.add_run_flags(p, workloads=WORKLOADS, modes=None)
    p.add_argument(
        "--modes",
        default="none,stream",
        help="comma-separated: stream, stream-capN, and the runner's modes (default none,stream)",
    )
    p.add_argument(
        "--stall-sec",
        type=float,
        default=STALL_SEC,
        help=f"no output for this long with a chunk outstanding: stalled (default {STALL_SEC:g})",
    )
    p.add_argument("--out", default=None, help="also write the summaries as JSON to this file")
    args = p.parse_args(argv)
    args.mode_list = []
    for text in (m.strip() for m in args.modes.split(",")):
        if text and stream_cap(text) is None:
            try:
                Mode.parse(text)
            except ValueError as exc:
                p.error(f"{exc}, stream or stream-capN")
        if text:
            args.mode_list.append(text)
    try:
        args.workloads = run_flags.workloads_of(args, WORKLOADS)
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    return args


async def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every workload in every mode of ``args.mode_list``, one engine per workload."""
    from tqdm import tqdm

    from session_gate import EngineProbe
    from session_gate.lab.bench.__main__ import _engine_for

    by_workload: dict[str, list[dict[str, Any]]] = {}
    for workload in args.workloads:
        print(workload.describe(), flush=True)
        started = time.perf_counter()
        llm = _engine_for(workload)
        print(f"engine up in {time.perf_counter() - started:.0f} s", flush=True)
        try:
            probe = EngineProbe(llm)
            summaries = []
            total = sum(len(s.turns) for s in workload.sessions) * len(args.mode_list)
            with tqdm(total=total, desc=workload.name, unit="turn") as bar:
                for text in args.mode_list:
                    bar.set_postfix_str(text)
                    cap = stream_cap(text)
                    if cap is None:
                        before = _preemptions()
                        result = await run_mode(llm, workload, Mode.parse(text), probe, bar)
                        # The engine's own preemptions (the runner reports the gate's).
                        result.gate_stats.setdefault("preemptions", _preemptions() - before)
                    else:
                        result = await run_stream(
                            llm, workload, bar, max_sessions=cap, stall_sec=args.stall_sec
                        )
                    summary = result.summary()
                    if "stalled" in result.gate_stats:
                        summary["stalled"] = result.gate_stats["stalled"]
                    summaries.append(summary)
        finally:
            llm.shutdown()
        by_workload[workload.name] = summaries
        print("\n" + report.table(summaries))
        for s in summaries:
            if "stalled" in s:
                print(f"{s['mode']}: STALLED {json.dumps(s['stalled'], sort_keys=True)}")
        print("\n" + report.turn_latency_table(summaries) + "\n", flush=True)
    return by_workload


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    by_workload = asyncio.run(run(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seed": args.seed, "workloads": by_workload}, f, indent=2)
    figures = report.figures(by_workload)
    for workload, summaries in by_workload.items():
        for s in summaries:
            entry = figures[workload][s["mode"]]
            entry["ideal_hit_rate"] = s["ideal_hit_rate"]
            entry["turns"] = s["turns"]
            entry["preemptions"] = s["preemptions"]
            if "stalled" in s:
                entry["stalled"] = s["stalled"]
    print(json.dumps({"figures": figures}, sort_keys=True))


if __name__ == "__main__":
    main()
