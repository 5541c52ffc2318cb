"""A scripted fake probe for unit tests and benchmarks of the gate's logic (no vLLM).

It answers what it is told, raises, hangs or reports "unavailable" on demand, and counts its
calls. Integration tests use a real engine and ``EngineProbe`` instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

__all__ = ["ScriptedProbe", "usage_answer"]


def usage_answer(usage: float, num_blocks: int, block_size: int) -> dict[str, Any]:
    """A ``session_gate_usage`` answer with ``usage`` of ``num_blocks`` blocks in use."""
    used = round(usage * num_blocks)
    return {
        "kv_cache_usage": usage,
        "num_blocks": num_blocks,
        "num_free_blocks": max(num_blocks - used, 0),
        "num_cached_free_blocks": None,
        "block_size": block_size,
    }


_ANSWER = "answer"
_RAISE = "raise"
_HANG = "hang"
_UNAVAILABLE = "unavailable"


class ScriptedProbe:
    """Fake probe. Prefix answers use the session's hit ratio from :meth:`set_hit`, else the
    default ``hit_ratio``; every call can be made to raise, hang or (prefix) say unavailable."""

    def __init__(
        self,
        usage: float = 0.0,
        *,
        num_blocks: int = 100,
        block_size: int = 16,
        hit_ratio: float = 0.0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hit_ratio = hit_ratio
        self.hits: dict[str, float] = {}
        self.usage_calls = 0
        self.prefix_calls = 0
        self.forgotten: list[str] = []
        self._usage = usage_answer(usage, num_blocks, block_size)
        self._usage_mode: tuple[str, Any] = (_ANSWER, None)
        self._prefix_mode: tuple[str, Any] = (_ANSWER, None)
        self._forget_mode: tuple[str, Any] = (_ANSWER, None)

    # -- scripting ----------------------------------------------------------------------------

    def set_usage(self, usage: float) -> None:
        """Answer usage probes with this ``kv_cache_usage`` from now on."""
        self._usage = usage_answer(usage, self.num_blocks, self.block_size)
        self._usage_mode = (_ANSWER, None)

    def set_usage_answer(self, answer: Any) -> None:
        """Answer usage probes with exactly this object (e.g. a dict missing a key)."""
        self._usage = answer
        self._usage_mode = (_ANSWER, None)

    def set_hit(self, session_id: str, hit_ratio: float) -> None:
        """This session's prefix hit ratio from now on."""
        self.hits[session_id] = hit_ratio

    def usage_raises(self, exc: BaseException) -> None:
        self._usage_mode = (_RAISE, exc)

    def usage_hangs(self) -> None:
        self._usage_mode = (_HANG, None)

    def prefix_answers(self) -> None:
        self._prefix_mode = (_ANSWER, None)

    def prefix_raises(self, exc: BaseException) -> None:
        self._prefix_mode = (_RAISE, exc)

    def prefix_hangs(self) -> None:
        self._prefix_mode = (_HANG, None)

    def prefix_unavailable(self, reason: str) -> None:
        """Answer ``{"available": False, "reason": reason}``, as an engine without caching does."""
        self._prefix_mode = (_UNAVAILABLE, reason)

    def forget_raises(self, exc: BaseException) -> None:
        self._forget_mode = (_RAISE, exc)

    # -- the probe ----------------------------------------------------------------------------

    async def usage(self) -> dict[str, Any]:
        self.usage_calls += 1
        mode, arg = self._usage_mode
        if mode is not _ANSWER:
            await _misbehave(mode, arg)
        return self._usage

    async def prefix(self, session_id: str, prompt_ids: Sequence[int] | bytes) -> dict[str, Any]:
        self.prefix_calls += 1
        prompt_tokens = len(prompt_ids) // 4 if isinstance(prompt_ids, bytes) else len(prompt_ids)
        mode, arg = self._prefix_mode
        if mode is _UNAVAILABLE:
            return {"available": False, "reason": arg, "prompt_tokens": prompt_tokens}
        if mode is not _ANSWER:
            await _misbehave(mode, arg)
        ratio = self.hits.get(session_id, self.hit_ratio)
        hit_tokens = int(ratio * prompt_tokens)
        return {
            "available": True,
            "hit_ratio": ratio,
            "hit_blocks": hit_tokens // self.block_size,
            "hit_tokens": hit_tokens,
            "prompt_tokens": prompt_tokens,
        }

    async def forget(self, session_id: str) -> bool:
        mode, arg = self._forget_mode
        if mode is not _ANSWER:
            await _misbehave(mode, arg)
        self.forgotten.append(session_id)
        return True


async def _misbehave(mode: str, arg: Any) -> None:
    if mode is _RAISE:
        raise arg
    # Hang: only the gate's probe timeout (or cancellation) ends this.
    await asyncio.Event().wait()
