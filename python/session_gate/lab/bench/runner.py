"""Drives one workload through one mode on a running ``AsyncLLM`` and measures what happened."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from session_gate.lab.bench.admission import Admission, EpisodeCancelled
from session_gate.lab.engine.launch import agenerate
from session_gate.modes import NAMED_SCHED_KINDS, SCHED_KINDS, Mode
from session_gate.results import ModeResult, TurnRecord, ideal_cached
from session_gate.workloads import SessionSpec, Workload

VOCAB = 4096
#: Modes whose gate runs in the client (``SessionGate``) and forgets a session at its end.
CLIENT_GATE_KINDS = ("seed", "gate")


def system_prompt(workload: Workload) -> list[int]:
    """The system prompt the sessions share (as long as the longest share any session uses),
    drawn from the workload's seed."""
    rng = random.Random(workload.seed)
    longest = max(s.system_tokens for s in workload.sessions)
    return [rng.randrange(3, VOCAB) for _ in range(longest)]


class SessionTokens:
    """A session's token contents, the same on every run, attempt and mode (a re-run can hit
    what is still cached): ``first`` is its share of ``system`` and its task; :meth:`draw`
    gives each turn's appended tool-result tokens, in turn order."""

    def __init__(self, workload: Workload, spec: SessionSpec, system: list[int]) -> None:
        self._rng = random.Random(f"{workload.seed}:{spec.session_id}")
        self.first = system[: spec.system_tokens] + self.draw(spec.task_tokens)

    def draw(self, n: int) -> list[int]:
        return [self._rng.randrange(3, VOCAB) for _ in range(n)]


async def run_mode(
    llm: Any,
    workload: Workload,
    mode: Mode,
    probe: Any,
    progress: Any = None,
    knobs: dict[str, Any] | None = None,
    *,
    only: Any = None,
    admission: Any = None,
    generate: Any = agenerate,
    finish: Callable[[str], Awaitable[Any]] | None = None,
) -> ModeResult:
    """Run every session of ``workload`` concurrently through ``mode``; the prefix cache is
    reset first so every mode starts cold. ``knobs`` override a baseline's defaults.

    For one of several client processes (``bench.clients``): ``only`` picks the session
    indices this process drives, ``admission`` replaces the mode's own (the caller reset the
    cache and closes it), ``generate`` sends a turn (``agenerate``'s signature), ``finish``
    ends each session after its last turn (in mode ``sched`` by default: the engine gate's
    ``session_gate_finish`` on ``llm``, what vllm-router's ``/finish_session`` reaches over
    HTTP)."""
    own = admission is None
    # The scheduler modes: no admission in the client, the engine's scheduler gates (its engine
    # was started with SESSION_GATE_SCHEDULER); `sched` and `sched-nofinish` name each turn's
    # session to vLLM, and `sched` ends each session when its episode is over.
    in_scheduler = mode.kind in SCHED_KINDS
    if admission is None:
        await llm.reset_prefix_cache()
        admission = Admission(
            Mode(mode.name, "none") if in_scheduler else mode, probe, llm, workload, knobs
        )
    block = workload.engine.block_size
    system = system_prompt(workload)
    records: list[TurnRecord] = []
    system_seen = [False]
    #: Tags this run's session ids, so an engine that ran the mode before holds none of them.
    run = f"{mode.name}-{time.monotonic_ns()}"
    lost = {"turns": 0, "tokens": 0, "cancellations": 0}
    end_session = finish
    if mode.kind == "sched" and end_session is None:

        async def finish_in_engine(session_id: str) -> Any:
            tagged = f"{session_id}@{run}"
            return await llm.engine_core.call_utility_async("session_gate_finish", tagged)

        end_session = finish_in_engine

    async def run_session(index: int, spec: SessionSpec) -> None:
        if spec.arrival > 0:
            await asyncio.sleep(spec.arrival)
        attempt = 0
        while True:
            kept: list[TurnRecord] = []
            try:
                await run_attempt(spec, attempt, kept)
            except EpisodeCancelled:
                # Re-run from the first turn; what the cancelled attempt did is lost work.
                lost["cancellations"] += 1
                lost["turns"] += len(kept)
                lost["tokens"] += sum(
                    r.prompt_tokens - r.cached_tokens + spec.turns[r.turn].output for r in kept
                )
                attempt += 1
                continue
            records.extend(kept)
            return

    async def run_attempt(spec: SessionSpec, attempt: int, kept: list[TurnRecord]) -> None:
        tokens = SessionTokens(workload, spec, system)
        history = list(tokens.first)
        prev_sequence = 0
        async with admission.session(spec.session_id):
            for t, turn in enumerate(spec.turns):
                history += tokens.draw(turn.append)
                ideal = ideal_cached(
                    prev_sequence, len(history), block, spec.system_tokens, system_seen[0]
                )
                system_seen[0] = True
                started = time.perf_counter()
                async with admission.turn(spec.session_id, history, turn.output) as (reason, wait):
                    rid = f"{mode.name}-{spec.session_id}-{t}.{attempt}"
                    if mode.kind in NAMED_SCHED_KINDS:
                        output, cached = await generate(
                            llm, history, turn.output, rid, session_id=f"{spec.session_id}@{run}"
                        )
                    elif mode.kind in CLIENT_GATE_KINDS and generate is agenerate:
                        # vLLM's own session id, the one the client's gate forgets at the
                        # session's end: the engine then evicts its blocks first.
                        output, cached = await generate(
                            llm, history, turn.output, rid, session_id=spec.session_id
                        )
                    else:
                        output, cached = await generate(llm, history, turn.output, rid)
                kept.append(
                    TurnRecord(
                        spec.session_id,
                        t,
                        len(history),
                        cached,
                        ideal,
                        time.perf_counter() - started,
                        wait,
                        reason,
                    )
                )
                if progress is not None:
                    progress.update(1)
                history += output
                prev_sequence = len(history)
                await asyncio.sleep(turn.tool_latency)
            if end_session is not None:
                # The episode is over: the client says so, as prime-rl does to its router.
                await end_session(spec.session_id)

    started = time.perf_counter()
    mine = [(i, s) for i, s in enumerate(workload.sessions) if only is None or i in only]
    try:
        await asyncio.gather(*(run_session(i, s) for i, s in mine))
    finally:
        if own:
            await admission.close()
    return ModeResult(
        mode.name,
        workload.name,
        time.perf_counter() - started,
        records,
        admission.stats(),
        lost_turns=lost["turns"],
        lost_tokens=lost["tokens"],
        cancellations=lost["cancellations"],
    )
