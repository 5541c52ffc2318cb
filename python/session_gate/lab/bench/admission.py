"""What stands between the sessions and vLLM in each benchmark mode (``session_gate.modes``
names them): the admission control the real bench runs per mode.

``aimd`` and ``pause`` are the controllers users deploy today (see the README's baselines),
written once in Rust (``session_gate._native.AimdController`` / ``PauseController``) and driven
here by the signals they use in production: vLLM's own Prometheus metrics, scraped in-process
(``session_gate.lab.engine.metrics``), and per-session token counts. The ``-scaled`` variants
multiply their time constants by :func:`time_scale` of the workload.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from session_gate.modes import BASELINE_KINDS, SCHED_KINDS, Mode
from session_gate.workloads import Workload

#: The tool latency the baselines' literal time constants were set for (seconds): a 5 s tick is
#: half of it. One public coding-agent trace has 95% of an agent's next calls within 10 s, and
#: GPU rollouts' turns (thousands of output tokens) take seconds each.
REFERENCE_TOOL_LATENCY_SEC = 10.0


def time_scale(workload: Workload) -> float:
    """How much faster the workload's clock runs than a GPU rollout's: its median tool latency
    over :data:`REFERENCE_TOOL_LATENCY_SEC` (0.09 for ``default``: a 0.45 s tick)."""
    latencies = [t.tool_latency for s in workload.sessions for t in s.turns]
    return max(statistics.median(latencies), 1e-3) / REFERENCE_TOOL_LATENCY_SEC


class EpisodeCancelled(Exception):
    """The ``aimd`` controller cancelled this session's episode; the runner re-runs it from
    its first turn (prime-rl drops it; every bench mode must finish the same work)."""


class Admission:
    """Per-run admission control: a session slot (caps, aimd) and a per-turn lease (gates,
    pause). ``llm`` and ``workload`` are needed by the baselines (signals, capacity, time scale),
    ``knobs`` override a baseline's published defaults; call :meth:`close` when the run ends."""

    def __init__(
        self,
        mode: Mode,
        probe: Any,
        llm: Any = None,
        workload: Workload | None = None,
        knobs: dict[str, Any] | None = None,
    ) -> None:
        if mode.kind in SCHED_KINDS:
            # The gate sits in vLLM's scheduler: the runner starts such a mode's engine in
            # scheduler mode and asks no admission of the client (kind "none"); an Admission of
            # the mode itself would silently run it ungated.
            raise ValueError(f"mode {mode.name}: the engine's scheduler gates it, not the client")
        self.mode = mode
        self.gate = None
        self._slots = asyncio.Semaphore(mode.cap) if mode.kind == "cap" else None
        self._started = time.perf_counter()
        self._tasks: list[asyncio.Task[None]] = []
        self._aimd: Any = None
        self._pause: Any = None
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._owners: dict[str, asyncio.Task[Any]] = {}
        self._cancelled: set[str] = set()
        self.scrape_errors = 0
        if mode.kind in ("seed", "gate"):
            from session_gate import GateConfig, SessionGate

            pressure = "engine" if mode.kind == "seed" else "committed"
            self.gate = SessionGate(probe=probe, config=GateConfig(pressure=pressure))
        elif mode.kind in BASELINE_KINDS:
            from session_gate._native import AimdController, PauseController
            from session_gate.lab.engine.metrics import kv_capacity

            if llm is None or workload is None:
                raise ValueError(f"mode {mode.name} needs the engine and the workload")
            scale = time_scale(workload) if mode.scaled else 1.0
            self._capacity, self._max_model_len = kv_capacity(llm)
            if mode.kind == "aimd":
                self._aimd = AimdController(time_scale=scale, **(knobs or {}))
                self._tasks.append(asyncio.ensure_future(self._aimd_poller()))
            else:
                self._pause = PauseController(self._capacity, time_scale=scale, **(knobs or {}))
                self._tasks.append(asyncio.ensure_future(self._pause_ticker()))

    def _now(self) -> float:
        return time.perf_counter() - self._started

    @contextlib.asynccontextmanager
    async def session(self, session_id: str) -> AsyncIterator[None]:
        """Holds a session's slot for its whole life. Under ``aimd`` it raises
        :class:`EpisodeCancelled` when the controller cancels the episode (its in-flight request
        is aborted: cancelling ``AsyncLLM.generate`` aborts the request in vLLM)."""
        if self._aimd is not None:
            async with self._aimd_episode(session_id):
                yield
        elif self._slots is not None:
            async with self._slots:
                yield
        else:
            yield
        if self.gate is not None:
            await self.gate.finish_session(session_id)
        if self._pause is not None:
            self._pause.finish(session_id)

    @contextlib.asynccontextmanager
    async def turn(
        self, session_id: str, prompt: list[int], max_tokens: int
    ) -> AsyncIterator[tuple[str, float]]:
        """Yields (admission reason, seconds waited)."""
        if self._pause is not None:
            async with self._pause_turn(session_id, prompt, max_tokens) as admitted:
                yield admitted
            return
        if self.gate is None:
            yield (self.mode.kind if self._aimd is not None else "none", 0.0)
            return
        async with self.gate.admit(session_id, prompt, max_tokens=max_tokens) as lease:
            yield (str(lease.reason), float(lease.wait_sec))

    def stats(self) -> dict[str, Any]:
        if self.gate is not None:
            return self.gate.stats()
        ctl = self._aimd or self._pause
        if ctl is None:
            return {}
        out = dict(ctl.stats())
        out["scrape_errors"] = self.scrape_errors
        out["time_scale"] = time_scale_of(ctl)
        return out

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------ aimd

    @contextlib.asynccontextmanager
    async def _aimd_episode(self, session_id: str) -> AsyncIterator[None]:
        ctl = self._aimd
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters[session_id] = waiter
        ctl.submit(session_id)
        self._aimd_pump()
        await waiter
        if session_id in self._cancelled:
            # Cancelled by a poll that ran between its admission and this task waking up.
            self._cancelled.discard(session_id)
            raise EpisodeCancelled(session_id)
        task = asyncio.current_task()
        assert task is not None
        self._owners[session_id] = task
        try:
            yield
        except asyncio.CancelledError:
            if session_id not in self._cancelled:
                raise
            # Our own cancellation: absorb it so the runner can re-run the episode.
            self._cancelled.discard(session_id)
            task.uncancel()
            raise EpisodeCancelled(session_id) from None
        else:
            if session_id in self._cancelled:
                # Cancelled after its last await: the controller already counts it cancelled.
                self._cancelled.discard(session_id)
                task.uncancel()
                raise EpisodeCancelled(session_id)
            ctl.on_complete(self._now(), session_id)
            self._aimd_pump()
        finally:
            self._owners.pop(session_id, None)

    def _aimd_pump(self) -> None:
        for sid in self._aimd.admit(self._now()):
            waiter = self._waiters.pop(sid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _aimd_poller(self) -> None:
        from session_gate.lab.engine.metrics import MetricsUnavailable, scrape

        ctl = self._aimd
        while True:
            try:
                load = scrape()
            except MetricsUnavailable:
                self.scrape_errors += 1
                raise
            victims = ctl.on_poll(
                self._now(),
                kv_usage=load.kv_usage,
                running=load.running,
                waiting=load.waiting,
                preemptions_total=load.preemptions_total,
                kv_capacity_tokens=self._capacity,
                max_model_len=self._max_model_len,
            )
            for sid in victims:
                # A victim admitted by an earlier pump may not have woken up yet (no owner): it
                # sees the mark when it does, so the controller and the runner count the same
                # cancellations and no cancelled episode runs on as if admitted.
                self._cancelled.add(sid)
                owner = self._owners.get(sid)
                if owner is not None:
                    owner.cancel()
            self._aimd_pump()
            await asyncio.sleep(ctl.poll_interval_sec)

    # ------------------------------------------------------------------ pause

    @contextlib.asynccontextmanager
    async def _pause_turn(
        self, session_id: str, prompt: list[int], max_tokens: int
    ) -> AsyncIterator[tuple[str, float]]:
        ctl = self._pause
        started = time.perf_counter()
        held = ctl.before_request(self._now(), session_id, len(prompt))
        reason = "active"
        if held is not None:
            reason = held
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[session_id] = waiter
            await waiter
        waited = time.perf_counter() - started
        yield (reason, waited)
        ctl.after_request(self._now(), session_id, len(prompt) + max_tokens)

    async def _pause_ticker(self) -> None:
        ctl = self._pause
        while True:
            await asyncio.sleep(ctl.scheduler_interval_sec)
            for sid in ctl.tick(self._now())["resumed"]:
                waiter = self._waiters.pop(sid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)


def time_scale_of(ctl: Any) -> float:
    """The time scale a controller runs at, from its (scaled) period over the literal 5 s."""
    period = getattr(ctl, "poll_interval_sec", None) or ctl.scheduler_interval_sec
    return float(period) / 5.0
