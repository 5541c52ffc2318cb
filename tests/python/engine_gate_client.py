"""A rollout-worker stand-in for the engine gate tests: its own process, its own ``HttpGate``.

``python engine_gate_client.py URL churn NAME SESSIONS TURNS PROMPT HOLD``
    For each of its SESSIONS sessions, TURNS times: admit a PROMPT-token turn (64 max_tokens,
    no idle grace), hold the lease HOLD seconds, release. Prints one JSON line per lease:
    session, admitted/released (time.monotonic, comparable across processes on one machine),
    working_set_blocks, wait_sec, reason.
``python engine_gate_client.py URL hold SESSION PROMPT``
    Admits one turn, prints ``{"admitted": ...}`` and then holds the lease until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from session_gate import HttpGate

WORD_BASE = 3  # any ids below the tiny model's vocabulary size


def prompt(seed: int, n: int) -> list[int]:
    return [WORD_BASE + (seed * 7919 + i) % 4000 for i in range(n)]


async def churn(url: str, name: str, sessions: int, turns: int, size: int, hold: float) -> None:
    gate = HttpGate(url)

    async def one(index: int) -> None:
        session = f"{name}-{index}"
        for _ in range(turns):
            lease = await gate.acquire(
                session, prompt(sum(map(ord, session)), size), 64, retain_session=False
            )
            admitted = time.monotonic()
            await asyncio.sleep(hold)
            released = time.monotonic()
            await lease.arelease()
            line = {
                "session": session,
                "admitted": admitted,
                "released": released,
                "working_set_blocks": lease.working_set_blocks,
                "wait_sec": lease.wait_sec,
                "reason": lease.reason,
            }
            print(json.dumps(line), flush=True)

    await asyncio.gather(*(one(i) for i in range(sessions)))
    await gate.aclose()


async def hold(url: str, session: str, size: int) -> None:
    gate = HttpGate(url)
    lease = await gate.acquire(session, prompt(1, size), 64)
    print(json.dumps({"admitted": lease.lease_id, "reason": lease.reason}), flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    url, mode, *rest = sys.argv[1:]
    if mode == "churn":
        name, sessions, turns, size, hold_sec = rest
        asyncio.run(churn(url, name, int(sessions), int(turns), int(size), float(hold_sec)))
    else:
        session, size = rest
        asyncio.run(hold(url, session, int(size)))
