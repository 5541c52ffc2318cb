"""What stands between the sessions and vLLM in each benchmark mode."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mode:
    """``kind`` is ``none``, ``cap`` (session-level cap of ``cap`` sessions, held for a session's
    whole life), ``seed`` (the seed's gate, ``pressure="engine"``) or ``gate`` (the default)."""

    name: str
    kind: str
    cap: int = 0

    @staticmethod
    def parse(text: str) -> Mode:
        if text in ("none", "seed", "gate"):
            return Mode(text, text)
        if text.startswith("cap") and text[3:].isdigit() and int(text[3:]) > 0:
            return Mode(text, "cap", int(text[3:]))
        raise ValueError(f"unknown mode {text!r}: expected none, capN (N > 0), seed or gate")


class Admission:
    """Per-run admission control: a session slot (caps) and a per-turn lease (gates)."""

    def __init__(self, mode: Mode, probe: Any) -> None:
        self.mode = mode
        self.gate = None
        self._slots = asyncio.Semaphore(mode.cap) if mode.kind == "cap" else None
        if mode.kind in ("seed", "gate"):
            from session_gate import GateConfig, SessionGate

            pressure = "engine" if mode.kind == "seed" else "committed"
            self.gate = SessionGate(probe=probe, config=GateConfig(pressure=pressure))

    @contextlib.asynccontextmanager
    async def session(self, session_id: str) -> AsyncIterator[None]:
        if self._slots is not None:
            async with self._slots:
                yield
        else:
            yield
        if self.gate is not None:
            await self.gate.finish_session(session_id)

    @contextlib.asynccontextmanager
    async def turn(
        self, session_id: str, prompt: list[int], max_tokens: int
    ) -> AsyncIterator[tuple[str, float]]:
        """Yields (admission reason, seconds waited)."""
        if self.gate is None:
            yield ("none", 0.0)
            return
        async with self.gate.admit(session_id, prompt, max_tokens=max_tokens) as lease:
            yield (str(lease.reason), float(lease.wait_sec))

    def stats(self) -> dict[str, Any]:
        return self.gate.stats() if self.gate is not None else {}
