"""Probes: how the gate asks an engine about KV usage and prefix residency.

A probe is any object with ``async def usage(self) -> dict`` and ``async def prefix(self,
session_id, prompt_ids) -> dict`` (optionally ``async def forget(self, session_id)``), answering
with the keys of the engine half's ``session_gate_usage`` / ``session_gate_probe``. The gate
treats an exception, a missing key, ``available: False`` or an answer slower than
``probe_timeout_sec`` as "unavailable"; probes need not guard against any of that themselves.

This module must not import vLLM (every ``import vllm`` lives in ``session_gate.engine``):
``EngineProbe`` only calls methods on the ``AsyncLLM`` it is given.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["EngineProbe", "Probe", "pack_token_ids"]


@runtime_checkable
class Probe(Protocol):
    """What ``SessionGate`` needs from a probe (``forget`` is optional and not listed here)."""

    async def usage(self) -> dict[str, Any]:
        """``kv_cache_usage``, ``num_blocks``, ``num_free_blocks``, ``num_cached_free_blocks``,
        ``block_size`` (as ``session_gate_usage`` answers)."""
        ...

    async def prefix(self, session_id: str, prompt_ids: Sequence[int] | bytes) -> dict[str, Any]:
        """``available``, ``hit_ratio``, ``hit_blocks``, ``hit_tokens``, ``prompt_tokens`` (as
        ``session_gate_probe`` answers; ``reason`` when unavailable)."""
        ...


# array('I') is 4 bytes on every mainstream platform; the struct path covers the rest.
_ARRAY_U32 = array("I").itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"


def pack_token_ids(prompt_ids: Sequence[int] | bytes) -> bytes:
    """Token ids as packed little-endian uint32 bytes, the form the engine half reads fastest:
    msgpack carries it as one binary blob instead of thousands of ints, so the engine core's
    busy loop (where the probe runs, stalling every sequence) does no per-token decoding.

    ``bytes`` pass through unchanged (assumed packed already). Ids outside ``0..2**32`` raise
    ``OverflowError``.
    """
    if isinstance(prompt_ids, bytes):
        return prompt_ids
    if not _ARRAY_U32:
        return struct.pack(f"<{len(prompt_ids)}I", *prompt_ids)
    if isinstance(prompt_ids, array) and prompt_ids.typecode == "I":
        packed = array("I", prompt_ids) if _BIG_ENDIAN else prompt_ids
    else:
        packed = array("I", prompt_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


class EngineProbe:
    """Probes an in-process vLLM ``AsyncLLM`` through the engine half's utility methods.

    The calls go to vLLM's engine core as ``EngineCoreRequestType.UTILITY`` requests: they never
    enter the scheduler's queues, never touch a KV block, and are answered between model steps.
    The engine must have the ``session_gate`` plugin loaded (it is, once the package is
    installed: ``vllm.general_plugins``); without it every call fails, and the gate treats the
    probes as unavailable.
    """

    __slots__ = ("_call",)

    def __init__(self, async_llm: Any) -> None:
        # AsyncLLM.engine_core is the client to the engine core process (or in-process core).
        self._call = async_llm.engine_core.call_utility_async

    async def usage(self) -> dict[str, Any]:
        """``session_gate_usage``: vLLM's KV usage and the block counts behind it."""
        return await self._call("session_gate_usage")

    async def prefix(self, session_id: str, prompt_ids: Sequence[int] | bytes) -> dict[str, Any]:
        """``session_gate_probe``: how much of this prompt's prefix vLLM would find cached."""
        return await self._call("session_gate_probe", session_id, pack_token_ids(prompt_ids))

    async def forget(self, session_id: str) -> bool:
        """``session_gate_forget``: drop the session's remembered hash chain in the engine."""
        return bool(await self._call("session_gate_forget", session_id))
